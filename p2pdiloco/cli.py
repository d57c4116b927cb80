"""The ``p2pdiloco`` command: node (run, status), swarm status, run manifests, the trained model
(export, eval, sample), bootstrap, demo and simulate.

Every expected failure (bad config or address, unreachable peers, port in use) ends with one
line on stderr and a non-zero exit code: 2 for configuration errors, 1 for the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import logging
import os
import socket
import sys
import typing
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

from p2pdiloco.errors import ConfigError, P2PDilocoError

log = logging.getLogger("p2pdiloco")


def setup_logging(verbose: int = 0) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    level = os.environ.get("P2PDILOCO_LOG", logging.getLevelName(level)).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.getLogger().level, logging.ERROR))


def report_error(e: P2PDilocoError) -> int:
    """Print ``e`` on stderr as ``p2pdiloco: message`` (one line per problem); its exit code:
    2 for configuration errors, 1 for the rest."""
    print(f"p2pdiloco: {e}", file=sys.stderr)
    return 2 if isinstance(e, ConfigError) else 1


def interrupted() -> int:
    """Ctrl+C: one line and exit code 130 (128 + SIGINT, what a shell reports for it)."""
    print("p2pdiloco: interrupted", file=sys.stderr)
    return 130


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    """Run ``coro`` on uvloop and translate our errors into one line and an exit code.

    Until ``coro`` installs its own handler, SIGINT cancels it (``asyncio.Runner``, which
    ``uvloop.run`` uses) and surfaces here as KeyboardInterrupt: an error that the interruption
    caused on the way out (a daemon that got the signal too) is reported as the interruption."""
    import asyncio  # noqa: PLC0415

    import uvloop  # noqa: PLC0415

    async def guarded() -> int:
        try:
            return await coro
        except (P2PDilocoError, OSError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # Ctrl+C came first
                raise asyncio.CancelledError from None
            raise

    try:
        return uvloop.run(guarded())
    except P2PDilocoError as e:
        return report_error(e)
    except OSError as e:  # a file or folder the user named (status, report, identity...) failed
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted()


def _node_parser(sub: argparse._SubParsersAction) -> None:
    node = sub.add_parser("node", help="run or inspect a training node")
    nsub = node.add_subparsers(dest="node_cmd", required=True, metavar="{run,status}")
    run = nsub.add_parser("run", help="run a node that joins a swarm and trains")
    run.add_argument("--join", default=None, metavar="MANIFEST",
                     help="join a run: its manifest file or its p2pdiloco-run:... string (from `p2pdiloco run "
                          "init`); gives the run ID, the run's settings and its initial peers")
    run.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                     help="multiaddrs of peers to join through (from `p2pdiloco bootstrap`)")
    run.add_argument("--config", type=Path, default=None, help="TOML config file")
    run.add_argument("--data", default=None, help="text file or folder to train on (default: Python's stdlib source)")
    run.add_argument("--run-id", default=None, help="name of the training run (all nodes of a run share it)")
    run.add_argument("--host", default=None, help="IPv4 address to listen on")
    run.add_argument("--port", type=int, default=None, help="TCP port to listen on (0: any)")
    run.add_argument("--data-dir", default=None, help="folder for the node's identity, status and report")
    run.add_argument("--device", default=None, help="auto (CUDA, else Apple MPS, else CPU), cpu, cuda, cuda:N or mps")
    run.add_argument("--threads", type=int, default=None, help="CPU threads torch may use (default 1)")
    run.add_argument("--memory-limit", type=int, default=None, metavar="MIB",
                     help="refuse to start when training would need more memory than this (MiB); warn when over it")
    run.add_argument("--max-steps", type=int, default=None, help="stop after this many inner steps")
    run.add_argument("--duration", type=float, default=None,
                     help="stop after this many seconds of training (default: the config's duration, 0: until stopped)")
    run.add_argument("--name", default=None, help="a label for logs and status (default: the data dir's name, "
                                                  "else this machine's host name)")
    run.add_argument("--status-file", type=Path, default=None,
                     help="write a JSON status snapshot here every status_every seconds (default 5; every second "
                          "while the live view shows)")
    run.add_argument("--report-file", type=Path, default=None, help="write the final JSON report here")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                     help="override any config value, e.g. --set outer.sync_every=50")
    run.add_argument("--no-progress", action="store_true",
                     help="no live view in the terminal (it is shown only when stdout is a terminal)")
    run.add_argument("-v", "--verbose", action="count", default=1)
    status = nsub.add_parser("status", help="show what a running node on this machine is doing",
                             description="Read a running node over its local control socket (control.sock in its "
                                         "data dir). Exit 1 with one line when no node answers within a few seconds.")
    where = status.add_mutually_exclusive_group()
    where.add_argument("--data-dir", default=None, help="the node's --data-dir (default: the only node without one)")
    where.add_argument("--socket", default=None, help="path of the node's control socket")
    status.add_argument("--json", action="store_true", help="print the raw JSON snapshot (for scripts)")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl+C")
    status.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the node's answer (default 3)")


def _run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="a training run's manifest: init (the owner, once), show")
    rsub = run.add_subparsers(dest="run_cmd", required=True, metavar="{init,show}")
    init = rsub.add_parser("init", help="make and sign a run's manifest: what nodes need to join it",
                           description="Write RUN_ID.manifest and print its one-string form. Every node started "
                                       "with `p2pdiloco node run --join MANIFEST` takes the run ID, the run's "
                                       "settings (model, optimizers, fragments, H, codec, seed, batch size, "
                                       "swarm key) and initial peers from it.")
    init.add_argument("--run-id", required=True, help="the run's name")
    init.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                      help="multiaddrs nodes join through (from `p2pdiloco bootstrap`)")
    init.add_argument("--config", type=Path, default=None,
                      help="TOML config with the run's settings (a node's own config works too: its per-node "
                           "settings, such as data.path or swarm.port, are left out, as with --set)")
    init.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                      help="a run setting, e.g. --set outer.sync_every=50")
    init.add_argument("--target-tokens", type=int, default=0, help="tokens the run means to train on (0: none)")
    init.add_argument("--identity", type=Path, default=Path("run-owner.key"),
                      help="the owner's Ed25519 key file, created if missing (default run-owner.key)")
    init.add_argument("--out", type=Path, default=None, help="manifest file to write (default RUN_ID.manifest)")
    show = rsub.add_parser("show", help="check a manifest's signature and print what it holds")
    show.add_argument("manifest", metavar="MANIFEST", help="a manifest file or its p2pdiloco-run:... string")
    show.add_argument("--json", action="store_true", help="print JSON (for scripts)")


def _pin_owner(m: Any) -> bool:
    """Pin the owner of manifest ``m`` for its run on first use (:mod:`p2pdiloco.owners`), saying
    so on stderr; returns whether it was new. Raises ConfigError: the run is pinned to another
    owner."""
    from p2pdiloco import owners  # noqa: PLC0415

    newly = owners.pin(m.run_id, m.owner_id)
    if newly:
        print(f"p2pdiloco: owner {m.owner_id} pinned for run {m.run_id!r} (first use on this machine; "
              f"a manifest of this run from another key will be refused)", file=sys.stderr)
    return newly


def _run_command(args: argparse.Namespace) -> int:
    from p2pdiloco import manifest  # noqa: PLC0415
    from p2pdiloco.config import load_config, parse_overrides, settings_in  # noqa: PLC0415
    from p2pdiloco.trust.identity import Identity  # noqa: PLC0415

    try:
        if args.run_cmd == "show":
            m = manifest.load(args.manifest, "run show")
            newly = _pin_owner(m)
            view = {"run_id": m.run_id, "owner": m.owner_id, "owner_pinned": "new" if newly else "same",
                    "digest": m.digest, "created": m.created, "initial_peers": list(m.initial_peers),
                    "target_tokens": m.target_tokens, "settings": dict(m.settings)}
            print(json.dumps(view, indent=1) if args.json else "\n".join(
                f"{k}: {v}" for k, v in view.items() if k != "settings") + "\n" + "\n".join(
                f"  {k} = {v}" for k, v in m.settings.items()))
            return 0
        overrides: dict[str, Any] = {**parse_overrides(args.set), "swarm.run_id": args.run_id}
        if args.initial_peers:
            overrides["swarm.initial_peers"] = args.initial_peers
        # a node's own config (file or --set) works too: its per-node settings (data.path,
        # swarm.port...) are left out, said in one line; data.tokenizer gives the run its digest
        per_node = set(manifest.per_node_settings()) - {"data.tokenizer"}
        skipped = [*(settings_in(args.config) if args.config is not None else []), *overrides]
        skipped = list(dict.fromkeys(k for k in skipped if k in per_node))
        overrides = {k: v for k, v in overrides.items() if k not in per_node}
        with _sigint_held() as held:  # initial peers' multiaddrs are parsed with hivemind (and torch)
            cfg = load_config(args.config, overrides=overrides, skip=per_node)
        if held:
            return interrupted()
        if args.target_tokens < 0:
            raise ConfigError("--target-tokens must be >= 0")
        identity, created = Identity.load_or_create(args.identity)
        m = manifest.RunManifest.create(identity, cfg, target_tokens=args.target_tokens)
        out = args.out or Path(f"{cfg.swarm.run_id}.manifest")
        m.save(out)
    except P2PDilocoError as e:
        return report_error(e)
    except OSError as e:
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 1
    if skipped:
        print(f"p2pdiloco: left out of the manifest: {', '.join(skipped)} (per-node settings: each node sets its "
              f"own)", file=sys.stderr)
    if created:
        print(f"p2pdiloco: made the run owner's key {args.identity}: keep it private", file=sys.stderr)
    if not m.initial_peers:
        print("p2pdiloco: the manifest names no initial peers: joining nodes will need --initial-peers",
              file=sys.stderr)
    print(f"wrote {out} (run {m.run_id!r}, digest {m.digest}); nodes join with:\n"
          f"  p2pdiloco node run --join {out}\nor with the string:\n{m.to_string()}")
    return 0


def _swarm_parser(sub: argparse._SubParsersAction) -> None:
    swarm = sub.add_parser("swarm", help="swarm status (without joining), private-swarm keys: init, admit, revoke, identity")
    ssub = swarm.add_subparsers(dest="swarm_cmd", required=True, metavar="{init,admit,revoke,identity,status}")
    from p2pdiloco.trust.cli import add_swarm_key_parsers  # noqa: PLC0415

    add_swarm_key_parsers(ssub)  # init, admit, revoke, identity: private-swarm keys (docs/trust.md)
    status = ssub.add_parser("status", help="every node's record in the DHT: state, step, tokens/s, versions",
                             description="Join the DHT as a light peer (no model, no training), print every node's "
                                         "record under the run, then leave.")
    status.add_argument("--initial-peers", nargs="+", default=None, metavar="MULTIADDR",
                        help="multiaddrs of peers to join through (from `p2pdiloco bootstrap`)")
    status.add_argument("--run-id", default=None, help="name of the training run (default: from --config, else "
                                                       "'p2pdiloco')")
    status.add_argument("--config", type=Path, default=None, help="a node's TOML config: its peers and run ID")
    status.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    status.add_argument("--wait", type=float, default=10.0,
                        help="seconds to wait for records to appear (default 10)")
    status.add_argument("-v", "--verbose", action="count", default=0)


def _node_status(args: argparse.Namespace) -> int:
    import time  # noqa: PLC0415

    from node.control import ControlUnreachable, find_socket, query  # noqa: PLC0415

    try:
        path = find_socket(args.data_dir, args.socket)
        snap = query(path, timeout=args.timeout)
    except ControlUnreachable as e:
        return report_error(e)
    if args.watch is None:
        _print_node_status(snap, args.json)
        return 0
    from rich.live import Live  # noqa: PLC0415

    from node.status_view import render_node  # noqa: PLC0415

    if args.json or not sys.stdout.isatty():  # one snapshot after the other: JSON lines, or plain text
        try:
            while True:
                if args.json:
                    print(json.dumps(snap), flush=True)
                else:
                    _print_node_status(snap, False)
                    print(flush=True)
                time.sleep(max(0.2, args.watch))
                snap = query(path, timeout=args.timeout)
        except ControlUnreachable as e:
            return report_error(e)
        except KeyboardInterrupt:
            return 0
    try:
        with Live(render_node(snap), auto_refresh=False) as live:
            while True:
                time.sleep(max(0.2, args.watch))
                snap = query(path, timeout=args.timeout)
                live.update(render_node(snap), refresh=True)
    except ControlUnreachable as e:
        return report_error(e)
    except KeyboardInterrupt:
        return 0


def _print_node_status(snap: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(snap, indent=1))
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
    from p2pdiloco.config import load_config, parse_overrides  # noqa: PLC0415
    from p2pdiloco.net.transport.addresses import JOIN_HINT, check_any_reachable, check_listen_port  # noqa: PLC0415

    try:
        overrides: dict[str, Any] = parse_overrides(args.set)
        flags = {"swarm.initial_peers": args.initial_peers, "data.path": args.data, "swarm.run_id": args.run_id,
                 "swarm.host": args.host, "swarm.port": args.port, "data_dir": args.data_dir,
                 "max_steps": args.max_steps, "duration": args.duration, "device": args.device,
                 "threads": args.threads, "memory_limit": args.memory_limit}
        overrides.update({k: v for k, v in flags.items() if v is not None})
        run = None
        if args.join is not None:
            from p2pdiloco import manifest  # noqa: PLC0415

            from p2pdiloco import owners  # noqa: PLC0415

            run = manifest.load(args.join)
            owners.check(run.run_id, run.owner_id)  # another owner than the one pinned here: refused
            manifest.check_factory(run, overrides.get("model.factory"))
        # checking initial peers' multiaddrs imports hivemind, and torch with it: Ctrl+C held
        with _sigint_held() as held:
            cfg = load_config(args.config, overrides=overrides, run=run and manifest.pinned(run),
                              run_source=run and f"the manifest of run {run.run_id!r}" or "")
            from p2pdiloco.footprint import check_memory  # noqa: PLC0415

            # before anything is built, without torch for the built-in GPT: a manifest may name
            # any model size (docs/trust.md); run_node checks again once torch is loaded
            check_memory(cfg)
        if held:
            return interrupted()
        if run is not None and run.initial_peers:  # the run's peers, after the node's own
            cfg = dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, initial_peers=tuple(
                dict.fromkeys(cfg.swarm.initial_peers + run.initial_peers))))
        # preflight: the two most common start-up mistakes, before any daemon is started
        check_listen_port(cfg.swarm.host, cfg.swarm.port)
        if cfg.metrics_port:
            from node.control import check_metrics_port  # noqa: PLC0415

            check_metrics_port(cfg.metrics_host, cfg.metrics_port)
        if _load_native_libraries():  # before dialing: check_any_reachable parses with hivemind
            return interrupted()
        check_any_reachable(cfg.swarm.initial_peers, hint=JOIN_HINT if run is not None else "")
        if run is not None:
            _pin_owner(run)
    except P2PDilocoError as e:
        return report_error(e)
    from node.main import run_node  # noqa: PLC0415

    async def go() -> int:
        name = args.name or (Path(cfg.data_dir).name if cfg.data_dir else socket.gethostname())
        report = await run_node(cfg, name=name, status_path=args.status_file, report_path=args.report_file,
                                progress=sys.stdout.isatty() and not args.no_progress, manifest=run)
        print(json.dumps({k: report[k] for k in ("name", "steps", "start_loss", "end_loss", "global_digest")
                          if k in report}))
        if report.get("exit_reason"):  # its daemon died for good (node.alone.DAEMON_LOST_EXIT)
            print(f"p2pdiloco: {name}: {report['exit_reason']}", file=sys.stderr)
        elif report.get("exit_code"):  # given peers to join, and its training reached nobody
            alone = report.get("alone") or {}
            print(f"p2pdiloco: {name} never merged with another node: {alone.get('detail') or 'no round with a peer'}",
                  file=sys.stderr)
        return int(report.get("exit_code") or 0)

    return run_async(go())


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
        if _load_native_libraries(_native_modules(args)):
            return interrupted()
        return _main(args)
    except KeyboardInterrupt:
        return interrupted()


def _native_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """The native libraries a command needs before it runs (``_load_native_libraries``)."""
    if args.cmd == "model":
        return ("torch",)
    if args.cmd in ("node", "demo", "run", "data"):  # `node run` loads them once its settings are checked, and
        return ()  # `run init` while it parses multiaddrs; `node status`, `run show` and the demo need neither
    return ("torch", "hivemind")


@contextlib.contextmanager
def _sigint_held() -> Iterator[list[int]]:
    """Hold Ctrl+C while native libraries are imported: a SIGINT meanwhile is only recorded in
    the list yielded, and the previous handler is back afterwards. torch runs Python callbacks
    from its C++ initialisation (pybind11); a KeyboardInterrupt raised in one ends in C++
    ``terminate``: the process aborts (SIGABRT, exit -6) instead of saying one line (measured:
    Ctrl+C 1 s after ``node run`` started on a loaded machine). Off the main thread, or when
    SIGINT is not Python's default handler (ignored by ``nohup``, or a test's own), nothing is
    changed."""
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    held: list[int] = []
    hold = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if hold:
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        if hold:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _load_native_libraries(modules: tuple[str, ...] = ("torch", "hivemind")) -> bool:
    """Import ``modules`` (torch, hivemind) with Ctrl+C held (``_sigint_held``), and say whether
    it was pressed meanwhile."""
    with _sigint_held() as held:
        for name in modules:
            importlib.import_module(name)
    return bool(held)


class _Parser(argparse.ArgumentParser):
    """argparse with one line per usage error, naming the command and where its help is (the
    default prints the whole usage first, dozens of lines for ``node run``). Subcommands inherit
    the class (``add_subparsers`` uses the parser's own class)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line's arguments; a usage error exits 2 with one line (``_Parser``), naming
    the subcommand an unknown flag was given to."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        words = [w for w in (args.cmd, getattr(args, f"{args.cmd}_cmd", None)) if isinstance(w, str)]
        parser.prog = " ".join([parser.prog, *words])
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="p2pdiloco", description="Decoupled DiLoCo over a peer-to-peer swarm")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _node_parser(sub)
    _swarm_parser(sub)
    _run_parser(sub)
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
        return _run_command(args)
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
