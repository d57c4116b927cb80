"""Volunteer-swarm model: churning peers, decoupled (quorum) merges against synchronous rounds.

Units: seconds, tokens, bytes, megabits per second. Sources of the rules:

* Peer churn: each of ``peers`` slots alternates an online session (exponential, Pareto or
  lognormal length with the given mean) and an offline gap (exponential); every session is
  a new peer with its own speed (lognormal around ``tokens_per_s``). Our model; heavy-tailed
  sessions follow measurements of volunteer and P2P systems.
* Join: a new peer downloads the global state (fp32 parameters and outer momentum, as nodes
  hold them: docs/architecture.md) before it trains: ``state_bytes / bandwidth + latency``.
* Traffic: a butterfly all-reduce among ``n`` peers makes each send and receive about
  ``2 (n - 1) / n`` times the fragment's bytes (Patarasuk and Yuan 2009; hivemind's
  all-reduce), plus a fixed matchmaking latency (about 3 s, measured with hivemind
  1.1.12 on 4 local peers).
* Decoupled (Decoupled DiLoCo, arXiv 2604.21428, sec. 3): peers never
  wait. One fragment merge every ``round_compute_s / fragments`` seconds among the peers
  online then, if at least ``min_quorum`` are; it stays open ``latency + grace +
  all-reduce`` seconds; a member's death in that window discards it (invariant I2) and the
  contributions carry over to the next merge. A peer's tokens are merged at its next
  successful merge; those computed after its last one are lost when it leaves.
* Synchronous (DiLoCo, arXiv 2311.08105; OpenDiLoCo): each round every online peer does
  ``round_compute_s`` of median-peer work (slower peers take longer, everyone waits for the
  slowest), then a blocking all-reduce. A member's death before the round ends discards the
  round and the survivors lose ``round_timeout_s`` more; peers join at round boundaries.

Goodput = peer-time spent computing tokens that get merged / online peer-time.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from p2pdiloco.sim.validate import require, require_nonneg, require_positive

log = logging.getLogger(__name__)

SESSION_DISTS = ("exponential", "pareto", "lognormal")


@dataclass(frozen=True)
class SwarmParams:
    """A volunteer swarm. Times in seconds, throughput in tokens/s, bandwidth in Mbit/s.

    ``session_shape`` is the Pareto tail index alpha (> 1 so the mean exists) or the
    lognormal sigma; it is ignored for exponential sessions. ``token_budget`` 0 means none.
    Raises :class:`ConfigError` for an unknown distribution or an out-of-range value.
    """

    peers: int = 16
    session_mean_s: float = 2 * 3600.0
    session_dist: str = "exponential"
    session_shape: float = 1.5
    offline_mean_s: float = 600.0
    tokens_per_s: float = 2000.0  # median peer
    speed_sigma: float = 0.5  # lognormal sigma of per-peer speed; 0: all equal
    model_params: float = 150e6
    state_bytes_per_param: float = 8.0  # fp32 parameters + fp32 outer momentum
    wire_bytes_per_param: float = 2.0  # fp16 on the wire
    fragments: int = 1  # P
    bandwidth_mbps: float = 100.0  # each peer, each direction
    latency_s: float = 3.0  # matchmaking and setup per all-reduce
    round_compute_s: float = 300.0  # H inner steps of a median peer
    min_quorum: int = 1  # K
    grace_s: float = 5.0
    round_timeout_s: float = 60.0
    horizon_s: float = 7 * 86400.0
    token_budget: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.session_dist in SESSION_DISTS, f"session distribution must be one of {', '.join(SESSION_DISTS)}")
        require(self.peers >= 1, "peers must be >= 1")
        require(1 <= self.fragments, "fragments must be >= 1")
        require(1 <= self.min_quorum <= self.peers, f"min_quorum must be in 1..{self.peers}")
        require_positive(self, "session_mean_s", "tokens_per_s", "model_params", "bandwidth_mbps", "round_compute_s",
                         "horizon_s", "state_bytes_per_param", "wire_bytes_per_param")
        require_nonneg(self, "offline_mean_s", "speed_sigma", "latency_s", "grace_s", "round_timeout_s", "token_budget")
        if self.session_dist == "pareto":
            require(self.session_shape > 1, "a Pareto session needs shape (tail index) > 1 for a finite mean")
        if self.session_dist == "lognormal":
            require(self.session_shape > 0, "a lognormal session needs shape (sigma) > 0")

    @property
    def join_s(self) -> float:
        """Seconds a new peer spends downloading the state before it trains."""
        return self.model_params * self.state_bytes_per_param * 8 / (self.bandwidth_mbps * 1e6) + self.latency_s

    def allreduce_s(self, n: np.ndarray | int) -> np.ndarray:
        """Seconds of one fragment's butterfly all-reduce among ``n`` peers (0 when alone)."""
        n = np.asarray(n, dtype=np.float64)
        frag_bits = self.model_params * self.wire_bytes_per_param * 8 / self.fragments
        busy = 2 * (n - 1) / np.maximum(n, 1) * frag_bits / (self.bandwidth_mbps * 1e6)
        return np.where(n > 1, busy + self.latency_s, 0.0)


