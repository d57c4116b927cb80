"""A running node's status snapshot (``p2pdiloco.status``), built from its collaborators, and
the board that holds the latest one for every reader: the status file, ``node status`` on the
control socket, the metrics endpoint and the live view."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from p2pdiloco.config import NodeConfig
from p2pdiloco.core.outer import run_tokens
from p2pdiloco.data import loss_unit
from p2pdiloco.footprint import peak_rss_mib, rss_mib
from p2pdiloco.manifest import RunManifest
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.status import (Alone, CheckpointError, Checkpoints, Connecting, FragmentStatus, Hardware, Manifest, Outer, Sessions,
                              Snapshot, Starting, Status, SwarmFigures)

from node.committed import global_digest
from node.status_view import progress, swarm_rate
from node.swarm_view import fragment_status
from node.vetting import trusted_records

if TYPE_CHECKING:
    from node.control import ControlServer
    from node.runtime import Node
    from node.setup import Setup

PROCESS_START = psutil.Process().create_time()


def num(x: Any, ndigits: int = 4) -> float | None:
    """A float for JSON: rounded, None for NaN/inf (scripts get valid JSON)."""
    return round(x, ndigits) if isinstance(x, (int, float)) and math.isfinite(x) else None


def hardware(cfg: NodeConfig, setup: Setup | None) -> Hardware:
    """Where the node trains: device, torch threads, resident memory (MiB), its limit and the
    memory estimate shown at start (``p2pdiloco.footprint.Footprint.as_dict``, MiB)."""
    rss = rss_mib()
    return Hardware(device=str(next(setup.model.parameters()).device) if setup else cfg.device, threads=cfg.threads,
                    rss_mib=round(rss), peak_rss_mib=round(peak_rss_mib()), memory_limit_mib=cfg.memory_limit or None,
                    over_memory_limit=bool(cfg.memory_limit and rss > cfg.memory_limit),
                    memory_estimate=setup.footprint.as_dict() if setup and setup.footprint else None)


class SwarmRead(Protocol):
    """The swarm as a node last read it (``node.main.SwarmView``): parsed heads records (None
    before any read), when (Unix s), libp2p connections now, and rejoins so far."""

    records: dict[str, HeadsRecord] | None
    read_at: float | None
    connections: int | None
    rejoins: int


def swarm_summary(view: SwarmRead | None, committed: list, me: str,
                  trusted: Any = None) -> tuple[SwarmFigures | None, list[FragmentStatus]]:
    """(swarm figures, per-fragment status against the swarm's newest heads); no figures
    before the first read. This node's own record counts with what it holds now, not with
    what it last published. With ``trusted`` (the node's Reputation), the heads are those of
    the peers it trusts, as its catch-up chooses them (``node.vetting.trusted_records``),
    while it trusts any."""
    if view is None or view.records is None:
        return None, [FragmentStatus(fragment=st.index, version=st.version, digest=st.short()) for st in committed]
    records = dict(view.records)
    mine = tuple((st.version, st.digest) for st in committed)
    records[me] = replace(records[me], fragments=mine) if me in records else HeadsRecord(mine)
    chosen = trusted_records(records, me, trusted) if trusted is not None else None
    heads, statuses = fragment_status(chosen or records, me, mine)
    frags = [FragmentStatus(fragment=st.index, version=st.version, digest=st.short(),
                            swarm_version=None if head is None else head.version,
                            holders=0 if head is None else len(head.holders), status=status)
             for st, head, status in zip(committed, heads, statuses)]
    figures = SwarmFigures(peers=len(records), learners=sum(1 for r in records.values() if not r.done),
                           newest=[h.version if h else None for h in heads],
                           behind=[f.fragment for f in frags if f.status == "behind"],
                           read_age_s=num(time.time() - view.read_at, 1) if view.read_at else None)
    return figures, frags


def _network(swarm: Swarm, maddrs: list[str], view: SwarmRead | None) -> dict[str, Any]:
    """The transport's figures: addresses, reachability, traffic, sessions, DHT operations."""
    stats = swarm.stats
    return dict(
        peer_id=swarm.peer_id, maddrs=maddrs, reachability=swarm.reach.state(maddrs),
        connections=view.connections if view else None, rejoins=view.rejoins if view else 0,
        reach=swarm.reach.status(stats.bytes_relayed, maddrs), bytes_relayed=stats.bytes_relayed,
        pid=os.getpid(), p2pd_pid=swarm.daemon_pid, p2pd_restarts=swarm.restarts,
        bytes_out=stats.bytes_out, bytes_in=stats.bytes_in, rpc_calls=stats.calls_out, rpc_failed=stats.calls_failed,
        dht_ops=dict(stats.dht), rpc_by_name={k: [n, stats.header_bytes[k]] for k, n in sorted(stats.calls_by.items())},
        sessions=Sessions(open=len(swarm.sessions()), opened=stats.sessions, serving=swarm.server.serving()),
        link_bytes_per_s=round(link) if (link := stats.link.estimate()) else None,
        clock=swarm.clock.status())


def _training(node: Node) -> dict[str, Any]:
    """The training loop's figures (zeros before it runs) and the rounds it took part in."""
    tr = node.training.stats if node.training else None
    st = node.stats
    alone = node.solo.alone
    return dict(
        state=node.state_name(), merging=list(node.committed.in_flight()), started_from=node.started_from,
        checkpoint_error=None if node.checkpoint_error is None else CheckpointError(**node.checkpoint_error),
        alone=None if alone is None else Alone(reason=alone.reason, detail=alone.detail,
                                               since_s=round(time.time() - alone.since, 1)),
        step=tr.step if tr else 0, tokens=tr.tokens if tr else 0,
        tokens_per_s=round(tr.tokens_per_s, 1) if tr else 0.0,
        blocked_s=round(node.training.blocked_s, 2) if node.training else 0.0,
        checkpoint=Checkpoints(count=node.training.checkpoints, last_s=round(node.training.checkpoint_s, 2),
                               max_s=round(node.training.checkpoint_max_s, 2)) if node.training else Checkpoints(),
        loss=num(tr.loss) if tr else None, heldout_loss=num(tr.heldout_loss) if tr else None,
        loss_unit=loss_unit(node.cfg.data.tokenizer),
        heldout_rising=tr.heldout_rising if tr else False,
        rounds_committed=st.rounds_committed, rounds_failed=st.rounds_failed,
        rounds_superseded=node.committed.superseded, rounds_late=st.rounds_late, rounds_alone=st.rounds_alone,
        rounds_excluded=st.rounds_excluded, rounds_with_peers=st.rounds_committed - st.rounds_alone,
        catchups=st.catchups, delta_catchups=node.sync.deltas.catchups if node.sync.deltas else 0,
        resyncs=st.resyncs, tokens_merged=st.tokens_merged, internal_errors=st.internal_errors,
        last_round=st.recent[-1] if st.recent else None,
        recent_rounds=[replace(r, seconds=round(r.seconds, 2)) for r in st.recent[-10:]])


def _defenses(node: Node, swarm: Swarm) -> dict[str, Any]:
    """What the node refused, ignored, banned and trusts (docs/trust.md)."""
    rejected = dict(node.allreducer.stats.rejected)
    return dict(
        gathering_pushes=dict(node.matchmaker.gatherings.stats),
        record_pushes=dict(node.sync.pusher.stats + node.sync.pushes_received),
        rejected=rejected, rejected_total=sum(rejected.values()),
        bans=dict(swarm.bans), ignored=node.sync.strikes.ignoring(), other_settings=node.sync.other_settings(),
        passed_over=node.matchmaker.passing_over(), ignored_groups=node.matchmaker.ignoring_groups(),
        avoided=node.matchmaker.avoiding(), refused_states=node.sync.refused_states,
        trusted={p: node.reputation.score(p) for p in sorted(node.reputation.trusted_peers())},
        blocked=swarm.blocking(), refused=dict(swarm.refused),
        dropped=dict(swarm.dropped), dropped_total=sum(swarm.drop_reasons.values()),
        dropped_reasons=dict(swarm.drop_reasons),
        allreduce={k: v for k, v in vars(node.allreducer.stats).items() if type(v) is int})


def snapshot(node: Node, swarm: Swarm, maddrs: list[str], view: SwarmRead | None = None,
             extra: dict[str, Any] | None = None) -> Status:
    """The node's figures as one :class:`~p2pdiloco.status.Status`: the status file, the report,
    `node status`, the metrics endpoint and the live view all read it. ``extra``: the board's
    keys (:meth:`Board.extra`: uptime_s, control_socket, metrics, manifest)."""
    extra = extra or {}
    swarm_figures, fragments = swarm_summary(view, node.committed, swarm.peer_id, node.reputation)
    maddrs = swarm.reach.maddrs or maddrs  # refreshed by the swarm view (a relay slot adds one)
    manifest = extra.get("manifest")
    figures = dict(
        name=node.setup.name, run_id=node.cfg.swarm.run_id, uptime_s=round(time.time() - PROCESS_START, 1),
        **_network(swarm, maddrs, view), **_training(node), **_defenses(node, swarm),
        fragments=[[s.version, s.short()] for s in node.committed], fragment_status=fragments, swarm=swarm_figures,
        global_digest=global_digest(node.committed), time=round(time.time(), 3), hardware=hardware(node.cfg, node.setup),
        outer=Outer(**{k: getattr(node.cfg.outer, k) for k in ("fragments", "sync_every", "lr", "momentum",
                                                               "wire_precision", "error_feedback_decay", "min_quorum")}),
        progress=progress(run_tokens(node.committed), node.stats.tokens_merged,
                          manifest.target_tokens if manifest else 0, swarm_rate(view.records) if view else None))
    return Status(**{**figures, **extra})


class Board:
    """What a running node shows: ``current()`` builds a fresh snapshot (event loop only);
    ``latest`` is the one built last second, safe to read from other threads (metrics)."""

    def __init__(self, cfg: NodeConfig, name: str, control: ControlServer, manifest: RunManifest | None = None):
        self.cfg, self.name, self.control = cfg, name, control
        self.manifest = None if manifest is None else Manifest(digest=manifest.digest, owner=manifest.owner_id,
                                                               target_tokens=manifest.target_tokens)
        self.metrics_url = f"http://{cfg.metrics_host}:{cfg.metrics_port}/metrics" if cfg.metrics_port else None
        self.current: Callable[[], Snapshot] = self.starting
        self.latest: Snapshot = self.starting()

    def extra(self) -> dict[str, Any]:
        """The keys the board adds to every form: uptime_s, control_socket, metrics, manifest."""
        return {"uptime_s": round(time.time() - PROCESS_START, 1), "control_socket": str(self.control.path),
                "metrics": self.metrics_url, "manifest": self.manifest}

    def starting(self) -> Starting:
        return Starting(name=self.name, run_id=self.cfg.swarm.run_id, state="starting", pid=os.getpid(),
                        **self.extra())

    def connecting(self, swarm: Swarm, maddrs: list[str]) -> Connecting:
        """A starting node whose transport is up."""
        return Connecting(**vars(self.starting()), peer_id=swarm.peer_id, p2pd_pid=swarm.daemon_pid, maddrs=maddrs,
                          reachability=swarm.reach.state(maddrs),
                          reach=swarm.reach.status(swarm.stats.bytes_relayed, maddrs))

    def refresh(self) -> Snapshot:
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
