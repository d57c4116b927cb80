"""The one boundary where a peer's input is parsed: typed, bounded records and messages.

Every value this node reads from the DHT (heads records, gathering announcements,
matchmaking declarations) and every RPC request or answer it acts on passes through one
``parse_*`` function here before any other code looks at it. A parser returns a frozen
dataclass whose fields have the documented types and ranges, or raises
:class:`~p2pdiloco.errors.ProtocolError`; it never raises anything else, whatever the
input (tests/test_fuzz_records.py feeds every parser 10,000 hostile inputs). Callers drop
what fails and count it per peer (``Swarm.drop``).

The field checks and their bounds are in :mod:`p2pdiloco.net.records.fields`, the RPC
messages in :mod:`p2pdiloco.net.records.messages`; this module holds the DHT records and
names every parser and bound of the boundary (``rec.parse_join_request``, ``rec.MAX_GROUP``).

Integers must be ``int`` (not ``bool``, not ``float``): msgpack keeps the distinction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records.fields import (  # noqa: F401  (the boundary's bounds and checks, named here too)
    MAX_VERSION,
    MAX_FRAGMENTS,
    MAX_GROUP,
    MAX_ROUND_ID,
    MAX_TEXT,
    MAX_COUNT,
    MAX_RECORD_KEYS,
    MAX_RATE_KIB,
    BEAT_S,
    MAX_BEAT_S,
    SHARE_GRID,
    _int,
    _finite,
    _text,
    _bytes,
    digest,
    wire_digest,
    version,
    fragment,
    round_id,
    members,
    wire_members,
    shares,
    rates,
    _map,
    _bool,
)
from p2pdiloco.net.records.messages import (  # noqa: F401  (the RPC messages, named here too)
    JoinRequest,
    parse_join_request,
    JoinAnswer,
    parse_join_answer,
    StateRequest,
    parse_state_request,
    StateAnswer,
    parse_state_answer,
    DeltaRequest,
    parse_delta_request,
    DeltaStep,
    parse_delta_answer,
    round_counters,
    MAX_DIALBACK_PORTS,
    parse_dialback_request,
    DialbackAnswer,
    parse_dialback_answer,
)
from p2pdiloco.trust.identity import is_peer_id

# ---- DHT records ----------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadsRecord:
    """A node's record under ``{run}/heads`` (subkey: its peer ID), published every few
    seconds and after each commit (``StateSync.publish``).

    Attributes:
        fragments: per fragment, (version, digest) of the global state the node holds, or
            None where this node decided to look past the claim (refused or unreachable).
        rounds: per fragment, the ID of the round that made that state ("" unknown).
        t: when the author published it: Unix seconds of the swarm's time as the author
            measured it (``Swarm.clock``, ``p2pdiloco.net.transport.clock``); a change marker for readers.
        name, state: the node's display name and life-cycle state ("training", ...).
        done: the node stopped training (its budget ended or it was stopped).
        step: its inner step; tps: its tokens per second; loss: its last training loss
            (nats/byte) or None.
        tag: the protocol tag of its settings (``node.runtime.protocol_tag``: what every
            member of a group must share); "" when not stated. A node whose tag differs from
            ours is of the same run but cannot merge with us: its claims are not heads for us.
        merged: tokens the swarm merged into the states it holds (``core.outer.run_tokens``).
        mine: tokens of its own that rounds merged (its share of ``merged``).
        reach: how peers can dial it as it says (``Reachability.state``; "" when not stated).
        beat: seconds between its heartbeats to each peer at most (``pushes.beat_period``):
            readers count it gone after ``pushes.stale_after(beat)`` without a change.
    """

    fragments: tuple[tuple[int, str] | None, ...]
    rounds: tuple[str, ...] = ()
    t: float = 0.0
    name: str = ""
    state: str = ""
    done: bool = False
    step: int = 0
    tps: float = 0.0
    loss: float | None = None
    tag: str = ""
    merged: int = 0
    mine: int = 0
    reach: str = ""
    beat: int = BEAT_S

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able form that :func:`parse_heads` reads back."""
        return {"f": [[f[0], wire_digest(f[1])] if f is not None else None for f in self.fragments],
                "r": list(self.rounds), "t": self.t, "name": self.name, "state": self.state, "done": self.done, "step": self.step,
                "tps": self.tps, "loss": self.loss, "g": self.tag, "m": self.merged, "k": self.mine,
                "reach": self.reach, "b": self.beat}

    def without(self, index: int) -> HeadsRecord:
        """The same record with fragment ``index``'s claim replaced by None."""
        frags = list(self.fragments)
        frags[index] = None
        return dataclasses.replace(self, fragments=tuple(frags))


