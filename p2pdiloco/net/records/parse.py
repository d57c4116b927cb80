"""The one boundary where a peer's input is parsed: typed, bounded records and messages.

Every value this node reads from the DHT (heads records, gathering announcements,
matchmaking declarations) and every RPC request or answer it acts on passes through one
``parse_*`` function here before any other code looks at it. A parser returns a frozen
dataclass whose fields have the documented types and ranges, or raises
:class:`~p2pdiloco.errors.ProtocolError`; it never raises anything else, whatever the
input (tests/test_fuzz_records.py feeds every parser 10,000 hostile inputs). Callers drop
what fails and count it per peer (``Swarm.drop``).

Bounds (module constants; far above anything an honest peer sends):

* versions: ``0 <= v <= MAX_VERSION`` (2**48: one outer step a millisecond for 8,900
  years; ``fragment_digest`` packs versions as int64, so 2**63 would not even hash);
* digests: sha256, 32 bytes on the wire (:func:`wire_digest`; 64 lower-case hex digits in the
  node, what :func:`digest` returns); round IDs: 1 to ``MAX_ROUND_ID`` characters;
* fragment indices: ``0 <= p < num_fragments`` (the run's P, at most ``MAX_FRAGMENTS``);
* member lists: 1 to ``MAX_GROUP`` Ed25519 public keys (32 bytes) whose peer IDs are sorted, no
  duplicates;
* counters (tokens, steps): ``0 <= n <= MAX_COUNT`` (2**53, exact in a float); heartbeat
  periods 1 to ``MAX_BEAT_S`` seconds; other numbers finite; names and states at most
  ``MAX_TEXT`` characters; signatures 64 bytes, public keys 32 bytes;
* link rates (``mm.join``'s ``bw``): 0 to ``MAX_RATE_KIB`` KiB/s; all-reduce shares: one
  integer in [0, ``SHARE_GRID``] per member, summing to 1 .. ``SHARE_GRID`` (or absent: equal).

Integers must be ``int`` (not ``bool``, not ``float``): msgpack keeps the distinction.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from p2pdiloco.core.outer import FRACTION_GRID, Ledger
from p2pdiloco.errors import ProtocolError
from p2pdiloco.trust.identity import is_peer_id, peer_id_of, public_key_of

MAX_VERSION = 2**48
MAX_FRAGMENTS = 1024
MAX_GROUP = 256
MAX_ROUND_ID = 64
MAX_TEXT = 64
MAX_COUNT = 2**53
MAX_RECORD_KEYS = 32
MAX_RATE_KIB = 2**32  # KiB/s: 4 TiB/s
BEAT_S = 20  # seconds: the shortest heartbeat period a node states (pushes.beat_period), and a record's without "b"
MAX_BEAT_S = 160  # ... and the longest (pushes.beat_period at MAX_AUDIENCE): a dead record lives 205 s at most
SHARE_GRID = 1000  # all-reduce shares are integers in [0, SHARE_GRID] (shares.bandwidth_shares)


# ---- field checks ---------------------------------------------------------------------------
def _int(x: Any, what: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise ProtocolError(f"{what}: expected an integer in [{lo}, {hi}]")
    return x


def _finite(x: Any, what: str) -> float:
    if type(x) not in (int, float) or not math.isfinite(x):
        raise ProtocolError(f"{what}: expected a finite number")
    return float(x)


def _text(x: Any, what: str, hi: int = MAX_TEXT, lo: int = 0) -> str:
    if not isinstance(x, str) or not lo <= len(x) <= hi:
        raise ProtocolError(f"{what}: expected a string of {lo} to {hi} characters")
    return x


def _bytes(x: Any, what: str, size: int) -> bytes:
    if not isinstance(x, bytes) or len(x) != size:
        raise ProtocolError(f"{what}: expected {size} bytes")
    return x


def digest(x: Any, what: str = "digest") -> str:
    """A sha256 digest as sent (:func:`wire_digest`: exactly 32 bytes), returned in the node's
    own form, 64 lower-case hex digits."""
    if not isinstance(x, bytes) or len(x) != 32:
        raise ProtocolError(f"{what}: expected 32 bytes")
    return x.hex()


def wire_digest(d: str) -> bytes:
    """The wire form of the node's digest ``d`` (64 hex digits): its 32 bytes, half the size
    (a digest is in most pushes and matchmaking calls: docs/benchmarks/control_plane.md).
    :func:`digest` reads it back.

    Raises:
        ValueError: ``d`` is not hex (the node's own digests always are).
    """
    return bytes.fromhex(d)


def version(x: Any, what: str = "version") -> int:
    """A fragment version: an int in [0, MAX_VERSION]."""
    return _int(x, what, 0, MAX_VERSION)


def fragment(x: Any, num_fragments: int, what: str = "fragment") -> int:
    """A fragment index: an int in [0, num_fragments)."""
    return _int(x, what, 0, num_fragments - 1)


def round_id(x: Any) -> str:
    return _text(x, "round id", MAX_ROUND_ID, 1)


def members(x: Any) -> tuple[str, ...]:
    """A group's member list as sent (:func:`wire_members`): 1 to MAX_GROUP Ed25519 public keys
    of 32 bytes (length checked first) whose peer IDs are sorted and distinct; returned as those
    peer IDs."""
    if not isinstance(x, list) or not 1 <= len(x) <= MAX_GROUP:
        raise ProtocolError(f"members: expected a list of 1 to {MAX_GROUP} public keys")
    if not all(isinstance(m, bytes) and len(m) == 32 for m in x):
        raise ProtocolError("members: expected 32-byte Ed25519 public keys")
    peers = [peer_id_of(m) for m in x]
    if peers != sorted(set(peers)):
        raise ProtocolError("members: expected sorted, distinct peer IDs")
    return tuple(peers)


def wire_members(peers: Sequence[str]) -> list[bytes]:
    """The wire form of a member list of Ed25519 peer IDs: their public keys, 32 bytes each (the
    peer ID inlines the key; its base58 text takes 52 characters), which
    :func:`members` reads back.

    Raises:
        ValueError: a peer ID that inlines no Ed25519 key (the node's groups hold none).
    """
    return [public_key_of(p) for p in peers]


def shares(x: Any, group_size: int) -> tuple[int, ...]:
    """All-reduce shares of a group (``core.fragments.assign_parts``): absent or empty means equal
    shares, ``()``; else ``group_size`` integers in [0, SHARE_GRID] summing to 1 .. SHARE_GRID."""
    if x is None or x == []:
        return ()
    if not isinstance(x, list) or len(x) != group_size:
        raise ProtocolError(f"shares: expected a list of {group_size} integers")
    out = tuple(_int(v, "share", 0, SHARE_GRID) for v in x)
    if not 1 <= sum(out) <= SHARE_GRID:
        raise ProtocolError(f"shares: the sum must be in [1, {SHARE_GRID}]")
    return out


def rates(x: Any, group_size: int) -> tuple[int, ...]:
    """Members' link rates as the leader had them (KiB/s, 0: unknown): absent or empty is
    ``()``, else ``group_size`` integers in [0, MAX_RATE_KIB]."""
    if x is None or x == []:
        return ()
    if not isinstance(x, list) or len(x) != group_size:
        raise ProtocolError(f"rates: expected a list of {group_size} integers")
    return tuple(_int(v, "rate", 0, MAX_RATE_KIB) for v in x)


def _map(value: Any, what: str) -> dict:
    if not isinstance(value, dict) or len(value) > MAX_RECORD_KEYS:
        raise ProtocolError(f"{what}: expected a map of at most {MAX_RECORD_KEYS} fields")
    return value


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


def _bool(x: Any, what: str) -> bool:
    if type(x) is not bool:
        raise ProtocolError(f"{what}: expected a boolean")
    return x


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


# ---- RPC messages ---------------------------------------------------------------------------
@dataclass(frozen=True)
class JoinRequest:
    """``mm.join``: the (fragment, version, digest) the joiner wants to merge at, its
    ``signature`` over ``signing.join_fields`` (64 bytes: what lets the other members check that
    it asked to join), and its measured link rate ``bandwidth`` in KiB/s
    (``drops.LinkMeter``; 0: not measured yet)."""

    fragment: int
    version: int
    digest: str
    signature: bytes
    bandwidth: int = 0


def parse_join_request(header: Any, num_fragments: int) -> JoinRequest:
    h = _map(header, "join request")
    return JoinRequest(fragment(h.get("f"), num_fragments), version(h.get("v")), digest(h.get("d")),
                       _bytes(h.get("sig"), "signature", 64), _int(h.get("bw", 0), "bandwidth", 0, MAX_RATE_KIB))


@dataclass(frozen=True)
class JoinAnswer:
    """A leader's answer to ``mm.join``: a closed group (``members``, ``round``, the members'
    all-reduce ``shares``, see :func:`shares`, link ``rates``, see :func:`rates`, and every
    member's ``mm.join`` signature, ``signatures``, in member order, 64 bytes each or empty:
    the leader leaves out the joiner's own, which the joiner does not check, and an empty
    one of another member fails the joiner's check), or a ``status`` of "redirect" (another
    peer leads) or "closed"."""

    status: str
    members: tuple[str, ...] = ()
    round: str = ""
    formed_in: float = 0.0
    shares: tuple[int, ...] = ()
    rates: tuple[int, ...] = ()
    signatures: tuple[bytes, ...] = ()


def parse_join_answer(header: Any) -> JoinAnswer:
    h = _map(header, "join answer")
    if "members" in h:
        group = members(h["members"])
        sigs = h.get("js")
        if not isinstance(sigs, list) or len(sigs) != len(group):
            raise ProtocolError("join answer: expected one join signature per member")
        return JoinAnswer("group", group, round_id(h.get("round")), max(0.0, _finite(h.get("t", 0.0), "t")),
                          shares(h.get("s"), len(group)), rates(h.get("bw"), len(group)),
                          tuple(x if x == b"" else _bytes(x, "join signature", 64) for x in sigs))
    status = h.get("status")
    if status not in ("redirect", "closed"):
        raise ProtocolError("join answer: neither a group nor a status")
    return JoinAnswer(status)


@dataclass(frozen=True)
class StateRequest:
    """``state.get``: which fragment; ``join``: the caller is joining the swarm."""

    fragment: int
    join: bool = False


def parse_state_request(header: Any, num_fragments: int) -> StateRequest:
    h = _map(header, "state request")
    return StateRequest(fragment(h.get("f"), num_fragments), _bool(h.get("join", False), "join"))


@dataclass(frozen=True)
class StateAnswer:
    """The header of a ``state.get`` answer: the version, digest and ledger
    (``core.outer.Ledger``, covered by the digest) of the state in its body."""

    version: int
    digest: str
    ledger: Ledger


def parse_state_answer(header: Any) -> StateAnswer:
    h = _map(header, "state answer")
    led = h.get("l")
    if not isinstance(led, list) or len(led) != 5:
        raise ProtocolError("state answer: ledger is not [period start, period tokens, rate, period fraction, "
                            "total tokens]")
    rate = led[2]
    if not isinstance(rate, float) or not math.isfinite(rate) or not 0 <= rate <= MAX_COUNT:
        raise ProtocolError("state answer: ledger rate is not a finite float in range")
    return StateAnswer(version(h.get("v")), digest(h.get("d")),
                       Ledger(_int(led[0], "period start", -1, MAX_COUNT), _int(led[1], "period tokens", 0, MAX_COUNT),
                              rate, _int(led[3], "period fraction", 0, FRACTION_GRID),
                              _int(led[4], "total tokens", 0, MAX_COUNT)))


@dataclass(frozen=True)
class DeltaRequest:
    """``state.deltas`` (``net.state.deltas``): the rounds of ``fragment`` from the state the caller holds
    to the one it asks for (``to_version`` > ``version``), in at most ``max_bytes`` of slices."""

    fragment: int
    version: int
    digest: str
    to_version: int
    to_digest: str
    max_bytes: int


def parse_delta_request(header: Any, num_fragments: int, max_steps: int) -> DeltaRequest:
    h = _map(header, "delta request")
    v, to = version(h.get("v")), version(h.get("tv"), "to version")
    if not v < to <= v + max_steps:
        raise ProtocolError(f"delta request: from v{v} to v{to}, not 1 to {max_steps} rounds ahead")
    return DeltaRequest(fragment(h.get("f"), num_fragments), v, digest(h.get("d")), to,
                        digest(h.get("td"), "to digest"), _int(h.get("max"), "max bytes"))


@dataclass(frozen=True)
class DeltaStep:
    """One round of a ``state.deltas`` answer: the digest of the state it makes, the round's
    counters (``RoundResult``: tokens, position, span fraction in 1/FRACTION_GRID units), its
    group's size, the precision of its merged slices, and per reducer (slot indices, bytes)."""

    digest: str
    tokens: int
    position: int
    first: int
    members: int
    precision: str
    parts: tuple[tuple[tuple[int, ...], int], ...]


def parse_delta_answer(header: Any, steps: int, num_slots: int, precisions: frozenset[str]) -> tuple[DeltaStep, ...] | None:
    """The ``steps`` rounds of a ``state.deltas`` answer, their parts' slots covering the
    fragment's ``num_slots`` once; None when the holder has no such chain (``{"none": why}``)."""
    h = _map(header, "delta answer")
    if "none" in h:
        _text(h["none"], "reason", 200)
        return None
    raw = h.get("s")
    if not isinstance(raw, list) or len(raw) != steps:
        raise ProtocolError(f"delta answer: expected {steps} rounds")
    out = []
    for st in raw:
        if not (isinstance(st, list) and len(st) == 7 and isinstance(st[5], str) and st[5] in precisions
                and isinstance(st[6], list) and 1 <= len(st[6]) <= num_slots):
            raise ProtocolError("delta answer: a round is not [digest, tokens, position, first, members, precision, parts]")
        if not all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], list) and 1 <= len(x[0]) <= num_slots
                   for x in st[6]):
            raise ProtocolError("delta answer: a part is not [slot indices, bytes]")
        pp = [(tuple(_int(i, "slot", 0, num_slots - 1) for i in slots), _int(n, "part bytes")) for slots, n in st[6]]
        if sorted(i for slots, _ in pp for i in slots) != list(range(num_slots)):
            raise ProtocolError("delta answer: the parts do not cover every slot once")
        tokens, position, first = round_counters(st[1:4])
        out.append(DeltaStep(digest(st[0]), tokens, position, first, _int(st[4], "members", 1, MAX_GROUP), st[5], tuple(pp)))
    return tuple(out)



