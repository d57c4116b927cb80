"""A node's status snapshot: a tree of frozen dataclasses and its JSON form, the one place that
says what each key holds.

A running node builds the snapshot every second (``node.main.snapshot``) and every view of the
node reads it by attribute: the status file (``--status-file``, JSON), the final report
(``--report-file``, :class:`Report`), ``node status`` over the control socket, the metrics
endpoint, the live view, and the chaos harness and benchmarks that read the files of nodes they
run. A snapshot goes to JSON with ``to_json()`` (a dict, keys in the order written here) and
comes back with :func:`parse_status` / :func:`read_status`. The table of docs/operating.md
("Status JSON") is :func:`schema_table`'s output, and tests/test_status.py holds a real node's
JSON to this schema, key for key and type for type.

A node goes through four forms: :class:`Starting` (from its first status write),
:class:`Connecting` (its transport is up), :class:`Status` (it trains) and :class:`Report` (it
stopped). Figures not known yet are ``null`` (None). ``reach``, ``clock`` and the counters keyed
by peer or reason stay JSON objects: the modules that fill them document their keys.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from p2pdiloco.typed_json import FormError, JsonForm, conforms, type_name

__all__ = ["Alone", "CheckpointError", "Checkpoints", "Connecting", "FragmentStatus", "Hardware", "Manifest", "Outer", "Progress", "Report",
           "RoundRecord", "Sessions", "Snapshot", "Starting", "Status", "StatusError", "SwarmFigures", "conforms",
           "keys", "parse_status", "read_status", "schema_table"]

Doc = str  # the metadata of each key: what it holds, with its unit

PeerSeconds = dict[str, float]  # {peer ID: seconds left}


class StatusError(FormError):
    """A status JSON that is not a node's: not an object, no ``name`` and ``state`` strings,
    or a key whose value has the wrong type."""


# ---- nested objects -------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Manifest(JsonForm):
    """The run manifest a node joined with (p2pdiloco.manifest)."""

    digest: str = ""
    owner: str = ""
    target_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class Alone(JsonForm):
    """Why a node merges with no other node (node.alone)."""

    reason: str = ""
    detail: str = ""
    since_s: float = 0.0


@dataclass(frozen=True)
class RoundRecord(JsonForm):
    """One finished outer round as a node saw it."""

    fragment: int
    version: int  # version produced
    members: int
    seconds: float
    committed: bool
    reason: str = ""
    digest: str = ""  # the committed state's (12 hex), else ""
    fraction: float = 0.0  # of an outer period, the step this round applied (round_fraction); committed only
    share: float = 0.0  # of the fragment, the part this node reduced (bandwidth-aware shares); committed only


@dataclass(frozen=True, kw_only=True)
class Sessions(JsonForm):
    """Sessions (net.transport.sessions): ours open to peers, ours opened since start, peers' to us."""

    open: int = 0
    opened: int = 0
    serving: int = 0


@dataclass(frozen=True, kw_only=True)
class FragmentStatus(JsonForm):
    """One fragment as held against the swarm's newest head (node.swarm_view.fragment_status)."""

    fragment: int = 0
    version: int = 0
    digest: str = ""
    swarm_version: int | None = None
    holders: int = 0
    status: str = "unknown"  # newest, behind, ahead, no record, unknown


@dataclass(frozen=True, kw_only=True)
class SwarmFigures(JsonForm):
    """The swarm's records as a node last read them."""

    peers: int = 0
    learners: int = 0
    newest: list[int | None] = field(default_factory=list)
    behind: list[int] = field(default_factory=list)
    read_age_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Hardware(JsonForm):
    """Where a node trains: device, torch threads, resident memory (MiB; now and its peak), its
    limit and the memory estimate shown at start (``p2pdiloco.footprint.Footprint.as_dict``:
    ``parameters``, each part's ``*_mib`` and ``total_mib``)."""

    device: str = ""
    threads: int = 1
    rss_mib: int = 0
    peak_rss_mib: int = 0
    memory_limit_mib: int | None = None
    over_memory_limit: bool = False
    memory_estimate: dict[str, int] | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointError(JsonForm):
    """The last local checkpoint write failed (node.runtime.Node._checkpoint): its errno's name
    (ENOSPC, EFBIG...), the system's message, since when (Unix s), failed writes in this streak,
    and whether an earlier checkpoint is still on disk."""

    errno: str = ""
    detail: str = ""
    since: float = 0.0
    failures: int = 0
    kept: bool = False


