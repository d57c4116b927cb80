"""The reducer side of the butterfly all-reduce (the protocol: :mod:`p2pdiloco.net.rounds.allreduce`).

A :class:`Reducer` serves ``ar.reduce`` (a member's signed slice of its pseudo-gradient for the
tensors this node reduces) and ``ar.final`` (phase 2: re-merge over the contributor set every
member computed), checks every slice at one boundary (``reduce_messages``, signature, counters,
finite values), merges what it accepted with ``core.robust.robust_merge`` and answers every
member with one signed statement (phase 1 and phase 2 merges: its base
:class:`~p2pdiloco.net.rounds.reduction.Reduction`). It holds the state both sides share (groups, rounds,
counters, signatures); :class:`~p2pdiloco.net.rounds.allreduce.AllReducer` adds the member side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from p2pdiloco.core.choices import DEFAULT_OUTLIER_FACTOR, OUTLIER_POLICIES
from p2pdiloco.core.fragments import Fragment, assign_parts
from p2pdiloco.core.merge import is_finite_contribution
from p2pdiloco.core.periods import FRACTION_GRID, span_fraction
from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.net.rounds import reduce_messages as rm
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.rounds.matchmaking import Group
from p2pdiloco.net.rounds.reduction import Reduction
from p2pdiloco.net.rounds.results import GROUP_WAIT_S, AllReduceStats, group_fingerprint, round_wait
from p2pdiloco.net.transport.swarm import Header, Swarm
from p2pdiloco.trust import signing
from p2pdiloco.trust.identity import public_key_of

log = logging.getLogger(__name__)

# Reasons a reducer rejects a slice. All but "missing" and "outlier" also ban the sender.
BANNING_REASONS = ("wrong_key", "bad_signature", "bad_counters", "malformed", "non_finite")
KEEP_DECIDED_SECONDS = 30.0  # a decided round is kept this long after its deadline, for phase 2
MAX_PENDING = 256  # undecided rounds one reducer holds at most
MAX_PENDING_PER_PEER = 2  # ... of which one member may have opened at most this many per fragment
MAX_KEPT = 1024  # rounds (decided or not) held at most; the oldest decided are forgotten first
@dataclass
class _Round:
    """A reducer's view of one round."""

    round_id: str
    fragment: int
    version: int
    digest: str
    members: tuple[str, ...]
    index: int  # this reducer's position in members
    shares: tuple[int, ...]  # the group's all-reduce shares (() = equal)
    rates: tuple[int, ...]  # the members' link rates in the group (KiB/s; () = unknown): set the deadline
    slots: tuple[int, ...]  # fragment slots this reducer merges
    creator: str = ""  # the member whose slice created this round here
    created: float = field(default_factory=swarm_clock.monotonic)
    parts: dict[str, tuple[list[torch.Tensor], int, int, int, int]] = field(default_factory=dict)  # tensors, counters
    rejected: dict[str, str] = field(default_factory=dict)
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    contributors: tuple[int, ...] = ()
    answer: tuple[Header, bytes] = ({}, b"")
    final: tuple[tuple[int, ...], Header, bytes] | None = None
    trust: tuple[float, ...] = ()  # per member, this reducer's trust multiplier, frozen at the round's first merge