def round_counters(value: Any) -> tuple[int, int, int]:
    """[tokens, position, span fraction in 1/FRACTION_GRID] of a reducer's statement."""
    if not isinstance(value, list) or len(value) != 3:
        raise ProtocolError("round counters: not [tokens, position, fraction]")
    return (_int(value[0], "tokens", 0, MAX_COUNT), _int(value[1], "position", 0, MAX_COUNT),
            _int(value[2], "fraction", 0, FRACTION_GRID))


MAX_DIALBACK_PORTS = 4


def parse_dialback_request(header: Any) -> tuple[int, ...]:
    """A dial-back request (``net.transport.reachability``): 1 to ``MAX_DIALBACK_PORTS`` TCP ports in
    [1, 65535]; returned sorted, without duplicates."""
    ports = _map(header, "dial-back request").get("ports")
    if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_DIALBACK_PORTS:
        raise ProtocolError(f"dial-back request: expected 1 to {MAX_DIALBACK_PORTS} ports")
    return tuple(sorted({_int(x, "port", 1, 65535) for x in ports}))


@dataclass(frozen=True)
class DialbackAnswer:
    """A checker's answer: the IP address it saw us connect from, and which of the asked
    ports it could open a TCP connection to there."""

    observed: str
    reachable: tuple[int, ...]


def parse_dialback_answer(header: Any) -> DialbackAnswer:
    h = _map(header, "dial-back answer")
    try:
        observed = str(ipaddress.ip_address(_text(h.get("observed"), "observed address", 45, 2)))
    except ValueError:
        raise ProtocolError("observed address: not an IP address") from None
    reachable = h.get("reachable")
    if not isinstance(reachable, list) or len(reachable) > MAX_DIALBACK_PORTS:
        raise ProtocolError(f"dial-back answer: expected at most {MAX_DIALBACK_PORTS} ports")
    return DialbackAnswer(observed, tuple(sorted({_int(x, "port", 1, 65535) for x in reachable})))


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
