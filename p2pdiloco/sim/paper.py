"""The paper's goodput table, its reproduction, and the one-time calibration.

Source of the numbers: Douillard et al., arXiv 2604.21428, Table 1, as reported in
secondary readings of that table (goodput in percent, one failure per chip-year, Decoupled
DiLoCo rows by number of learners M). The calibration (:func:`calibrate`) is how
:data:`p2pdiloco.sim.datacenter.CALIBRATED` was obtained; bench/simulate_table.py runs it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from p2pdiloco.sim.datacenter import CALIBRATED, DatacenterParams, FailureTiming, simulate

log = logging.getLogger(__name__)

SIZES = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
"""Cluster sizes of the table, in chips."""

PAPER_TABLE: dict[str, tuple[int, ...]] = {
    "data-parallel": (72, 57, 38, 27, 18),
    "elastic data-parallel": (88, 80, 69, 58, 40),
    "M = 2": (94, 88, 80, 70, 54),
    "M = 4": (96, 93, 89, 82, 73),
    "M = 8": (98, 96, 94, 88, 80),
    "M = 16": (99, 98, 96, 93, 86),
}
"""Goodput in percent by system (rows) and cluster size (:data:`SIZES`)."""


def row_params(row: str, chips: int, timing: FailureTiming, horizon_s: float, seed: int) -> DatacenterParams:
    """The :class:`DatacenterParams` of one table cell (quorum K = 1 for the DiLoCo rows).

    Raises ``KeyError`` for a row name not in :data:`PAPER_TABLE`.
    """
    if row not in PAPER_TABLE:
        raise KeyError(row)
    if row == "data-parallel":
        return DatacenterParams(chips, "dp", horizon_s=horizon_s, seed=seed, timing=timing)
    if row == "elastic data-parallel":
        return DatacenterParams(chips, "elastic", horizon_s=horizon_s, seed=seed, timing=timing)
    return DatacenterParams(chips, "diloco", learners=int(row.split("=")[1]), horizon_s=horizon_s,
                            seed=seed, timing=timing)


@dataclass(frozen=True)
class TableFit:
    """Reproduced table (percent, same layout as :data:`PAPER_TABLE`) and its error."""

    timing: FailureTiming
    horizon_s: float
    seed: int
    cells: dict[str, tuple[float, ...]]

    @property
    def errors(self) -> dict[str, tuple[float, ...]]:
        """Reproduced minus paper, in percentage points, per cell."""
        return {r: tuple(a - b for a, b in zip(v, PAPER_TABLE[r], strict=True)) for r, v in self.cells.items()}

    @property
    def max_error(self) -> float:
        """Largest absolute cell error, in percentage points."""
        return max(abs(e) for row in self.errors.values() for e in row)


def reproduce_table(timing: FailureTiming = CALIBRATED, horizon_s: float = 30 * 86400.0, seed: int = 0,
                    rows: Iterable[str] = tuple(PAPER_TABLE)) -> TableFit:
    """Simulate every cell of the paper's table (or of ``rows``) with ``timing``.

    One run of ``horizon_s`` seconds per cell, all with ``seed``. Returns a :class:`TableFit`.
    """
    cells = {}
    for row in rows:
        cells[row] = tuple(100.0 * simulate(row_params(row, n, timing, horizon_s, seed)).goodput for n in SIZES)
        log.info("%s: %s", row, " ".join(f"{v:.1f}" for v in cells[row]))
    return TableFit(timing, horizon_s, seed, cells)


def calibrate(detect: Iterable[float], reconfig: Iterable[float], repair: Iterable[float],
              readmit: Iterable[float], horizon_s: float = 7 * 86400.0, seed: int = 0) -> TableFit:
    """Grid-search the timing that minimises the largest cell error of the table.

    The data-parallel row depends on ``detect_s`` and ``repair_s + reconfig_s``; the other
    rows on ``detect_s``, ``reconfig_s`` and ``readmit_wait_s`` (``repair_s`` only moves
    them by chip-seconds of order repair / MTBI). So for each ``detect_s`` the two groups
    are searched separately and combined. Arguments are the candidate values in seconds.
    Returns the best :class:`TableFit` (at ``horizon_s``; re-check it with a longer one).
    Raises ``ValueError`` if a candidate list is empty.
    """
    detect, reconfig, repair, readmit = (tuple(x) for x in (detect, reconfig, repair, readmit))
    if not all((detect, reconfig, repair, readmit)):
        raise ValueError("every candidate list needs at least one value")
    elastic_rows = tuple(PAPER_TABLE)[1:]

    def worst(fit: TableFit) -> tuple[float, float]:
        errs = np.abs([e for row in fit.errors.values() for e in row])
        return float(errs.max()), float(np.sqrt((errs**2).mean()))

    best: tuple[tuple[float, float], FailureTiming] | None = None
    for h in detect:
        el = min((worst(reproduce_table(FailureTiming(detect_s=h, reconfig_s=s, readmit_wait_s=g),
                                        horizon_s, seed, elastic_rows)), s, g)
                 for s, g in itertools.product(reconfig, readmit))
        (_, s, g) = el
        dp = min((worst(reproduce_table(FailureTiming(detect_s=h, reconfig_s=s, repair_s=r),
                                        horizon_s, seed, ("data-parallel",))), r) for r in repair)
        score = max(el[0], dp[0]), el[0][1] + dp[0][1]
        timing = FailureTiming(detect_s=float(h), reconfig_s=float(s), repair_s=float(dp[1]), readmit_wait_s=float(g))
        log.info("detect %.1f s: elastic rows max %.2f, data-parallel max %.2f with %s", h, el[0][0], dp[0][0], timing)
        if best is None or score < best[0]:
            best = (score, timing)
    assert best is not None
    return reproduce_table(best[1], horizon_s, seed)