@dataclass(frozen=True, kw_only=True)
class Checkpoints(JsonForm):
    """Local checkpoints written and how long training waited for them (seconds)."""

    count: int = 0
    last_s: float = 0.0
    max_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Outer(JsonForm):
    """The outer settings a node runs (config.OuterConfig)."""

    fragments: int = 0
    sync_every: int = 0
    lr: float = 0.0
    momentum: float = 0.0
    wire_precision: str = ""
    error_feedback_decay: float = 0.0
    min_quorum: int = 0


@dataclass(frozen=True, kw_only=True)
class Progress(JsonForm):
    """The run's progress (node.status_view.progress); None where unknown."""

    tokens: int = 0
    target_tokens: int | None = None
    done: float | None = None
    tokens_per_s: float | None = None
    eta_s: int | None = None
    share: float | None = None


# ---- the keys of every form (one doc each) ----------------------------------------------------

Name = Annotated[str, "the node's name (`--name`)"]
RunId = Annotated[str, "the run it trains (`swarm.run_id`)"]
State = Annotated[str, "starting, joining, training, catching up, alone, leaving, evaluating, stopped"]
Pid = Annotated[int, "the node's process ID"]
Uptime = Annotated[float, "seconds since the process started"]
ControlSocket = Annotated[str, "path of the control socket `node status` asks"]
Metrics = Annotated[str | None, "URL of the Prometheus endpoint (`metrics_port`), null when off"]
ManifestKey = Annotated[Manifest | None, "the run manifest joined with: digest, owner, target_tokens"]
PeerId = Annotated[str, "this node's libp2p peer ID"]
Maddrs = Annotated[list[str], "multiaddrs it announces"]
Reachability = Annotated[str, "how peers can dial it: public, behind NAT, relayed, loopback only, ..."]
Reach = Annotated[dict[str, Any], "reachability detail (net.transport.reachability `status`): mode, relays, check, advice"]
P2pdPid = Annotated[int | None, "process ID of its libp2p daemon"]


@dataclass(frozen=True, kw_only=True)
class Starting(JsonForm):
    """The keys present from a node's first status write."""

    name: Name
    run_id: RunId = ""
    state: State
    pid: Pid = 0
    uptime_s: Uptime = 0.0
    control_socket: ControlSocket = ""
    metrics: Metrics = None
    manifest: ManifestKey = None


