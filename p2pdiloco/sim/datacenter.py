"""Datacenter goodput model: data-parallel, elastic data-parallel and Decoupled DiLoCo.

Source: Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training",
arXiv 2604.21428, Table 1 (goodput of 150k to 2.4M simulated chips, one failure per
chip-year), as reported in secondary readings of that table. The paper does not publish its
stall and repair times; :data:`CALIBRATED` holds ours, fitted once to that table
(docs/simulator.md explains the fit and every assumption below).

Rules (all times in seconds, sizes in chips):

* **Failures** are Poisson per chip with mean time between interruptions ``mtbi_s``; a job
  of ``n`` chips sees the superposed Poisson process of rate ``n / mtbi_s`` (paper, sec. 2).
* **Detection.** A failure is acted on ``detect_s`` after it happens (the step in flight
  finishes on the surviving chips). The health check at that moment finds every chip that
  has failed since, so all of them are handled by one stall (our assumption).
* **Data-parallel** (paper's baseline): any failure stalls the whole job until the failed
  chip is repaired (``repair_s``) and the job restarted (``reconfig_s``); failures during
  the stall are handled by it.
* **Elastic data-parallel** (paper's baseline): a failure stalls the job for one
  reconfiguration (``reconfig_s``); it then continues without the chip. The chip is back
  ``repair_s`` later and is re-admitted by the next failure's reconfiguration, or by a
  growth reconfiguration (another ``reconfig_s`` stall) if none comes within
  ``readmit_wait_s`` (our assumption: growth is optional, shrinking is not).
* **Decoupled DiLoCo** (paper, sec. 3 and Table 1): ``learners`` independent elastic jobs
  over ``chips / learners`` chips each; a learner's stall stalls no other learner. Merges
  progress while at least ``min_quorum`` learners run.

Goodput = useful chip-time / allocated chip-time (paper's definition): a chip is useful
while its job runs, it is in the job, and (Decoupled DiLoCo) the quorum is met. Uptime =
fraction of the time some merge (or, for the baselines, the job) progresses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from p2pdiloco.sim.events import (
    SECONDS_PER_YEAR,
    down_profile,
    first_of_windows,
    poisson_arrivals,
    stalled_before,
)
from p2pdiloco.sim.validate import require, require_nonneg

log = logging.getLogger(__name__)

SYSTEMS = ("dp", "elastic", "diloco")
"""System names: data-parallel, elastic data-parallel, Decoupled DiLoCo."""


@dataclass(frozen=True)
class FailureTiming:
    """Failure rate and the stall and repair times of the datacenter model, in seconds.

    The defaults are the values calibrated once against the paper's Table 1 (arXiv
    2604.21428); see docs/simulator.md. Raises :class:`ConfigError` when a time is
    negative or not finite, or ``mtbi_s`` is not positive (``inf`` means no failures).
    """

    mtbi_s: float = SECONDS_PER_YEAR  # mean time between interruptions of one chip
    detect_s: float = 2.5  # failure -> the system acts on it
    reconfig_s: float = 22.5  # one elastic reconfiguration, or a data-parallel restart
    repair_s: float = 60.0  # a failed chip is back (repaired or swapped) after this
    readmit_wait_s: float = 240.0  # longest a returned chip waits for a failure's reconfiguration

    def __post_init__(self) -> None:
        require(self.mtbi_s > 0, "mtbi must be > 0 (inf: no failures)")
        require_nonneg(self, "detect_s", "reconfig_s", "repair_s", "readmit_wait_s")


CALIBRATED = FailureTiming()
"""The calibrated timing (the defaults), fitted to the paper's Table 1 by bench/simulate_table.py."""


