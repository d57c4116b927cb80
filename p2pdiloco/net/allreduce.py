"""Butterfly all-reduce of one fragment's pseudo-gradients within a closed group, signed and robust.

The fragment's tensors are split among the members with the same greedy balanced packing
as fragments (``assign_parts``), weighted by the group's shares (the leader's
bandwidth-aware split, ``shares.bandwidth_shares``; equal when the group has none);
member r reduces the tensors it owns, a member of share 0 none. Every member sends
each reducer its slice of the pseudo-gradient with its token and step counts, in one
``ar.reduce`` request. Whole tensors per reducer mean every norm of the radial-directional
merge is computed by exactly one peer, and everyone receives the same bytes. A request names
its group by round ID and :func:`group_fingerprint` only, not by its member list (which grew
every header with the group): every reducer is a member, and takes the group from its own
matchmaking (:meth:`AllReducer.expect`), waiting up to ``GROUP_WAIT_S`` for it when a
request overtakes the leader's answer; a request whose fingerprint differs is refused.

Signed updates (docs/trust.md). Each ``ar.reduce`` request carries the author's Ed25519
signature (``signing.message("ar.contrib", ...)``: run, fragment, version, state digest,
round id, member list, reducer index, tokens, steps, span, sha256 of the exact slice bytes).
The reducer verifies it against the key inlined in the sender's authenticated peer ID before
it decodes anything. A slice that fails (``banned``, ``wrong_key`` (a peer ID without an
inlined Ed25519 key), ``bad_signature``, ``bad_counters``, ``malformed``, ``non_finite``) is
rejected: the round goes on without it, the sender is banned for the rest of the run
(``Swarm.bans``), and the rejection is logged and counted in ``AllReducer.stats.rejected``.
The reducer merges what it accepted with :func:`p2pdiloco.core.merge.robust_merge`
(weights capped at the median; norm outliers clipped or dropped, reason ``outlier``;
every other member's weight scaled by its alignment with the reducer's own slice, which it
knows to be honest, and tensors pointing against it left out, or their member dropped, reason
``misaligned``; the members' median direction when its own slice is not among them) and
answers every member with the same
statement: the contributor set it used (member indices), the round's counters over those
contributors (their tokens summed, their lower median schedule position, and the fraction of a
period ``core.outer.span_fraction`` gives their signed tokens, steps and spans), the merged
bytes, and its signature over ``signing.message("ar.merged", [..., reducer index, phase,
contributors, counters, sha256(merged bytes)])``. Members verify that signature before using
the bytes; they compute the round's fraction of a period from those counters and their
anchor's ledger (``core.outer.round_fraction``, invariant I9).

Agreement (invariants I1, I2: every member reaches the same result or none). A reducer
answers once every member's slice is accepted or rejected, or :func:`round_wait` seconds
after the round's first slice (``timeout``, longer when the link rates the leader put in the
group predict a slower transfer; missing members are then left out, reason ``missing``); a
slice that arrives after that gets the same answer. Each reducer sends one statement to all
members, so every member that hears from every reducer sees the same statements:

* all reducers used the same contributor set S: phase 1 is the result;
* otherwise (a slice rejected or missing at one reducer only, an outlier dropped at one
  reducer): S = the intersection of the sets, computed identically by every member, and
  phase 2 (``ar.final``) asks each reducer to re-merge over S. The request carries every
  reducer's signed phase-1 statement, so a reducer recomputes S itself and trusts no member;
  phase 2 clips outliers but never drops, so its set is exactly S.

A member commits only when every reducer answered with a verified statement over the same
S and the same counters (a member that signed different counters for different reducers makes
them differ: the round fails); a member outside S raises :class:`ContributionExcluded` (its
progress was not merged: it must not reset its counters). When S came from phase 1 the
exception carries the round's result, which the excluded member commits like the others,
its progress rebased on it (no download, so it is not a version behind at the next round);
after a phase 2 it follows the others through the records. Anything else
(no answer, an unverifiable answer, an empty S) is :class:`RoundFailed` and nothing is
committed.

Reducer parts (docs/trust.md). A reducer computes its tensors alone, so a malicious one (or
one merging against its own poisoned Δ) can return a wrong merge of its part; its signature
makes that attributable, and every member checks every other reducer's part against its own
Δ before it uses any (``core.audit.check_parts``). An oversized part refuses the round
(:class:`ResultRefused`, naming the reducers): nothing is committed, and the node distrusts and
avoids them. A part pointing against our Δ names its reducer in ``RoundResult.suspects``: the
node commits the round only if it does not raise its held-out loss (else the same refusal).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from p2pdiloco.core.audit import check_parts
from p2pdiloco.core.fragments import Fragment, assign_parts
from p2pdiloco.core.outer import FRACTION_GRID, span_fraction
from p2pdiloco.core.merge import (
    DEFAULT_OUTLIER_FACTOR,
    OUTLIER_POLICIES,
    contribution_weight,
    is_finite_contribution,
    robust_merge,
)
from p2pdiloco.errors import NetworkError, ProtocolError, RoundFailed
from p2pdiloco.net import clock as swarm_clock, reduce_messages as rm, wire
from p2pdiloco.net.matchmaking import Group
from p2pdiloco.net.rounds import (
    GROUP_WAIT_S,
    AllReduceStats,
    Contribution,
    ContributionExcluded,
    ResultRefused,
    RoundResult,
    group_fingerprint,
    round_wait,
)
from p2pdiloco.net.transport import Header, Swarm
from p2pdiloco.trust import signing
from p2pdiloco.trust.identity import public_key_of

log = logging.getLogger(__name__)

TRIM_LOG_S = 60.0  # seconds between two log lines about one peer's trimmed tensors

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


class AllReducer:
    """Runs fragment all-reduces; serves ``ar.reduce`` and ``ar.final``. One per node.

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
        # its Δ (the last 256 rounds): they earn no reputation from the round (node.runtime._credit)
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

    # ---- member side -----------------------------------------------------------------------
    async def run(self, group: Group, contrib: Contribution) -> RoundResult:
        """Merge ``contrib`` with the other members' and return the merged pseudo-gradient
        and the round's counters, the same on every member that gets a result. A group of
        this node alone returns its Δ unchanged in fp32 (the merge of one contribution is
        itself, arXiv 2604.21428), never passed through the wire codec, with its own counters.
        Raises:
            ContributionExcluded: the round merged without our contribution.
            RoundFailed: some reducer did not answer with a verified statement, or the
                reducers' contributor sets have no member in common.
        """
        frag, me, members = group.key.fragment, self.swarm.peer_id, group.members
        if members == (me,):  # a lone round: nothing is sent, so nothing is quantised
            if not is_finite_contribution(contrib.delta):
                self.stats.failed += 1
                raise RoundFailed(f"round {group.round_id}: our own contribution is not finite")
            self.stats.rounds += 1
            tokens, position, first = self._counters([(contrib.tokens, contrib.steps, contrib.span, contrib.position)])
            return RoundResult([t.detach().to("cpu", torch.float32).clone() for t in contrib.delta], tokens, position,
                               first / FRACTION_GRID, (me,))
        self.expect(group)
        parts = self._parts(frag, len(members), group.shares)
        reducers = [r for r in range(len(members)) if parts[r]]
        base = {"round": group.round_id, "g": group_fingerprint(group), "tokens": contrib.tokens,
                "steps": contrib.steps, "span": contrib.span, "pos": contrib.position}

        received: dict[int, torch.Tensor] = {}  # slot -> what the reducers decode from our slices

        async def phase1(r: int) -> tuple[int, tuple[int, ...], tuple[int, int, int], bytes, bytes]:
            payload = wire.encode([contrib.delta[i] for i in parts[r]], self.precision)
            if self.precision != "fp32":  # lossy: keep what was lost for error feedback
                received.update(zip(parts[r], wire.decode(payload, self._shapes(frag, parts[r]), self.precision)))
            fields = signing.contribution_fields(self.run_id, frag, group.key.version, group.key.digest,
                                                 group.round_id, members, r, contrib.tokens, contrib.steps,
                                                 contrib.span, contrib.position,
                                                 self._digest(payload, signing_side=True), group.shares)
            head, payload = self._outgoing(r, dict(base, r=r, sig=self._sign("ar.contrib", fields)), payload)
            if members[r] == me:
                reply, body = await self._receive(me, head, payload)
                if "error" in reply:
                    raise RoundFailed(f"own reducer part: {reply['error']}")
            else:
                reply, body = await self.swarm.call(members[r], "ar.reduce", head, payload,
                                                    timeout=self._call_timeout(group), max_reply=self._slice_bytes(group, r))
            contributors, counters = self._check_answer(group, r, 1, reply, body)
            return r, contributors, counters, reply["sig"], body

        answers = await self._each_reducer(group, reducers, phase1, "")
        sets = {c for c, _, _, _ in answers.values()}
        if len(sets) == 1:
            common = next(iter(sets))
        else:
            common = tuple(sorted(set.intersection(*(set(c) for c in sets))))
            self.stats.reconciled += 1
            log.info("round %s f%d: reducers used different contributor sets %s; merging over %s",
                     group.round_id, frag, sorted(sets), list(common))
        mine = members.index(me)
        if mine not in common:
            self.stats.failed += 1
            self.stats.excluded += 1
            why = f"round {group.round_id} of fragment {frag} was merged without our contribution " \
                  f"(contributor sets {sorted(sets)})"
            result = None
            if len(sets) == 1:  # the bodies are the round's result, which the included members commit
                try:
                    result = self._audited(group, parts, self._result(group, parts, answers, common), contrib)
                except ResultRefused:
                    raise
                except RoundFailed:
                    result = None
                if result is not None and result.suspects:  # no own Δ merged to weigh it against: follow instead
                    result = None
            raise ContributionExcluded(why, result)
        if len(sets) > 1:
            answers = await self._phase2(group, reducers, answers, common)
        try:
            result = self._audited(group, parts, self._result(group, parts, answers, common), contrib)
        except RoundFailed:
            self.stats.failed += 1
            raise
        if received:
            result = dataclasses.replace(result, residual=[
                contrib.delta[i].detach().to("cpu", torch.float32) - received[i] for i in range(len(result.delta))])
        self.stats.rounds += 1
        return result

    def _result(self, group: Group, parts: tuple[tuple[int, ...], ...], answers: dict,
                common: tuple[int, ...]) -> RoundResult:
        """The round's result from the reducers' verified answers over one contributor set
        ``common``: merged slices decoded into slot order, the stated counters. Raises
        RoundFailed when the reducers stated different counters (a member signed two
        versions) or a signed slice does not decode."""
        frag, members = group.key.fragment, group.members
        stated = {n for _, n, _, _ in answers.values()}
        if len(stated) != 1:  # same contributors, different counters: someone signed two versions
            raise RoundFailed(f"round {group.round_id}: reducers stated different counters {sorted(stated)}")
        merged: list[torch.Tensor | None] = [None] * len(self.fragments[frag].slots)
        for r, (_, _, _, body) in answers.items():
            try:
                tensors = wire.decode_merged(body, self._shapes(frag, parts[r]), self.precision, len(members))
                if not is_finite_contribution(tensors):
                    raise ProtocolError("a merged slice that is not finite")
            except ProtocolError as e:  # signed, so the reducer sent these wrong bytes: provable
                self.stats.rejected["bad_result"] += 1
                self.swarm.ban(members[r], f"signed a malformed merged slice in round {group.round_id}: {e}")
                raise RoundFailed(f"round {group.round_id}: merged slice of {members[r][-8:]}: {e}") from None
            for i, t in zip(parts[r], tensors):
                merged[i] = t
        tokens, position, first = stated.pop()
        return RoundResult([t for t in merged if t is not None], tokens, position, first / FRACTION_GRID,
                           tuple(members[i] for i in common),
                           wire=tuple((parts[r], answers[r][3]) for r in sorted(answers)))

    def _audited(self, group: Group, parts: tuple[tuple[int, ...], ...], result: RoundResult,
                 contrib: Contribution) -> RoundResult:
        """``result`` after this member's check of every other reducer's merged part against its
        own Δ (``core.audit.check_parts``, counted in ``stats.rejected`` by reason): an oversized
        part raises ResultRefused naming its reducers; the reducers of parts pointing against our
        Δ are named in ``result.suspects`` (the node weighs the round by its held-out loss)."""
        members, me = group.members, self.swarm.peer_id
        reducers = [r for r in range(len(members)) if parts[r]]
        mine = members.index(me)
        refused = check_parts([[contrib.delta[i] for i in parts[r]] for r in reducers],
                              [[result.delta[i] for i in parts[r]] for r in reducers],
                              reducers.index(mine) if mine in reducers else None)
        if not refused:
            return result
        for k, c in refused.items():
            self.stats.rejected[c.reason] += 1
            log.warning("round %s f%d: the merged part of %s: %s (cosine with our own %.2f, norm x%.2f)",
                        group.round_id, group.key.fragment, members[reducers[k]][-8:], c.reason, c.cosine, c.ratio)
        blamed = {members[reducers[k]]: c.reason for k, c in refused.items() if c.reason == "oversized_result"}
        if blamed:
            raise ResultRefused(f"round {group.round_id}: merged part(s) of {sorted(p[-8:] for p in blamed)} refused "
                                f"(oversized_result)", blamed)
        return dataclasses.replace(result, suspects={members[reducers[k]]: parts[reducers[k]] for k in refused})

    async def _phase2(self, group: Group, reducers: list[int], answers: dict, common: tuple[int, ...]) -> dict:
        """Ask every reducer to merge over ``common``, proving the sets with their statements."""
        statements = [[r, list(c), list(n), self._digest(body, signing_side=False), sig]
                      for r, (c, n, sig, body) in answers.items()]
        me = self.swarm.peer_id

        async def final(r: int) -> tuple[int, tuple[int, ...], tuple[int, int, int], bytes, bytes]:
            head = {"round": group.round_id, "r": r, "st": statements}
            if group.members[r] == me:
                reply, body = await self._finalize(me, head)
            else:
                reply, body = await self.swarm.call(group.members[r], "ar.final", head, timeout=self._call_timeout(group),
                                                    max_reply=self._slice_bytes(group, r))
            contributors, counters = self._check_answer(group, r, 2, reply, body)
            if contributors != common:
                raise RoundFailed(f"reducer {group.members[r][-8:]} merged over {list(contributors)}, not {list(common)}")
            return r, contributors, counters, reply["sig"], body

        return await self._each_reducer(group, reducers, final, " in phase 2")

    async def _each_reducer(self, group: Group, reducers: list[int], ask, phase: str) -> dict:
        """Run ``ask(r)`` for every reducer at once: {r: (contributors, counters, signature, merged bytes)}.
        Raises RoundFailed (counted) as soon as one of them fails."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(ask(r)) for r in reducers]
        except* (NetworkError, RoundFailed) as eg:
            self.stats.failed += 1
            raise RoundFailed(f"round {group.round_id} of fragment {group.key.fragment} failed{phase}: "
                              f"{eg.exceptions[0]}") from None
        return {r: (c, f, sig, body) for r, c, f, sig, body in (t.result() for t in tasks)}

    def _check_answer(self, group: Group, r: int, phase: int, reply: Header,
                      body: bytes) -> tuple[tuple[int, ...], tuple[int, int, int]]:
        """The contributor set and counters of reducer r's signed statement; RoundFailed if it
        does not verify."""
        if "error" in reply:
            raise RoundFailed(f"reducer {group.members[r][-8:]}: {str(reply['error'])[:200]}")
        try:
            statement = rm.parse_statement(reply, len(group.members))
        except ProtocolError as e:
            self.swarm.drop(group.members[r], "reducer_statement")
            raise RoundFailed(f"reducer {group.members[r][-8:]} sent a malformed statement: {e}") from None
        fields = self._merged_fields(group, r, phase, statement.contributors, statement.counters,
                                     self._digest(body, signing_side=False))
        if not self._verify(group.members[r], "ar.merged", fields, statement.signature):
            self.stats.rejected["bad_result"] += 1
            self.swarm.ban(group.members[r], f"merged slice with a bad signature in round {group.round_id}")
            raise RoundFailed(f"reducer {group.members[r][-8:]}'s merged slice failed signature verification")
        return statement.contributors, statement.counters

    def _outgoing(self, reducer: int, head: Header, payload: bytes) -> tuple[Header, bytes]:
        """The request about to be sent to ``reducer`` (index); tests override this to act
        as a faulty or malicious member."""
        return head, payload

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

    def _merge(self, rnd: _Round, contributors: Sequence[int], policy: str):
        """Robust merge of the given members' slices (indices into rnd.members, sorted). This
        reducer is the member ``rnd.index``: its own slice, when among them, is the merge's
        trusted reference direction (``robust_merge``'s ``own``; docs/trust.md §5), else the
        merge falls back to the members' median direction. The others' weights are multiplied
        by :attr:`trust` (this node's earned trust in them; each slice has one reducer, so its
        members get its bytes whatever another reducer would have weighed)."""
        order = [rnd.parts[rnd.members[i]] for i in contributors]
        weights = [contribution_weight(tok, st) for _, tok, st, _, _ in order]
        mask = [self.fragments[rnd.fragment].slots[i].is_embedding for i in rnd.slots]
        own = list(contributors).index(rnd.index) if rnd.index in contributors else None
        if self.trust is not None and not rnd.trust:  # frozen for the round: phase 2 weighs as phase 1
            rnd.trust = tuple(1.0 if i == rnd.index else self.trust(m) for i, m in enumerate(rnd.members))
            self.trust_used[rnd.round_id] = rnd.trust
            while len(self.trust_used) > 256:
                del self.trust_used[next(iter(self.trust_used))]
        trust = [rnd.trust[i] for i in contributors] if rnd.trust else None
        out = robust_merge([ts for ts, *_ in order], weights, mask, policy=policy, factor=self.outlier_factor,
                           own=own, trust=trust)
        self.stats.clipped += len(out.clipped)
        self.stats.misaligned += len(out.misaligned)
        self.muted[rnd.round_id] = frozenset(rnd.members[contributors[m]] for m, _ in out.misaligned)
        while len(self.muted) > 256:
            del self.muted[next(iter(self.muted))]
        if out.clipped or out.misaligned:
            self._log_trimmed(rnd, [rnd.members[contributors[m]] for m, _ in (*out.clipped, *out.misaligned)])
        return out

    def _log_trimmed(self, rnd: _Round, peers: Sequence[str]) -> None:
        """Say, at most once a minute per peer, that its tensors were trimmed by the robust merge:
        routine for learners of different speeds (counted in ``stats.clipped``/``misaligned``)."""
        now = swarm_clock.monotonic()
        fresh = sorted({p for p in peers if now - self._trim_logged.get(p, -math.inf) >= TRIM_LOG_S})
        if not fresh:
            return
        for p in fresh:
            self._trim_logged[p] = now
        while len(self._trim_logged) > 4096:  # bounded
            del self._trim_logged[next(iter(self._trim_logged))]
        log.info("round %s f%d: clipped to the group's median norm or left out some tensors of %s (routine for "
                 "learners of different speeds or directions, not an attack; counted in status 'allreduce')",
                 rnd.round_id, rnd.fragment, ", ".join(p[-8:] for p in fresh))

    def _statement(self, rnd: _Round, phase: int, contributors: Sequence[int], merged) -> tuple[Header, bytes]:
        body = wire.encode_merged(merged, self.precision)
        counters = self._counters([rnd.parts[rnd.members[i]][1:] for i in contributors])
        fields = self._merged_fields(rnd, rnd.index, phase, contributors, counters,
                                     self._digest(body, signing_side=True))
        head = {"c": list(contributors), "n": list(counters), "sig": self._sign("ar.merged", fields),
                "rej": {p[-8:]: why for p, why in rnd.rejected.items()}}  # informational, unsigned
        return head, body

    def _decide(self, rnd: _Round) -> None:
        """Phase 1: merge what was accepted, sign the statement, release every waiting member."""
        accepted = [i for i, m in enumerate(rnd.members) if m in rnd.parts]
        try:
            if not accepted:
                raise ValueError("no valid contribution")
            out = self._merge(rnd, accepted, self.outliers)
            for k, reason in out.dropped.items():
                self._reject(rnd, rnd.members[accepted[k]], reason)
            rnd.contributors = tuple(accepted[k] for k in out.kept)
            rnd.answer = self._statement(rnd, 1, rnd.contributors, out.merged)
        except ValueError as e:
            rnd.answer = {"error": f"nothing to merge: {e}"}, b""
        rnd.decided.set()

    async def _on_final(self, peer: str, head: Header, _: bytes) -> tuple[Header, bytes]:
        return await self._finalize(peer, head)

    async def _finalize(self, peer: str, head: Header) -> tuple[Header, bytes]:
        """Phase 2: verify every reducer's phase-1 statement, merge over their common set."""
        try:
            req = rm.parse_final_request(head)
        except ProtocolError:
            self.swarm.drop(peer, "final_request")
            raise
        rnd = self._rounds.get(req.round)
        if rnd is None or peer not in rnd.members or req.reducer != rnd.index:
            raise ProtocolError("unknown or expired round")
        await rnd.decided.wait()
        reducers = [r for r, slots in enumerate(self._parts(rnd.fragment, len(rnd.members), rnd.shares)) if slots]
        statements = {r: (c, n, h, sig) for r, c, n, h, sig in req.statements}
        if sorted(statements) != reducers or len(req.statements) != len(reducers):
            raise ProtocolError("phase-2 request does not hold one statement per reducer")
        for r, (c, n, h, sig) in statements.items():
            if not all(i < len(rnd.members) for i in c):
                raise ProtocolError("malformed statement")
            if not self._verify(rnd.members[r], "ar.merged", self._merged_fields(rnd, r, 1, c, n, h), sig):
                raise ProtocolError(f"statement of reducer {rnd.members[r][-8:]} does not verify")
        if statements[rnd.index][0] != rnd.contributors:
            raise ProtocolError("our own statement differs from the one presented")
        common = tuple(sorted(set.intersection(*(set(c) for c, _, _, _ in statements.values()))))
        if not common:
            raise ProtocolError("the reducers' contributor sets have no member in common")
        if rnd.final is None:
            out = self._merge(rnd, common, "off" if self.outliers == "off" else "clip")
            head_out, body = self._statement(rnd, 2, common, out.merged)
            rnd.final = (common, head_out, body)
        elif rnd.final[0] != common:
            raise ProtocolError("phase 2 of this round was already merged over another set")
        return rnd.final[1], rnd.final[2]