@dataclass(frozen=True, kw_only=True)
class Connecting(Starting):
    """A starting node whose transport is up: its peer ID and addresses."""

    peer_id: PeerId = ""
    p2pd_pid: P2pdPid = None
    maddrs: Maddrs = field(default_factory=list)
    reachability: Reachability = ""
    reach: Reach = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Status(JsonForm):
    """Every key of a running node's snapshot, in the order of its JSON."""

    name: Name
    run_id: RunId = ""
    peer_id: PeerId = ""
    maddrs: Maddrs = field(default_factory=list)
    reachability: Reachability = ""
    connections: Annotated[int | None, "libp2p connections now"] = None
    rejoins: Annotated[int, "times it lost every connection and dialled the initial peers again"] = 0
    reach: Reach = field(default_factory=dict)
    bytes_relayed: Annotated[int, "RPC bytes, both directions, with peers reached only through a relay"] = 0
    pid: Pid = 0
    p2pd_pid: P2pdPid = None
    p2pd_restarts: Annotated[int, "times its libp2p daemon died under it and was started again (same peer ID)"] = 0
    state: State
    started_from: Annotated[str | None, "where its training began: checkpoint (its data dir's own), swarm (a state "
                                        "downloaded from a node of the run) or initial (the initial model: the run "
                                        "started afresh); null while joining"] = None
    checkpoint_error: Annotated[CheckpointError | None, "the last local checkpoint write failed (a full disk...), "
                                "else null: errno (ENOSPC, EFBIG...), detail, since (Unix s), failures, kept "
                                "(an earlier checkpoint is still on disk); training goes on"] = None
    alone: Annotated[Alone | None, "why it merges with no other node, else null: reason (started_alone, "
                     "no_peers, quorum, no_relay: from the first seconds; other_settings, unreachable, "
                     "no_rounds: after alone_after s), detail, since_s (node.alone)"] = None
    merging: Annotated[list[int], "fragments with an outer round in flight"] = field(default_factory=list)
    uptime_s: Uptime = 0.0
    step: Annotated[int, "inner steps done"] = 0
    tokens: Annotated[int, "tokens trained by this node"] = 0
    tokens_per_s: Annotated[float, "its training rate, tokens/s"] = 0.0
    blocked_s: Annotated[float, "seconds its training waited on outer rounds"] = 0.0
    checkpoint: Annotated[Checkpoints, "local checkpoints written (count) and how long training waited for the "
                                       "last and the longest (last_s, max_s; seconds)"] = field(default_factory=Checkpoints)
    loss: Annotated[float | None, "training loss, in loss_unit"] = None
    heldout_loss: Annotated[float | None, "held-out loss of its own parameters, in loss_unit"] = None
    loss_unit: Annotated[str, "nats/byte (the tokens are bytes) or nats/token (data.tokenizer)"] = "nats/byte"
    heldout_rising: Annotated[bool, "held-out loss rose at the last evaluations (a warning)"] = False
    rounds_committed: Annotated[int, "outer rounds it committed"] = 0
    rounds_failed: Annotated[int, "outer rounds discarded (a member failed, or superseded)"] = 0
    rounds_superseded: Annotated[int, "of those, merged rounds dropped because the fragment moved meanwhile"] = 0
    rounds_late: Annotated[int, "rounds it came to after the group closed (it follows the group's state)"] = 0
    rounds_alone: Annotated[int, "committed rounds with no other member"] = 0
    rounds_excluded: Annotated[int, "rounds merged without its contribution (an outlier): kept, offered again"] = 0
    rounds_with_peers: Annotated[int, "committed rounds with at least one other member"] = 0
    catchups: Annotated[int, "fragment states downloaded from peers"] = 0
    delta_catchups: Annotated[int, "of those, states computed from the rounds missed (their merged slices), not downloaded"] = 0
    resyncs: Annotated[int, "downloads at the version already held (another digest won a split brain)"] = 0
    tokens_merged: Annotated[float, "tokens of its contributions that went into merges"] = 0.0
    last_round: Annotated[RoundRecord | None, "the last round as in recent_rounds, null before any"] = None
    recent_rounds: Annotated[list[RoundRecord], "last 10 rounds: fragment, version, members, seconds, committed, "
                             "reason, digest, fraction (of an outer period), share (reduced)"] = field(default_factory=list)
    bytes_out: Annotated[int, "RPC bytes sent"] = 0
    bytes_in: Annotated[int, "RPC bytes received"] = 0
    rpc_calls: Annotated[int, "RPCs it made"] = 0
    rpc_failed: Annotated[int, "of those, failed"] = 0
    dht_ops: Annotated[dict[str, int], "DHT reads and stores it made, by \"get:\" or \"store:\" and record kind "
                       "(mm: matchmaking declarations, heads, ...)"] = field(default_factory=dict)
    rpc_by_name: Annotated[dict[str, list[int]], "RPCs it made by name: [calls, bytes of their framed request and "
                           "reply headers]"] = field(default_factory=dict)
    sessions: Annotated[Sessions, "sessions, each one stream carrying many small calls (net.transport.sessions): open "
                        "(ours to peers), opened (ours, since start), serving (peers' to us)"] = field(default_factory=Sessions)
    gathering_pushes: Annotated[dict[str, int], "gathering announcements pushed (net.rounds.gatherings): sent, failed, "
                                "resent (a patch sent whole again: the receiver lacked its base, "
                                "net.records.patches), received, other_run (refused: another run's or other "
                                "settings')"] = field(default_factory=dict)
    record_pushes: Annotated[dict[str, int], "heads records pushed to the learners it knows (net.state.statesync, "
                             "st.heads): sent, failed, resent, received, other_run and ignored (refused)"] = field(default_factory=dict)
    link_bytes_per_s: Annotated[int | None, "measured link rate (median of large replies), bytes/s"] = None
    rejected: Annotated[dict[str, int], "contributions refused, by reason"] = field(default_factory=dict)
    rejected_total: Annotated[int, "sum of rejected"] = 0
    bans: Annotated[dict[str, str], "banned peers: {peer ID: reason}"] = field(default_factory=dict)
    ignored: Annotated[dict[str, str], "peers whose state claims are ignored now: {peer ID: reason}"] = field(default_factory=dict)
    other_settings: Annotated[dict[str, str], "nodes of the run with other settings: {peer ID: their settings}"] = field(default_factory=dict)
    passed_over: Annotated[PeerSeconds, "group leaders passed over now"] = field(default_factory=dict)
    ignored_groups: Annotated[PeerSeconds, "peers whose group declarations are ignored now"] = field(default_factory=dict)
    avoided: Annotated[PeerSeconds, "peers this node forms no group with now (it refused a merged part of theirs)"] = field(default_factory=dict)
    refused_states: Annotated[int, "downloaded states refused as implausible (docs/trust.md)"] = 0
    trusted: Annotated[dict[str, float], "peers whose records may move this node's state, earned by rounds merged "
                       "with them or a vetted state: {peer ID: points} (docs/trust.md)"] = field(default_factory=dict)
    blocked: Annotated[PeerSeconds, "peers whose streams are closed unread now"] = field(default_factory=dict)
    refused: Annotated[dict[str, int], "requests from non-members of a private swarm refused, by reason"] = field(default_factory=dict)
    dropped: Annotated[dict[str, int], "messages dropped at the parsing boundary, by peer ID"] = field(default_factory=dict)
    dropped_total: Annotated[int, "sum of dropped_reasons"] = 0
    dropped_reasons: Annotated[dict[str, int], "messages dropped, by reason"] = field(default_factory=dict)
    internal_errors: Annotated[int, "background steps that raised (logged, never fatal)"] = 0
    allreduce: Annotated[dict[str, int], "all-reduce counters (net.rounds.allreduce `AllReduceStats`)"] = field(default_factory=dict)
    fragments: Annotated[list[list[Any]], "per fragment [version, digest prefix] held"] = field(default_factory=list)
    fragment_status: Annotated[list[FragmentStatus], "per fragment: fragment, version, digest, swarm_version, "
                               "holders, status (newest, behind, ahead, no record, unknown)"] = field(default_factory=list)
    swarm: Annotated[SwarmFigures | None, "the swarm's records: peers, learners, newest, behind, read_age_s"] = None
    global_digest: Annotated[str, "one hash over every fragment's (version, digest): equal iff the models are"] = ""
    time: Annotated[float, "Unix time of the snapshot, s"] = 0.0
    hardware: Annotated[Hardware, "device, threads, rss_mib, peak_rss_mib, memory_limit_mib, over_memory_limit, "
                                   "memory_estimate (total_mib and its parts, p2pdiloco.footprint)"] = field(default_factory=Hardware)
    outer: Annotated[Outer, "the outer settings it runs (config.OuterConfig): fragments, sync_every, lr, "
                     "momentum, wire_precision, error_feedback_decay, min_quorum"] = field(default_factory=Outer)
    progress: Annotated[Progress, "the run's progress: tokens, target_tokens, done, tokens_per_s, eta_s, share"] = field(default_factory=Progress)
    clock: Annotated[dict[str, Any], "clock offset to the swarm (net.transport.clock `status`): offset_s, synced, ..."] = field(default_factory=dict)
    control_socket: ControlSocket = ""
    metrics: Metrics = None
    manifest: ManifestKey = None


