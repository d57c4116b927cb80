"""A node's status snapshot: its typed JSON form, the one place that says what each key holds.

A running node builds the snapshot every second (``node.main.snapshot``) and every view of the
node reads it: the status file (``--status-file``, JSON), the final report (``--report-file``,
the last snapshot plus the keys of :class:`Report`), ``node status --json`` over the control
socket, the metrics endpoint, the live view, and the chaos harness and benchmarks that read the
files of nodes they run. :class:`Status` lists every key with its type and unit; the table of
docs/operating.md ("Status JSON") is :func:`schema_table`'s output, and tests/test_status.py
holds a real node's snapshot to this schema, key for key and type for type.

A node that has not started its swarm yet writes only the keys of :class:`Starting`.
Figures not known yet are ``null``. Readers outside a node use :func:`read_status`.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any, TypedDict, Union

Doc = str  # the metadata of each key: what it holds, with its unit

PeerSeconds = dict[str, float]  # {peer ID: seconds left}


class Starting(TypedDict):
    """The keys present from a node's first status write."""

    name: Annotated[str, "the node's name (`--name`)"]
    run_id: Annotated[str, "the run it trains (`swarm.run_id`)"]
    state: Annotated[str, "starting, joining, training, catching up, alone, leaving, evaluating, stopped"]
    pid: Annotated[int, "the node's process ID"]
    uptime_s: Annotated[float, "seconds since the process started"]
    control_socket: Annotated[str, "path of the control socket `node status` asks"]
    metrics: Annotated[str | None, "URL of the Prometheus endpoint (`metrics_port`), null when off"]
    manifest: Annotated[dict[str, Any] | None, "the run manifest joined with: digest, owner, target_tokens"]


