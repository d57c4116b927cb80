"""The figures of one chaos run, computed from the harness's samples and the nodes' reports.

Definitions (times on the harness clock, the measured window is ``[t0, t0 + duration]``):

* **goodput (merged / processed)**: tokens of committed merges (each node's ``tokens_merged``,
  already counted per fragment) over tokens the nodes computed, summed over incarnations.
  Merges pay off the oldest tokens first: the tokens a node computed before ``t0`` (the
  warm-up, lossless) are counted as the first ones it merges in the window, so the window
  starts, as the simulator's runs do, with nothing pending; what is lost is what a kill or the
  end of the run leaves unmerged.
* **goodput (useful / allocated)**, the paper's definition as in :mod:`p2pdiloco.sim.chaos`:
  merged tokens / (nodes x standalone tokens/s x duration). The standalone rate is one
  node's training throughput: unless given, the tokens the nodes (never slowed) computed
  per second spent training (from its first 'training' status to its kill or the
  end of the window, less freezes and, where the node reports ``blocked_s``, waits for
  rounds). Measured over the whole window rather than in the warm-up alone, so that a
  machine whose other load changes during the run does not bias it (the warm-up rate is
  reported next to it). Equivalently: goodput (merged / processed) x the share of the
  allocated node-time spent training.
* **uptime**: the share of ``window``-second bins of the measured window in which some node
  committed a merge (its ``rounds_committed`` grew).
* **rejoin time**: from a restart (process spawned) to the first status in state 'training'
  whose fragment versions are no older than the newest another live node reported
  ``slack`` seconds before.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from p2pdiloco.chaos.observe import TRAINING, Incarnation, NodeTrack


@dataclass
class ChaosResult:
    mode: str  # decoupled | synchronous
    nodes: int
    duration_s: float
    schedule: str
    failures: dict[str, int]  # injected: kill, freeze, slow; and kill_skipped (node already down)
    standalone_tokens_per_s: float
    rate_source: str  # where the standalone rate comes from
    warmup_tokens_per_s: float  # median per-node rate in the fault-free warm-up
    training_node_s: float  # node-seconds spent training within the window
    tokens_processed: float
    tokens_merged: float
    goodput_merged: float  # (a) merged / processed
    goodput: float  # (b) merged / (nodes x standalone tokens/s x duration)
    uptime: float
    uptime_window_s: float
    rejoin_s: list[float]
    rejoin_median_s: float | None
    rejoin_max_s: float | None
    rejoins_missing: int  # restarts that never got back to the newest versions
    rounds_committed: int
    rounds_failed: int
    start_loss: float | None  # held-out loss (nats/byte) of the initial model
    end_loss: dict[str, float]  # per live node: held-out loss of its final global model
    digests: dict[str, str]  # per node alive at the end: its final global digest
    digests_agree: bool
    exit_codes: dict[str, int | None]
    survivors: list[int] = field(default_factory=list)  # processes left after close (must be empty)
    load: dict[str, float] = field(default_factory=dict)  # mean cores busy: total, ours, others
    cpu_share: float = 1.0  # duty cycle of each training node
    simulated_goodput: float | None = None  # the simulator on the same kill timeline
    workdir: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def end_loss_mean(self) -> float | None:
        return statistics.fmean(self.end_loss.values()) if self.end_loss else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "end_loss_mean": self.end_loss_mean}


def warmup_rate(tracks: list[NodeTrack], start: float, end: float) -> float:
    """Median over nodes of (tokens at ``end`` - tokens at ``start``) / (end - start), from the
    samples of each node's first incarnation nearest those times."""
    rates = []
    for tr in tracks:
        life = tr.lives[0]
        a = [s for s in life.samples if s.t <= start and s.state in TRAINING]
        b = [s for s in life.samples if s.t <= end]
        if a and b and b[-1].t > a[-1].t:
            rates.append((b[-1].tokens - a[-1].tokens) / (b[-1].t - a[-1].t))
    return statistics.median(rates) if rates else 0.0


def training_seconds(tr: NodeTrack, life: Incarnation, t0: float, t1: float) -> float:
    """Seconds ``life`` spent training within [t0, t1]: less freezes and reported round waits."""
    if life.training_at is None:
        return 0.0
    a, b = max(t0, life.training_at), min(t1, life.ended if life.ended is not None else t1)
    if b <= a:
        return 0.0
    frozen = sum(max(0.0, min(b, e) - max(a, s)) for s, e in tr.frozen)
    inside = [x for x in life.samples if a <= x.t <= b]
    blocked = inside[-1].blocked - inside[0].blocked if len(inside) > 1 else 0.0
    return max(0.0, b - a - frozen - blocked)


