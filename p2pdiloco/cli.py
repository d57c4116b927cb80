"""The ``p2pdiloco`` command: node (run, status), swarm status, run manifests, the trained model
(export, eval, sample), bootstrap, demo and simulate.

Every expected failure (bad config or address, unreachable peers, port in use) ends with one
line on stderr and a non-zero exit code: 2 for configuration errors, 1 for the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from p2pdiloco.cli_args import add_node_parser, add_swarm_parser
from p2pdiloco.cli_common import (Parser, interrupted, load_native_libraries, report_error, run_async, setup_logging,
                                  sigint_held)
from p2pdiloco.errors import ConfigError, P2PDilocoError
from p2pdiloco.run_cli import add_run_parser, pin_owner, run_command
from p2pdiloco.status import Snapshot, StatusError, parse_status

log = logging.getLogger("p2pdiloco")


def _node_status(args: argparse.Namespace) -> int:
    import time  # noqa: PLC0415

    from node.control import ControlUnreachable, find_socket, query  # noqa: PLC0415

    def ask(path: str) -> tuple[dict[str, Any], Snapshot]:
        """The node's status JSON as it answered, and parsed (one line and exit 1 when not a node's)."""
        raw = query(path, timeout=args.timeout)
        try:
            return raw, parse_status(raw)
        except StatusError as e:
            raise ControlUnreachable(f"{path}: {e}") from None

    try:
        path = find_socket(args.data_dir, args.socket)
        raw, snap = ask(path)
    except ControlUnreachable as e:
        return report_error(e)
    if args.watch is None:
        _print_node_status(raw, snap, args.json)
        return 0
    from rich.live import Live  # noqa: PLC0415

    from node.status_view import render_node  # noqa: PLC0415

    try:
        if args.json or not sys.stdout.isatty():  # one snapshot after the other: JSON lines, or plain text
            while True:
                if args.json:
                    print(json.dumps(raw), flush=True)
                else:
                    _print_node_status(raw, snap, False)
                    print(flush=True)
                time.sleep(max(0.2, args.watch))
                raw, snap = ask(path)
        with Live(render_node(snap), auto_refresh=False) as live:
            while True:
                time.sleep(max(0.2, args.watch))
                raw, snap = ask(path)
                live.update(render_node(snap), refresh=True)
    except ControlUnreachable as e:
        return report_error(e)
    except KeyboardInterrupt:
        return 0


def _print_node_status(raw: dict[str, Any], snap: Snapshot, as_json: bool) -> None:
    """The node's status: its JSON as it answered (``--json``), else the rendered view."""
    if as_json:
        print(json.dumps(raw, indent=1))
        return
    from node.status_view import render_node  # noqa: PLC0415

    _print_view(render_node(snap))


def _print_view(view: Any) -> None:
    """Print a rich renderable: as rich lays it out on a terminal; into a pipe or a file, without
    wrapping long lines (peer IDs, multiaddrs) at 80 columns and without trailing padding, so that
    ``grep`` and scripts see whole lines."""
    from rich.console import Console  # noqa: PLC0415

    if sys.stdout.isatty():
        Console().print(view)
        return
    console = Console(file=io.StringIO(), width=400, color_system=None)
    console.print(view)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in console.file.getvalue().splitlines()))


def _swarm_status(args: argparse.Namespace) -> int:
    from p2pdiloco.config import load_config  # noqa: PLC0415
    from p2pdiloco.net.transport.addresses import check_any_reachable, check_peer_maddr  # noqa: PLC0415

    try:
        if args.config is not None:
            cfg = load_config(args.config).swarm
            peers, run_id = list(args.initial_peers or cfg.initial_peers), args.run_id or cfg.run_id
        else:
            peers, run_id = list(args.initial_peers or []), args.run_id or "p2pdiloco"
        if not peers:
            raise ConfigError("swarm status needs --initial-peers MULTIADDR (or --config with swarm.initial_peers)")
        for m in peers:
            check_peer_maddr(m)
        from p2pdiloco import owners  # noqa: PLC0415

        owner = owners.owner_of(run_id)  # whose manifest counts: anyone can publish one (docs/trust.md)
        check_any_reachable(peers)
    except P2PDilocoError as e:
        return report_error(e)
    from node.status_view import read_swarm, render_swarm  # noqa: PLC0415

    async def go() -> int:
        view = await read_swarm(peers, run_id, wait=args.wait, owner=owner)
        if args.json:
            print(json.dumps(view, indent=1))
        else:
            _print_view(render_swarm(view))
        if not view["peers"]:
            print(f"p2pdiloco: no node of run {run_id!r} stored a record in the last 6 minutes "
                  "(check --run-id; nodes store theirs every 5 minutes)", file=sys.stderr)
            return 1
        return 0

    return run_async(go())


