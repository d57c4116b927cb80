"""Real text as bytes: corpus discovery, disjoint per-node shards, batches and evaluation.

Tokens are raw bytes (vocab 256), or the IDs of a run's tokenizer (:mod:`p2pdiloco.tokenizer`)
applied to the bytes a node reads. Files (text, JSON Lines, Parquet: :mod:`p2pdiloco.formats`,
each standing for a stream of bytes) are cut into pieces of at most ``PIECE_BYTES``; each
piece is keyed by its file's path relative to the corpus root plus its piece number, and a
stable hash of that key decides, identically on every node, whether the piece is held out and
which shard trains on it. So shards are disjoint and every node evaluates on the same bytes.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from p2pdiloco.formats import check_not_empty, collect_text_files, document_bytes, file_size, kind_of

__all__ = ["PIECE_BYTES", "min_text_bytes", "default_corpus_files", "collect_text_files", "Corpus", "load_corpus",
           "BatchSampler", "heldout_batches", "evaluate", "bits_per_byte", "loss_unit"]


PIECE_BYTES = 1 << 16  # unit of the held-out / shard split, so one large file can feed many shards
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_corpus_files() -> list[Path]:
    """The Python standard library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``),
    sorted, without site-packages, test directories and hidden entries. Raises ValueError if
    none are found."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS and not x.startswith(".")]
        files += [Path(d, n) for n in names if n.endswith(".py") and not n.startswith(".")]
    if not files:
        raise ValueError(f"no .py files found in the standard library at {root}")
    return sorted(files)


@dataclass(frozen=True)
class Corpus:
    """train: [N] tokens of this node's shard; heldout: [M] tokens common to all nodes. uint8
    bytes, or int32 token IDs with a tokenizer; heldout_bytes: the bytes of text the held-out
    tokens encode (None: the tokens are bytes)."""

    train: Tensor
    heldout: Tensor
    heldout_bytes: int | None = None

    @property
    def bytes_per_token(self) -> float:
        """Mean bytes of text per held-out token (1.0 without a tokenizer): turns a loss in nats
        per token into nats per byte (:func:`bits_per_byte`)."""
        if self.heldout_bytes is None or not self.heldout.numel():
            return 1.0
        return self.heldout_bytes / self.heldout.numel()


def _unit_hash(salt: bytes, key: str) -> int:
    return int.from_bytes(hashlib.sha256(salt + b"\0" + key.encode()).digest()[:8], "little")


def _read(pieces: Sequence[tuple[Path, int, int]], cap: int | None, kinds: dict[Path, str] | None = None,
          field: str = "text") -> Tensor:
    """Concatenate pieces (path, offset, length), stopping after ``cap`` bytes. uint8 [N].
    ``kinds``: the kind of each non-text file (:func:`p2pdiloco.formats.kind_of`); each such
    file is decoded once, for all of its pieces read."""
    trimmed, total = [], 0
    for path, off, n in pieces:
        if cap is not None and total >= cap:
            break
        n = n if cap is None else min(n, cap - total)
        trimmed.append((path, off, n))
        total += n
    decoded: dict[tuple[Path, int], bytes] = {}
    for path in dict.fromkeys(p for p, _, _ in trimmed if (kinds or {}).get(p, "text") != "text"):
        whole = document_bytes(path, kinds[path], field)  # type: ignore[index]
        decoded.update({(path, off): whole[off:off + n] for p, off, n in trimmed if p == path})
    out = bytearray()
    for path, off, n in trimmed:
        if (path, off) in decoded:
            out += decoded[(path, off)]
            continue
        with open(path, "rb") as f:
            f.seek(off)
            out += f.read(n)
    return torch.frombuffer(out, dtype=torch.uint8).clone() if out else torch.empty(0, dtype=torch.uint8)


def min_text_bytes(block_size: int) -> int:
    """Bytes of text that always work for one node on one shard: one file of this size is cut
    into two pieces (:data:`PIECE_BYTES` and the rest), one held out and one to train on, each
    of at least one sequence (``block_size + 1`` bytes). The batch size does not matter:
    training and held-out windows may overlap."""
    return PIECE_BYTES + block_size + 1


class EmptyShard(ValueError):
    """The corpus has fewer training pieces than shards: the requested shard holds nothing.
    ``pieces``: the training pieces there are (0: the text is too small for any shard)."""

    def __init__(self, message: str, pieces: int) -> None:
        super().__init__(message)
        self.pieces = pieces