def parse_heads(value: Any, num_fragments: int | None = None) -> HeadsRecord:
    """Parse a heads record (the map :meth:`HeadsRecord.to_wire` writes).

    Args:
        value: the decoded DHT value (anything).
        num_fragments: the run's P; the record must list exactly P fragments. None accepts
            any count up to MAX_FRAGMENTS (``swarm status``, which knows no model).
    Raises:
        ProtocolError: any field missing, of the wrong type or out of range.
    """
    rec = _map(value, "heads record")
    frags = rec.get("f")
    if not isinstance(frags, list) or not 1 <= len(frags) <= MAX_FRAGMENTS \
            or (num_fragments is not None and len(frags) != num_fragments):
        raise ProtocolError("heads record: wrong fragment list")
    parsed: list[tuple[int, str] | None] = []
    for item in frags:
        if item is None:
            parsed.append(None)
        elif isinstance(item, list) and len(item) == 2:
            parsed.append((version(item[0]), digest(item[1])))
        else:
            raise ProtocolError("heads record: a fragment entry is not [version, digest]")
    rounds = rec.get("r", [])
    if not isinstance(rounds, list) or len(rounds) not in (0, len(frags)):
        raise ProtocolError("heads record: wrong round list")
    rounds = tuple(_text(r, "round id", MAX_ROUND_ID) for r in rounds) or ("",) * len(frags)
    loss = rec.get("loss")
    return HeadsRecord(
        tuple(parsed), rounds, _finite(rec.get("t", 0.0), "t"), _text(rec.get("name", ""), "name"),
        _text(rec.get("state", ""), "state"), _bool(rec.get("done", False), "done"),
        _int(rec.get("step", 0), "step"), _finite(rec.get("tps", 0.0), "tps"),
        None if loss is None else _finite(loss, "loss"), _text(rec.get("g", ""), "tag"),
        _int(rec.get("m", 0), "merged tokens", 0, MAX_COUNT), _int(rec.get("k", 0), "own merged tokens", 0, MAX_COUNT),
        _text(rec.get("reach", ""), "reach"), _int(rec.get("b", BEAT_S), "beat", 1, MAX_BEAT_S))


@dataclass(frozen=True)
class Gathering:
    """A learner's pushed announcement (``mm.gather``): the (fragment, version, digest) keys
    it leads a gathering at now, and ``left``: per fragment, the last key where it closed a
    group, with when (the swarm's Unix seconds, its clock), so that learners arriving there
    later know they are late."""

    keys: tuple[tuple[int, int, str], ...]
    t: float
    left: tuple[tuple[int, int, str, float], ...] = ()


def parse_gathering(value: Any, num_fragments: int) -> Gathering:
    """Parse a gathering announcement ``{"g": [[fragment, version, digest], ...], "t": time,
    "l": [[fragment, version, digest, time], ...]}`` (``l`` optional).

    Raises:
        ProtocolError: malformed, more keys than fragments in ``g`` or in ``l``, or one
            fragment twice in either (a second vote of its author: ``gatherings.Gatherings.open``).
    """
    rec = _map(value, "gathering")
    items, gone = rec.get("g"), rec.get("l", [])
    if not isinstance(items, list) or len(items) > num_fragments:
        raise ProtocolError("gathering: expected a list of at most P keys")
    if not isinstance(gone, list) or len(gone) > num_fragments:
        raise ProtocolError("gathering: expected a list of at most P closed keys")
    keys, left = [], []
    for item in items:
        if not isinstance(item, list) or len(item) != 3:
            raise ProtocolError("gathering: a key is not [fragment, version, digest]")
        keys.append((fragment(item[0], num_fragments), version(item[1]), digest(item[2])))
    for item in gone:
        if not isinstance(item, list) or len(item) != 4:
            raise ProtocolError("gathering: a closed key is not [fragment, version, digest, time]")
        left.append((fragment(item[0], num_fragments), version(item[1]), digest(item[2]), _finite(item[3], "t")))
    if len({k[0] for k in keys}) != len(keys) or len({k[0] for k in left}) != len(left):
        raise ProtocolError("gathering: a fragment named twice")
    return Gathering(tuple(keys), _finite(rec.get("t", 0.0), "t"), tuple(left))


@dataclass(frozen=True)
class Declaration:
    """A matchmaking declaration under a group key: ``open`` while its author gathers;
    ``grouped``: its author left the gathering in a group (closed by it or joined), so a group
    at this key exists; ``t``: when it was stored (the swarm's Unix seconds, the author's clock)."""

    open: bool
    grouped: bool
    t: float


def parse_declaration(value: Any) -> Declaration:
    """A matchmaking declaration ``{"open": bool, "t": time, "g": bool}``. Without ``g`` (a
    node before WIRE_VERSION 4) a closed declaration counts as grouped.

    Raises:
        ProtocolError: malformed.
    """
    rec = _map(value, "declaration")
    t = _finite(rec.get("t", 0.0), "t")
    is_open = _bool(rec.get("open"), "open")
    grouped = _bool(rec.get("g"), "g") if "g" in rec else not is_open
    return Declaration(is_open, grouped and not is_open, float(t))


def parse_many(values: dict[str, Any], parse, *args) -> tuple[dict[str, Any], list[str]]:
    """Parse every ``{peer ID: value}`` of a DHT read: (parsed, peers whose value failed). Subkeys
    that are not Ed25519 peer IDs are skipped (owner-only records live under the author's ID)."""
    good, bad = {}, []
    for peer, value in values.items():
        if not is_peer_id(peer):
            continue
        try:
            good[peer] = parse(value, *args)
        except ProtocolError:
            bad.append(peer)
    return good, bad


__all__ = [n for n in dir() if n.startswith(("parse_", "MAX_")) or n in (
    "HeadsRecord", "Gathering", "JoinRequest", "JoinAnswer", "StateRequest", "StateAnswer", "ReduceRequest",
    "ReducerStatement", "FinalRequest", "DialbackAnswer", "digest", "version", "fragment", "members", "round_id",
    "wire_digest", "wire_members")]
