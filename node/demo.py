"""The main job on its embedded default: a bootstrap peer and N nodes, as separate processes
on this machine, train a small byte-level transformer on the Python standard library's
source with Decoupled DiLoCo, show live progress, then print the final table.

Every child runs in its own process group and is terminated (then killed) on any exit
path, so no node or p2pd is left behind.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import typing
from pathlib import Path

from p2pdiloco.presets import DEMO
from p2pdiloco.procs import Processes
from p2pdiloco.status import Report, read_status

DEMO_SETTINGS = DEMO  # the demo's settings: p2pdiloco.presets


def _positive(kind: type) -> typing.Callable[[str], int | float]:
    """An argparse type: a number of ``kind`` above 0 (a usage error names the flag)."""
    def parse(text: str) -> int | float:
        value = kind(text)  # ValueError: argparse says "invalid int value: ..."
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=_positive(int), default=3, help="number of training nodes (default 3)")
    parser.add_argument("--duration", type=_positive(float), default=240,
                        help="seconds of training per node (default 240)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop each node after this many inner steps")
    parser.add_argument("--workdir", type=Path, default=None, help="keep statuses and reports here")
    parser.add_argument("--data", default=None, help="text file or folder instead of the stdlib source")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a demo setting, e.g. --set outer.sync_every=20")
    parser.add_argument("--quiet", action="store_true", help="no live progress, final table only")


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # run the cleanup in run_demo's finally


def _last_line(path: Path) -> str:
    """The last non-empty line of a node's log (its one-line reason when it failed), or ""."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _print_samples(data_dirs: list[Path], cfg: typing.Any, prompt: str) -> None:
    """Print text written by the run's initial model and by the trained global model of the
    first node that left a checkpoint (``node.export.before_after``), so a person sees what
    it learned; one line instead when no node left a usable one."""
    from node.export import before_after  # noqa: PLC0415  (imports torch)

    from p2pdiloco.errors import P2PDilocoError  # noqa: PLC0415

    problem = "no node left a checkpoint"
    for d in data_dirs:
        try:
            print("\n".join(before_after(d, cfg, prompt)), flush=True)
            return
        except (P2PDilocoError, OSError) as e:
            problem = str(e)
    print(f"p2pdiloco demo: no sample: {problem}", file=sys.stderr, flush=True)


def run_demo(args: argparse.Namespace) -> int:
    from node.demo_view import Clock, final_table, live_view  # noqa: PLC0415

    from p2pdiloco.config import load_config, parse_overrides, topk2_note  # noqa: PLC0415
    from p2pdiloco.errors import ConfigError  # noqa: PLC0415

    try:  # the nodes' settings, checked before anything starts (a bad --set: one line, exit 2)
        settings = {**DEMO_SETTINGS, **parse_overrides(args.set), "data.num_shards": str(args.nodes)}
        cfg = load_config(None, overrides={**settings, "data.shard_index": "0",
                                           **({"data.path": args.data} if args.data else {})})
    except ConfigError as e:
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 2
    if note := topk2_note(cfg.outer):  # the nodes log it too, in their node.log
        print(f"p2pdiloco demo: warning: {note}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _terminate)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="p2pdiloco-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"p2pdiloco demo: {args.nodes} nodes in {work} (watch one with: p2pdiloco node status --data-dir "
          f"{work / 'node0'} --watch)", flush=True)
    children = Processes(parent_death=signal.SIGTERM)  # nodes leave gracefully if the demo dies
    py = sys.executable
    try:
        maddr = children.start_bootstrap(work)
        print(f"p2pdiloco demo: the whole swarm with: p2pdiloco swarm status --initial-peers {maddr} --run-id demo "
              f"(the address is in {work / 'bootstrap.txt'})", flush=True)
        nodes = []
        for i in range(args.nodes):
            d = work / f"node{i}"
            argv = [py, "-m", "node", "run", "--initial-peers", maddr, "--host", "127.0.0.1", "--port", "0",
                    "--name", f"node{i}", "--data-dir", str(d), "--duration", str(args.duration),
                    "--status-file", str(d / "status.json"), "--report-file", str(d / "report.json"),
                    "--run-id", "demo", "--set", f"data.shard_index={i}"]
            if args.max_steps:
                argv += ["--max-steps", str(args.max_steps)]
            if args.data:
                argv += ["--data", args.data]
            for k, v in settings.items():
                argv += ["--set", f"{k}={v}"]
            d.mkdir(exist_ok=True)
            for old in ("node.log", "status.json", "report.json"):  # a reused --workdir: this run's files only
                (d / old).unlink(missing_ok=True)
            nodes.append((children.start(argv, d / "node.log", f"node{i}"), d))
        live_view(nodes, quiet=args.quiet, clock=Clock(args.duration, args.max_steps or 0))
        reports = [r if isinstance(r := read_status(d / "report.json"), Report) else None for _, d in nodes]
        codes = [p.returncode for p, _ in nodes]
        ok = final_table(reports, codes, [_last_line(d / "node.log") for _, d in nodes])
        _print_samples([d for _, d in nodes], cfg, "The " if args.data else "def ")
        print(f"logs and reports: {work}")
        return 0 if ok else 1
    except KeyboardInterrupt:
        print("p2pdiloco: interrupted; stopping the swarm", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 1
    finally:
        children.close()
