"""Run one node: start the transport, build the learner, train, report. Used by the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from p2pdiloco.atomic import write_json_atomic
from p2pdiloco.config import NodeConfig, SwarmConfig
from p2pdiloco.data import bits_per_byte, evaluate
from p2pdiloco.errors import ConfigError, NetworkError, P2PDilocoError
from p2pdiloco.footprint import check_memory
from p2pdiloco import owners
from p2pdiloco.manifest import RunManifest, published, run_settings
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.status import FragmentStatus, Report, Status, SwarmFigures

from node.alone import DAEMON_LOST_EXIT, START_ALONE_HINT
from node.checkpoint import save_node_config
from node.control import ControlServer, start_metrics
from node.runtime import Node
from node.snapshot import Board, live_progress, snapshot, swarm_summary
from node.status_view import RECORD_RPC
from node.setup import Setup

if TYPE_CHECKING:
    from p2pdiloco.trust import NodeTrust

log = logging.getLogger(__name__)


class SwarmView:
    """The swarm as this node last read it from the DHT (``{run}/heads``), refreshed every
    few seconds by :meth:`refresh_forever`; read by status, metrics and the live view. A node
    left without any connection (its router reset them all, its link was down) dials its
    initial peers again at every refresh until one answers (``Swarm.rejoin``; in tests/internet
    neither p2pd nor the DHT reconnected within 5 minutes); ``rejoins`` counts the refreshes
    that brought a peer back."""

    REFRESH_SECONDS = 5.0

    def __init__(self) -> None:
        self.records: dict[str, Any] | None = None
        self.read_at: float | None = None
        self.connections: int | None = None
        self.rejoins = 0

    async def refresh_forever(self, node: Node, swarm: Swarm) -> None:
        while True:
            try:
                self.records = await node.sync.records(node.sync.read_age())
                self.read_at = time.time()
            except P2PDilocoError as e:
                log.debug("swarm view: %s", e)
            try:
                self.connections = await swarm.reach.refresh(swarm)
            except Exception as e:  # the daemon's answer is informative only
                log.debug("swarm view: connections and addresses: %s", e)
            if self.connections == 0 and swarm.initial_peers and await swarm.rejoin():
                self.rejoins += 1
                log.warning("lost every connection; dialled the initial peers again and rejoined the swarm")
            await asyncio.sleep(self.REFRESH_SECONDS)

    def summary(self, committed: list, me: str,
                trusted: Any = None) -> tuple[SwarmFigures | None, list[FragmentStatus]]:
        """(swarm figures, per-fragment status against the swarm's newest heads):
        :func:`node.snapshot.swarm_summary` of this view."""
        return swarm_summary(self, committed, me, trusted)


DAEMON_POLL_S = 1.0  # how often the node checks that its libp2p daemon still runs


async def keep_daemon(node: Node, swarm: Swarm, lost: list[str]) -> None:
    """Check every ``DAEMON_POLL_S`` that p2pd, the node's libp2p daemon, still runs (its
    process: ``Swarm.daemon_running``); when it died (killed, OOM), start it again under the
    running node (``Swarm.restart``: same peer ID and port, rejoins the DHT) and store this
    node's record at once, so that its peers find it again. When the restart fails, the reason
    goes to ``lost``, one line is logged and the node stops (exit code ``DAEMON_LOST_EXIT``):
    a node without a daemon would only train alone (docs/operating.md, "Faults of the machine")."""
    while True:
        await asyncio.sleep(DAEMON_POLL_S)
        if swarm.daemon_running():
            continue
        log.warning("the libp2p daemon (p2pd, pid %s) exited under the node: starting it again", swarm.daemon_pid)
        try:
            await swarm.restart()
        except P2PDilocoError as e:
            lost.append(f"the libp2p daemon (p2pd) exited and could not be started again: {e}")
            log.error("%s; stopping", lost[-1])
            node.stop()
            return
        log.warning("p2pd started again (pid %s) and the node rejoined the swarm", swarm.daemon_pid)
        await node.republish()


async def serve_record(node: Node, swarm: Swarm) -> None:
    """Answer ``st.record`` with this node's heads record as it stands (its states, figures,
    protocol tag, the swarm's time): ``swarm status`` asks every node whose record it finds in
    the DHT, where a node stores its record every ``STORE_EVERY_S`` (300 s) only, so the two
    views read the same figures. The transport authenticates the answering peer, so a reader
    takes the answer as that peer's own record; the request carries nothing."""

    async def on_record(peer: str, header: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        record = HeadsRecord(tuple((s.version, s.digest) for s in node.committed), t=swarm.clock.now(),
                             tag=node.sync.tag, **node.record())
        return {"r": record.to_wire(), "run": node.cfg.swarm.run_id}, b""

    await swarm.add_handler(RECORD_RPC, on_record)


MANIFEST_REPUBLISH_S = 60.0  # a node that joined with a run manifest stores it in the DHT this often
MANIFEST_TTL_S = 300.0


async def share_manifest(swarm: Swarm, cfg: NodeConfig, manifest: RunManifest | None) -> None:
    """With a manifest: keep it in the DHT under ``RUN/manifest`` (subkey: this node's peer ID).
    Without one: read the manifest of the run's owner pinned on this machine
    (:mod:`p2pdiloco.owners`; none pinned: nothing is read) once and warn, naming the first
    setting, when this node's settings differ from it (a stranger can publish a manifest for
    any run ID, so only the pinned owner's counts, and a node that did not join with one is
    not refused because of it)."""
    key = f"{cfg.swarm.run_id}/manifest"
    if manifest is not None:
        while True:
            with contextlib.suppress(NetworkError):
                await swarm.store(key, swarm.peer_id, manifest.encode(), MANIFEST_TTL_S)
            await asyncio.sleep(MANIFEST_REPUBLISH_S)
    with contextlib.suppress(NetworkError, ConfigError):  # ConfigError: a damaged owners file, said at `run show`
        mine = run_settings(cfg)
        m = published(await swarm.get(key), owners.owner_of(cfg.swarm.run_id))
        if m is not None:
            diff = next(((k, v, mine[k]) for k, v in m.settings.items() if mine.get(k) != v), None)
            if diff is not None:
                log.warning("this node's %s = %s differs from the manifest of run %r (%s, by %s): it will merge only "
                            "with nodes that share its settings; join with `--join` to use the run's", diff[0], diff[2],
                            m.run_id, diff[1], m.owner_id)


STOP_BURST_S = 1.0  # stop signals this close together are one request


def once_per_burst(stop: Callable[[], None], window: float = STOP_BURST_S) -> Callable[[], None]:
    """``stop`` as a signal handler that ignores a signal arriving within ``window`` seconds of
    the one that called it. Coreutils ``timeout`` sends its signal to its child and then to its
    whole process group (timeout.c, ``cleanup``), so the node gets SIGTERM twice at once, as
    from ``kill PID; kill -- -PGID``: one request, not the second Ctrl+C after which
    :meth:`Node.stop` exits at once."""
    last = -math.inf

    def handler() -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= window:
            last = now
            stop()

    return handler


async def run_node(cfg: NodeConfig, *, name: str = "node", status_path: Path | None = None,
                   report_path: Path | None = None, on_ready=None, progress: bool = False,
                   manifest: RunManifest | None = None) -> Report:
    """Run one node to the end of its budget or until SIGINT/SIGTERM; returns its report.
    ``manifest``: the run manifest the node joined with (shown in status, kept in the DHT).

    While it runs, ``p2pdiloco node status`` reads it on its control socket (``control.sock``
    in the data dir), Prometheus on ``metrics_port`` when set, and with ``progress`` the
    terminal shows a live view.

    Raises:
        NetworkError: the transport could not start or join, another node runs with the same
            data dir, or the metrics port cannot be bound.
        ConfigError: the data or model settings cannot work.
    """
    data_dir = Path(cfg.data_dir) if cfg.data_dir else None
    if data_dir:
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"data_dir: cannot create {data_dir}: {e.strerror or e}") from None
    control = await ControlServer.start(data_dir)  # refuses a second node on this data dir
    board = Board(cfg, name, control, manifest)
    control.provider = lambda: board.current().to_json()
    stop_metrics = None
    try:
        if data_dir:  # what `p2pdiloco model export` rebuilds the checkpoint's module from
            try:
                save_node_config(data_dir, cfg)
            except OSError as e:  # a full disk: the node can train; its checkpoints will say so too
                log.warning("%s not written (%s): `model export` needs it", data_dir / "node-config.json",
                            e.strerror or e)
        if cfg.metrics_port:
            stop_metrics = start_metrics(cfg.metrics_host, cfg.metrics_port, lambda: board.latest)
        sw = cfg.swarm
        from p2pdiloco.trust import load_node_trust  # noqa: PLC0415  (identity, private-swarm membership)

        trust = load_node_trust(cfg.trust, data_dir)
        # model and data first: a setting or a data folder that cannot work is refused in one
        # line before any daemon starts (the peer ID, which seeds the data order, is the identity's)
        # its memory before the model is built: a run manifest may name any model size (docs/trust.md)
        before = psutil.Process().memory_info().rss  # the process without the model (footprint.estimate)
        footprint = await asyncio.to_thread(check_memory, cfg)
        setup = await asyncio.to_thread(Setup.build, cfg, name, trust.identity.peer_id)
        if footprint is None:  # a factory model that cannot be built on the meta device: its count now
            footprint = check_memory(cfg, sum(p.numel() for p in setup.model.parameters()), before)
        setup.footprint = footprint  # shown once the node is up (Setup.log_notes): a refused node says one line
        setup.notes += ((logging.INFO, f"{name}: {footprint.line()}"),)
        swarm = await start_swarm(sw, trust)
        try:
            return await _serve(cfg, name, setup, swarm, board, status_path, report_path, on_ready, progress, manifest)
        finally:
            await swarm.shutdown()
    finally:
        if stop_metrics is not None:
            stop_metrics()
        await control.close()


