"""Training text as people keep it: plain text files, JSON Lines, Parquet (docs/data.md).

A corpus file is one of three kinds. ``text``: its bytes as they are. ``jsonl``: one JSON
object per line whose string field ``data.text_field`` holds a document; ``parquet``: a table
whose string column ``data.text_field`` holds one document per row. A JSON Lines or Parquet
file stands for the UTF-8 bytes of its documents in file order, each followed by one ``"\\n"``:
the same bytes as a text file holding those documents one after another, so it is split,
sharded and held out exactly as that text file would be (:func:`p2pdiloco.data.load_corpus`).

Every file is hostile until read: a line that is not an object, a missing or non-string field,
a Parquet file without the column, an empty corpus raise :class:`DataError` (a ValueError), one
line naming the file (and line or row) and what to do; a node says it and exits 2.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

__all__ = ["DataFormat", "FORMATS", "EXTRA_HINT", "DataError", "kind_of", "collect_text_files", "collect_files", "documents",
           "document_bytes", "file_size", "require"]

DataFormat = Literal["auto", "text", "jsonl", "parquet"]
FORMATS: tuple[str, ...] = ("auto", "text", "jsonl", "parquet")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
EXTRA_HINT = "pip install 'p2pdiloco[data]'"
_SNIFF_BYTES = 1 << 16


class DataError(ValueError):
    """A corpus file that cannot be read as its format says (one line: the file, what, the fix)."""


def require(module: str, what: str) -> None:
    """Import ``module`` (``pyarrow.parquet``, ``tokenizers``) or raise DataError naming the
    optional extra that installs it (``what``: the setting that needs it)."""
    try:
        __import__(module)
    except ImportError:
        raise DataError(f"{what} needs the {module.split('.')[0]} package: {EXTRA_HINT}") from None


def kind_of(path: Path, fmt: str) -> str:
    """The kind (``text``, ``jsonl``, ``parquet``) of one corpus file under ``data.format``
    ``fmt``: the format itself, or for ``auto`` by the file's suffix (``.jsonl``/``.ndjson``,
    ``.parquet``; anything else is text)."""
    if fmt != "auto":
        return fmt
    return _SUFFIXES.get(Path(path).suffix.lower(), "text")


def _is_text(path: Path) -> bool:
    """True for a non-empty file whose first 64 KiB hold no NUL byte and decode as UTF-8."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _SNIFF_BYTES)
    except (OSError, UnicodeDecodeError):
        return False
    return bool(head) and b"\0" not in head


def collect_text_files(path: Path) -> list[Path]:
    """``path`` itself if it is a text file, else every non-hidden regular text file below the
    folder (recursive, sorted); binary, non-UTF-8 and empty files are skipped.
    Raises FileNotFoundError if path does not exist, ValueError if nothing usable is found."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {path} does not exist")
    if path.is_file():
        if not _is_text(path):
            raise ValueError(f"{path} is not a non-empty UTF-8 text file")
        return [path]
    files = []
    for d, dirs, names in os.walk(path):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        files += [Path(d, n) for n in names if not n.startswith(".")]
    usable = sorted(f for f in files if f.is_file() and not f.is_symlink() and _is_text(f))
    if not usable:
        raise ValueError(f"no usable UTF-8 text files under {path}")
    return usable


def collect_files(path: Path, fmt: str) -> list[Path]:
    """The corpus files of ``path`` under ``data.format`` ``fmt``, sorted (the same order on
    every node): ``path`` itself if it is a file, else every non-hidden regular file below the
    folder whose kind (:func:`kind_of`) is the format's (for ``auto``: ``.jsonl``/``.parquet``
    files and UTF-8 text files). Text files are chosen by
    :func:`collect_text_files` (binary, non-UTF-8 and empty files skipped).
    Raises FileNotFoundError if path does not exist, DataError if nothing usable is found."""
    path = Path(path)
    if fmt == "text" or (path.is_file() and kind_of(path, fmt) == "text"):
        return collect_text_files(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {path} does not exist")
    if path.is_file():
        return [path]
    files = []
    for d, dirs, names in os.walk(path):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        files += [Path(d, n) for n in names if not n.startswith(".")]
    files = [f for f in files if f.is_file() and not f.is_symlink()]
    structured = [f for f in files if _SUFFIXES.get(f.suffix.lower()) in (fmt, "jsonl", "parquet")
                  and (fmt == "auto" or _SUFFIXES.get(f.suffix.lower()) == fmt)]
    texts: list[Path] = []
    if fmt == "auto":
        try:
            texts = [f for f in collect_text_files(path) if kind_of(f, "auto") == "text"]
        except ValueError:
            texts = []
    usable = sorted({*structured, *texts})
    if not usable:
        want = {"jsonl": ".jsonl files", "parquet": ".parquet files"}.get(fmt, "text, .jsonl or .parquet files")
        raise DataError(f"data.path {path}: no {want} found (data.format = {fmt!r})")
    return usable


def documents(path: Path, kind: str, field: str) -> Iterator[str]:
    """The documents of one ``jsonl`` or ``parquet`` file, in file order. Raises DataError on a
    line that is not a JSON object, a record without the string field ``field``, a Parquet file
    without that column (or unreadable), OSError when the file cannot be read."""
    if kind == "jsonl":
        yield from _jsonl(Path(path), field)
    elif kind == "parquet":
        yield from _parquet(Path(path), field)
    else:
        raise ValueError(f"not a document format: {kind!r}")


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise DataError(f"{path}:{n}: not valid JSON (data.format jsonl: one JSON object per line)") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{n}: a JSON {type(record).__name__}, not an object "
                                f"(data.format jsonl: one object per line)")
            text = record.get(field)
            if not isinstance(text, str):
                what = "has no" if text is None else f"has a {type(text).__name__} in its"
                raise DataError(f"{path}:{n}: the record {what} {field!r} field (data.text_field: the field "
                                f"that holds the text)")
            yield text


def _parquet(path: Path, field: str) -> Iterator[str]:
    require("pyarrow.parquet", "data.format parquet")
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0] if str(e) else e})") from None
    if field not in schema.names:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)}; data.text_field names "
                        f"the text column)")
    if not (pa.types.is_string(schema.field(field).type) or pa.types.is_large_string(schema.field(field).type)):
        raise DataError(f"{path}: column {field!r} holds {schema.field(field).type}, not strings")
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=8192):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise DataError(f"{path}: row {row} has no {field!r} (null)")
            yield text


def document_bytes(path: Path, kind: str, field: str) -> bytes:
    """The bytes a ``jsonl``/``parquet`` file stands for: each document's UTF-8 bytes followed
    by ``b"\\n"``, in file order (module docstring). Raises as :func:`documents`."""
    return b"".join(t.encode("utf-8", "replace") + b"\n" for t in documents(path, kind, field))


def file_size(path: Path, kind: str, field: str) -> int:
    """Bytes one corpus file stands for: its size for ``text``, else of :func:`document_bytes`."""
    if kind == "text":
        return Path(path).stat().st_size
    return sum(len(t.encode("utf-8", "replace")) + 1 for t in documents(path, kind, field))


def check_not_empty(sizes: Sequence[int], root: str) -> None:
    """Raise DataError when the corpus stands for no bytes at all."""
    if not sum(sizes):
        raise DataError(f"the corpus {root} holds no text (every document is empty)")