def _node_run(args: argparse.Namespace) -> int:
    from p2pdiloco.footprint import bound_heap  # noqa: PLC0415

    bound_heap()  # before torch allocates: resident memory follows the estimate (p2pdiloco.footprint)
    try:
        loaded = _node_settings(args)
    except P2PDilocoError as e:
        return report_error(e)
    if loaded is None:
        return interrupted()
    cfg, run = loaded
    from node.main import run_node  # noqa: PLC0415

    async def go() -> int:
        name = args.name or (Path(cfg.data_dir).name if cfg.data_dir else socket.gethostname())
        report = await run_node(cfg, name=name, status_path=args.status_file, report_path=args.report_file,
                                progress=sys.stdout.isatty() and not args.no_progress, manifest=run)
        print(json.dumps({"name": report.name, "start_loss": report.start_loss, "end_loss": report.end_loss,
                          "global_digest": report.global_digest}))
        if report.exit_reason:  # its daemon died for good (node.alone.DAEMON_LOST_EXIT)
            print(f"p2pdiloco: {name}: {report.exit_reason}", file=sys.stderr)
        elif report.exit_code:  # given peers to join, and its training reached nobody
            detail = report.alone.detail if report.alone else ""
            print(f"p2pdiloco: {name} never merged with another node: {detail or 'no round with a peer'}",
                  file=sys.stderr)
        return report.exit_code

    return run_async(go())


def _node_settings(args: argparse.Namespace) -> tuple[Any, Any] | None:
    """``node run``'s settings (config < env < flags, a joined run's manifest pinned) and the
    manifest (None without ``--join``), after the preflight checks (listen port, metrics port,
    memory, a reachable initial peer); None when Ctrl+C came meanwhile. Raises what the
    checks raise (P2PDilocoError)."""
    from p2pdiloco.config import load_config, parse_overrides  # noqa: PLC0415
    from p2pdiloco.net.transport.addresses import JOIN_HINT, check_any_reachable, check_listen_port  # noqa: PLC0415

    overrides: dict[str, Any] = parse_overrides(args.set)
    flags = {"swarm.initial_peers": args.initial_peers, "data.path": args.data, "swarm.run_id": args.run_id,
             "swarm.host": args.host, "swarm.port": args.port, "data_dir": args.data_dir,
             "max_steps": args.max_steps, "duration": args.duration, "device": args.device,
             "threads": args.threads, "memory_limit": args.memory_limit}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    run = None
    if args.join is not None:
        from p2pdiloco import manifest, owners  # noqa: PLC0415

        run = manifest.load(args.join)
        owners.check(run.run_id, run.owner_id)  # another owner than the one pinned here: refused
        manifest.check_factory(run, overrides.get("model.factory"))
    # checking initial peers' multiaddrs imports hivemind, and torch with it: Ctrl+C held
    with sigint_held() as held:
        cfg = load_config(args.config, overrides=overrides, run=run and manifest.pinned(run),
                          run_source=run and f"the manifest of run {run.run_id!r}" or "")
        from p2pdiloco.footprint import check_memory  # noqa: PLC0415

        # before anything is built, without torch for the built-in GPT: a manifest may name
        # any model size (docs/trust.md); run_node checks again once torch is loaded
        check_memory(cfg)
    if held:
        return None
    if run is not None and run.initial_peers:  # the run's peers, after the node's own
        cfg = dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, initial_peers=tuple(
            dict.fromkeys(cfg.swarm.initial_peers + run.initial_peers))))
    # preflight: the two most common start-up mistakes, before any daemon is started
    check_listen_port(cfg.swarm.host, cfg.swarm.port)
    if cfg.metrics_port:
        from node.control import check_metrics_port  # noqa: PLC0415

        check_metrics_port(cfg.metrics_host, cfg.metrics_port)
    if load_native_libraries():  # before dialing: check_any_reachable parses with hivemind
        return None
    check_any_reachable(cfg.swarm.initial_peers, hint=JOIN_HINT if run is not None else "")
    if run is not None:
        pin_owner(run)
    return cfg, run


def main(argv: list[str] | None = None) -> int:
    """The command line. Ctrl+C before a command handles it itself (imports, configuration,
    the preflight checks, a daemon starting) ends with one line and exit code 130, not a
    traceback and death by SIGINT."""
    try:
        return _main_interruptible(argv)
    finally:
        exec("")  # noqa: S102  (forgets an interrupt that was handled: see _main_interruptible)


