"""Catch-ups as deltas: a node a few versions behind on a fragment gets the rounds it missed,
not the state (docs/benchmarks/catchups.md).

A state download carries Θ and the outer momentum in fp32, 8 bytes per parameter; a round's
merged pseudo-gradient, as the wire carried it, 0.5 bytes per parameter in int4 (plus scales).
So a node that holds the state (version v, digest d) of a fragment and finds the swarm at
(V, D), V − v <= ``MAX_STEPS``, asks a holder for the rounds v+1 .. V (``state.deltas``): per
round its merged slices as the reducers sent them (``RoundResult.wire``; a lone round's Δ in
fp32, since it never went through the codec), its counters and the digest of the state it made.
It decodes each round's slices, applies the same outer step every member applied
(``core.outer.apply_round``, bit-identical on every CPU kernel
set: tests/test_cpu_kernels.py) and checks each digest on the way: a chain that does not end at
(V, D) is not installed, and the node downloads the state instead. A holder keeps its last
rounds per fragment (its own commits, and the rounds it got as deltas) within half the
fragment's state bytes (``RoundLog``); it answers ``{"none": reason}`` when its log does not
reach from the caller's state, and the caller downloads the state. The answer is asked for only
when the rounds cost less than half the state (``DELTA_SHARE``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from p2pdiloco.core.fragments import Fragment
from p2pdiloco.core.outer import FragmentState, apply_round
from p2pdiloco.core.periods import FRACTION_GRID
from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.state.heads import Head
from p2pdiloco.net.state.downloads import SLOW_DONOR_RATE
from p2pdiloco.net.records.parse import DeltaStep
from p2pdiloco.net.rounds.results import RoundResult
from p2pdiloco.net.transport.swarm import Header, Swarm
from p2pdiloco.core.merge import is_finite_contribution

__all__ = ["DELTA_SHARE", "MAX_STEPS", "Deltas", "LoggedRound", "RoundLog", "logged", "replay_round"]

log = logging.getLogger(__name__)

MAX_STEPS = 8  # rounds one answer carries at most
DELTA_SHARE = 0.5  # rounds are asked for (and logged) within this share of the fragment's state bytes


@dataclass(frozen=True)
class LoggedRound:
    """One committed round of a fragment, as its members applied it.

    Attributes:
        anchor: (version, digest) of the state it stepped from; it made version + 1.
        step: its counters, the new state's digest, group size and slices' precision.
        bodies: the merged slices' bytes, one per ``step.parts`` entry.
    """

    anchor: tuple[int, str]
    step: DeltaStep
    bodies: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.bodies)


def logged(anchor: FragmentState, new: FragmentState, merged: RoundResult, members: int, precision: str) -> LoggedRound:
    """The round that made ``new`` from ``anchor`` with ``merged``, from a group of ``members``
    whose slices were coded in ``precision``: the slices as sent, or, for a lone round
    (``merged.wire`` empty), its Δ in fp32 (encoded exactly)."""
    if merged.wire:
        parts, bodies = tuple((s, len(b)) for s, b in merged.wire), tuple(b for _, b in merged.wire)
    else:
        body = wire.encode(merged.delta, "fp32")
        parts, bodies, precision = ((tuple(range(len(merged.delta))), len(body)),), (body,), "fp32"
    step = DeltaStep(new.digest, merged.tokens, merged.position, round(merged.first * FRACTION_GRID), members,
                     precision, parts)
    return LoggedRound((anchor.version, anchor.digest), step, bodies)


def replay_round(state: FragmentState, step: DeltaStep, bodies: Sequence[bytes], fragment: Fragment,
                sync_every: int, lr: float, momentum: float) -> FragmentState:
    """The state a round makes from ``state``: its slices decoded into slot order (fp32, slot
    shapes), then the outer step every member applied (``core.outer.apply_round``). Raises ProtocolError
    when a body does not decode for its slots or is not finite, or the result's digest is not
    ``step.digest``."""
    shapes = [s.shape for s in fragment.slots]
    delta: list[torch.Tensor | None] = [None] * len(shapes)
    for (slots, _), body in zip(step.parts, bodies, strict=True):
        tensors = wire.decode_merged(body, [shapes[i] for i in slots], step.precision, step.members)
        for i, t in zip(slots, tensors):
            delta[i] = t
    if any(t is None for t in delta) or not is_finite_contribution(delta):
        raise ProtocolError("a round's merged slices are not finite")
    new, _ = apply_round(state, delta, step.tokens, step.position, step.first / FRACTION_GRID, sync_every, lr, momentum)
    if new.digest != step.digest:
        raise ProtocolError(f"round v{new.version} makes digest {new.short()}, not the {step.digest[:12]} stated")
    return new


class RoundLog:
    """This node's last rounds per fragment (event-loop only), to serve ``state.deltas``.

    Args:
        budget: per fragment, the bytes of slices kept at most (the oldest rounds go first).
    """

    def __init__(self, budget: Sequence[int]):
        self.budget = list(budget)
        self._rounds: list[OrderedDict[tuple[int, str], LoggedRound]] = [OrderedDict() for _ in budget]

    def add(self, fragment: int, entry: LoggedRound) -> None:
        """Keep ``entry`` (one round per anchor: a later one from the same anchor replaces it)."""
        log = self._rounds[fragment]
        log.pop(entry.anchor, None)
        log[entry.anchor] = entry
        while len(log) > MAX_STEPS or sum(e.nbytes for e in log.values()) > self.budget[fragment]:
            log.popitem(last=False)

    def chain(self, fragment: int, start: tuple[int, str], end: tuple[int, str], max_bytes: int) -> list[LoggedRound] | str:
        """The rounds from the state ``start`` (version, digest) to ``end``, or why not (text)."""
        log, out, at = self._rounds[fragment], [], start
        while at != end:
            if at[0] >= end[0]:
                return f"the logged rounds do not reach v{end[0]} {end[1][:12]}"
            entry = log.get(at)
            if entry is None:
                return f"no round from v{at[0]} logged"
            out.append(entry)
            at = (at[0] + 1, entry.step.digest)
        if sum(e.nbytes for e in out) > max_bytes:
            return f"{sum(e.nbytes for e in out)} bytes of rounds, over the {max_bytes} asked for"
        return out


def answer(chain: Sequence[LoggedRound]) -> tuple[dict, bytes]:
    """The ``state.deltas`` answer for ``chain``: header and body (the slices, in order)."""
    steps = [[rec.wire_digest(e.step.digest), e.step.tokens, e.step.position, e.step.first, e.step.members,
              e.step.precision,
              [[list(slots), n] for slots, n in e.step.parts]] for e in chain]
    return {"s": steps}, b"".join(b for e in chain for b in e.bodies)


def split(steps: Sequence[DeltaStep], body: bytes) -> list[tuple[bytes, ...]]:
    """Cut an answer's body into each round's slices by the sizes its header states. Raises
    ProtocolError when they do not add up to the body's length."""
    if sum(n for st in steps for _, n in st.parts) != len(body):
        raise ProtocolError(f"the rounds state {sum(n for st in steps for _, n in st.parts)} bytes, the body has {len(body)}")
    out, at = [], 0
    for st in steps:
        bodies = []
        for _, n in st.parts:
            bodies.append(body[at:at + n])
            at += n
        out.append(tuple(bodies))
    return out


