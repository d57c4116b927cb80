"""Atomic file writes: a reader sees the old file or the new one, never a torn one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["write_bytes_atomic", "write_json_atomic"]


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder (created if
    missing) and a rename. ``durable``: fsync the file before the rename, so that a power loss
    cannot leave an empty file either; a file rewritten every second (a status snapshot) may
    skip it. ``mode``: the file's permission bits (default: the temporary file's 0600, this
    user only). Raises OSError (the folder cannot be made or written); the temporary file is
    removed then."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any, *, durable: bool = True, sort_keys: bool = False) -> None:
    """Write ``data`` as JSON (indented) to ``path`` atomically (:func:`write_bytes_atomic`): a
    reader sees the old file or the new one, never a torn one. ``durable``: fsync before the
    rename, so that a power loss cannot leave an empty file either (the final report); the
    status snapshot, rewritten every second, skips it (a disk flush a second per node)."""
    write_bytes_atomic(path, json.dumps(data, indent=1, sort_keys=sort_keys).encode(), durable=durable)