@dataclass(frozen=True, kw_only=True)
class Report(Status):
    """The final report: the last snapshot plus the held-out losses."""

    start_loss: Annotated[float, "held-out loss of the initial model, in loss_unit"] = 0.0
    end_loss: Annotated[float, "held-out loss of the final global model, in loss_unit"] = 0.0
    end_bits_per_byte: Annotated[float, "end_loss in bits per byte of held-out text (per token / bytes per token / "
                                        "ln 2)"] = 0.0
    heldout_history: Annotated[list[list[float]], "[inner step, held-out loss] at each evaluation"] = field(default_factory=list)
    exit_code: Annotated[int, "the node's exit code: 0, or 3 when it was given peers to join, ran to the end of its "
                         "budget and reached no other node (no round with one, none taken without its "
                         "contribution, no state from one), or 4 when its libp2p daemon died and could not be "
                         "started again"] = 0
    exit_reason: Annotated[str | None, "why it stopped before its budget ended (exit code 4), else null"] = None


Snapshot = Starting | Connecting | Status | Report  # what a node's status file holds, by its phase


def parse_status(data: Any) -> Snapshot:
    """A node's status JSON (a status or report file, a ``node status`` answer) as its
    dataclass: a :class:`Report` when it has a report's keys, else a :class:`Status` when it
    has a running node's, else a :class:`Connecting` when it has a peer ID, else a
    :class:`Starting`. Raises StatusError when it is not a node's (see :class:`StatusError`)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("state"), str):
        raise StatusError("not a node's status: a JSON object with name and state strings")
    try:
        for cls in (Report, Status, Connecting):
            base = Status if cls is Report else Connecting if cls is Status else Starting
            if set(data) & (set(keys(cls)) - set(keys(base))):
                return cls.from_json(data)
        return Starting.from_json(data)
    except FormError as e:
        raise StatusError(str(e)) from None


def read_status(path: Path) -> Snapshot | None:
    """A node's status or report file, or None if it is missing, torn or not a node's
    (:func:`parse_status`). The node writes it atomically, so a reader sees the old file or the
    new one; a file being replaced can still vanish between listing and reading."""
    try:
        return parse_status(json.loads(path.read_text()))
    except (OSError, ValueError):  # StatusError is a ValueError
        return None


def keys(schema: type) -> dict[str, tuple[Any, Doc]]:
    """{key: (type, doc)} of a form above (Starting, Connecting, Status, Report), in the order
    of its JSON."""
    hints = typing.get_type_hints(schema, include_extras=True)
    return {f.name: typing.get_args(hints[f.name])[:2] for f in dataclasses.fields(schema)}


def schema_table() -> str:
    """The markdown table of docs/operating.md, "Status JSON": key, type, meaning."""
    rows, seen = ["| key | type | meaning |", "|---|---|---|"], set()
    for schema, where in ((Starting, " (from the start)"), (Status, ""), (Report, " (report only)")):
        for k, (t, doc) in keys(schema).items():
            if k not in seen:
                seen.add(k)
                rows.append(f"| `{k}` | {type_name(t)} | {doc}{where} |")
    return "\n".join(rows)