class Deltas:
    """Catch-ups as deltas for one node (module docstring): its ``RoundLog``, the
    ``state.deltas`` handler (:meth:`serve`) and the caller's side (:meth:`fetch`). Event-loop only.

    Args:
        swarm: the transport.
        fragments: the model's fragments.
        state_bytes: a fragment's state bytes (Θ and momentum, fp32) by index.
        sync_every: H, inner steps per outer period (``round_fraction``'s).
        precision: the run's wire precision (a lone round's slices are fp32).
        outer: the run's outer learning rate and Nesterov momentum.
    """

    def __init__(self, swarm: Swarm, fragments: Sequence[Fragment], state_bytes: Callable[[int], int], sync_every: int,
                 precision: str, outer: tuple[float, float]):
        self.swarm, self.fragments, self.sync_every, self.precision = swarm, tuple(fragments), sync_every, precision
        self.lr, self.momentum = outer
        self.most = [int(state_bytes(p) * DELTA_SHARE) for p in range(len(self.fragments))]
        self.log = RoundLog(self.most)
        self.catchups = 0  # states made from the rounds missed instead of downloaded

    async def serve(self, peer: str, header: Header, _: bytes) -> tuple[Header, bytes]:
        """``state.deltas``: the rounds asked for, or ``{"none": why}``."""
        try:
            request = rec.parse_delta_request(header, len(self.fragments), MAX_STEPS)
        except ProtocolError:
            self.swarm.drop(peer, "delta_request")
            raise
        chain = self.log.chain(request.fragment, (request.version, request.digest),
                               (request.to_version, request.to_digest), request.max_bytes)
        return ({"none": chain}, b"") if isinstance(chain, str) else answer(chain)

    async def fetch(self, donor: str, mine: FragmentState, head: Head, timeout: float,
                    first_reply: float) -> tuple[FragmentState, int] | None:
        """The state at ``head`` computed from ``mine`` and the rounds between them, asked of
        ``donor``, and the bytes of their slices; None where they are more than ``MAX_STEPS`` or would cost more than
        ``DELTA_SHARE`` of the state, the donor has no such rounds or refuses (the caller
        downloads the state). An answer that does not compute to the digests it states bans the
        donor (an honest one computes what every member of those rounds did). Raises
        NetworkError when the donor does not answer within ``timeout`` seconds or is unreachable."""
        p, n = mine.index, head.version - mine.version
        frag = self.fragments[p]
        if not 0 < n <= MAX_STEPS or n * wire.wire_nbytes([s.shape for s in frag.slots], self.precision) > self.most[p]:
            return None
        request = {"f": p, "v": mine.version, "d": rec.wire_digest(mine.digest), "tv": head.version,
                   "td": rec.wire_digest(head.digest), "max": self.most[p]}
        try:  # a NetworkError (no answer in time, unreachable) is the caller's to count
            reply, body = await self.swarm.call(donor, "state.deltas", request, timeout=timeout, max_reply=self.most[p],
                                                first_reply=first_reply, min_rate=SLOW_DONOR_RATE)
        except ProtocolError as e:  # refused: a peer without state.deltas, busy, an answer over max_reply
            log.debug("rounds of fragment %d from %s: %s", p, donor[-8:], e)
            return None

        def compute() -> tuple[FragmentState, list[LoggedRound]] | None:
            steps = rec.parse_delta_answer(reply, n, len(frag.slots), frozenset({self.precision, "fp32"}))
            if steps is None:
                return None
            state, entries = mine, []
            for step, bodies in zip(steps, split(steps, body)):
                entries.append(LoggedRound((state.version, state.digest), step, bodies))
                state = replay_round(state, step, bodies, frag, self.sync_every, self.lr, self.momentum)
            if (state.version, state.digest) != (head.version, head.digest):
                raise ProtocolError(f"the rounds end at {state.short()}, not at the {head.digest[:12]} asked for")
            return state, entries

        try:
            done = await asyncio.to_thread(compute)
        except ProtocolError as e:
            self.swarm.drop(donor, "delta_answer")
            self.swarm.ban(donor, f"rounds of fragment {p} that do not compute: {e}")
            return None
        if done is None:
            return None
        for entry in done[1]:  # ours to serve as well
            self.log.add(p, entry)
        self.catchups += 1
        return done[0], len(body)