@dataclass(frozen=True)
class DatacenterParams:
    """One datacenter run: ``chips`` chips, a system, ``horizon_s`` seconds, a seed.

    ``learners`` (M) and ``min_quorum`` (K) apply to ``system="diloco"``; the baselines need
    ``learners == 1``. Raises :class:`ConfigError` for an unknown system, fewer chips than
    learners, ``min_quorum`` outside ``1..learners`` or a non-positive horizon.
    """

    chips: int
    system: str = "diloco"
    learners: int = 1
    min_quorum: int = 1
    horizon_s: float = 30 * 86400.0
    seed: int = 0
    timing: FailureTiming = field(default_factory=FailureTiming)

    def __post_init__(self) -> None:
        require(self.system in SYSTEMS, f"system must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        require(self.learners >= 1, "learners must be >= 1")
        require(self.system == "diloco" or self.learners == 1, f"{self.system} has a single job: learners must be 1")
        require(self.chips >= self.learners, f"need at least one chip per learner ({self.chips} < {self.learners})")
        require(1 <= self.min_quorum <= self.learners, f"min_quorum must be in 1..{self.learners}")
        require(bool(np.isfinite(self.horizon_s)) and self.horizon_s > 0, "horizon must be finite and > 0")


@dataclass(frozen=True)
class DatacenterResult:
    """Outcome of one run. ``goodput`` and ``uptime`` are fractions in [0, 1]."""

    params: DatacenterParams
    goodput: float
    uptime: float
    failures: int  # chip failures in the horizon
    stalls: int  # stalls of all jobs (reconfigurations, restarts, growths)


@dataclass(frozen=True)
class _Stalls:
    owner: np.ndarray  # job of each stall
    start: np.ndarray  # local time, clipped to [0, horizon]
    end: np.ndarray
    lost_chip_s: np.ndarray  # per job: chip-seconds of running time with chips away
    failures: int


def _job_stalls(rng: np.random.Generator, chips: np.ndarray, horizon: float, tm: FailureTiming,
                elastic: bool) -> _Stalls:
    """Stall intervals of independent jobs of ``chips[j]`` chips each (see module rules)."""
    jobs = chips.size
    owner, f = poisson_arrivals(rng, chips / tm.mtbi_s, horizon)
    h, s, r, g = tm.detect_s, tm.reconfig_s, tm.repair_s, tm.readmit_wait_s
    span = horizon + h + r + g + s + 1.0  # jobs live on disjoint stretches of one time axis
    base = owner * span
    fk = f + base  # failure times on the shared axis, sorted
    if elastic:
        back = fk + h + r  # the chip is back
        j = np.searchsorted(fk + h, back, side="left")  # first failure acted on after that
        has = j < fk.size
        has[has] = fk[j[has]] + h <= back[has] + g
        admit = np.where(has, fk[np.minimum(j, fk.size - 1)] + h, back + g)
        grow = ~has & (back + g - base < horizon)
        starts = np.concatenate([fk, back[grow] + g])
        window = np.concatenate([np.full(fk.size, h + s), np.full(int(grow.sum()), s)])
        offset = np.concatenate([np.full(fk.size, h), np.zeros(int(grow.sum()))])
        dur = np.full(starts.size, s)
        t_owner = np.concatenate([owner, owner[grow]])
    else:
        starts, window = fk, np.full(fk.size, h + r + s)
        offset, dur, t_owner = np.full(fk.size, h), np.full(fk.size, r + s), owner
    order = np.argsort(starts, kind="stable")
    starts, window, offset, dur, t_owner = starts[order], window[order], offset[order], dur[order], t_owner[order]
    sel = first_of_windows(starts, window)
    o = t_owner[sel]
    st = starts[sel] + offset[sel]
    en = np.minimum(st + dur[sel], o * span + horizon)
    st = np.minimum(st, o * span + horizon)
    lost = np.zeros(jobs)
    if elastic and fk.size:
        # chip-seconds a failed chip is missing while its job runs: from failure to the end
        # of the reconfiguration that re-admits it
        until = np.minimum(admit + s, base + horizon)
        away = (until - fk) - (stalled_before(st, en, until) - stalled_before(st, en, fk))
        lost = np.bincount(owner, weights=np.maximum(away, 0.0), minlength=jobs)
    local = o * span
    return _Stalls(o, st - local, en - local, lost, int(f.size))


def simulate(params: DatacenterParams) -> DatacenterResult:
    """Simulate one datacenter run and return its goodput and uptime.

    Rules and sources: module docstring (arXiv 2604.21428, Table 1).
    Deterministic for a given ``params`` (including ``seed``). Raises :class:`ConfigError`
    only through the parameter classes.
    """
    p, tm, T = params, params.timing, params.horizon_s
    rng = np.random.default_rng(p.seed)
    m = p.learners
    chips = np.full(m, p.chips // m, dtype=np.float64)
    chips[: p.chips % m] += 1
    st = _job_stalls(rng, chips, T, tm, elastic=p.system != "dp")
    lengths, down, down_chips = down_profile(st.owner, st.start, st.end, chips, T)
    quorum = (m - down) >= p.min_quorum
    uptime = float(lengths[quorum].sum() / T)
    useful = float(((p.chips - down_chips) * lengths)[quorum].sum() - st.lost_chip_s.sum())
    goodput = max(0.0, useful / (p.chips * T))
    log.debug("simulated %s chips=%d M=%d K=%d: goodput %.4f uptime %.4f (%d failures, %d stalls)",
              p.system, p.chips, m, p.min_quorum, goodput, uptime, st.failures, st.owner.size)
    return DatacenterResult(p, goodput, uptime, st.failures, int(st.owner.size))