async def start_swarm(sw: SwarmConfig, trust: NodeTrust) -> Swarm:
    """Start the node's transport (``swarm`` settings, the node's identity and membership). In
    reachability ``auto`` with relays on, the dial-back check decides how p2pd runs
    (``p2pdiloco.net.transport.reachability``): a node its initial peers could not dial back
    starts p2pd again forced private, reserving a slot on its initial peers at once; one they
    dialled back starts it again forced public, so that it relays for the run's nodes behind
    NAT (p2pd's relay service runs only on a public node, and its AutoNAT never finds a node
    public without 4 peers to dial it back). The check's verdict stays in ``swarm.reach``.
    Raises what :meth:`Swarm.start` raises."""
    args = dict(initial_peers=sw.initial_peers, host_maddrs=[f"/ip4/{sw.host}/tcp/{sw.port}"], announce_maddrs=sw.announce,
                identity=trust.identity, membership=trust.membership, admission_key=f"{sw.run_id}/heads", relay=sw.relay)
    swarm = await Swarm.start(**args, reachability=sw.reachability)
    mode = swarm.reach.restart_mode() if sw.reachability == "auto" and sw.relay else None
    if mode is None:
        return swarm
    log.info("peers %s this node (seen as %s): restarting p2pd forced %s, %s", "cannot dial" if mode == "private"
             else "can dial", swarm.reach.observed, mode, "to reserve a slot on a relay" if mode == "private"
             else "to relay for nodes behind NAT")
    checked = swarm.reach
    await swarm.shutdown()
    swarm = await Swarm.start(**args, reachability=mode)
    swarm.reach = replace(checked, restarted=True, maddrs=await swarm.visible_maddrs())
    return swarm


