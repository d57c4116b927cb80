"""Local crash safety: periodic, atomic checkpoints of a node's learner and global states.

A checkpoint is written to a temporary file in the data dir, fsynced, then renamed over
``checkpoint.pt`` (and the folder fsynced), so a kill at any moment leaves either the old or
the new checkpoint, never a torn one. A checkpoint that still fails to load (disk error,
other version) is set aside as ``checkpoint.pt.corrupt`` and the node starts fresh; the
swarm's state then wins anyway. A write that fails (a full disk: ENOSPC; a file-size limit:
EFBIG) raises the OSError and leaves the previous checkpoint as it was: the old one goes only
when the new one is in place (docs/operating.md, "Faults of the machine").

A checkpoint whose progress may have left the node since it was written (the journal could not
record a send: ``set_aside_progress``) is renamed ``checkpoint-sent.pt``, never deleted: a
resume takes its global states, step and optimizer state, and none of its local progress.

What a resumed node does with the checkpoint's local progress (θ − Θ per fragment) is decided
here too (``kept_progress``): progress that never left the node is kept, rebased on the
swarm's newer state like any follow's (invariant I3 in docs/architecture.md); progress that
may be inside a state the swarm merged is dropped, never merged twice (I2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2pdiloco.atomic import write_bytes_atomic
from p2pdiloco.config import NodeConfig
from p2pdiloco.core.learner import Learner, global_states_of
from p2pdiloco.core.outer import FragmentState

from node.journal import FILE as JOURNAL_FILE, read_journals

log = logging.getLogger(__name__)

FORMAT = 1
NODE_CONFIG = "node-config.json"  # the node's effective settings, written at each start
NODE_CONFIG_FORMAT = 1


def checkpoint_path(data_dir: Path) -> Path:
    return data_dir / "checkpoint.pt"


def sent_path(data_dir: Path) -> Path:
    """Where ``set_aside_progress`` moves a checkpoint whose progress may have been sent since."""
    return data_dir / "checkpoint-sent.pt"


class _KeepsWriteError:
    """The file ``torch.save`` writes to, keeping the OSError that a write raised: torch reports
    a failed write to a file object as a RuntimeError without it (``inline_container.cc``), so a
    full disk would not be told from a bug."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(data_dir: Path, learner: Learner, extra: dict[str, Any]) -> Path:
    """Atomically write the learner's state (model, AdamW, step, counters, global states)
    and ``extra`` (JSON-able) to ``data_dir/checkpoint.pt``. Returns the path.

    Must run in the thread that owns the learner (the training thread), between steps: it
    serializes the live tensors, not a copy (a copy would add 20 bytes per parameter to the
    node's peak memory, p2pdiloco.footprint); training waits for the write (how long:
    ``checkpoint_s`` in the status JSON, at most 5% of the time: node.training.CHECKPOINT_COST).

    Raises:
        OSError: the file could not be written (ENOSPC, EFBIG, EIO...); the previous
            checkpoint is left as it was and the temporary file removed. A checkpoint set
            aside by ``set_aside_progress`` is removed only once this one is in place."""
    path = checkpoint_path(data_dir)
    blob = {"format": FORMAT, "learner": learner.state_dict(copy_tensors=False), "extra": extra}
    fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=".checkpoint.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            sink = _KeepsWriteError(f)
            try:
                torch.save(blob, sink)
            except RuntimeError:
                if sink.error is not None:
                    raise sink.error from None
                raise
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
    sent_path(data_dir).unlink(missing_ok=True)
    return path


def set_aside_progress(data_dir: Path) -> None:
    """The journal could not record that a round sends this node's progress (a full disk), so
    the checkpoint's word that some progress never left can no longer be checked
    (``kept_progress``): rename it ``checkpoint-sent.pt`` (a rename needs no free space), whose
    resume keeps no local progress (docs/architecture.md, I2) but its global states, step and
    optimizer state. Raises nothing: a failed rename removes the checkpoint instead."""
    try:
        os.replace(checkpoint_path(data_dir), sent_path(data_dir))
    except FileNotFoundError:
        pass
    except OSError:
        with contextlib.suppress(OSError):
            checkpoint_path(data_dir).unlink(missing_ok=True)


def read_global_states(data_dir: Path) -> list[FragmentState] | None:
    """The global states Θ (one per fragment, fragment order) held by ``data_dir``'s
    checkpoint, read without changing the data dir (a node may be running on it); None when
    there is no checkpoint.

    Raises:
        ValueError: the checkpoint cannot be read, is of another format, or a state's digest
            does not match its tensors.
    """
    path = checkpoint_path(data_dir)
    if not path.exists():
        return None
    try:  # weights_only: tensors and plain containers, no pickled code (the data dir may be anyone's)
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise ValueError(f"format {blob.get('format') if isinstance(blob, dict) else None!r}, expected {FORMAT}")
        return global_states_of(blob["learner"])
    except Exception as e:  # noqa: BLE001  (unpickling, a missing key, a bad tensor: one line)
        first = str(e).strip().splitlines()[:1]
        raise ValueError(f"checkpoint {path} is unusable: {type(e).__name__}{': ' + first[0] if first else ''}") \
            from None


