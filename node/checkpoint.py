"""Local crash safety: periodic, atomic checkpoints of a node's learner and global states.

A checkpoint is written to a temporary file in the data dir, fsynced, then renamed over
``checkpoint.pt`` (and the folder fsynced), so a kill at any moment leaves either the old or
the new checkpoint, never a torn one. A checkpoint that still fails to load (disk error,
other version) is set aside as ``checkpoint.pt.corrupt`` and the node starts fresh; the
swarm's state then wins anyway.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.core.learner import Learner

log = logging.getLogger(__name__)

FORMAT = 1


def checkpoint_path(data_dir: Path) -> Path:
    return data_dir / "checkpoint.pt"


def save_checkpoint(data_dir: Path, learner: Learner, extra: dict[str, Any]) -> Path:
    """Atomically write the learner's state (model, AdamW, step, counters, global states)
    and ``extra`` (JSON-able) to ``data_dir/checkpoint.pt``. Returns the path.

    Must run in the thread that owns the learner (the training thread), between steps."""
    path = checkpoint_path(data_dir)
    blob = {"format": FORMAT, "learner": learner.state_dict(), "extra": extra}
    fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=".checkpoint.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(data_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(data_dir: Path, learner: Learner) -> dict[str, Any] | None:
    """Restore ``learner`` from ``data_dir/checkpoint.pt`` if there is a usable one; returns
    its ``extra`` dict, or None when there is no checkpoint or it could not be used."""
    for stale in data_dir.glob(".checkpoint.*.tmp"):  # left by a kill during a write
        stale.unlink(missing_ok=True)
    path = checkpoint_path(data_dir)
    if not path.exists():
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=False)
        if blob.get("format") != FORMAT:
            raise ValueError(f"format {blob.get('format')!r}, expected {FORMAT}")
        learner.load_state_dict(blob["learner"])
    except Exception as e:  # any unreadable checkpoint: keep it for inspection, start fresh
        corrupt = path.with_name(path.name + ".corrupt")
        os.replace(path, corrupt)
        log.warning("checkpoint %s unusable (%s); moved to %s, starting from the swarm's state", path, e, corrupt)
        return None
    log.info("resumed from %s at inner step %d", path, learner.step)
    return blob.get("extra", {})