def _main_interruptible(argv: list[str] | None) -> int:
    """``main``'s body. A KeyboardInterrupt raised inside ``exec`` of a string (dataclasses
    build their methods that way, so an import can be the place) sets CPython's "unhandled
    keyboard interrupt" flag even when it is then handled, and under ``python -m`` the
    interpreter ends itself with SIGINT at exit (``Py_RunMain`` in CPython's Modules/main.c):
    exit -2 after ``p2pdiloco: interrupted``, seen 2 times in 30 with Ctrl+C 0.3 to 0.6 s into
    ``node run``. The flag is cleared at the start of every string ``exec``
    (``run_eval_code_obj``, Python/pythonrun.c), so ``main`` runs an empty one on its way out; an
    interrupt that leaves ``main`` unhandled sets it again."""
    try:
        args = _parse(argv)  # --help and usage errors end here, without torch (~0.3 s)
        # torch (about 2 s of imports) and hivemind (1 s more) only for the commands that use them:
        # not for `node status`, which only asks a running node's control socket, nor the demo,
        # which supervises node processes; `node run` imports both once its settings are checked
        if load_native_libraries(_native_modules(args)):
            return interrupted()
        return _main(args)
    except KeyboardInterrupt:
        return interrupted()


def _native_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """The native libraries a command needs before it runs (``cli_common.load_native_libraries``)."""
    if args.cmd == "model":
        return ("torch",)
    if args.cmd in ("node", "demo", "run", "data"):  # `node run` loads them once its settings are checked, and
        return ()  # `run init` while it parses multiaddrs; `node status`, `run show` and the demo need neither
    return ("torch", "hivemind")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line's arguments; a usage error exits 2 with one line (``cli_common.Parser``), naming
    the subcommand an unknown flag was given to."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        words = [w for w in (args.cmd, getattr(args, f"{args.cmd}_cmd", None)) if isinstance(w, str)]
        parser.prog = " ".join([parser.prog, *words])
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="p2pdiloco", description="Decoupled DiLoCo over a peer-to-peer swarm")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    add_node_parser(sub)
    add_swarm_parser(sub)
    add_run_parser(sub)
    from p2pdiloco.model_cli import add_model_parser  # noqa: PLC0415

    add_model_parser(sub)
    boot = sub.add_parser("bootstrap", help="run a bootstrap peer (DHT only) and print its multiaddrs")
    from bootstrap.main import add_arguments  # noqa: PLC0415

    add_arguments(boot)
    boot.add_argument("-v", "--verbose", action="count", default=0)
    from node.demo import add_arguments as add_demo_arguments  # noqa: PLC0415

    add_demo_arguments(sub.add_parser("demo", help="train a small local swarm on real text (the main job)"))
    try:
        from p2pdiloco.sim.cli import add_simulate_parser  # noqa: PLC0415

        add_simulate_parser(sub)
    except ImportError:
        pass
    from p2pdiloco.chaos.cli import add_chaos_parser  # noqa: PLC0415
    from p2pdiloco.data_cli import add_data_parser  # noqa: PLC0415

    add_chaos_parser(sub)
    add_data_parser(sub)
    return parser


def _main(args: argparse.Namespace) -> int:
    setup_logging(getattr(args, "verbose", 0))
    if args.cmd == "node":
        return _node_status(args) if args.node_cmd == "status" else _node_run(args)
    if args.cmd == "swarm":
        if args.swarm_cmd != "status":
            from p2pdiloco.trust.cli import run_swarm_key_command  # noqa: PLC0415

            return run_swarm_key_command(args)
        return _swarm_status(args)
    if args.cmd == "run":
        return run_command(args)
    if args.cmd == "model":
        from node.export import run_model_command  # noqa: PLC0415

        try:
            return run_model_command(args)
        except P2PDilocoError as e:
            return report_error(e)
        except OSError as e:  # a folder the user named cannot be written
            print(f"p2pdiloco: {e}", file=sys.stderr)
            return 1
    if args.cmd == "bootstrap":
        from bootstrap.main import serve  # noqa: PLC0415

        return run_async(serve(args))
    if args.cmd == "demo":
        from node.demo import run_demo  # noqa: PLC0415

        return run_demo(args)
    if args.cmd == "simulate":
        from p2pdiloco.sim.cli import run_simulate  # noqa: PLC0415

        return run_simulate(args)
    if args.cmd == "chaos":
        from p2pdiloco.chaos.cli import run_chaos  # noqa: PLC0415

        return run_chaos(args)
    if args.cmd == "data":
        from p2pdiloco.data_cli import run_data_command  # noqa: PLC0415

        try:
            print(run_data_command(args))
        except P2PDilocoError as e:
            return report_error(e)
        except OSError as e:  # the output could not be written
            print(f"p2pdiloco: {e}", file=sys.stderr)
            return 1
        return 0
    raise AssertionError(f"unknown command {args.cmd}")  # argparse allows only the commands above


if __name__ == "__main__":
    sys.exit(main())
