"""Terminal views of a node and of a swarm (rich): ``p2pdiloco node status``, the node's live
progress, and ``p2pdiloco swarm status``.

A node's view renders its snapshot (``p2pdiloco.status``, built by ``node.snapshot.snapshot``
and served on its control socket) by attribute; the swarm's view renders the records nodes
publish under ``{run}/heads`` in the DHT. Only
:func:`read_swarm` touches the network (it imports the transport lazily, so ``node status``
stays fast).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from p2pdiloco.status import Connecting, Progress, Snapshot, Status

from node.formatting import fmt_age, fmt_bytes, fmt_count, fmt_link, fmt_num, plural

LOOPBACK_HINT = ("only loopback addresses are announced: peers on other machines cannot dial this node; "
                 "restart it with --host 0.0.0.0, or --set swarm.announce=/ip4/PUBLIC_IP/tcp/PORT behind NAT")
PRIVATE_HINT = ("only private-network addresses are announced: peers outside this network cannot dial this node; "
                "behind NAT forward the port and --set swarm.announce=/ip4/PUBLIC_IP/tcp/PORT")

# robust merge, step 3 (docs/trust.md): honest learners of different speeds bring Δs of different norms
CLIPPED_NOTE = (" (clipped: peers' tensors trimmed to the group's median norm, routine between learners of "
                "different speed, not an attack)")


def swarm_rate(records: dict[str, Any] | None) -> float | None:
    """Tokens/s of the live nodes among parsed heads ``records`` (their published rates); None
    before any read."""
    return None if records is None else sum(r.tps for r in records.values() if not r.done)


def progress(merged: int, mine: float | None, target: int, rate: float | None) -> Progress:
    """The run's progress: ``merged`` tokens the swarm merged into the global model
    (``core.outer.run_tokens``), ``mine`` of them one node's own (None: no node's view),
    ``target`` the run's target in tokens (its manifest; 0: none), ``rate`` the swarm's
    tokens/s (:func:`swarm_rate`). Returns tokens, target_tokens, done (fraction of the
    target), tokens_per_s, eta_s (seconds to the target at that rate) and share (the node's
    fraction of the merged tokens); None where unknown."""
    from node.swarm_view import share  # noqa: PLC0415  (the one rule; `node status` stays light)

    left = max(0, target - merged) if target else None
    return Progress(tokens=merged, target_tokens=target or None,
                    done=round(min(1.0, merged / target), 4) if target else None,
                    tokens_per_s=round(rate, 1) if rate is not None else None,
                    eta_s=round(left / rate) if left is not None and rate else (0 if left == 0 else None),
                    share=share(mine, merged))


def progress_text(p: Progress | None, alone: bool = False) -> str:
    """One line of the run's progress (``progress`` of a node's snapshot), "" when unknown;
    ``alone``: the node merges with no other node (its ``alone`` is set), so nothing it counts
    is the swarm's."""
    if p is None or not p.tokens:
        return ""
    if alone:
        return f"{fmt_count(p.tokens)} tokens merged, by this node alone: it contributes to no swarm"
    text = f"{fmt_count(p.tokens)} tokens merged swarm-wide"
    if p.target_tokens:
        text += f", {100 * (p.done or 0):.1f}% of the run's {fmt_count(p.target_tokens)}"
        text += f" (about {fmt_age(p.eta_s)} left)" if p.eta_s is not None else ""
    if p.tokens_per_s is not None:
        text += f"; swarm {fmt_num(p.tokens_per_s, ',.0f')} tokens/s"
    if p.share is not None:
        text += f"; this node's share {100 * p.share:.1f}%"
    return text


def state_text(s: Snapshot) -> str:
    merging = s.merging if isinstance(s, Status) else []
    if merging and s.state == "training":
        return f"training, merging {', '.join(f'f{p}' for p in merging)}"
    return s.state


def address_warning(reachability: str) -> str | None:
    return LOOPBACK_HINT if reachability == "loopback only" else \
        PRIVATE_HINT if reachability == "direct, private network only" else None


