"""``p2pdiloco chaos``: real nodes under a fault schedule, decoupled against the synchronous baseline.

The owner of p2pdiloco/cli.py wires :func:`add_chaos_parser` and :func:`run_chaos` in. Bad
arguments end with one line on stderr and exit code 2; a swarm that could not be started,
disagreeing digests at the end or a process left behind give exit code 1 (after the report).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
import time
from pathlib import Path

from p2pdiloco.errors import ConfigError


def _num(kind: type, minimum: float, strict: bool = False):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(v) or v < minimum or (strict and v == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum:g}, got {text!r}")
        return v

    parse.__name__ = kind.__name__
    return parse


def add_chaos_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chaos", help="run real nodes under a fault schedule and measure goodput",
                              description="Start a bootstrap peer and N nodes on this machine, kill/restart, "
                              "freeze/thaw and slow them down on a schedule, and report goodput, uptime, rejoin "
                              "times, held-out loss and whether the nodes agree at the end (docs/chaos.md).")
    p.add_argument("--nodes", type=_num(int, 2), default=4, help="training nodes (default 4)")
    p.add_argument("--duration", type=_num(float, 10), default=600, help="measured seconds (default 600)")
    p.add_argument("--mode", choices=("decoupled", "synchronous", "both"), default="both",
                   help="decoupled swarm, synchronous baseline (outer.synchronous=true), or both in turn (default)")
    p.add_argument("--schedule", default=None, metavar="SCRIPT",
                   help="scripted faults, e.g. 'kill:node2@60,restart@80; freeze:node1@100-115; slow:node3x4' "
                   "(times in seconds after the warm-up); default: a seeded random schedule")
    p.add_argument("--kill-every", type=_num(float, 0), default=60.0,
                   help="random schedule: about one kill every this many seconds (default 60; 0: none)")
    p.add_argument("--restart-delay", type=_num(float, 0), default=20.0,
                   help="seconds a killed node stays down (default 20)")
    p.add_argument("--freeze-every", type=_num(float, 0), default=0.0,
                   help="random schedule: about one freeze (SIGSTOP) every this many seconds (default 0: none)")
    p.add_argument("--freeze-s", type=_num(float, 0, strict=True), default=15.0, help="length of a freeze (default 15)")
    p.add_argument("--slow", action="append", default=[], metavar="nodeNxF",
                   help="random schedule: run nodeN F times slower for the whole run (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random schedule (default 0)")
    p.add_argument("--preset", choices=("demo", "tiny"), default="demo",
                   help="node settings: the demo's model (default) or the tests' tiny one")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a node setting for every node, e.g. --set outer.sync_every=80")
    p.add_argument("--data", default=None, help="text file or folder instead of the stdlib source")
    p.add_argument("--warmup", type=_num(float, 5), default=30.0, help="fault-free seconds before the window (default 30)")
    p.add_argument("--cpu-share", type=_num(float, 0, strict=True), default=None,
                   help="CPU duty cycle of each node (default 0.7 x cores / nodes, at most 1; 1: no throttling)")
    p.add_argument("--standalone-tps", type=_num(float, 0, strict=True), default=None,
                   help="tokens/s of one node for goodput (default: measured in the warm-up)")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs, statuses and reports here")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress lines, the report only")
    return p


def build_schedule(args: argparse.Namespace):
    """The run's :class:`~p2pdiloco.chaos.schedule.Schedule` from the arguments (ConfigError if bad)."""
    from p2pdiloco.chaos.schedule import parse_script, random_schedule  # noqa: PLC0415

    if args.schedule is not None:
        return parse_script(args.schedule, args.nodes, args.restart_delay)
    slows = parse_script(";".join(f"slow:{s}" for s in args.slow), args.nodes).faults if args.slow else ()
    return random_schedule(args.nodes, args.duration, args.seed, args.kill_every, args.restart_delay,
                           args.freeze_every, args.freeze_s, extra=slows)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_results(results: list) -> str:
    """The comparison table and the details of each run, as printed."""
    head = ("mode", "goodput", "goodput", "uptime", "kills", "freezes", "slow", "rejoin s", "held-out loss",
            "digests")
    sub = ("", "merged/proc.", "useful/alloc.", "", "(skipped)", "", "", "median/max", "start -> end", "at end")
    rows = [head, sub]
    for r in results:
        f = r.failures
        rejoin = "-" if r.rejoin_median_s is None else f"{r.rejoin_median_s:.1f}/{r.rejoin_max_s:.1f}"
        if r.rejoins_missing:
            rejoin += f" ({r.rejoins_missing} never)"
        loss = "-" if r.end_loss_mean is None else \
            f"{r.start_loss:.3f} -> {r.end_loss_mean:.3f}" if r.start_loss is not None else f"{r.end_loss_mean:.3f}"
        digests = f"{'equal' if r.digests_agree else 'DIFFER'} ({len(r.digests)}/{r.nodes} live)"
        rows.append((r.mode, _pct(r.goodput_merged), _pct(r.goodput), _pct(r.uptime),
                     f"{f['kill']} ({f['kill_skipped']})", str(f["freeze"]), str(f["slow"]), rejoin, loss, digests))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for r in results:
        load = r.load or {}
        lines.append(f"{r.mode}: {r.nodes} nodes, {r.duration_s:.0f} s measured; standalone "
                     f"{r.standalone_tokens_per_s:.0f} tokens/s per node ({r.rate_source}; warm-up "
                     f"{r.warmup_tokens_per_s:.0f}; CPU share {r.cpu_share:g}); {r.tokens_processed:.0f} tokens "
                     f"processed, {r.tokens_merged:.0f} merged; {r.training_node_s:.0f} of "
                     f"{r.nodes * r.duration_s:.0f} node-seconds training; rounds {r.rounds_committed} committed, "
                     f"{r.rounds_failed} failed; uptime window {r.uptime_window_s:g} s")
        if load:
            lines.append(f"  machine: {load['busy_cores']:.2f} of {load['cores']} cores busy on average, "
                         f"{load['ours_cores']:.2f} by this run, {load['others_cores']:.2f} by other processes")
        if r.simulated_goodput is not None:
            lines.append(f"  simulator on this run's kill timeline (p2pdiloco.chaos.replay): {_pct(r.simulated_goodput)}")
        if r.rejoin_s:
            lines.append(f"  rejoin times: {', '.join(f'{x:.1f}' for x in r.rejoin_s)} s")
        for n in r.notes:
            lines.append(f"  note: {n}")
        if r.survivors:
            lines.append(f"  PROCESSES LEFT RUNNING: {r.survivors}")
        lines.append(f"  logs: {r.workdir}")
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the harness's finally ends every process


