"""Terminal views of a node and of a swarm (rich): ``p2pdiloco node status``, the node's live
progress, and ``p2pdiloco swarm status``.

Everything here renders plain dicts: a node's snapshot (``node.main.snapshot``, served on its
control socket) and the records nodes publish under ``{run}/heads`` in the DHT. Only
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

LOOPBACK_HINT = ("only loopback addresses are announced: peers on other machines cannot dial this node; "
                 "restart it with --host 0.0.0.0, or --set swarm.announce=/ip4/PUBLIC_IP/tcp/PORT behind NAT")
PRIVATE_HINT = ("only private-network addresses are announced: peers outside this network cannot dial this node; "
                "behind NAT forward the port and --set swarm.announce=/ip4/PUBLIC_IP/tcp/PORT")

# robust merge, step 3 (docs/trust.md): honest learners of different speeds bring Δs of different norms
CLIPPED_NOTE = (" (clipped: peers' tensors trimmed to the group's median norm, routine between learners of "
                "different speed, not an attack)")


# ---- formatting -----------------------------------------------------------------------------

def _link(rate: object) -> str:
    """A measured link rate (bytes/s) in Mbit/s, or "not measured yet"."""
    return f"{float(rate) * 8 / 1e6:.1f} Mbit/s" if isinstance(rate, (int, float)) and rate > 0 else "not measured yet"


def fmt_num(x: Any, spec: str = ".3f") -> str:
    return "-" if not isinstance(x, (int, float)) or x != x else format(x, spec)


def fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return "-"


def fmt_count(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    return f"{n / 1e9:.2f}G" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else str(n)


def fmt_age(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def swarm_rate(records: dict[str, Any] | None) -> float | None:
    """Tokens/s of the live nodes among parsed heads ``records`` (their published rates); None
    before any read."""
    return None if records is None else sum(r.tps for r in records.values() if not r.done)


def progress(merged: int, mine: float | None, target: int, rate: float | None) -> dict[str, Any]:
    """The run's progress: ``merged`` tokens the swarm merged into the global model
    (``core.outer.run_tokens``), ``mine`` of them one node's own (None: no node's view),
    ``target`` the run's target in tokens (its manifest; 0: none), ``rate`` the swarm's
    tokens/s (:func:`swarm_rate`). Returns tokens, target_tokens, done (fraction of the
    target), tokens_per_s, eta_s (seconds to the target at that rate) and share (the node's
    fraction of the merged tokens); None where unknown."""
    from node.swarm_view import share  # noqa: PLC0415  (the one rule; `node status` stays light)

    left = max(0, target - merged) if target else None
    return {"tokens": merged, "target_tokens": target or None,
            "done": round(min(1.0, merged / target), 4) if target else None,
            "tokens_per_s": round(rate, 1) if rate is not None else None,
            "eta_s": round(left / rate) if left is not None and rate else (0 if left == 0 else None),
            "share": share(mine, merged)}


def progress_text(p: Any, alone: bool = False) -> str:
    """One line of the run's progress (``progress`` of a node's snapshot), "" when unknown;
    ``alone``: the node merges with no other node (its ``alone`` is set), so nothing it counts
    is the swarm's."""
    if not isinstance(p, dict) or not p.get("tokens"):
        return ""
    if alone:
        return f"{fmt_count(p['tokens'])} tokens merged, by this node alone: it contributes to no swarm"
    text = f"{fmt_count(p['tokens'])} tokens merged swarm-wide"
    if p.get("target_tokens"):
        text += f", {100 * (p.get('done') or 0):.1f}% of the run's {fmt_count(p['target_tokens'])}"
        text += f" (about {fmt_age(p['eta_s'])} left)" if isinstance(p.get("eta_s"), (int, float)) else ""
    if isinstance(p.get("tokens_per_s"), (int, float)):
        text += f"; swarm {fmt_num(p['tokens_per_s'], ',.0f')} tokens/s"
    if isinstance(p.get("share"), (int, float)):
        text += f"; this node's share {100 * p['share']:.1f}%"
    return text


def state_text(s: dict[str, Any]) -> str:
    state = str(s.get("state", "unknown"))
    merging = s.get("merging") or []
    if merging and state == "training":
        return f"training, merging {', '.join(f'f{p}' for p in merging)}"
    return state


def address_warning(s: dict[str, Any]) -> str | None:
    reach = s.get("reachability")
    return LOOPBACK_HINT if reach == "loopback only" else PRIVATE_HINT if reach == "direct, private network only" else None


