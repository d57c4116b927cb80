"""A run's tokenizer: a Hugging Face ``tokenizers`` JSON file named by ``data.tokenizer``.

Without one, tokens are bytes (vocab 256, :mod:`p2pdiloco.data`). With one, its sha256
(``data.tokenizer_sha256``) is a run setting the manifest carries (:mod:`p2pdiloco.manifest`),
so every node of a run tokenizes alike: a node whose file has another digest is refused in one
line; ``model.vocab_size`` follows the tokenizer's vocabulary. ``p2pdiloco data tokenizer``
trains a byte-level BPE (Sennrich et al., arXiv:1508.07909; byte-level alphabet as in GPT-2)
from the run's own text (:func:`train`). docs/data.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from p2pdiloco.errors import ConfigError
from p2pdiloco.formats import DataError, documents, kind_of, require

__all__ = ["file_sha256", "load", "encode", "train", "resolve"]

MAX_FILE_BYTES = 256 << 20  # a tokenizer JSON file at most (large vocabularies are tens of MiB)


def file_sha256(path: str | Path) -> str:
    """sha256 of the file's bytes, 64 lowercase hex digits. Raises DataError when it cannot be
    read or is larger than :data:`MAX_FILE_BYTES`."""
    p = Path(path).expanduser()
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            raise DataError(f"data.tokenizer {path}: larger than {MAX_FILE_BYTES >> 20} MiB")
        return hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError as e:
        raise DataError(f"data.tokenizer {path}: cannot read it ({e.strerror or e})") from None


def load(path: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` in the JSON file ``path``. Raises DataError (one line) when
    the tokenizers package is missing (naming the ``data`` extra) or the file is not a
    tokenizer."""
    require("tokenizers", "data.tokenizer")
    from tokenizers import Tokenizer  # noqa: PLC0415

    file_sha256(path)  # readable and bounded before it is parsed
    try:
        return Tokenizer.from_file(str(Path(path).expanduser()))
    except Exception as e:  # tokenizers raises its own Exception on a malformed file
        raise DataError(f"data.tokenizer {path}: not a tokenizers JSON file ({str(e).splitlines()[0][:200]})") from None


def encode(tokenizer: Any, data: Tensor) -> Tensor:
    """Token IDs of ``data`` (uint8 [N], UTF-8 bytes; a character cut at a piece boundary
    becomes U+FFFD), encoded line by line (``encode_batch``: lines are independent, so the
    result does not depend on threads). int32 [M]."""
    text = bytes(data.numpy()).decode("utf-8", "replace")
    ids = [i for enc in tokenizer.encode_batch(text.splitlines(keepends=True), add_special_tokens=False)
           for i in enc.ids]
    return torch.tensor(ids, dtype=torch.int32) if ids else torch.empty(0, dtype=torch.int32)


def _texts(files: Sequence[Path], fmt: str, field: str) -> Iterator[str]:
    for f in files:
        kind = kind_of(f, fmt)
        if kind == "text":
            yield Path(f).read_bytes().decode("utf-8", "replace")
        else:
            yield from documents(f, kind, field)


def train(files: Sequence[Path], vocab_size: int, output: Path, *, fmt: str = "auto", field: str = "text",
          min_frequency: int = 2) -> tuple[int, str]:
    """Train a byte-level BPE tokenizer (the 256 byte symbols, then merges up to ``vocab_size``)
    on the documents of ``files`` read as ``fmt`` and write it to ``output`` atomically (a
    temporary file renamed into place). Returns (its vocabulary size, its sha256 hex).
    Raises DataError on a missing package, an unreadable file, a corpus of no text or a vocab_size outside
    257..2**20."""
    if not 257 <= vocab_size <= 2**20:
        raise DataError(f"--vocab-size must be in 257..{2**20} (256 byte symbols and at least one merge), "
                        f"got {vocab_size}")
    require("tokenizers", "p2pdiloco data tokenizer")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    seen = [0]

    def texts() -> Iterator[str]:
        for text in _texts(files, fmt, field):
            seen[0] += len(text)
            yield text

    tok.train_from_iterator(texts(), trainer=trainer)
    if not seen[0]:
        raise DataError(f"the corpus ({len(files)} file(s)) holds no text (every document is empty)")
    output = Path(output)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(tok.to_str())
    tmp.replace(output)
    return tok.get_vocab_size(), file_sha256(output)


def resolve(cfg: Any, pinned: bool = False) -> Any:
    """``cfg`` (a NodeConfig) with its tokenizer's digest and vocabulary: when ``data.tokenizer``
    names a file, ``data.tokenizer_sha256`` becomes its digest and ``model.vocab_size`` its
    vocabulary size; unchanged without one. Raises ConfigError (one line) when the file's digest
    is not the run's ``data.tokenizer_sha256``, the vocabulary is not ``model.vocab_size`` of a
    run that pins its settings (``pinned``: the node joins with a manifest), or the file cannot be used (:func:`load`)."""
    path = cfg.data.tokenizer
    if not path:
        return cfg
    try:
        digest = file_sha256(path)
        if cfg.data.tokenizer_sha256 and cfg.data.tokenizer_sha256 != digest:
            raise ConfigError(f"data.tokenizer {path} has sha256 {digest[:16]}..., not the run's "
                              f"{cfg.data.tokenizer_sha256[:16]}... (data.tokenizer_sha256): every node of a run "
                              f"uses the same tokenizer; get the run's file from its owner")
        vocab = load(path).get_vocab_size()
    except DataError as e:
        raise ConfigError(str(e)) from None
    if pinned and cfg.data.tokenizer_sha256 and vocab != cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer {path} has {vocab} tokens, the run's model.vocab_size is "
                          f"{cfg.model.vocab_size}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab),
                               data=dataclasses.replace(cfg.data, tokenizer_sha256=digest))