def _announce(cfg: NodeConfig, name: str, swarm: Swarm, board: Board, maddrs: list[str]) -> None:
    """Log where the node's status is read and warn about addresses no other machine can dial."""
    where = f"--data-dir {cfg.data_dir}" if cfg.data_dir else f"--socket {board.control.path}"
    log.info("%s: status with `p2pdiloco node status %s`%s", name, where,
             f"; Prometheus metrics on {board.metrics_url}" if board.metrics_url else "")
    if swarm.reach.state(maddrs) == "loopback only":
        log.warning("%s: only loopback addresses are announced (%s); peers on other machines cannot dial this "
                    "node: use --host 0.0.0.0, or --set swarm.announce=/ip4/PUBLIC_IP/tcp/PORT behind NAT",
                    name, ", ".join(maddrs))
    if not cfg.swarm.initial_peers:
        log.warning("%s: %s", name, START_ALONE_HINT)


async def _write_status(cfg: NodeConfig, name: str, board: Board, status_path: Path | None, progress: bool) -> None:
    """Refresh the board and write the status file (atomically) every ``status_every`` seconds,
    every second with the live view; warn once when the node outgrows its memory limit."""
    warned = status_failing = False
    while True:
        hw = getattr(board.refresh(), "hardware", None)
        if hw is not None and hw.over_memory_limit and not warned:
            warned = True
            log.warning("%s uses %s MiB, over its memory_limit of %s MiB: lower data.batch_size or use a smaller "
                        "model", name, hw.rss_mib, hw.memory_limit_mib)
        if status_path is not None:
            try:
                await asyncio.to_thread(write_json_atomic, status_path, board.latest.to_json(), durable=False)
                status_failing = False
            except OSError as e:  # a full disk: the status file is stale, the node trains on
                if not status_failing:
                    log.warning("status file %s not written (%s): `node status` still answers", status_path,
                                e.strerror or e)
                status_failing = True
        # on whole multiples of the period on the clock: the snapshots of several nodes on one
        # machine (the chaos and attack harnesses, a person comparing two nodes) are taken at one
        # instant; the live view redraws every second, so it takes a snapshot every second
        every = 1.0 if progress else cfg.status_every
        await asyncio.sleep(every - time.time() % every)