def run_chaos(args: argparse.Namespace) -> int:
    from p2pdiloco.chaos.harness import ChaosConfig, ChaosError, run  # noqa: PLC0415
    from p2pdiloco.presets import PRESETS  # noqa: PLC0415
    from p2pdiloco.config import load_config, parse_overrides  # noqa: PLC0415

    try:
        schedule = build_schedule(args)
        settings = dict(PRESETS[args.preset])
        settings.update(parse_overrides(args.set))
        load_config(None, overrides=parse_overrides([f"{k}={v}" for k, v in settings.items()]))  # checks them
    except ConfigError as e:
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="p2pdiloco-chaos-"))
    modes = ("decoupled", "synchronous") if args.mode == "both" else (args.mode,)
    say = None if args.quiet else (lambda m: print(f"{time.strftime('%H:%M:%S')} {m}", flush=True))
    if say:
        say(f"schedule ({schedule.description or 'scripted'}): {schedule.text() or 'no faults'}")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    results = []
    try:
        tps = args.standalone_tps
        for mode in modes:
            source = "given" if args.standalone_tps else "the decoupled run" if tps else "this run"
            cfg = ChaosConfig(schedule=schedule, duration=args.duration, settings=settings, workdir=work, mode=mode,
                              warmup=args.warmup, cpu_share=args.cpu_share, standalone_tps=tps, rate_source=source,
                              data=args.data, progress=say)
            res = run(cfg)
            results.append(res)
            # the baseline is charged the same allocation: its own rate includes its waits
            tps = tps or res.standalone_tokens_per_s
    except ChaosError as e:
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("p2pdiloco: interrupted; every node was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_results(results))
    if args.json is not None:
        args.json.write_text(json.dumps({"schedule": schedule.text(), "description": schedule.description,
                                         "results": [r.to_json() for r in results]}, indent=1))
    ok = all(r.digests_agree and not r.survivors for r in results)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2pdiloco")
    add_chaos_parser(parser.add_subparsers(dest="cmd", required=True))
    return run_chaos(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
