"""What the harness sees of its nodes: status-file samples per incarnation.

A node writes its status file (JSON, atomically) about every second. The harness reads it
about twice a second and keeps, per incarnation (one process lifetime), the samples it saw
and the counters at the incarnation's start and end. A restarted node starts its counters
(tokens, tokens_merged, rounds) at 0, so totals are summed over incarnations; the counters of
a killed incarnation are those of its last status, with the tokens extrapolated at its
tokens/s from the status time to the kill.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from p2pdiloco.procs import Proc
from p2pdiloco.status import Report, Snapshot, Status, read_status

# node states (status JSON) in which the node trains: "alone" trains too, merging with nobody
TRAINING = ("training", "alone")


@dataclass
class Sample:
    """One status reading. ``t``: harness clock (monotonic seconds) of the status's own time."""

    t: float
    state: str
    tokens: float
    merged: float
    committed: int
    failed: int
    tps: float
    versions: tuple[int, ...]
    digest: str
    heldout: float | None = None  # held-out loss of the local model at its last evaluation
    blocked: float = 0.0  # seconds training waited for rounds (synchronous mode), if reported


@dataclass
class Incarnation:
    """One process lifetime of a node."""

    proc: Proc
    spawned: float  # harness clock
    restart: bool  # started by the schedule after a kill
    samples: list[Sample] = field(default_factory=list)
    base_tokens: float = 0.0  # counters at the start of the measured window
    base_merged: float = 0.0
    base_committed: int = 0
    end_tokens: float | None = None  # counters at the end (kill or final report)
    end_merged: float | None = None
    ended: float | None = None
    training_at: float | None = None  # first sample in state 'training'
    rejoined_at: float | None = None  # restarts: back at the swarm's newest versions
    exit_code: int | None = None
    report: Report | None = None

    @property
    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def processed(self) -> float:
        end = self.end_tokens if self.end_tokens is not None else (self.last.tokens if self.last else 0.0)
        return max(0.0, end - self.base_tokens)

    def merged(self) -> float:
        end = self.end_merged if self.end_merged is not None else (self.last.merged if self.last else 0.0)
        return max(0.0, end - self.base_merged)


@dataclass
class NodeTrack:
    """One node slot of the run: its folder and its incarnations."""

    index: int
    folder: Path
    lives: list[Incarnation] = field(default_factory=list)
    frozen_since: float | None = None
    frozen: list[tuple[float, float]] = field(default_factory=list)  # (SIGSTOP, SIGCONT or kill) times
    slow_factor: float = 1.0
    slowed: bool = False  # ever slowed down by the schedule

    def thawed(self, at: float) -> None:
        """The freeze ended at ``at`` (SIGCONT or a kill)."""
        if self.frozen_since is not None:
            self.frozen.append((self.frozen_since, at))
        self.frozen_since = None

    @property
    def name(self) -> str:
        return f"node{self.index}"

    @property
    def status_path(self) -> Path:
        return self.folder / "status.json"

    @property
    def report_path(self) -> Path:
        return self.folder / "report.json"

    @property
    def current(self) -> Incarnation | None:
        return self.lives[-1] if self.lives else None

    def up(self) -> bool:
        cur = self.current
        return cur is not None and cur.ended is None and cur.proc.alive()

    def poll(self, clock_offset: float) -> Sample | None:
        """Read the status file; record and return a new sample of the current incarnation
        (None when missing, stale, from an earlier incarnation or unchanged)."""
        cur = self.current
        if cur is None or cur.ended is not None:
            return None
        data = read_status(self.status_path)
        if data is None or data.pid != cur.proc.pid:
            return None
        wall = data.time if isinstance(data, Status) and data.time else None
        if wall is None:
            try:
                wall = os.stat(self.status_path).st_mtime
            except OSError:
                return None
        t = float(wall) - clock_offset
        if cur.samples and t <= cur.samples[-1].t:
            return None
        s = sample_of(data, t)
        cur.samples.append(s)
        if s.state in TRAINING and cur.training_at is None:
            cur.training_at = t
        return s


def sample_of(data: Snapshot, t: float) -> Sample:
    """One sample of a node's status at harness time ``t`` (zeros before it trains)."""
    run = data if isinstance(data, Status) else Status(name=data.name, state=data.state)
    versions = tuple(int(f[0]) for f in run.fragments if isinstance(f, list) and f)
    return Sample(t, run.state, float(run.tokens), float(run.tokens_merged), run.rounds_committed, run.rounds_failed,
                  float(run.tokens_per_s), versions, run.global_digest, run.heldout_loss, float(run.blocked_s))


def clock_offset() -> float:
    """wall clock - harness clock (time.time() - time.monotonic())."""
    return time.time() - time.monotonic()


def close_incarnation(life: Incarnation, at: float, extrapolate: bool) -> None:
    """Freeze an incarnation's end counters at harness time ``at`` (a kill): its last status,
    tokens extrapolated at its tokens/s when ``extrapolate`` (it was computing until then)."""
    life.ended = at
    last = life.last
    if last is None:
        life.end_tokens, life.end_merged = life.base_tokens, life.base_merged
        return
    extra = last.tps * max(0.0, at - last.t) if extrapolate and last.state in TRAINING else 0.0
    life.end_tokens, life.end_merged = last.tokens + extra, last.merged


def versions_at(track: NodeTrack, t: float) -> tuple[int, ...] | None:
    """The fragment versions ``track``'s current incarnation reported at or before ``t``."""
    cur = track.current
    if cur is None:
        return None
    for s in reversed(cur.samples):
        if s.t <= t:
            return s.versions
    return None


def is_rejoined(tracks: list[NodeTrack], node: NodeTrack, s: Sample, slack: float) -> bool:
    """A restarted node is back once it trains at versions no older than the newest any other
    live node reported ``slack`` seconds before (status files lag by up to a second)."""
    if s.state not in TRAINING:
        return False
    for tr in tracks:
        if tr is node or not tr.up():
            continue
        theirs = versions_at(tr, s.t - slack)
        if theirs is not None and any(mine < v for mine, v in zip(s.versions, theirs, strict=False)):
            return False
    return True