async def _report(node: Node, setup: Setup, board: Board, last: Callable[[], Status], signalled: bool,
                  lost: list[str]) -> Report:
    """Evaluate the final global model on the held-out bytes and build the report from the
    ``last`` snapshot; the board shows "evaluating" meanwhile, then the report. ``lost``: why
    the node's daemon could not be started again (:func:`keep_daemon`), empty when it ran on."""
    board.current = lambda: replace(last(), state="evaluating")
    status = last()
    final = await asyncio.to_thread(evaluate, setup.global_model(node.committed), setup.heldout)
    start = node.training.stats.heldout_history[0][1]
    reached = status.rounds_with_peers + status.rounds_excluded + status.catchups  # followed the swarm: not alone
    report = Report(**{**vars(status), "state": "stopped"}, start_loss=start, end_loss=final,
                    end_bits_per_byte=bits_per_byte(final, setup.bytes_per_token), heldout_history=node.training.stats.heldout_history,
                    exit_code=DAEMON_LOST_EXIT if lost else node.solo.exit_code(reached, budget_ended=not signalled),
                    exit_reason=lost[0] if lost else None)
    board.current = lambda: replace(report, **board.extra())
    return report


async def _serve(cfg: NodeConfig, name: str, setup: Setup, swarm: Swarm, board: Board, status_path: Path | None,
                 report_path: Path | None, on_ready, progress: bool, manifest: RunManifest | None) -> Report:
    """Train until the budget ends or a signal stops the node, with its status written, its
    record served and its manifest shared meanwhile; then the report (also written to
    ``status_path`` and ``report_path``)."""
    maddrs = await swarm.visible_maddrs()
    _announce(cfg, name, swarm, board, maddrs)
    board.current = lambda: board.connecting(swarm, maddrs)
    setup.log_notes()
    node = Node(setup, swarm)
    node.solo.joined = manifest is not None  # "alone" advice for a joiner of an existing run
    view = SwarmView()
    await serve_record(node, swarm)
    board.current = lambda: snapshot(node, swarm, maddrs, view, board.extra())
    loop = asyncio.get_running_loop()
    signalled: list[bool] = []  # a supervisor stopped the node: it did not end at its budget

    def stop() -> None:
        signalled.append(True)
        node.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, once_per_burst(stop))
    if on_ready is not None:
        on_ready(swarm.peer_id, maddrs)
    lost: list[str] = []  # why the daemon could not be started again (keep_daemon)
    async with asyncio.TaskGroup() as tg:
        background = [tg.create_task(_write_status(cfg, name, board, status_path, progress)),
                      tg.create_task(view.refresh_forever(node, swarm)),
                      tg.create_task(keep_daemon(node, swarm, lost)),
                      tg.create_task(share_manifest(swarm, cfg, manifest))]
        if progress:
            background.append(tg.create_task(live_progress(board)))
        try:
            await node.run()
        finally:
            for task in background:
                task.cancel()
    report = await _report(node, setup, board, lambda: snapshot(node, swarm, maddrs, view, board.extra()),
                           bool(signalled), lost)
    log.info("%s done: held-out loss %.3f -> %.3f %s (%.3f bits/byte), %d rounds, digest %s", name, report.start_loss,
             report.end_loss, report.loss_unit, report.end_bits_per_byte, node.stats.rounds_committed,
             report.global_digest)
    if not report.rounds_with_peers:
        log.warning("%s never merged with another node: its training reached nobody%s", name,
                    f" ({node.solo.alone.detail})" if node.solo.alone else "")
    for path in (status_path, report_path):
        if path is not None:
            try:
                write_json_atomic(path, report.to_json())
            except OSError as e:  # a full disk: the report still goes to the caller (and stdout)
                log.warning("%s not written: %s", path, e.strerror or e)
    return report