class Status(Starting):
    """Every key of a running node's snapshot."""

    peer_id: Annotated[str, "this node's libp2p peer ID"]
    maddrs: Annotated[list[str], "multiaddrs it announces"]
    reachability: Annotated[str, "how peers can dial it: public, behind NAT, relayed, loopback only, ..."]
    reach: Annotated[dict[str, Any], "reachability detail (net.transport.reachability `status`): mode, relays, check, advice"]
    connections: Annotated[int | None, "libp2p connections now"]
    rejoins: Annotated[int, "times it lost every connection and dialled the initial peers again"]
    bytes_relayed: Annotated[int, "RPC bytes, both directions, with peers reached only through a relay"]
    p2pd_pid: Annotated[int | None, "process ID of its libp2p daemon"]
    p2pd_restarts: Annotated[int, "times its libp2p daemon died under it and was started again (same peer ID)"]
    started_from: Annotated[str | None, "where its training began: checkpoint (its data dir's own), swarm (a state "
                                        "downloaded from a node of the run) or initial (the initial model: the run "
                                        "started afresh); null while joining"]
    checkpoint_error: Annotated[dict[str, Any] | None, "the last local checkpoint write failed (a full disk...), "
                                "else null: errno (ENOSPC, EFBIG...), detail, since (Unix s), failures, kept "
                                "(an earlier checkpoint is still on disk); training goes on"]
    alone: Annotated[dict[str, Any] | None, "why it merges with no other node, else null: reason (started_alone, "
                                            "no_peers, quorum: from the first seconds; other_settings, unreachable, "
                                            "no_rounds: after alone_after s), detail, since_s (node.alone)"]
    merging: Annotated[list[int], "fragments with an outer round in flight"]
    step: Annotated[int, "inner steps done"]
    tokens: Annotated[int, "tokens trained by this node"]
    tokens_per_s: Annotated[float, "its training rate, tokens/s"]
    blocked_s: Annotated[float, "seconds its training waited on outer rounds"]
    loss: Annotated[float | None, "training loss, nats/byte"]
    heldout_loss: Annotated[float | None, "held-out loss of its own parameters, nats/byte"]
    heldout_rising: Annotated[bool, "held-out loss rose at the last evaluations (a warning)"]
    rounds_committed: Annotated[int, "outer rounds it committed"]
    rounds_failed: Annotated[int, "outer rounds discarded (a member failed, or superseded)"]
    rounds_superseded: Annotated[int, "of those, merged rounds dropped because the fragment moved meanwhile"]
    rounds_late: Annotated[int, "rounds it came to after the group closed (it follows the group's state)"]
    rounds_alone: Annotated[int, "committed rounds with no other member"]
    rounds_excluded: Annotated[int, "rounds merged without its contribution (an outlier): kept, offered again"]
    rounds_with_peers: Annotated[int, "committed rounds with at least one other member"]
    catchups: Annotated[int, "fragment states downloaded from peers"]
    delta_catchups: Annotated[int, "of those, states computed from the rounds missed (their merged slices), not downloaded"]
    resyncs: Annotated[int, "downloads at the version already held (another digest won a split brain)"]
    tokens_merged: Annotated[float, "tokens of its contributions that went into merges"]
    last_round: Annotated[dict[str, Any] | None, "the last round as in recent_rounds, null before any"]
    recent_rounds: Annotated[list[dict[str, Any]], "last 10 rounds: fragment, version, members, seconds, committed, "
                                                   "reason, digest, fraction (of an outer period), share (reduced)"]
    bytes_out: Annotated[int, "RPC bytes sent"]
    bytes_in: Annotated[int, "RPC bytes received"]
    rpc_calls: Annotated[int, "RPCs it made"]
    rpc_failed: Annotated[int, "of those, failed"]
    rpc_by_name: Annotated[dict[str, list[int]], "RPCs it made by name: [calls, bytes of their framed request and "
                                                 "reply headers]"]
    sessions: Annotated[dict[str, int], "sessions, each one stream carrying many small calls (net.transport.sessions): open "
                                        "(ours to peers), opened (ours, since start), serving (peers' to us)"]
    dht_ops: Annotated[dict[str, int], "DHT reads and stores it made, by \"get:\" or \"store:\" and record kind "
                                       "(mm: matchmaking declarations, heads, ...)"]
    gathering_pushes: Annotated[dict[str, int], "gathering announcements pushed (net.rounds.gatherings): sent, failed, "
                                                "resent (a patch sent whole again: the receiver lacked its base, "
                                                "net.records.patches), received, other_run (refused: another run's or other "
                                                "settings')"]
    record_pushes: Annotated[dict[str, int], "heads records pushed to the learners it knows (net.state.statesync, "
                                             "st.heads): sent, failed, resent, received, other_run and ignored (refused)"]
    link_bytes_per_s: Annotated[int | None, "measured link rate (median of large replies), bytes/s"]
    rejected: Annotated[dict[str, int], "contributions refused, by reason"]
    rejected_total: Annotated[int, "sum of rejected"]
    bans: Annotated[dict[str, str], "banned peers: {peer ID: reason}"]
    ignored: Annotated[dict[str, str], "peers whose state claims are ignored now: {peer ID: reason}"]
    other_settings: Annotated[dict[str, str], "nodes of the run with other settings: {peer ID: their settings}"]
    passed_over: Annotated[PeerSeconds, "group leaders passed over now"]
    ignored_groups: Annotated[PeerSeconds, "peers whose group declarations are ignored now"]
    avoided: Annotated[PeerSeconds, "peers this node forms no group with now (it refused a merged part of theirs)"]
    refused_states: Annotated[int, "downloaded states refused as implausible (docs/trust.md)"]
    trusted: Annotated[dict[str, float], "peers whose records may move this node's state, earned by rounds merged "
                                         "with them or a vetted state: {peer ID: points} (docs/trust.md)"]
    blocked: Annotated[PeerSeconds, "peers whose streams are closed unread now"]
    refused: Annotated[dict[str, int], "requests from non-members of a private swarm refused, by reason"]
    dropped: Annotated[dict[str, int], "messages dropped at the parsing boundary, by peer ID"]
    dropped_total: Annotated[int, "sum of dropped_reasons"]
    dropped_reasons: Annotated[dict[str, int], "messages dropped, by reason"]
    internal_errors: Annotated[int, "background steps that raised (logged, never fatal)"]
    allreduce: Annotated[dict[str, int], "all-reduce counters (net.rounds.allreduce `AllReduceStats`)"]
    fragments: Annotated[list[list[Any]], "per fragment [version, digest prefix] held"]
    fragment_status: Annotated[list[dict[str, Any]], "per fragment: fragment, version, digest, swarm_version, "
                                                     "holders, status (newest, behind, ahead, no record, unknown)"]
    swarm: Annotated[dict[str, Any] | None, "the swarm's records: peers, learners, newest, behind, read_age_s"]
    global_digest: Annotated[str, "one hash over every fragment's (version, digest): equal iff the models are"]
    time: Annotated[float, "Unix time of the snapshot, s"]
    hardware: Annotated[dict[str, Any], "device, threads, rss_mib, memory_limit_mib, over_memory_limit"]
    outer: Annotated[dict[str, Any], "the outer settings it runs (config.OuterConfig): fragments, sync_every, lr, "
                                     "momentum, wire_precision, error_feedback_decay, min_quorum"]
    progress: Annotated[dict[str, Any], "the run's progress: tokens, target_tokens, done, tokens_per_s, eta_s, share"]
    clock: Annotated[dict[str, Any], "clock offset to the swarm (net.transport.clock `status`): offset_s, synced, ..."]