def save_node_config(data_dir: Path, cfg: NodeConfig) -> Path:
    """Atomically write ``cfg``, the node's effective settings, as JSON to
    ``data_dir/node-config.json``: ``{"format": 1, "settings": {section: {field: value}, field:
    value}}`` (``dataclasses.asdict``; tuples become lists). ``p2pdiloco model export`` rebuilds
    the module of the checkpoint from it. Returns the path; raises OSError."""
    path = data_dir / NODE_CONFIG
    write_bytes_atomic(path, json.dumps({"format": NODE_CONFIG_FORMAT, "settings": dataclasses.asdict(cfg)},
                                        indent=1).encode())
    return path


def load_checkpoint(data_dir: Path, learner: Learner, path: Path | None = None) -> dict[str, Any] | None:
    """Restore ``learner`` from ``path`` (default ``data_dir/checkpoint.pt``) if there is a
    usable one; returns its ``extra`` dict, or None when there is no checkpoint or it could not
    be used."""
    for stale in data_dir.glob(".checkpoint.*.tmp"):  # left by a kill during a write
        stale.unlink(missing_ok=True)
    path = path or checkpoint_path(data_dir)
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


@dataclass(frozen=True)
class Resumed:
    """A checkpoint loaded: the fragments whose progress is kept, the send counters to go on from."""

    kept: frozenset[int]
    sends: list[int]


def resume(data_dir: Path, learner: Learner) -> Resumed | None:
    """``load_checkpoint`` into ``learner``, then ``kept_progress`` with the data dir's journal;
    the progress of every other fragment is dropped here, before any download (θ_p ← Θ_p, its
    counters reset), so that no later follow can rebase it. Without ``checkpoint.pt``, the
    checkpoint set aside by ``set_aside_progress`` is loaded, none of its progress kept. None
    when there is no usable checkpoint."""
    sent = not checkpoint_path(data_dir).exists()
    extra = load_checkpoint(data_dir, learner, sent_path(data_dir) if sent else None)
    if extra is None:
        return None
    kept, sends = kept_progress(extra, read_journals(data_dir / JOURNAL_FILE), len(learner.fragments))
    if sent:
        kept = set()
    for p, state in enumerate(learner.global_states):
        if p not in kept and learner.counters(p)[1]:
            log.info("fragment %d: checkpointed progress (%d steps at v%d) dropped: it may have been sent since",
                     p, learner.counters(p)[1], state.version)
            learner.install(state, rebase=False)
    return Resumed(frozenset(kept), sends)


def kept_progress(extra: dict[str, Any], journal: Sequence[dict[str, Any]], fragments: int) -> tuple[set[int], list[int]]:
    """Which fragments' checkpointed progress a resumed node keeps, and its send counters.

    Args:
        extra: the checkpoint's ``extra``: ``sends`` (rounds started per fragment when it was
            written, ``TrainingLoop.sends``) and ``unsent`` (fragments whose progress had not left
            the node then, ``TrainingLoop.unsent``).
        journal: the data dir's journal events (``node.journal.read_journals``), whose ``send``
            events (``fragment``, ``n``) are written and synced before a round sends anything.
        fragments: the number of fragments P.

    Returns:
        (kept, sends): the fragments p whose progress had not left the node when the checkpoint
        was written and whose last ``send`` in the journal is the checkpoint's own count (no round
        of p started after it: a previous incarnation may have sent that progress since, into a
        state the swarm merged; an empty or missing journal proves nothing, so nothing is kept);
        and the send counters to go on from (per fragment, the larger of the checkpoint's and the
        journal's, so that a later checkpoint is judged right). A
        checkpoint without these fields, or fields of the wrong type, keeps nothing: lost
        progress costs work, progress merged twice counts twice (docs/architecture.md, I2).
    """
    sends, unsent = extra.get("sends"), extra.get("unsent")
    last = [0] * fragments
    for e in journal:
        p, n = e.get("fragment"), e.get("n")
        if e.get("event") == "send" and type(p) is int and type(n) is int and 0 <= p < fragments:
            last[p] = max(last[p], n)
    if not (isinstance(sends, list) and len(sends) == fragments and all(type(n) is int and n >= 0 for n in sends)):
        return set(), last
    counts = [max(a, b) for a, b in zip(sends, last)]
    if not journal or not (isinstance(unsent, list) and all(type(p) is int for p in unsent)):
        return set(), counts
    return {p for p in unsent if 0 <= p < fragments and last[p] == sends[p]}, counts
