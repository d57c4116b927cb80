"""Chaos harness (docs/chaos.md): real node processes under a fault schedule, goodput measured.

``p2pdiloco chaos`` (:mod:`p2pdiloco.chaos.cli`) runs a bootstrap peer and N nodes, kills
and restarts, freezes and thaws, and slows nodes down on a scripted or seeded random
schedule (:mod:`~p2pdiloco.chaos.schedule`), in the decoupled mode and in the synchronous
baseline, and reports goodput, uptime, rejoin times, held-out loss and whether the live
nodes agree on the global state at the end (:mod:`~p2pdiloco.chaos.metrics`). Method and
results: docs/chaos.md.

:func:`run_schedule` is the simulator's validation hook (docs/simulator.md, section 3).
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pdiloco.presets import PRESETS, TINY
from p2pdiloco.chaos.schedule import Freeze, Kill, Schedule, Slow, parse_script, random_schedule, round_robin_schedule

if TYPE_CHECKING:
    from p2pdiloco.chaos.harness import ChaosConfig, ChaosError, run
    from p2pdiloco.chaos.metrics import ChaosResult

# imported on first use (PEP 562), so that `p2pdiloco --help`, which builds the chaos command's
# parser (p2pdiloco.chaos.cli), does not import torch through the harness
_LAZY = {"ChaosConfig": "harness", "ChaosError": "harness", "run": "harness", "ChaosResult": "metrics"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"p2pdiloco.chaos.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# inner steps per second of one tiny node at the default CPU share on the 2-core development machine
TINY_STEPS_PER_S = 40.0

__all__ = ["PRESETS", "TINY", "ChaosConfig", "ChaosError", "ChaosResult", "Freeze", "Kill", "Schedule", "Slow",
           "parse_script", "random_schedule", "round_robin_schedule", "run", "run_schedule"]


def run_schedule(schedule, *, settings: dict[str, str] | None = None, workdir: Path | None = None,
                 warmup: float = 20.0, mode: str = "decoupled", **kw) -> ChaosResult:
    """Run real nodes under a simulator :class:`p2pdiloco.sim.chaos.ChaosSchedule` (round-robin
    kills, restart after ``restart_delay_s``, ``duration_s`` measured seconds) and return the
    measured :class:`ChaosResult`; ``.goodput`` is merged tokens / (nodes x standalone
    tokens/s x duration), the definition :func:`p2pdiloco.sim.chaos.predict_chaos_goodput`
    predicts. The schedule's ``tokens_per_s`` is not imposed (goodput does not depend on it);
    the standalone rate is measured. With the default (tiny) settings, ``round_s`` sets H so
    that one node's H inner steps take about ``round_s`` seconds (at ``TINY_STEPS_PER_S``);
    the realized value is added to the result's notes.
    """
    from p2pdiloco.chaos.harness import ChaosConfig, run  # noqa: PLC0415
    from p2pdiloco.chaos.replay import round_seconds  # noqa: PLC0415

    sched = round_robin_schedule(schedule.nodes, schedule.kill_interval_s, schedule.restart_delay_s,
                                 schedule.duration_s)
    base = dict(TINY if settings is None else settings)
    base["outer.min_quorum"] = str(schedule.min_quorum)
    if settings is None:  # H inner steps of the tiny model take about round_s seconds
        base["outer.sync_every"] = str(max(1, round(schedule.round_s * TINY_STEPS_PER_S)))
    work = workdir or Path(tempfile.mkdtemp(prefix="p2pdiloco-chaos-"))
    cfg = ChaosConfig(schedule=sched, duration=schedule.duration_s, settings=base, workdir=work, mode=mode,
                      warmup=warmup, **kw)
    result = run(cfg)
    if result.standalone_tokens_per_s > 0:
        result.notes.append(f"round_s asked {schedule.round_s:g} s, realized "
                            f"{round_seconds(base, result.standalone_tokens_per_s):.1f} s (H inner steps of one node)")
    return result
