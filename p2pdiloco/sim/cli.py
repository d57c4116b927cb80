"""``p2pdiloco simulate`` (and ``python -m p2pdiloco.sim``): datacenter, table and swarm.

The owner of p2pdiloco/cli.py wires :func:`add_simulate_parser` and :func:`run_simulate`
in. Bad arguments end with one line on stderr and exit code 2 (argparse's own errors, or
a :class:`ConfigError` from the parameter classes). Output is printed: this is the one place
of the simulator that prints.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from p2pdiloco.errors import ConfigError

if TYPE_CHECKING:
    from p2pdiloco.sim.paper import TableFit

HOUR = 3600.0
DAY = 86400.0


def _positive(kind: type) -> Callable[[str], float | int]:
    def parse(text: str) -> float | int:
        try:
            v = kind(float(text)) if kind is int and "e" in text.lower() else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
        return v

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _nonneg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def fill_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``datacenter``, ``table`` and ``swarm`` subcommands to ``p``."""
    from p2pdiloco.sim.datacenter import CALIBRATED, SYSTEMS  # noqa: PLC0415
    from p2pdiloco.sim.swarm import SESSION_DISTS, SwarmParams  # noqa: PLC0415

    pint, pfloat = _positive(int), _positive(float)
    sub = p.add_subparsers(dest="sim_cmd", required=True)
    dc = sub.add_parser("datacenter", help="goodput and uptime of one cluster under chip failures")
    dc.add_argument("--chips", type=pint, default=1_200_000, help="chips in the cluster (default 1200000)")
    dc.add_argument("--system", choices=("all", *SYSTEMS), default="all", help="which system (default: all three)")
    dc.add_argument("--learners", type=pint, default=8, help="Decoupled DiLoCo learners M (default 8)")
    dc.add_argument("--quorum", type=pint, default=1, help="minimum quorum K (default 1)")
    dc.add_argument("--mtbi-years", type=pfloat, default=1.0, help="mean time between interruptions per chip, years")
    dc.add_argument("--days", type=pfloat, default=30.0, help="simulated days (default 30)")
    dc.add_argument("--seed", type=int, default=0)
    for name, default, what in (("detect", CALIBRATED.detect_s, "failure to action"),
                                ("reconfig", CALIBRATED.reconfig_s, "reconfiguration or restart stall"),
                                ("repair", CALIBRATED.repair_s, "chip repair or swap"),
                                ("readmit-wait", CALIBRATED.readmit_wait_s, "longest wait to re-admit a chip")):
        dc.add_argument(f"--{name}-s", type=_nonneg, default=default, help=f"{what}, seconds (default {default:g})")
    tb = sub.add_parser("table", help="reproduce the paper's goodput table next to the paper's numbers")
    tb.add_argument("--days", type=pfloat, default=30.0, help="simulated days per cell (default 30)")
    tb.add_argument("--seed", type=int, default=0)
    tb.add_argument("--markdown", action="store_true", help="print a Markdown table")
    sw = sub.add_parser("swarm", help="volunteer swarm: decoupled merges against synchronous rounds")
    d = SwarmParams()
    sw.add_argument("--peers", type=pint, default=d.peers, help=f"peer slots (default {d.peers})")
    sw.add_argument("--session-mean-h", type=pfloat, default=d.session_mean_s / HOUR, help="mean session, hours")
    sw.add_argument("--session-dist", choices=SESSION_DISTS, default=d.session_dist)
    sw.add_argument("--session-shape", type=pfloat, default=d.session_shape,
                    help="Pareto tail index (> 1) or lognormal sigma (default %(default)s)")
    sw.add_argument("--offline-mean-min", type=_nonneg, default=d.offline_mean_s / 60,
                    help="mean gap before a slot's next peer arrives, minutes")
    sw.add_argument("--tokens-per-s", type=pfloat, default=d.tokens_per_s, help="median peer throughput")
    sw.add_argument("--speed-sigma", type=_nonneg, default=d.speed_sigma, help="lognormal sigma of peer speeds")
    sw.add_argument("--model-params", type=pfloat, default=d.model_params, help="parameters (e.g. 150e6)")
    sw.add_argument("--wire-bytes", type=pfloat, default=d.wire_bytes_per_param, help="bytes per parameter on the wire")
    sw.add_argument("--bandwidth-mbps", type=pfloat, default=d.bandwidth_mbps, help="per-peer link, Mbit/s")
    sw.add_argument("--latency-s", type=_nonneg, default=d.latency_s, help="fixed cost per all-reduce, seconds")
    sw.add_argument("--round-s", type=pfloat, default=d.round_compute_s, help="H inner steps of a median peer, seconds")
    sw.add_argument("--fragments", type=pint, default=d.fragments, help="fragments P")
    sw.add_argument("--quorum", type=pint, default=d.min_quorum, help="minimum quorum K")
    sw.add_argument("--grace-s", type=_nonneg, default=d.grace_s, help="grace window, seconds")
    sw.add_argument("--round-timeout-s", type=_nonneg, default=d.round_timeout_s, help="synchronous: cost of a death")
    sw.add_argument("--hours", type=pfloat, default=d.horizon_s / HOUR, help="simulated hours")
    sw.add_argument("--token-budget", type=_nonneg, default=0.0, help="tokens to reach (0: none)")
    sw.add_argument("--seed", type=int, default=0)