# ---- node status ----------------------------------------------------------------------------
def _fragments_table(s: Status) -> Table:
    t = Table(title="fragments", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("fragment", "version", "swarm newest", "holders", "digest", "status"):
        t.add_column(col, justify="right" if col in ("fragment", "version", "swarm newest", "holders") else "left")
    styles = {"newest": "green", "behind": "yellow", "ahead": "cyan"}
    for f in s.fragment_status:
        t.add_row(str(f.fragment), str(f.version), "-" if f.swarm_version is None else str(f.swarm_version),
                  str(f.holders), f.digest, Text(f.status, style=styles.get(f.status, "")))
    return t


def _rounds_table(s: Status) -> Table:
    t = Table(title="recent rounds (newest last)", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("fragment", "version", "members", "seconds", "outcome"):
        t.add_column(col, justify="left" if col == "outcome" else "right")
    for r in s.recent_rounds:
        outcome = Text("committed", style="green") if r.committed else \
            Text(f"discarded: {r.reason or 'no result'}", style="yellow")
        t.add_row(f"f{r.fragment}", str(r.version), str(r.members), fmt_num(r.seconds, ".2f"), outcome)
    return t


def _reach_line(s: Connecting | Status) -> str:
    """How peers dial the node: its reachability, connections, relays and dial-back check."""
    conns, reach = s.connections if isinstance(s, Status) else None, s.reach
    line = s.reachability + ("" if conns is None else f"   ({plural(conns, 'connection')} now)")
    if reach.get("relays"):
        line += f"   relay {', '.join(r[-8:] for r in reach['relays'])}, {fmt_bytes(reach.get('bytes_relayed'))} relayed"
    if reach.get("check") in ("reachable", "unreachable"):
        line += f"   (dial-back check by {plural(len(reach.get('checked_by') or []), 'peer')}: {reach['check']}" \
                + (f", seen as {reach['observed']})" if reach.get("observed") else ")")
    return line


def _network_rows(g: Table, s: Connecting | Status) -> None:
    """Peer ID, addresses, reachability (with advice and warnings)."""
    if s.peer_id:
        g.add_row("peer ID", s.peer_id)
    if s.maddrs:
        g.add_row("addresses", "\n".join(s.maddrs))
    if s.reachability:
        g.add_row("reachability", _reach_line(s))
        if s.reach.get("advice"):
            g.add_row(Text("advice", style="bold yellow"), Text(s.reach["advice"], style="yellow"))
    warning = address_warning(s.reachability)
    if warning:
        g.add_row(Text("warning", style="bold yellow"), Text(warning, style="yellow"))


def _run_rows(g: Table, s: Status) -> None:
    """Alone, the swarm as read, the run's progress, hardware and outer settings."""
    if s.alone is not None:
        g.add_row(Text("alone", style="bold red"),
                  Text(f"merged with nobody for {fmt_age(s.alone.since_s)}: {s.alone.detail}", style="red"))
    if s.swarm is not None:
        where = ("merging with no other node" if s.alone is not None else
                 f"behind on {', '.join(f'f{p}' for p in s.swarm.behind)}" if s.swarm.behind else "up to date")
        g.add_row("swarm", f"{plural(s.swarm.peers, 'node')} with a live record, {s.swarm.learners} training; "
                           f"this node is {where} (read {fmt_age(s.swarm.read_age_s)} ago)")
    else:
        g.add_row("swarm", "not read yet")
    if progress_text(s.progress, s.alone is not None):
        g.add_row("run progress", progress_text(s.progress, s.alone is not None))
    hw = s.hardware
    limit = f" of {hw.memory_limit_mib} MiB allowed" if hw.memory_limit_mib else ""
    g.add_row(Text("hardware", style="bold yellow" if hw.over_memory_limit else "bold"),
              f"{hw.device}, {plural(hw.threads or 1, 'CPU thread')}, {hw.rss_mib} MiB resident{limit}")
    out = s.outer
    feedback = f" (error feedback decay {out.error_feedback_decay})" if out.wire_precision != "fp32" else ""
    g.add_row("outer", f"{out.wire_precision} on the wire{feedback}, a round every {out.sync_every} "
                       f"inner steps per fragment, {out.fragments} fragments, lr {out.lr}, "
                       f"momentum {out.momentum}, quorum {out.min_quorum}")


def _training_rows(g: Table, s: Status) -> None:
    """Training, loss, rounds, rejections, all-reduce, traffic and the global digest."""
    g.add_row("training", f"inner step {s.step}   {fmt_count(s.tokens)} tokens   "
                          f"{fmt_num(s.tokens_per_s, ',.0f')} tokens/s")
    g.add_row("loss", f"training {fmt_num(s.loss)}   held-out {fmt_num(s.heldout_loss)} ({s.loss_unit})")
    g.add_row("rounds", f"{s.rounds_committed} committed ({s.rounds_alone} alone), "
                        f"{s.rounds_failed} failed ({s.rounds_superseded} superseded), {s.rounds_late} late, "
                        f"{s.rounds_excluded} excluded (kept); "
                        f"{s.catchups} catch-ups; {fmt_count(s.tokens_merged)} of its tokens merged")
    g.add_row("rejected", ", ".join(f"{n} {reason}" for reason, n in sorted(s.rejected.items()) if n) or "none")
    if s.allreduce:
        g.add_row("all-reduce", ", ".join(f"{n} {k}" for k, n in s.allreduce.items())
                  + (CLIPPED_NOTE if s.allreduce.get("clipped") else ""))
    g.add_row("traffic", f"sent {fmt_bytes(s.bytes_out)}   received {fmt_bytes(s.bytes_in)}   "
                         f"({s.rpc_calls} calls, {s.rpc_failed} failed)   link {fmt_link(s.link_bytes_per_s)}")
    if s.global_digest:
        g.add_row("global digest", s.global_digest)


def node_lines(s: Snapshot) -> Table:
    """The key/value summary of one node's snapshot."""
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold", no_wrap=True)
    g.add_column(overflow="fold")
    g.add_row("node", f"{s.name} (run {s.run_id or '?'})")
    if s.manifest is not None:
        g.add_row("run manifest", f"digest {s.manifest.digest}, owner {s.manifest.owner}")
    g.add_row("state", state_text(s))
    p2pd = s.p2pd_pid if isinstance(s, (Connecting, Status)) else None
    g.add_row("uptime", f"{fmt_age(s.uptime_s)}   pid {s.pid or '-'}   p2pd pid {p2pd or '-'}")
    clock = s.clock if isinstance(s, Status) else {}
    if clock and not clock.get("synced", True):
        from p2pdiloco.net.transport.clock import describe  # noqa: PLC0415

        g.add_row("clock", Text(f"{describe(clock.get('measured_s', 0.0))} the swarm's ({clock.get('peers')} peers); "
                                f"using the swarm's time; turn on time sync (timedatectl set-ntp true)",
                                style="yellow"))
    if isinstance(s, (Connecting, Status)):
        _network_rows(g, s)
    if isinstance(s, Status):
        _run_rows(g, s)
        _training_rows(g, s)
    g.add_row("control", (s.control_socket or "-") + (f"   metrics {s.metrics}" if s.metrics else ""))
    return g


def render_node(s: Snapshot) -> RenderableType:
    """``p2pdiloco node status``: summary, fragments against the swarm, recent rounds."""
    parts: list[RenderableType] = [node_lines(s)]
    if isinstance(s, Status) and s.fragment_status:
        parts += [Text(""), _fragments_table(s)]
    if isinstance(s, Status) and s.recent_rounds:
        parts += [Text(""), _rounds_table(s)]
    return Group(*parts)


def render_live(s: Snapshot) -> RenderableType:
    """The node's own terminal: one compact table, redrawn every second."""
    t = Table(show_edge=True, title=f"p2pdiloco {s.name} (run {s.run_id or '?'})")
    for col in ("state", "step", "tokens/s", "loss", "held-out", "rounds", "versions (swarm)", "peers", "sent/recv",
                "uptime"):
        t.add_column(col)
    if not isinstance(s, Status):
        t.add_row(state_text(s), "0", "-", "-", "-", "0/0 failed", "-", "-", "-/-", fmt_age(s.uptime_s))
        return t
    versions = " ".join(f"{f.version}" + (f"({f.swarm_version})" if f.status == "behind" else "")
                        for f in s.fragment_status) or "-"
    t.add_row(state_text(s), str(s.step), fmt_num(s.tokens_per_s, ",.0f"), fmt_num(s.loss),
              fmt_num(s.heldout_loss), f"{s.rounds_committed}/{s.rounds_failed} failed", versions,
              str(s.swarm.peers if s.swarm else "-"), f"{fmt_bytes(s.bytes_out)}/{fmt_bytes(s.bytes_in)}",
              fmt_age(s.uptime_s))
    lines: list[RenderableType] = [t]
    if progress_text(s.progress, s.alone is not None):
        lines.append(Text(progress_text(s.progress, s.alone is not None)))
    if s.alone is not None:  # a volunteer must not miss that the node contributes nothing
        lines.append(Text(f"ALONE for {fmt_age(s.alone.since_s)}: {s.alone.detail}", style="bold red"))
    return Group(*lines) if len(lines) > 1 else t


# ---- swarm status ---------------------------------------------------------------------------
def summarize_swarm(run_id: str, records: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """Every peer's record and the swarm's newest fragment versions, as one JSON-able dict.
    Records are parsed at the one boundary (``p2pdiloco.net.records.parse.parse_heads``); those that
    do not parse, or list another fragment count than most, are counted as ``malformed``;
    those published more than ``STORE_EVERY_S`` + 60 seconds before ``now`` (Unix seconds of the
    swarm's time, ``Swarm.clock``; default this machine's clock) as ``gone``: a live node stores
    its record that often (on a publish, every 5 s), and the DHT keeps records for ``HEAD_TTL``
    and longer, for nodes whose clocks are ahead."""
    from p2pdiloco.net.records.pushes import stale_after  # noqa: PLC0415
    from p2pdiloco.net.records.parse import parse_many, parse_heads  # noqa: PLC0415
    from p2pdiloco.net.state.heads_records import STORE_EVERY_S  # noqa: PLC0415

    from node.swarm_view import fragment_status, share  # noqa: PLC0415  (the rule `node status` uses)

    now = time.time() if now is None else now
    # only records under a peer ID count: the DHT accepts those only when signed by that peer
    good, _ = parse_many(records, parse_heads, None)
    sizes = Counter(len(r.fragments) for r in good.values())
    n = max(sizes, key=lambda k: (sizes[k], k)) if sizes else 0
    good = {p: r for p, r in good.items() if len(r.fragments) == n}
    malformed = len(records) - len(good)
    # gone as a node's first read counts it (StateSync._live): a stored record missed a store by
    # more than its author's heartbeat allows
    good = {p: r for p, r in good.items() if now - r.t <= STORE_EVERY_S + stale_after(r.beat)}
    peers, newest = [], [None] * n
    for peer, r in sorted(good.items(), key=lambda kv: kv[1].name):
        heads, statuses = fragment_status(good, peer, r.fragments)  # judged from its own seat, as it judges
        newest = [max((v for v in (old, h and h.version) if v is not None), default=None)
                  for old, h in zip(newest, heads)]
        peers.append({
            "peer_id": peer, "name": r.name, "state": r.state, "done": r.done, "step": r.step, "reach": r.reach,
            "tokens_per_s": r.tps, "loss": r.loss, "versions": [f[0] if f else None for f in r.fragments],
            "tokens_merged": r.mine, "share": share(r.mine, r.merged), "status": statuses,
            "behind": [p for p, st in enumerate(statuses) if st == "behind"], "last_seen_s": round(now - r.t, 1),
        })
    # the highest median of the nodes' counts: one peer claiming a giant count moves it no further
    merged = statistics.median_high([r.merged for r in good.values()]) if good else 0
    return {"run_id": run_id, "peers": peers, "newest": newest,
            "malformed": malformed, "gone": len(records) - malformed - len(good),
            "progress": {"tokens": merged, "tokens_per_s": round(swarm_rate(good), 1),
                         "shares": {p: s for p, r in good.items() if (s := share(r.mine, r.merged)) is not None}}}


def render_swarm(view: dict[str, Any]) -> RenderableType:
    peers = view["peers"]
    training = sum(1 for p in peers if not p["done"])
    t = Table(title=f"swarm {view['run_id']}: {plural(len(peers), 'node')} with a live record, {training} training",
              title_justify="left")
    for col in ("peer", "name", "state", "reachability", "step", "tokens/s", "loss", "share", "fragment versions",
                "last seen"):
        t.add_column(col, justify="right" if col in ("step", "tokens/s", "loss", "share", "last seen") else "left")
    for p in peers:
        versions = Text()
        for i, v in enumerate(p["versions"]):
            versions.append(("" if i == 0 else " ") + str(v), style="yellow" if i in p["behind"] else "")
        t.add_row("…" + p["peer_id"][-8:], str(p.get("name") or "-"), str(p.get("state") or "-"),
                  str(p.get("reach") or "-"), str(p.get("step", "-")),
                  fmt_num(p.get("tokens_per_s"), ",.0f"), fmt_num(p.get("loss")),
                  fmt_num(100 * p["share"], ".1f") + "%" if isinstance(p.get("share"), (int, float)) else "-", versions,
                  f"{fmt_age(p.get('last_seen_s'))} ago")
    notes = [Text(f"newest fragment versions: {' '.join(str(v) for v in view['newest']) or '-'}"
                  "   (yellow: behind the newest, as the node itself counts it; share: of the tokens merged "
                  "into its states, its own, as `node status` shows)")]
    swarm_progress = Progress.from_json(view["progress"]) if view.get("progress") else None  # "shares" left out
    if progress_text(swarm_progress):
        notes.append(Text(progress_text(swarm_progress)))
    for m in view.get("manifests") or []:
        notes.append(Text(f"run manifest {m['digest']} by {m['owner']}"))
    if view.get("malformed"):
        notes.append(Text(f"{view['malformed']} malformed records ignored", style="yellow"))
    return Group(t, *notes)


RECORD_RPC = "st.record"  # a node's record as it stands now (node.main.serve_record)
ASK_AT_MOST, ASK_TIMEOUT_S = 64, 3.0  # nodes asked for their current record, seconds for all answers


async def _fresh_records(swarm: Any, run_id: str, stored: dict[str, Any]) -> dict[str, Any]:
    """``stored`` (the DHT's {peer ID: record}, each up to ``STORE_EVERY_S`` old) with the
    record each of up to ``ASK_AT_MOST`` of those peers gives for itself now (``st.record``,
    ``node.main.serve_record``), where it parses and is newer; a peer that does not answer
    within ``ASK_TIMEOUT_S`` keeps its stored record. The answer is bounded by the transport's
    reply limit and parsed at the one boundary (``net.records.parse.parse_heads``)."""
    from p2pdiloco.errors import P2PDilocoError, ProtocolError  # noqa: PLC0415
    from p2pdiloco.net.records.parse import parse_heads  # noqa: PLC0415
    from p2pdiloco.trust.identity import is_peer_id  # noqa: PLC0415

    async def ask(peer: str) -> tuple[str, Any] | None:
        try:
            reply, _ = await swarm.call(peer, RECORD_RPC, {}, timeout=ASK_TIMEOUT_S)
            if not isinstance(reply, dict) or reply.get("run") != run_id:
                return None
            new = parse_heads(reply.get("r"), None)
        except (P2PDilocoError, ProtocolError):
            return None
        try:
            if parse_heads(stored[peer], None).t > new.t:
                return None
        except ProtocolError:
            pass
        return peer, reply["r"]

    peers = [p for p in stored if is_peer_id(p) and p != swarm.peer_id][:ASK_AT_MOST]
    answers = await asyncio.gather(*(ask(p) for p in peers))
    return {**stored, **dict(a for a in answers if a is not None)}


async def read_swarm(initial_peers: list[str], run_id: str, *, wait: float = 10.0,
                     owner: str | None = None) -> dict[str, Any]:
    """Join the DHT as a light peer (no model, no training), read ``{run}/heads`` until it is
    non-empty or ``wait`` seconds passed, shut the daemon down and return the summary.
    ``owner``: the run owner's peer ID pinned on this machine (:mod:`p2pdiloco.owners`): its
    newest manifest in the DHT gives ``manifests`` (a list of at most one) and the target;
    None: no manifest is trusted, whatever the DHT holds (``manifests`` empty, no target).

    Raises:
        NetworkError: no initial peer answered, or the daemon did not start.
    """
    from p2pdiloco.net.transport.swarm import Swarm  # noqa: PLC0415  (imports hivemind)

    from p2pdiloco.manifest import published  # noqa: PLC0415

    swarm = await Swarm.start(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        end = time.monotonic() + wait
        records: dict[str, Any] = {}
        # the manifest's DHT search runs beside the records' (each a Kademlia traversal), not after it
        manifest = asyncio.ensure_future(swarm.get(f"{run_id}/manifest"))
        try:
            while True:
                records = await swarm.get(f"{run_id}/heads")
                if records or time.monotonic() >= end:
                    break
                await asyncio.sleep(1.0)
            stored = await manifest
        finally:
            manifest.cancel()
        records = await _fresh_records(swarm, run_id, records)
        view = summarize_swarm(run_id, records, swarm.clock.now())
        m = published(stored, owner)
        view["owner"] = owner
        view["manifests"] = [] if m is None else [{"digest": m.digest, "owner": m.owner_id,
                                                   "target_tokens": m.target_tokens}]
        target = m.target_tokens if m is not None else 0
        p = view["progress"]
        p.update({k: v for k, v in progress(p["tokens"], None, target, p["tokens_per_s"]).to_json().items() if k != "share"})
        return view
    finally:
        await swarm.shutdown()
