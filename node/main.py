"""Run one node: start the transport, build the learner, train, report. Used by the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from p2pdiloco.atomic import write_json_atomic
from p2pdiloco.config import NodeConfig, SwarmConfig
from p2pdiloco.core.outer import run_tokens
from p2pdiloco.data import bits_per_byte, evaluate
from p2pdiloco.errors import ConfigError, NetworkError, P2PDilocoError
from p2pdiloco.footprint import check_memory, rss_mib
from p2pdiloco import owners
from p2pdiloco.manifest import RunManifest, published, run_settings
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.status import Status

from node.alone import DAEMON_LOST_EXIT, START_ALONE_HINT
from node.checkpoint import save_node_config
from node.committed import global_digest
from node.control import ControlServer, start_metrics
from node.runtime import Node
from node.status_view import RECORD_RPC, progress, swarm_rate
from node.setup import Setup
from node.swarm_view import fragment_status
from node.vetting import trusted_records

if TYPE_CHECKING:
    from p2pdiloco.trust import NodeTrust

log = logging.getLogger(__name__)

PROCESS_START = psutil.Process().create_time()




def _num(x: Any, ndigits: int = 4) -> float | None:
    """A float for JSON: rounded, None for NaN/inf (scripts get valid JSON)."""
    return round(x, ndigits) if isinstance(x, (int, float)) and math.isfinite(x) else None


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

    def summary(self, committed: list, me: str, trusted: Any = None) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """(swarm figures, per-fragment status against the swarm's newest heads). This node's
        own record counts with what it holds now, not with what it last published. With
        ``trusted`` (the node's Reputation), the heads are those of the peers it trusts, as its
        catch-up chooses them (``node.vetting.trusted_records``), while it trusts any."""
        frags = [{"fragment": st.index, "version": st.version, "digest": st.short(), "swarm_version": None,
                  "holders": 0, "status": "unknown"} for st in committed]
        if self.records is None:
            return None, frags
        records = dict(self.records)
        mine = tuple((st.version, st.digest) for st in committed)
        records[me] = replace(records[me], fragments=mine) if me in records else HeadsRecord(mine)
        chosen = trusted_records(records, me, trusted) if trusted is not None else None
        heads, statuses = fragment_status(chosen or records, me, mine)
        for f, head, status in zip(frags, heads, statuses):
            f["status"] = status
            if head is not None:
                f.update(swarm_version=head.version, holders=len(head.holders))
        now = time.time()
        return {
            "peers": len(records),
            "learners": sum(1 for r in records.values() if not r.done),
            "newest": [h.version if h else None for h in heads],
            "behind": [f["fragment"] for f in frags if f["status"] == "behind"],
            "read_age_s": _num(now - self.read_at, 1) if self.read_at else None,
        }, frags


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


def snapshot(node: Node, swarm: Swarm, maddrs: list[str], view: SwarmView | None = None,
             extra: dict[str, Any] | None = None) -> Status:
    """The node's figures as one JSON-able dict: the status file, the report, `node status`,
    the metrics endpoint and the live view all read it. Its keys and types: ``p2pdiloco.status``."""
    tr = node.training.stats if node.training else None
    st = node.stats
    swarm_figures, fragments = (view or SwarmView()).summary(node.committed, swarm.peer_id, node.reputation)
    in_flight = list(node.committed.in_flight())
    rejected = dict(node.allreducer.stats.rejected)
    maddrs = swarm.reach.maddrs or maddrs  # refreshed by the swarm view (a relay slot adds one)
    return {
        "name": node.setup.name, "run_id": node.cfg.swarm.run_id, "peer_id": swarm.peer_id, "maddrs": maddrs,
        "reachability": swarm.reach.state(maddrs), "connections": view.connections if view else None,
        "rejoins": view.rejoins if view else 0,
        "reach": swarm.reach.status(swarm.stats.bytes_relayed, maddrs), "bytes_relayed": swarm.stats.bytes_relayed,
        "pid": os.getpid(), "p2pd_pid": swarm.daemon_pid, "p2pd_restarts": swarm.restarts,
        "state": node.state_name(),
        "checkpoint_error": node.checkpoint_error, "started_from": node.started_from,
        "alone": None if node.solo.alone is None else {"reason": node.solo.alone.reason,
                                                       "detail": node.solo.alone.detail,
                                                       "since_s": round(time.time() - node.solo.alone.since, 1)},
        "merging": in_flight, "uptime_s": round(time.time() - PROCESS_START, 1),
        "step": tr.step if tr else 0, "tokens": tr.tokens if tr else 0,
        "tokens_per_s": round(tr.tokens_per_s, 1) if tr else 0.0,
        "blocked_s": round(node.training.blocked_s, 2) if node.training else 0.0,
        "loss": _num(tr.loss) if tr else None, "heldout_loss": _num(tr.heldout_loss) if tr else None,
        "heldout_rising": tr.heldout_rising if tr else False,
        "rounds_committed": st.rounds_committed, "rounds_failed": st.rounds_failed,
        "rounds_superseded": node.committed.superseded,
        "rounds_late": st.rounds_late, "rounds_alone": st.rounds_alone, "rounds_excluded": st.rounds_excluded,
        "rounds_with_peers": st.rounds_committed - st.rounds_alone,
        "catchups": st.catchups, "delta_catchups": node.sync.deltas.catchups if node.sync.deltas else 0,
        "resyncs": st.resyncs, "tokens_merged": st.tokens_merged,
        "last_round": vars(st.recent[-1]) if st.recent else None,
        "recent_rounds": [{**vars(r), "seconds": round(r.seconds, 2)} for r in st.recent[-10:]],
        "bytes_out": swarm.stats.bytes_out, "bytes_in": swarm.stats.bytes_in,
        "rpc_calls": swarm.stats.calls_out, "rpc_failed": swarm.stats.calls_failed, "dht_ops": dict(swarm.stats.dht),
        "rpc_by_name": {k: [n, swarm.stats.header_bytes[k]] for k, n in sorted(swarm.stats.calls_by.items())},
        "sessions": {"open": len(swarm.sessions()), "opened": swarm.stats.sessions, "serving": swarm.server.serving()},
        "gathering_pushes": dict(node.matchmaker.gatherings.stats),
        "record_pushes": dict(node.sync.pusher.stats + node.sync.pushes_received),
        "link_bytes_per_s": round(link) if (link := swarm.stats.link.estimate()) else None,
        "rejected": rejected, "rejected_total": sum(rejected.values()),
        "bans": dict(swarm.bans), "ignored": node.sync.strikes.ignoring(), "other_settings": node.sync.other_settings(),
        "passed_over": node.matchmaker.passing_over(), "ignored_groups": node.matchmaker.ignoring_groups(),
        "avoided": node.matchmaker.avoiding(),
        "refused_states": node.sync.refused_states,
        "trusted": {p: node.reputation.score(p) for p in sorted(node.reputation.trusted_peers())},
        "blocked": swarm.blocking(), "refused": dict(swarm.refused),
        "dropped": dict(swarm.dropped), "dropped_total": sum(swarm.drop_reasons.values()),
        "dropped_reasons": dict(swarm.drop_reasons), "internal_errors": st.internal_errors,
        "allreduce": {k: v for k, v in vars(node.allreducer.stats).items() if type(v) is int},
        "fragments": [[s.version, s.short()] for s in node.committed],
        "fragment_status": fragments, "swarm": swarm_figures,
        "global_digest": global_digest(node.committed), "time": round(time.time(), 3),
        "hardware": hardware(node.cfg, node.setup),
        "outer": {k: getattr(node.cfg.outer, k) for k in ("fragments", "sync_every", "lr", "momentum", "wire_precision",
                                                          "error_feedback_decay", "min_quorum")},
        "progress": progress(run_tokens(node.committed), st.tokens_merged,
                             ((extra or {}).get("manifest") or {}).get("target_tokens", 0),
                             swarm_rate(view.records) if view else None), "clock": swarm.clock.status(),
        **(extra or {}),
    }


class Board:
    """What a running node shows: ``current()`` builds a fresh snapshot (event loop only);
    ``latest`` is the one built last second, safe to read from other threads (metrics)."""

    def __init__(self, cfg: NodeConfig, name: str, control: ControlServer, manifest: RunManifest | None = None):
        self.cfg, self.name, self.control = cfg, name, control
        self.manifest = None if manifest is None else {"digest": manifest.digest, "owner": manifest.owner_id,
                                                       "target_tokens": manifest.target_tokens}
        self.metrics_url = f"http://{cfg.metrics_host}:{cfg.metrics_port}/metrics" if cfg.metrics_port else None
        self.current: Callable[[], dict[str, Any]] = self.starting
        self.latest: dict[str, Any] = self.starting()

    def extra(self) -> dict[str, Any]:
        return {"uptime_s": round(time.time() - PROCESS_START, 1), "control_socket": str(self.control.path),
                "metrics": self.metrics_url, "manifest": self.manifest}

    def starting(self) -> dict[str, Any]:
        return {"name": self.name, "run_id": self.cfg.swarm.run_id, "state": "starting", "pid": os.getpid(),
                **self.extra()}

    def refresh(self) -> dict[str, Any]:
        self.latest = self.current()
        return self.latest


async def live_progress(board: Board) -> None:
    """Redraw the node's status in its terminal every second (rich); log lines scroll above."""
    from rich.live import Live  # noqa: PLC0415

    from node.status_view import render_live  # noqa: PLC0415

    handlers = [h for h in logging.getLogger().handlers
                if isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr, sys.stdout)]
    streams = [h.stream for h in handlers]
    with Live(render_live(board.latest), refresh_per_second=2, redirect_stderr=True, redirect_stdout=True) as live:
        for h in handlers:  # through rich's proxy, so log lines print above the live view
            h.setStream(sys.stderr)
        try:
            while True:
                await asyncio.sleep(1.0)
                live.update(render_live(board.latest))
        finally:
            for h, stream in zip(handlers, streams):
                h.setStream(stream)


def hardware(cfg: NodeConfig, setup: Setup | None) -> dict[str, Any]:
    """Where the node trains: device, torch threads, resident memory (MiB) and its limit."""
    rss = rss_mib()
    return {"device": str(next(setup.model.parameters()).device) if setup else cfg.device, "threads": cfg.threads,
            "rss_mib": round(rss), "memory_limit_mib": cfg.memory_limit or None,
            "over_memory_limit": bool(cfg.memory_limit and rss > cfg.memory_limit)}


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
                   manifest: RunManifest | None = None) -> dict[str, Any]:
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
    control.provider = lambda: board.current()
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
        checked = await asyncio.to_thread(check_memory, cfg)
        setup = await asyncio.to_thread(Setup.build, cfg, name, trust.identity.peer_id)
        if not checked:  # a factory model that cannot be built on the meta device: its count now
            check_memory(cfg, sum(p.numel() for p in setup.model.parameters()))
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
    reachability ``auto`` a node that its initial peers could not dial back starts p2pd again
    forced private, to reserve a relay slot (``p2pdiloco.net.transport.reachability``); the check's
    verdict stays in ``swarm.reach``. Raises what :meth:`Swarm.start` raises."""
    args = dict(initial_peers=sw.initial_peers, host_maddrs=[f"/ip4/{sw.host}/tcp/{sw.port}"], announce_maddrs=sw.announce,
                identity=trust.identity, membership=trust.membership, admission_key=f"{sw.run_id}/heads", relay=sw.relay)
    swarm = await Swarm.start(**args, reachability=sw.reachability)
    if sw.reachability != "auto" or swarm.reach.verdict != "unreachable" or not sw.relay:
        return swarm
    log.info("peers cannot dial this node (seen as %s): restarting p2pd to reserve a slot on a relay",
             swarm.reach.observed)
    checked = swarm.reach
    await swarm.shutdown()
    swarm = await Swarm.start(**args, reachability="private")
    swarm.reach = replace(checked, restarted=True, maddrs=await swarm.visible_maddrs())
    return swarm


async def _serve(cfg: NodeConfig, name: str, setup: Setup, swarm: Swarm, board: Board, status_path: Path | None,
                 report_path: Path | None, on_ready, progress: bool, manifest: RunManifest | None) -> dict[str, Any]:
    maddrs = await swarm.visible_maddrs()
    where = f"--data-dir {cfg.data_dir}" if cfg.data_dir else f"--socket {board.control.path}"
    log.info("%s: status with `p2pdiloco node status %s`%s", name, where,
             f"; Prometheus metrics on {board.metrics_url}" if board.metrics_url else "")
    if swarm.reach.state(maddrs) == "loopback only":
        log.warning("%s: only loopback addresses are announced (%s); peers on other machines cannot dial this "
                    "node: use --host 0.0.0.0, or --set swarm.announce=/ip4/PUBLIC_IP/tcp/PORT behind NAT",
                    name, ", ".join(maddrs))
    board.current = lambda: {**board.starting(), "peer_id": swarm.peer_id, "p2pd_pid": swarm.daemon_pid,
                             "maddrs": maddrs, "reachability": swarm.reach.state(maddrs),
                             "reach": swarm.reach.status(swarm.stats.bytes_relayed, maddrs)}
    setup.log_notes()
    if not cfg.swarm.initial_peers:
        log.warning("%s: %s", name, START_ALONE_HINT)
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

    async def write_status() -> None:
        warned = status_failing = False
        while True:
            board.refresh()
            hw = board.latest.get("hardware") or {}
            if hw.get("over_memory_limit") and not warned:
                warned = True
                log.warning("%s uses %s MiB, over its memory_limit of %s MiB: lower data.batch_size or use a smaller "
                            "model", name, hw["rss_mib"], hw["memory_limit_mib"])
            if status_path is not None:
                try:
                    await asyncio.to_thread(write_json_atomic, status_path, board.latest, durable=False)
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

    lost: list[str] = []  # why the daemon could not be started again (keep_daemon)
    async with asyncio.TaskGroup() as tg:
        background = [tg.create_task(write_status()), tg.create_task(view.refresh_forever(node, swarm)),
                      tg.create_task(keep_daemon(node, swarm, lost)),
                      tg.create_task(share_manifest(swarm, cfg, manifest))]
        if progress:
            background.append(tg.create_task(live_progress(board)))
        try:
            await node.run()
        finally:
            for task in background:
                task.cancel()
    board.current = lambda: {**snapshot(node, swarm, maddrs, view, board.extra()), "state": "evaluating"}
    report = snapshot(node, swarm, maddrs, view, board.extra())
    final = await asyncio.to_thread(evaluate, setup.global_model(node.committed), setup.heldout)
    start = node.training.stats.heldout_history[0][1]
    report.update(start_loss=start, end_loss=final, end_bits_per_byte=bits_per_byte(final),
                  heldout_history=node.training.stats.heldout_history, state="stopped")
    board.current = lambda: {**report, **board.extra()}
    log.info("%s done: held-out loss %.3f -> %.3f nats/byte, %d rounds, digest %s",
             name, start, final, node.stats.rounds_committed, report["global_digest"])
    reached = report["rounds_with_peers"] + report["rounds_excluded"] + report["catchups"]  # followed the swarm: not alone
    report["exit_code"] = DAEMON_LOST_EXIT if lost else node.solo.exit_code(reached, budget_ended=not signalled)
    report["exit_reason"] = lost[0] if lost else None
    if not report["rounds_with_peers"]:
        log.warning("%s never merged with another node: its training reached nobody%s", name,
                    f" ({node.solo.alone.detail})" if node.solo.alone else "")
    for path in (status_path, report_path):
        if path is not None:
            try:
                write_json_atomic(path, report)
            except OSError as e:  # a full disk: the report still goes to the caller (and stdout)
                log.warning("%s not written: %s", path, e.strerror or e)
    return report