def run_rate(tracks: list[NodeTrack], t0: float, t1: float) -> tuple[float, float]:
    """(tokens per training second of the nodes never slowed, total training node-seconds)."""
    tokens = secs = total = 0.0
    for tr in tracks:
        mine = sum(training_seconds(tr, life, t0, t1) for life in tr.lives)
        total += mine
        if not tr.slowed:
            secs += mine
            tokens += sum(life.processed() for life in tr.lives)
    return (tokens / secs if secs else 0.0), total


def commit_times(tracks: list[NodeTrack]) -> list[float]:
    """Harness times at which some node was seen with more committed rounds than before."""
    out = []
    for tr in tracks:
        for life in tr.lives:
            prev = None
            for s in life.samples:
                if prev is not None and s.committed > prev:
                    out.append(s.t)
                prev = s.committed
    return sorted(out)


def uptime(commits: list[float], t0: float, t1: float, window: float) -> float:
    bins = max(1, math.ceil((t1 - t0) / window - 1e-9))
    hit = {int((t - t0) // window) for t in commits if t0 <= t < t1}
    return len(hit) / bins


def rejoin_times(tracks: list[NodeTrack]) -> tuple[list[float], int]:
    times, missing = [], 0
    for tr in tracks:
        for life in tr.lives:
            if not life.restart:
                continue
            if life.rejoined_at is None:
                missing += 1
            else:
                times.append(life.rejoined_at - life.spawned)
    return times, missing


def summarize(mode: str, tracks: list[NodeTrack], *, t0: float, t1: float, schedule: str,
              failures: dict[str, int], standalone_tps: float | None, rate_source: str, warmup_tps: float,
              window: float, workdir: str, survivors: list[int], notes: list[str]) -> ChaosResult:
    """Compute a :class:`ChaosResult` once every node has ended (see module docstring);
    ``standalone_tps`` None: measured in this run."""
    processed = sum(life.processed() for tr in tracks for life in tr.lives)
    merged = sum(life.merged() for tr in tracks for life in tr.lives)
    duration = t1 - t0
    rate, training = run_rate(tracks, t0, t1)
    if standalone_tps is None:
        standalone_tps, rate_source = rate, "this run"
    allocated = len(tracks) * standalone_tps * duration
    rejoins, missing = rejoin_times(tracks)
    finals = {tr.name: tr.current for tr in tracks if tr.current is not None and tr.current.report is not None}
    digests = {n: life.report.global_digest for n, life in finals.items()}
    fragments = [life.report.fragments for life in finals.values()]
    agree = bool(digests) and len(set(digests.values())) == 1 and all(f == fragments[0] for f in fragments)
    end_loss = {n: float(life.report.end_loss) for n, life in finals.items()}
    # every node starts from the same weights (I8): a first incarnation's first evaluation
    firsts = [tr.lives[0].report.start_loss for tr in tracks if tr.lives[0].report is not None]
    firsts += [x.heldout for tr in tracks for x in tr.lives[0].samples[:1] if x.heldout is not None]
    start = next((float(x) for x in firsts if isinstance(x, (int, float))), None)
    rounds = [(life.last.committed, life.last.failed) for tr in tracks for life in tr.lives if life.last]
    return ChaosResult(
        mode=mode, nodes=len(tracks), duration_s=round(duration, 1), schedule=schedule, failures=failures,
        standalone_tokens_per_s=round(standalone_tps, 1), rate_source=rate_source,
        warmup_tokens_per_s=round(warmup_tps, 1), training_node_s=round(training, 1), tokens_processed=round(processed),
        tokens_merged=round(merged), goodput_merged=merged / processed if processed else 0.0,
        goodput=merged / allocated if allocated else 0.0,
        uptime=uptime(commit_times(tracks), t0, t1, window), uptime_window_s=window,
        rejoin_s=[round(r, 1) for r in rejoins], rejoin_median_s=statistics.median(rejoins) if rejoins else None,
        rejoin_max_s=max(rejoins) if rejoins else None, rejoins_missing=missing,
        rounds_committed=sum(c for c, _ in rounds), rounds_failed=sum(f for _, f in rounds),
        start_loss=start, end_loss=end_loss, digests=digests, digests_agree=agree,
        exit_codes={f"{tr.name}#{i}": life.exit_code for tr in tracks for i, life in enumerate(tr.lives)},
        survivors=survivors, workdir=workdir, notes=notes)