def load_corpus(files: Sequence[Path], shard_index: int, num_shards: int,
                heldout_fraction: float = 0.05, max_bytes: int | None = None, *, fmt: str = "text",
                text_field: str = "text", tokenizer: Any = None) -> Corpus:
    """Split ``files`` into a held-out set and ``num_shards`` disjoint training shards; read
    shard ``shard_index`` and the held-out set.

    Pieces (<= 64 KiB of a file, keyed by path relative to the files' common folder and piece
    number) are held out when a stable hash maps them below ``heldout_fraction`` (at least one
    piece when the fraction is > 0 and there are two or more pieces); the rest, ordered by a
    second stable hash, go round-robin to the shards. Bytes are concatenated in hash order.
    max_bytes caps the bytes read for the shard and for the held-out set (for fast demos).
    ``fmt`` (``data.format``) and ``text_field`` say how each file is read
    (:func:`p2pdiloco.formats.kind_of`: JSON Lines and Parquet files stand for their documents'
    bytes); ``tokenizer`` (a ``tokenizers.Tokenizer``, :func:`p2pdiloco.tokenizer.encode`)
    turns the bytes read into int32 token IDs; None keeps bytes.
    Raises EmptyShard (a ValueError) when the shard is empty, DataError (a ValueError) on a
    file its format cannot read or a corpus of no text, ValueError on bad arguments,
    FileNotFoundError on a missing file.
    """
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"need 0 <= shard_index < num_shards, got {shard_index}, {num_shards}")
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    if not files:
        raise ValueError("no corpus files")
    paths = [Path(f).absolute() for f in files]
    root = Path(os.path.commonpath([p.parent for p in paths]))
    kinds = {p: kind_of(p, fmt) for p in paths}
    sizes = [file_size(p, kinds[p], text_field) for p in paths]
    if fmt != "text":
        check_not_empty(sizes, str(root))
    units = []  # (key, path, offset, length)
    for p, size in zip(paths, sizes):
        rel = p.relative_to(root).as_posix()
        units += [(f"{rel}#{i}", p, off, min(PIECE_BYTES, size - off))
                  for i, off in enumerate(range(0, size, PIECE_BYTES))]
    units.sort(key=lambda u: _unit_hash(b"heldout", u[0]))
    n_held = sum(_unit_hash(b"heldout", u[0]) < heldout_fraction * 2**64 for u in units)
    if heldout_fraction > 0 and len(units) >= 2:
        n_held = max(n_held, 1)
    held, rest = units[:n_held], sorted(units[n_held:], key=lambda u: _unit_hash(b"shard", u[0]))
    mine = rest[shard_index::num_shards]
    if not mine:
        fewer = (f"set data.num_shards to at most {len(rest)}"
                 + (" (and data.shard_index below it)" if shard_index >= len(rest) else "") + " or ") if rest else ""
        raise EmptyShard(f"data shard {shard_index} of {num_shards} is empty: the corpus has {len(rest)} training "
                         f"piece(s) of up to {PIECE_BYTES} bytes; {fewer}give more text (data.path)", len(rest))
    train, heldout = (_read([u[1:] for u in part], max_bytes, kinds, text_field) for part in (mine, held))
    if tokenizer is not None:
        from p2pdiloco.tokenizer import encode  # noqa: PLC0415

        return Corpus(encode(tokenizer, train), encode(tokenizer, heldout), heldout.numel())
    return Corpus(train, heldout)


class BatchSampler:
    """Random training windows from ``data`` (uint8 bytes or int32 token IDs [N]) with its own ``torch.Generator``
    seeded by ``seed``. ``next()`` -> (inputs, targets), int64 [batch_size, block_size] each,
    targets shifted one byte ahead. Raises ValueError if N < block_size + 1 or sizes < 1."""

    def __init__(self, data: Tensor, batch_size: int, block_size: int, seed: int) -> None:
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size and block_size must be >= 1, got {batch_size}, {block_size}")
        if data.numel() < block_size + 1:
            raise ValueError(f"{data.numel()} bytes of data is too little for block_size {block_size}")
        self.data, self.batch_size, self.block_size = data, batch_size, block_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[Tensor, Tensor]:
        T = self.block_size
        starts = torch.randint(self.data.numel() - T, (self.batch_size,), generator=self.generator)  # [B]
        w = self.data[starts[:, None] + torch.arange(T + 1)].long()  # [B, T+1]
        return w[:, :-1], w[:, 1:]


def heldout_batches(heldout: Tensor, batch_size: int, block_size: int, num_batches: int) -> list[tuple[Tensor, Tensor]]:
    """``num_batches`` batches of evenly spaced windows over ``heldout`` (uint8/int32 [M]), identical
    on every node: list of (inputs, targets), int64 [batch_size, block_size] each.
    Raises ValueError if M < block_size + 1 or any size < 1."""
    if min(batch_size, block_size, num_batches) < 1:
        raise ValueError("batch_size, block_size and num_batches must be >= 1")
    if heldout.numel() < block_size + 1:
        raise ValueError(f"{heldout.numel()} held-out bytes is too little for block_size {block_size}")
    T, n = block_size, batch_size * num_batches
    starts = torch.linspace(0, heldout.numel() - T - 1, n, dtype=torch.float64).long()  # [n]
    w = heldout[starts[:, None] + torch.arange(T + 1)].long().view(num_batches, batch_size, T + 1)
    return [(b[:, :-1], b[:, 1:]) for b in w]


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]]) -> float:
    """Mean cross-entropy of ``model`` over all positions of ``batches``, in nats per token
    (per byte without a tokenizer).
    The model's train/eval mode is restored. Raises ValueError on an empty batch list."""
    if not batches:
        raise ValueError("no evaluation batches")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        logits = model(x.to(device))  # [B, T, V]
        total += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    return total / count


def bits_per_byte(loss: float, bytes_per_token: float = 1.0) -> float:
    """A loss in nats per token as bits per byte of text: loss / ``bytes_per_token`` / ln 2
    (``bytes_per_token``: :attr:`Corpus.bytes_per_token`, 1.0 when the tokens are bytes)."""
    return loss / bytes_per_token / math.log(2)


def loss_unit(tokenizer: str) -> str:
    """The unit of a loss over tokens of ``tokenizer`` (``data.tokenizer``; "": bytes):
    ``nats/byte`` without one, ``nats/token`` with one."""
    return "nats/token" if tokenizer else "nats/byte"