class Report(Status):
    """The final report: the last snapshot plus the held-out losses."""

    start_loss: Annotated[float, "held-out loss of the initial model, nats/byte"]
    end_loss: Annotated[float, "held-out loss of the final global model, nats/byte"]
    end_bits_per_byte: Annotated[float, "end_loss in bits/byte"]
    heldout_history: Annotated[list[list[float]], "[inner step, held-out loss] at each evaluation"]
    exit_code: Annotated[int, "the node's exit code: 0, or 3 when it was given peers to join, ran to the end of its "
                              "budget and reached no other node (no round with one, none taken without its "
                              "contribution, no state from one), or 4 when its libp2p daemon died and could not be "
                              "started again"]
    exit_reason: Annotated[str | None, "why it stopped before its budget ended (exit code 4), else null"]


def keys(schema: type) -> dict[str, tuple[Any, Doc]]:
    """{key: (type, doc)} of a schema class above, in declaration order (bases first)."""
    hints = typing.get_type_hints(schema, include_extras=True)
    return {k: (typing.get_args(t)[0], typing.get_args(t)[1]) for k, t in hints.items()}


def _type_name(t: Any) -> str:
    if t is type(None):
        return "null"
    args = typing.get_args(t)
    if isinstance(t, types.UnionType) or typing.get_origin(t) is Union:
        return " or ".join(_type_name(a) for a in args)
    origin = typing.get_origin(t)
    if origin in (list, dict):
        return "list" if origin is list else "object"
    return {str: "string", int: "int", float: "number", bool: "bool"}.get(t, "any")


def schema_table() -> str:
    """The markdown table of docs/operating.md, "Status JSON": key, type, meaning."""
    rows, seen = ["| key | type | meaning |", "|---|---|---|"], set()
    for schema, where in ((Starting, " (from the start)"), (Status, ""), (Report, " (report only)")):
        for k, (t, doc) in keys(schema).items():
            if k not in seen:
                seen.add(k)
                rows.append(f"| `{k}` | {_type_name(t)} | {doc}{where} |")
    return "\n".join(rows)


def conforms(value: Any, t: Any) -> bool:
    """Whether a JSON value fits the type of a key (outer container types only: a list is a
    list, a dict is an object; int fits float, bool does not fit int)."""
    args = typing.get_args(t)
    if isinstance(t, types.UnionType) or typing.get_origin(t) is Union:
        return any(conforms(value, a) for a in args)
    if t is type(None):
        return value is None
    if t is Any:
        return True
    origin = typing.get_origin(t) or t
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin)


def read_status(path: Path) -> Status | None:
    """A node's status or report file, or None if it is missing, torn or not a node's (no
    ``name`` and ``state`` strings). The node writes it atomically, so a reader sees the old
    file or the new one; a file being replaced can still vanish between listing and reading."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("state"), str):
        return None
    return typing.cast(Status, data)
