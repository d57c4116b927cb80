"""Goodput simulator: a fast, vectorised discrete-event model of training under failures.

* :mod:`~p2pdiloco.sim.datacenter`: data-parallel, elastic data-parallel and Decoupled
  DiLoCo on a cluster of chips with Poisson failures (arXiv 2604.21428, Table 1).
* :mod:`~p2pdiloco.sim.paper`: the paper's table, its reproduction and the calibration.
* :mod:`~p2pdiloco.sim.swarm` / :mod:`~p2pdiloco.sim.swarm_modes`: a volunteer swarm with
  churn, decoupled quorum merges against synchronous rounds.
* :mod:`~p2pdiloco.sim.chaos`: the goodput a chaos-harness schedule should measure.

The command line is ``p2pdiloco simulate`` or ``python -m p2pdiloco.sim``; the model, its
calibration and the measurements are documented in docs/simulator.md. The library logs and
never prints.
"""

from p2pdiloco.sim.chaos import ChaosSchedule, chaos_sessions, predict_chaos_goodput
from p2pdiloco.sim.datacenter import (
    CALIBRATED,
    SYSTEMS,
    DatacenterParams,
    DatacenterResult,
    FailureTiming,
    simulate,
)
from p2pdiloco.sim.events import SECONDS_PER_YEAR
from p2pdiloco.sim.paper import PAPER_TABLE, SIZES, TableFit, calibrate, reproduce_table
from p2pdiloco.sim.swarm import SESSION_DISTS, Sessions, SwarmParams, SwarmResult, make_sessions
from p2pdiloco.sim.swarm_modes import decoupled, simulate_swarm, synchronous

__all__ = [
    "CALIBRATED", "PAPER_TABLE", "SECONDS_PER_YEAR", "SESSION_DISTS", "SIZES", "SYSTEMS", "ChaosSchedule",
    "DatacenterParams", "DatacenterResult", "FailureTiming", "Sessions", "SwarmParams", "SwarmResult", "TableFit",
    "calibrate", "chaos_sessions", "decoupled", "make_sessions", "predict_chaos_goodput", "reproduce_table",
    "simulate", "simulate_swarm", "synchronous",
]
