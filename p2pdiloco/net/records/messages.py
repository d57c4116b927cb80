"""RPC requests and answers as the parsing boundary (:mod:`p2pdiloco.net.records.parse`) reads
them: matchmaking joins (``mm.join``), state and delta downloads (``state.get``,
``state.deltas``), a reducer's round counters and dial-back checks. Each ``parse_*`` returns a
frozen dataclass of checked fields or raises :class:`~p2pdiloco.errors.ProtocolError`."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from typing import Any

from p2pdiloco.core.periods import FRACTION_GRID, Ledger
from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records.fields import (MAX_COUNT, MAX_GROUP, MAX_RATE_KIB, _bool, _bytes, _finite, _int, _map,
                                          _text, digest, fragment, members, rates, round_id, shares, version)


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
    (``core.periods.Ledger``, covered by the digest) of the state in its body."""

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