class Reducer(Reduction):
    """Serves ``ar.reduce`` and ``ar.final`` for the groups this node is a member of, and holds
    the state and signatures both sides of the all-reduce share. One per node (as its AllReducer).

    Args:
        swarm: the transport (its identity signs, its ban list is consulted and extended).
        fragments: the model's fragments (identical on every member).
        precision: wire precision of pseudo-gradient slices and merged slices.
        timeout: liveness timeout (seconds): how long a reducer waits for missing members.
        sync_every: H, inner steps per outer period (``round_fraction``); equal on every
            member (protocol tag).
        run_id: the run's name (with its protocol tag), part of every signature.
        outliers: robust-merge policy for norms far above the round's median: ``clip``,
            ``drop`` or ``off`` (non-finite contributions are always dropped).
        outlier_factor: "far above" means more than this many times the lower median (or the
            reducer's own) norm.
    """

    def __init__(self, swarm: Swarm, fragments: Sequence[Fragment], precision: str, timeout: float, *,
                 sync_every: int, run_id: str = "", outliers: str = "clip",
                 outlier_factor: float = DEFAULT_OUTLIER_FACTOR):
        wire.wire_dtype(precision)
        if outliers not in OUTLIER_POLICIES:
            raise ValueError(f"unknown outlier policy {outliers!r}; choose one of {OUTLIER_POLICIES}")
        self.swarm, self.fragments, self.precision, self.timeout = swarm, tuple(fragments), precision, timeout
        self.sync_every = sync_every
        self.run_id, self.outliers, self.outlier_factor = run_id, outliers, outlier_factor
        self._rounds: dict[str, _Round] = {}
        self._groups: dict[tuple[str, bytes], Group] = {}  # (round ID, fingerprint) -> our groups, newest last
        self._group_added = asyncio.Event()  # set, and replaced, when a group is added
        self._fragment_bytes = [wire.wire_nbytes([s.shape for s in f.slots], precision) for f in self.fragments]
        self.stats = AllReduceStats()
        # a member's multiplier of its token weight in the merges this node reduces, in [0, 1]
        # (the node's Reputation.merge_weight: locally earned, docs/trust.md); None: all 1
        self.trust: Callable[[str], float] | None = None
        self.trust_used: dict[str, tuple[float, ...]] = {}  # round ID -> _Round.trust (the last 256 rounds)
        # round ID -> members with a tensor left out of this node's own merge as pointing against
        # its Δ (the last 256 rounds): they earn no reputation from the round (node.rounds.Rounds._credit)
        self.muted: dict[str, frozenset[str]] = {}
        self._trim_logged: dict[str, float] = {}  # peer -> monotonic s its trimmed tensors were last logged

    async def start(self) -> None:
        await self.swarm.add_handler("ar.reduce", self._on_reduce, max_payload=max(self._fragment_bytes))
        await self.swarm.add_handler("ar.final", self._on_final, max_payload=0)

    def expect(self, group: Group) -> None:
        """Serve the members of ``group`` (one this node is a member of, as its matchmaking
        formed it) as a reducer. :meth:`run` calls it too; the node calls it as soon as the
        group is formed, as other members may send their slices before its own run starts.
        The last ``MAX_KEPT`` groups are kept."""
        self._groups[(group.round_id, group_fingerprint(group))] = group
        while len(self._groups) > MAX_KEPT:
            del self._groups[next(iter(self._groups))]
        self._group_added.set()
        self._group_added = asyncio.Event()

    def _shapes(self, fragment: int, slots: Sequence[int]) -> list[tuple[int, ...]]:
        frag = self.fragments[fragment]
        return [frag.slots[i].shape for i in slots]

    def _slice_bytes(self, group: Group, r: int) -> int:
        """The most bytes reducer r's merged slice in ``group`` takes on the wire."""
        parts = self._parts(group.key.fragment, len(group.members), group.shares)
        return wire.merged_max_nbytes(self._shapes(group.key.fragment, parts[r]), self.precision, len(group.members))

    def _wait(self, group: Group) -> float:
        """:func:`round_wait` for a round of ``group`` (seconds), for the larger of a slice and
        a merged slice of its fragment (``topk2``'s merged slices, the union of the
        contributions, outweigh them)."""
        frag = group.key.fragment
        merged = wire.merged_max_nbytes(self._shapes(frag, range(len(self.fragments[frag].slots))), self.precision,
                                        len(group.members))
        return round_wait(self.timeout, max(self._fragment_bytes[frag], merged), group.shares, group.rates)

    def _call_timeout(self, group: Group) -> float:
        """Seconds a member waits for a reducer's answer: the reducers' wait, then as long
        again as the wait exceeds ``timeout`` (the merged slices travel back), plus 5 s."""
        wait = self._wait(group)
        return 2 * wait - self.timeout + 5

    def _parts(self, fragment: int, n: int, shares: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        return assign_parts([s.numel for s in self.fragments[fragment].slots], n, shares)

    # ---- signatures ------------------------------------------------------------------------
    def _sign(self, purpose: str, fields: list) -> bytes:
        t0 = time.perf_counter()
        sig = signing.sign(self.swarm.identity, purpose, fields)
        self.stats.sign_seconds += time.perf_counter() - t0
        return sig

    def _verify(self, peer: str, purpose: str, fields: list, sig: object) -> bool:
        t0 = time.perf_counter()
        ok = isinstance(sig, bytes) and signing.verify_by_peer(peer, purpose, fields, sig)
        self.stats.verify_seconds += time.perf_counter() - t0
        return ok

    def _digest(self, data: bytes, *, signing_side: bool) -> bytes:
        t0 = time.perf_counter()
        h = signing.sha256(data)
        dt = time.perf_counter() - t0
        if signing_side:
            self.stats.sign_seconds += dt
        else:
            self.stats.verify_seconds += dt
        return h

    def _merged_fields(self, rnd: _Round | Group, reducer: int, phase: int, contributors: Sequence[int],
                       counters: Sequence[int], h: bytes) -> list:
        if isinstance(rnd, Group):
            frag, version, digest, round_id = rnd.key.fragment, rnd.key.version, rnd.key.digest, rnd.round_id
        else:
            frag, version, digest, round_id = rnd.fragment, rnd.version, rnd.digest, rnd.round_id
        return signing.merged_fields(self.run_id, frag, version, digest, round_id, reducer, phase, contributors,
                                     counters, h)

    def _counters(self, contributions: Sequence[tuple[int, int, int, int]]) -> tuple[int, int, int]:
        """(tokens summed, lower median position, ``span_fraction`` in 1/FRACTION_GRID units)
        of these (tokens, steps, span, position), in member order. The median: one member
        cannot move the schedule position of a group it does not make at least half of."""
        first = span_fraction([c[:3] for c in contributions], self.sync_every)
        positions = sorted(c[3] for c in contributions)
        return sum(c[0] for c in contributions), positions[(len(positions) - 1) // 2], round(first * FRACTION_GRID)

    # ---- reducer side ----------------------------------------------------------------------
    async def _on_reduce(self, peer: str, head: Header, payload: bytes) -> tuple[Header, bytes]:
        return await self._receive(peer, head, payload)

    async def _round_for(self, peer: str, req: rm.ReduceRequest) -> _Round:
        """The round a request belongs to, created on its first slice from the group it names
        (waiting up to ``GROUP_WAIT_S`` for our matchmaking to give it). ProtocolError when
        we hold no such group, or this reducer and the sender are not both members of it, or
        when the sender already has ``MAX_PENDING_PER_PEER`` undecided rounds here (or this
        reducer ``MAX_PENDING`` in all)."""
        try:
            async with asyncio.timeout(GROUP_WAIT_S):
                while (group := self._groups.get((req.round, req.group))) is None:
                    await self._group_added.wait()
        except TimeoutError:
            raise ProtocolError("no group of ours has that round ID and fingerprint") from None
        me, members, frag = self.swarm.peer_id, group.members, group.key.fragment
        if me not in members or peer not in members or members.index(me) != req.reducer:
            raise ProtocolError("not a member of that round")
        rnd = self._rounds.get(req.round)
        if rnd is None:
            pending = [r for r in self._rounds.values() if not r.decided.is_set()]
            if len(pending) >= MAX_PENDING or \
                    sum(r.creator == peer for r in pending) >= MAX_PENDING_PER_PEER * len(self.fragments):
                raise ProtocolError("too many open rounds")
            slots = self._parts(frag, len(members), group.shares)[req.reducer]
            if not slots:
                raise ProtocolError("this member reduces no tensor in that round")
            if len(self._rounds) >= MAX_KEPT:  # bounded: forget the oldest decided rounds
                for old in sorted((r for r in self._rounds.values() if r.decided.is_set()),
                                  key=lambda r: r.created)[:len(self._rounds) - MAX_KEPT + 1]:
                    self._forget(old)
            rnd = self._rounds[req.round] = _Round(req.round, frag, group.key.version, group.key.digest, members,
                                                   req.reducer, group.shares, group.rates, slots, creator=peer)
            wait = self._wait(group)
            loop = asyncio.get_running_loop()
            loop.call_later(wait, self._deadline, rnd)
            loop.call_later(2 * wait - self.timeout + 5 + KEEP_DECIDED_SECONDS, self._forget, rnd)  # members' wait
        elif (rnd.members, rnd.shares, rnd.rates, rnd.fragment, rnd.version, rnd.digest) != \
                (members, group.shares, group.rates, frag, group.key.version, group.key.digest):
            raise ProtocolError("request differs from the round's members, shares, fragment, version or digest")
        return rnd

    async def _receive(self, peer: str, head: Header, payload: bytes) -> tuple[Header, bytes]:
        """Check one member's slice, add it to its round (or reject it), wait for the round's
        decision and return the reducer's signed statement.

        Raises:
            ProtocolError: the request does not parse (:func:`records.parse_reduce_request`;
                dropped and counted), names no round of ours, or is a duplicate.
        """
        try:
            req = rm.parse_reduce_request(head)
        except ProtocolError:
            self.swarm.drop(peer, "reduce_request")
            raise
        try:
            rnd = await self._round_for(peer, req)
        except ProtocolError as e:
            self.swarm.drop(peer, "reduce_round")
            raise ProtocolError(str(e)) from None
        if not rnd.decided.is_set():
            if peer in rnd.parts or peer in rnd.rejected:
                raise ProtocolError("duplicate slice")
            reason, tensors = self._check_slice(peer, rnd, req, payload)
            if reason is None:
                rnd.parts[peer] = (tensors, req.tokens, req.steps, req.span, req.position)
            else:
                self._reject(rnd, peer, reason)
            if len(rnd.parts) + len(rnd.rejected) == len(rnd.members):
                self._decide(rnd)
        await rnd.decided.wait()
        return rnd.answer

    def _check_slice(self, peer: str, rnd: _Round, req: rm.ReduceRequest, payload: bytes) -> tuple[str | None, list]:
        """(None, tensors) for a slice that verifies, else (reason, [])."""
        if peer in self.swarm.bans:
            return "banned", []
        try:
            public_key_of(peer)  # the key the signature is checked with
        except ValueError:  # not an Ed25519 peer ID: it cannot sign
            return "wrong_key", []
        fields = signing.contribution_fields(self.run_id, rnd.fragment, rnd.version, rnd.digest, rnd.round_id,
                                             rnd.members, rnd.index, req.tokens, req.steps, req.span, req.position,
                                             self._digest(payload, signing_side=False), rnd.shares)
        if not self._verify(peer, "ar.contrib", fields, req.signature):
            return "bad_signature", []
        if req.tokens < 0 or req.steps < 0 or req.span < 1 or req.position < 0:
            return "bad_counters", []
        try:
            tensors = wire.decode(payload, self._shapes(rnd.fragment, rnd.slots), self.precision)
        except ProtocolError:
            return "malformed", []
        if not is_finite_contribution(tensors):
            return "non_finite", []
        return None, tensors

    def _reject(self, rnd: _Round, peer: str, reason: str) -> None:
        rnd.rejected[peer] = reason
        self.stats.rejected[reason] += 1
        log.warning("round %s f%d: rejected the contribution of %s: %s", rnd.round_id, rnd.fragment, peer[-8:], reason)
        if reason in BANNING_REASONS:
            self.swarm.ban(peer, f"{reason} contribution in round {rnd.round_id} of fragment {rnd.fragment}")

    def _deadline(self, rnd: _Round) -> None:
        if not rnd.decided.is_set():
            for m in rnd.members:
                if m not in rnd.parts and m not in rnd.rejected:
                    self._reject(rnd, m, "missing")
            self._decide(rnd)

    def _forget(self, rnd: _Round) -> None:
        if self._rounds.get(rnd.round_id) is rnd:
            del self._rounds[rnd.round_id]
