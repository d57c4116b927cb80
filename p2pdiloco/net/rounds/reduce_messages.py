"""The all-reduce's messages (``ar.reduce``, its reducers' statements, ``ar.final``), parsed at
the one boundary as :mod:`p2pdiloco.net.records.parse` parses every other peer input: typed and
bounded, a malformed one a ``ProtocolError`` (dropped and counted by the caller,
``net.rounds.allreduce``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records.parse import (MAX_COUNT, MAX_GROUP, _bytes, _int, _map, round_counters,
                                   round_id)

__all__ = ["FinalRequest", "ReduceRequest", "ReducerStatement", "parse_final_request", "parse_reduce_request",
           "parse_statement"]


@dataclass(frozen=True)
class ReduceRequest:
    """``ar.reduce``: one member's signed slice of its pseudo-gradient for one reducer.

    Attributes:
        round: round ID; group: the group's fingerprint (16 bytes,
        ``allreduce.group_fingerprint``: the reducer, a member, holds the group itself);
        reducer: index of the addressed reducer in the group's members; tokens, steps: the
        member's counters (signed; negative values parse, so that the reducer can reject
        the signed slice as ``bad_counters`` and ban its author); span: rounds its progress
        spans (``Learner.span``; signed; values < 1 parse, rejected as ``bad_counters``
        too); position: its schedule position (``Learner.step``; signed; negative values
        parse, rejected as ``bad_counters``); signature: 64 bytes over
        ``signing.contribution_fields`` by the key inlined in the sender's peer ID (the
        transport authenticates the sender, so the request does not carry the key).
    """

    round: str
    group: bytes
    reducer: int
    tokens: int
    steps: int
    span: int
    position: int
    signature: bytes


def parse_reduce_request(header: Any) -> ReduceRequest:
    h = _map(header, "reduce request")
    return ReduceRequest(
        round_id(h.get("round")), _bytes(h.get("g"), "group fingerprint", 16),
        _int(h.get("r"), "reducer", 0, MAX_GROUP - 1), _int(h.get("tokens"), "tokens", -MAX_COUNT),
        _int(h.get("steps"), "steps", -MAX_COUNT), _int(h.get("span"), "span", -MAX_COUNT),
        _int(h.get("pos"), "position", -MAX_COUNT), _bytes(h.get("sig"), "signature", 64))


@dataclass(frozen=True)
class ReducerStatement:
    """A reducer's answer: the member indices it merged (sorted, distinct), the round's
    counters over them (tokens summed, lower median schedule position, ``span_fraction`` as an
    integer in [0, FRACTION_GRID]) and its signature over them and the merged bytes."""

    contributors: tuple[int, ...]
    counters: tuple[int, int, int]
    signature: bytes


def parse_statement(header: Any, group_size: int) -> ReducerStatement:
    h = _map(header, "reducer statement")
    c = h.get("c")
    if not isinstance(c, list) or not 1 <= len(c) <= group_size:
        raise ProtocolError("reducer statement: wrong contributor list")
    contributors = tuple(_int(i, "contributor", 0, group_size - 1) for i in c)
    if list(contributors) != sorted(set(contributors)):
        raise ProtocolError("reducer statement: contributors not sorted and distinct")
    return ReducerStatement(contributors, round_counters(h.get("n")), _bytes(h.get("sig"), "signature", 64))


@dataclass(frozen=True)
class FinalRequest:
    """``ar.final`` (phase 2): the round, the addressed reducer, and every reducer's signed
    phase-1 statement as (reducer index, contributors, counters, sha256 of its merged bytes,
    signature)."""

    round: str
    reducer: int
    statements: tuple[tuple[int, tuple[int, ...], tuple[int, int, int], bytes, bytes], ...]


def parse_final_request(header: Any) -> FinalRequest:
    h = _map(header, "final request")
    st = h.get("st")
    if not isinstance(st, list) or not 1 <= len(st) <= MAX_GROUP:
        raise ProtocolError("final request: wrong statement list")
    out = []
    for item in st:
        if not isinstance(item, list) or len(item) != 5 or not isinstance(item[1], list) \
                or len(item[1]) > MAX_GROUP:
            raise ProtocolError("final request: a statement is not [reducer, contributors, counters, hash, signature]")
        r = _int(item[0], "reducer", 0, MAX_GROUP - 1)
        contributors = tuple(_int(i, "contributor", 0, MAX_GROUP - 1) for i in item[1])
        out.append((r, contributors, round_counters(item[2]), _bytes(item[3], "hash", 32),
                    _bytes(item[4], "signature", 64)))
    return FinalRequest(round_id(h.get("round")), _int(h.get("r"), "reducer", 0, MAX_GROUP - 1), tuple(out))
