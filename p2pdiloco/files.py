"""Files a node or a command writes whole: atomically, so a reader (or a crash) never sees a
torn one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["write_json_atomic"]


def write_json_atomic(path: Path, data: Any, *, durable: bool = True, sort_keys: bool = False) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temp file in the same folder, rename):
    a reader sees the old file or the new one, never a torn one. ``durable``: fsync before the
    rename, so that a power loss cannot leave an empty file either (the final report); the
    status snapshot, rewritten every second, skips it (a disk flush a second per node)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=sort_keys)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