# ---- node status ----------------------------------------------------------------------------
def _fragments_table(s: dict[str, Any]) -> Table:
    t = Table(title="fragments", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("fragment", "version", "swarm newest", "holders", "digest", "status"):
        t.add_column(col, justify="right" if col in ("fragment", "version", "swarm newest", "holders") else "left")
    styles = {"newest": "green", "behind": "yellow", "ahead": "cyan"}
    for f in s.get("fragment_status") or []:
        newest = f.get("swarm_version")
        t.add_row(str(f["fragment"]), str(f["version"]), "-" if newest is None else str(newest),
                  str(f.get("holders", 0)), f.get("digest", ""),
                  Text(f.get("status", ""), style=styles.get(f.get("status", ""), "")))
    return t


def _rounds_table(s: dict[str, Any]) -> Table:
    t = Table(title="recent rounds (newest last)", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("fragment", "version", "members", "seconds", "outcome"):
        t.add_column(col, justify="left" if col == "outcome" else "right")
    for r in s.get("recent_rounds") or []:
        outcome = Text("committed", style="green") if r.get("committed") else \
            Text(f"discarded: {r.get('reason') or 'no result'}", style="yellow")
        t.add_row(f"f{r['fragment']}", str(r["version"]), str(r.get("members", 0)),
                  fmt_num(r.get("seconds"), ".2f"), outcome)
    return t


def node_lines(s: dict[str, Any]) -> Table:
    """The key/value summary of one node's snapshot."""
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold", no_wrap=True)
    g.add_column(overflow="fold")
    g.add_row("node", f"{s.get('name', '?')} (run {s.get('run_id', '?')})")
    if s.get("manifest"):
        m = s["manifest"]
        g.add_row("run manifest", f"digest {m.get('digest')}, owner {m.get('owner')}")
    g.add_row("state", state_text(s))
    g.add_row("uptime", f"{fmt_age(s.get('uptime_s'))}   pid {s.get('pid', '-')}   p2pd pid {s.get('p2pd_pid') or '-'}")
    clock = s.get("clock") or {}
    if clock and not clock.get("synced", True):
        from p2pdiloco.net.transport.clock import describe  # noqa: PLC0415

        g.add_row("clock", Text(f"{describe(clock.get('measured_s', 0.0))} the swarm's ({clock.get('peers')} peers); "
                                f"using the swarm's time; turn on time sync (timedatectl set-ntp true)",
                                style="yellow"))
    if s.get("peer_id"):
        g.add_row("peer ID", s["peer_id"])
    maddrs = s.get("maddrs") or []
    if maddrs:
        g.add_row("addresses", "\n".join(maddrs))
    if s.get("reachability"):
        conns, reach = s.get("connections"), s.get("reach") or {}
        line = s["reachability"] + ("" if conns is None else f"   ({plural(conns, 'connection')} now)")
        if reach.get("relays"):
            line += f"   relay {', '.join(r[-8:] for r in reach['relays'])}, {fmt_bytes(reach.get('bytes_relayed'))} relayed"
        if reach.get("check") in ("reachable", "unreachable"):
            line += f"   (dial-back check by {plural(len(reach.get('checked_by') or []), 'peer')}: {reach['check']}" \
                    + (f", seen as {reach['observed']})" if reach.get("observed") else ")")
        g.add_row("reachability", line)
        if reach.get("advice"):
            g.add_row(Text("advice", style="bold yellow"), Text(reach["advice"], style="yellow"))
    warning = address_warning(s)
    if warning:
        g.add_row(Text("warning", style="bold yellow"), Text(warning, style="yellow"))
    alone = s.get("alone")
    if isinstance(alone, dict):
        g.add_row(Text("alone", style="bold red"),
                  Text(f"merged with nobody for {fmt_age(alone.get('since_s'))}: {alone.get('detail', '')}", style="red"))
    sw = s.get("swarm")
    if sw:
        behind = sw.get("behind") or []
        where = ("merging with no other node" if isinstance(alone, dict) else
                 f"behind on {', '.join(f'f{p}' for p in behind)}" if behind else "up to date")
        g.add_row("swarm", f"{plural(sw['peers'], 'node')} with a live record, {sw['learners']} training; "
                           f"this node is {where} (read {fmt_age(sw.get('read_age_s'))} ago)")
    elif s.get("state") not in (None, "starting"):
        g.add_row("swarm", "not read yet")
    if progress_text(s.get("progress"), isinstance(alone, dict)):
        g.add_row("run progress", progress_text(s.get("progress"), isinstance(alone, dict)))
    hw = s.get("hardware")
    if isinstance(hw, dict):
        limit = f" of {hw['memory_limit_mib']} MiB allowed" if hw.get("memory_limit_mib") else ""
        g.add_row(Text("hardware", style="bold yellow" if hw.get("over_memory_limit") else "bold"),
                  f"{hw.get('device')}, {plural(hw.get('threads') or 1, 'CPU thread')}, {hw.get('rss_mib')} MiB "
                  f"resident{limit}")
    out = s.get("outer")
    if isinstance(out, dict):
        feedback = f" (error feedback decay {out.get('error_feedback_decay')})" if out.get("wire_precision") != "fp32" else ""
        g.add_row("outer", f"{out.get('wire_precision')} on the wire{feedback}, a round every {out.get('sync_every')} "
                           f"inner steps per fragment, {out.get('fragments')} fragments, lr {out.get('lr')}, "
                           f"momentum {out.get('momentum')}, quorum {out.get('min_quorum')}")
    if "step" in s:
        g.add_row("training", f"inner step {s.get('step', 0)}   {fmt_count(s.get('tokens'))} tokens   "
                              f"{fmt_num(s.get('tokens_per_s'), ',.0f')} tokens/s")
        g.add_row("loss", f"training {fmt_num(s.get('loss'))}   held-out {fmt_num(s.get('heldout_loss'))} "
                          f"({s.get('loss_unit') or 'nats/byte'})")
        g.add_row("rounds", f"{s.get('rounds_committed', 0)} committed ({s.get('rounds_alone', 0)} alone), "
                            f"{s.get('rounds_failed', 0)} failed ({s.get('rounds_superseded', 0)} superseded), "
                            f"{s.get('rounds_late', 0)} late, "
                            f"{s.get('rounds_excluded', 0)} excluded (kept); "
                            f"{s.get('catchups', 0)} catch-ups; {fmt_count(s.get('tokens_merged'))} of its tokens merged")
        rejected = s.get("rejected") or {}
        g.add_row("rejected", ", ".join(f"{n} {reason}" for reason, n in sorted(rejected.items()) if n) or "none")
        if s.get("allreduce"):
            g.add_row("all-reduce", ", ".join(f"{n} {k}" for k, n in s["allreduce"].items())
                      + (CLIPPED_NOTE if s["allreduce"].get("clipped") else ""))
        g.add_row("traffic", f"sent {fmt_bytes(s.get('bytes_out'))}   received {fmt_bytes(s.get('bytes_in'))}   "
                             f"({s.get('rpc_calls', 0)} calls, {s.get('rpc_failed', 0)} failed)   "
                             f"link {_link(s.get('link_bytes_per_s'))}")
        if s.get("global_digest"):
            g.add_row("global digest", s["global_digest"])
    g.add_row("control", str(s.get("control_socket", "-")) + (f"   metrics {s['metrics']}" if s.get("metrics") else ""))
    return g


def render_node(s: dict[str, Any]) -> RenderableType:
    """``p2pdiloco node status``: summary, fragments against the swarm, recent rounds."""
    parts: list[RenderableType] = [node_lines(s)]
    if s.get("fragment_status"):
        parts += [Text(""), _fragments_table(s)]
    if s.get("recent_rounds"):
        parts += [Text(""), _rounds_table(s)]
    return Group(*parts)


def render_live(s: dict[str, Any]) -> RenderableType:
    """The node's own terminal: one compact table, redrawn every second."""
    t = Table(show_edge=True, title=f"p2pdiloco {s.get('name', 'node')} (run {s.get('run_id', '?')})")
    for col in ("state", "step", "tokens/s", "loss", "held-out", "rounds", "versions (swarm)", "peers", "sent/recv",
                "uptime"):
        t.add_column(col)
    frags = s.get("fragment_status") or []
    versions = " ".join(f"{f['version']}" + (f"({f['swarm_version']})" if f.get("status") == "behind" else "")
                        for f in frags) or "-"
    sw = s.get("swarm") or {}
    t.add_row(state_text(s), str(s.get("step", 0)), fmt_num(s.get("tokens_per_s"), ",.0f"), fmt_num(s.get("loss")),
              fmt_num(s.get("heldout_loss")), f"{s.get('rounds_committed', 0)}/{s.get('rounds_failed', 0)} failed",
              versions, str(sw.get("peers", "-")), f"{fmt_bytes(s.get('bytes_out'))}/{fmt_bytes(s.get('bytes_in'))}",
              fmt_age(s.get("uptime_s")))
    lines: list[RenderableType] = [t]
    alone = s.get("alone")
    if progress_text(s.get("progress"), isinstance(alone, dict)):
        lines.append(Text(progress_text(s.get("progress"), isinstance(alone, dict))))
    if isinstance(alone, dict):  # a volunteer must not miss that the node contributes nothing
        lines.append(Text(f"ALONE for {fmt_age(alone.get('since_s'))}: {alone.get('detail', '')}", style="bold red"))
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
    from p2pdiloco.net.state.statesync import STORE_EVERY_S  # noqa: PLC0415

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
    if progress_text(view.get("progress")):
        notes.append(Text(progress_text(view["progress"])))
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
        p.update({k: v for k, v in progress(p["tokens"], None, target, p["tokens_per_s"]).items() if k != "share"})
        return view
    finally:
        await swarm.shutdown()
