"""Prediction of a chaos run's goodput, for validating the simulator against the harness.

The chaos harness (docs/chaos.md, ``p2pdiloco.chaos``) kills real nodes on a schedule; the
simulator, given the same schedule, predicts the goodput the harness should measure. The
two must agree within 5 points (tests/test_sim.py, skipped until the harness exists). The
contract the harness is expected to meet is in docs/simulator.md ("Validation hook").

Rules (seconds, tokens): a run of ``nodes`` nodes that all start trained-ready at time 0
(identical start, invariant I8). Kill number ``k = 1, 2, ...`` happens at ``k *
kill_interval_s`` and hits node ``(k - 1) mod nodes`` (round robin); a kill of a node that is
still down does nothing. A killed node restarts ``restart_delay_s`` later and trains again
after ``join_s`` (state download). Merges follow the decoupled swarm model
(:func:`p2pdiloco.sim.swarm_modes.decoupled`, Decoupled DiLoCo arXiv 2604.21428 sec. 3)
with one merge every ``round_s``, open for ``merge_s``. Goodput = merged tokens /
(nodes * tokens_per_s * duration_s): useful node-time over allocated node-time, the
paper's definition, with every node allocated for the whole run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from p2pdiloco.sim.swarm import Sessions, SwarmParams
from p2pdiloco.sim.swarm_modes import decoupled
from p2pdiloco.sim.validate import require, require_nonneg, require_positive


@dataclass(frozen=True)
class ChaosSchedule:
    """A chaos fault schedule and the run it applies to.

    ``nodes``: node count; ``kill_interval_s``: seconds between two kills; ``restart_delay_s``:
    seconds a killed node stays down; ``duration_s``: run length in seconds; ``tokens_per_s``:
    training throughput of one node; ``round_s``: seconds between two merges; ``merge_s``:
    seconds a merge stays open (a member dying inside it loses its unmerged tokens);
    ``join_s``: seconds a restarted node spends fetching the state; ``min_quorum``: K.
    Raises :class:`ConfigError` for out-of-range values.
    """

    nodes: int
    kill_interval_s: float
    restart_delay_s: float
    duration_s: float
    tokens_per_s: float
    round_s: float
    merge_s: float = 1.0
    join_s: float = 0.0
    min_quorum: int = 1

    def __post_init__(self) -> None:
        require(self.nodes >= 1, "nodes must be >= 1")
        require(1 <= self.min_quorum <= self.nodes, f"min_quorum must be in 1..{self.nodes}")
        require_positive(self, "duration_s", "tokens_per_s", "round_s")
        require_positive(self, "kill_interval_s", allow_inf=True)  # inf: no kills
        require_nonneg(self, "restart_delay_s", "merge_s", "join_s")
        require(self.merge_s <= self.round_s, "merge_s must be <= round_s (one merge at a time)")


def chaos_sessions(c: ChaosSchedule) -> Sessions:
    """The nodes' up-times under the schedule, as simulator sessions (seconds)."""
    down_until = np.zeros(c.nodes)
    up_since = np.zeros(c.nodes)
    ready_at = np.zeros(c.nodes)
    start, end, ready = [], [], []
    kills = int(c.duration_s // c.kill_interval_s) if math.isfinite(c.kill_interval_s) else 0
    for k in range(1, kills + 1):  # one iteration per kill of the schedule, not per event of the model
        at, node = k * c.kill_interval_s, (k - 1) % c.nodes
        if at < down_until[node]:
            continue  # already down
        start.append(up_since[node]), end.append(at), ready.append(ready_at[node])
        down_until[node] = at + c.restart_delay_s
        up_since[node] = down_until[node]
        ready_at[node] = down_until[node] + c.join_s
    alive = up_since < c.duration_s
    start += list(up_since[alive])
    ready += list(ready_at[alive])
    end += [math.inf] * int(alive.sum())
    return Sessions(np.asarray(start), np.asarray(end), np.asarray(ready), np.full(len(start), c.tokens_per_s))


def predict_chaos_goodput(c: ChaosSchedule) -> float:
    """Goodput (fraction) the simulator predicts for a chaos run with schedule ``c``.

    Rules and sources: module docstring. Raises :class:`ConfigError` only through
    :class:`ChaosSchedule`.
    """
    p = SwarmParams(peers=c.nodes, tokens_per_s=c.tokens_per_s, speed_sigma=0.0, round_compute_s=c.round_s,
                    latency_s=c.merge_s, grace_s=0.0, bandwidth_mbps=1e12, model_params=1.0,
                    min_quorum=c.min_quorum, horizon_s=c.duration_s)
    result = decoupled(p, chaos_sessions(c))
    return result.merged_tokens / (c.nodes * c.tokens_per_s * c.duration_s)