@dataclass(frozen=True)
class Sessions:
    """Peer sessions: online from ``start`` to ``end`` (may pass the horizon), trained from
    ``ready`` (after the join download), at ``speed`` tokens/s. Seconds."""

    start: np.ndarray
    end: np.ndarray
    ready: np.ndarray
    speed: np.ndarray

    def online_s(self, horizon_s: float) -> float:
        """Total online peer-seconds within the horizon."""
        return float((np.minimum(self.end, horizon_s) - self.start).sum())


def draw_durations(rng: np.random.Generator, dist: str, mean: float, shape: float, size: tuple[int, ...]) -> np.ndarray:
    """Random durations (seconds) with the given mean: exponential, Pareto (tail index
    ``shape``, minimum ``mean (shape - 1) / shape``) or lognormal (sigma ``shape``).
    Raises ``ValueError`` for another ``dist``."""
    if dist == "exponential":
        return rng.exponential(mean, size)
    if dist == "pareto":
        return mean * (shape - 1) / shape * (1.0 + rng.pareto(shape, size))
    if dist == "lognormal":
        return rng.lognormal(math.log(mean) - shape**2 / 2, shape, size)
    raise ValueError(f"unknown distribution {dist!r}")


def make_sessions(p: SwarmParams, rng: np.random.Generator) -> Sessions:
    """Draw every slot's alternating sessions and gaps until the horizon (all slots start
    online at time 0). Vectorised over slots; redraws longer only if a slot falls short."""
    cycle = p.session_mean_s + p.offline_mean_s
    k = int(p.horizon_s / cycle * 1.5) + 8
    while True:
        on = draw_durations(rng, p.session_dist, p.session_mean_s, p.session_shape, (p.peers, k))
        off = rng.exponential(p.offline_mean_s, (p.peers, k)) if p.offline_mean_s > 0 else np.zeros((p.peers, k))
        ends = np.cumsum(on + off, axis=1)
        if (ends[:, -1] >= p.horizon_s).all():
            break
        k *= 2
    start = ends - on - off
    end = start + on
    keep = start < p.horizon_s
    start, end = start[keep], end[keep]
    speed = p.tokens_per_s * rng.lognormal(0.0, p.speed_sigma, start.size) if p.speed_sigma else \
        np.full(start.size, p.tokens_per_s)
    return Sessions(start, end, start + p.join_s, speed)


@dataclass(frozen=True)
class SwarmResult:
    """Outcome of one mode. ``goodput`` and ``uptime`` are fractions; ``time_to_budget_s``
    is None when the budget is 0 or not reached within the horizon."""

    mode: str
    goodput: float
    tokens_per_s: float  # merged tokens per second of horizon
    merged_tokens: float
    time_to_budget_s: float | None
    uptime: float  # decoupled: share of merge slots that merged; synchronous: share of time in good rounds
    rounds_ok: int  # merges (decoupled) or rounds (synchronous) that completed
    rounds_failed: int  # decoupled: merge slots without a quorum; synchronous: rounds discarded
    mean_online_peers: float


def budget_time(done_at: np.ndarray, cum_tokens: np.ndarray, budget: float) -> float | None:
    """First completion time (seconds) at which ``cum_tokens`` reaches ``budget``, or None."""
    if budget <= 0 or cum_tokens.size == 0 or cum_tokens[-1] < budget:
        return None
    return float(done_at[np.searchsorted(cum_tokens, budget, side="left")])