def add_simulate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``simulate`` (with its subcommands) on the ``p2pdiloco`` command's subparsers."""
    fill_parser(subparsers.add_parser("simulate", help="goodput simulator: datacenter, paper table, volunteer swarm"))


def _datacenter(a: argparse.Namespace) -> None:
    from p2pdiloco.sim.datacenter import DatacenterParams, FailureTiming, simulate  # noqa: PLC0415

    tm = FailureTiming(mtbi_s=a.mtbi_years * 365 * DAY, detect_s=a.detect_s, reconfig_s=a.reconfig_s,
                       repair_s=a.repair_s, readmit_wait_s=a.readmit_wait_s)
    systems = ("dp", "elastic", "diloco") if a.system == "all" else (a.system,)
    params = [DatacenterParams(a.chips, s, a.learners if s == "diloco" else 1,
                               a.quorum if s == "diloco" else 1, a.days * DAY, a.seed, tm) for s in systems]
    print(f"{a.chips} chips, one failure per {a.mtbi_years:g} chip-year(s), {a.days:g} days, seed {a.seed}")
    print(f"{'system':<28} {'goodput':>8} {'uptime':>8} {'failures':>9} {'seconds':>8}")
    for p in params:
        t0 = time.perf_counter()
        r = simulate(p)
        seconds = time.perf_counter() - t0
        label = {"dp": "data-parallel", "elastic": "elastic data-parallel"}.get(
            p.system, f"Decoupled DiLoCo M={p.learners} K={p.min_quorum}")
        print(f"{label:<28} {100 * r.goodput:7.1f}% {100 * r.uptime:7.1f}% {r.failures:9d} {seconds:8.2f}")


def format_table(fit: TableFit, markdown: bool) -> str:
    """The reproduced table next to the paper's, as plain text or Markdown."""
    from p2pdiloco.sim.paper import PAPER_TABLE, SIZES  # noqa: PLC0415

    heads = [f"{n // 1000}k" if n < 1_000_000 else f"{n / 1e6:g}M" for n in SIZES]
    lines = []
    if markdown:
        lines.append("| system | " + " | ".join(heads) + " |")
        lines.append("|---|" + "---|" * len(heads))
    else:
        lines.append(f"{'system':<22}" + "".join(f"{h:>13}" for h in heads))
    for row, ours in fit.cells.items():
        cells = [f"{o:.1f} ({p})" for o, p in zip(ours, PAPER_TABLE[row], strict=True)]
        if markdown:
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"{row:<22}" + "".join(f"{c:>13}" for c in cells))
    lines.append(f"\nsimulated (paper); largest difference {fit.max_error:.2f} points")
    return "\n".join(lines)


def _swarm(a: argparse.Namespace) -> None:
    from p2pdiloco.sim.swarm import SwarmParams  # noqa: PLC0415
    from p2pdiloco.sim.swarm_modes import simulate_swarm  # noqa: PLC0415

    p = SwarmParams(peers=a.peers, session_mean_s=a.session_mean_h * HOUR, session_dist=a.session_dist,
                    session_shape=a.session_shape, offline_mean_s=a.offline_mean_min * 60, tokens_per_s=a.tokens_per_s,
                    speed_sigma=a.speed_sigma, model_params=a.model_params, wire_bytes_per_param=a.wire_bytes,
                    bandwidth_mbps=a.bandwidth_mbps, latency_s=a.latency_s, round_compute_s=a.round_s,
                    fragments=a.fragments, min_quorum=a.quorum, grace_s=a.grace_s, round_timeout_s=a.round_timeout_s,
                    horizon_s=a.hours * HOUR, token_budget=a.token_budget, seed=a.seed)
    res = simulate_swarm(p)
    print(f"{p.peers} peer slots, {a.session_dist} sessions of mean {a.session_mean_h:g} h, {a.hours:g} h simulated; "
          f"join {p.join_s:.0f} s, all-reduce {float(p.allreduce_s(p.peers)):.0f} s among {p.peers}")
    print(f"{'mode':<12} {'goodput':>8} {'tokens/s':>10} {'to budget':>10} {'uptime':>7} {'rounds':>7} {'failed':>6}")
    for r in res.values():
        budget = "-" if r.time_to_budget_s is None else f"{r.time_to_budget_s / HOUR:.1f} h"
        print(f"{r.mode:<12} {100 * r.goodput:7.1f}% {r.tokens_per_s:10.0f} {budget:>10} {100 * r.uptime:6.1f}% "
              f"{r.rounds_ok:7d} {r.rounds_failed:6d}")
    print(f"mean online peers {res['decoupled'].mean_online_peers:.1f}; to budget '-': no budget or not reached")


def run_simulate(args: argparse.Namespace) -> int:
    """Run the subcommand parsed into ``args``; print its output. Returns the exit code
    (0, or 2 with one line on stderr for an invalid parameter combination)."""
    from p2pdiloco.sim.paper import reproduce_table  # noqa: PLC0415

    try:
        if args.sim_cmd == "datacenter":
            _datacenter(args)
        elif args.sim_cmd == "table":
            print(format_table(reproduce_table(horizon_s=args.days * DAY, seed=args.seed), args.markdown))
        else:
            _swarm(args)
    except ConfigError as e:
        print(f"p2pdiloco simulate: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m p2pdiloco.sim``."""
    parser = argparse.ArgumentParser(prog="python -m p2pdiloco.sim", description="p2pdiloco goodput simulator")
    fill_parser(parser)
    return run_simulate(parser.parse_args(argv))
