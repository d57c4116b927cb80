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
The reducer merges what it accepted with :func:`p2pdiloco.core.robust.robust_merge`
(weights capped at the median; norm outliers clipped or dropped, reason ``outlier``;
every other member's weight scaled by its alignment with the reducer's own slice, which it
knows to be honest, and tensors pointing against it left out, or their member dropped, reason
``misaligned``; the members' median direction when its own slice is not among them) and
answers every member with the same
statement: the contributor set it used (member indices), the round's counters over those
contributors (their tokens summed, their lower median schedule position, and the fraction of a
period ``core.periods.span_fraction`` gives their signed tokens, steps and spans), the merged
bytes, and its signature over ``signing.message("ar.merged", [..., reducer index, phase,
contributors, counters, sha256(merged bytes)])``. Members verify that signature before using
the bytes; they compute the round's fraction of a period from those counters and their
anchor's ledger (``core.periods.round_fraction``, invariant I9).

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
Δ before it uses any (``core.audit.check_parts``). A part pointing clearly against our Δ, or
far larger than it, names its reducer in ``RoundResult.suspects``: the node commits the round
only if those parts do not raise its held-out loss; else it refuses it (:class:`ResultRefused`,
naming the reducers): nothing is committed, and the node distrusts and avoids them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from typing import NoReturn

import torch

from p2pdiloco.core.audit import check_parts
from p2pdiloco.core.merge import is_finite_contribution
from p2pdiloco.core.periods import FRACTION_GRID
from p2pdiloco.errors import NetworkError, ProtocolError, RoundFailed
from p2pdiloco.net.rounds import reduce_messages as rm
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.rounds.matchmaking import Group
from p2pdiloco.net.rounds.reducer import Reducer
from p2pdiloco.net.rounds.results import Contribution, ContributionExcluded, ResultRefused, RoundResult, group_fingerprint
from p2pdiloco.net.transport.swarm import Header
from p2pdiloco.trust import signing

__all__ = ["AllReducer", "Contribution", "ContributionExcluded", "ResultRefused", "RoundResult"]

log = logging.getLogger(__name__)


class AllReducer(Reducer):
    """Runs fragment all-reduces as a member (:meth:`run`) and, as its :class:`Reducer`, serves
    ``ar.reduce`` and ``ar.final``. One per node. Args: as :class:`Reducer`."""

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
        me, members = self.swarm.peer_id, group.members
        if members == (me,):  # a lone round: nothing is sent, so nothing is quantised
            return self._lone(group, contrib)
        self.expect(group)
        parts = self._parts(group.key.fragment, len(members), group.shares)
        reducers = [r for r in range(len(members)) if parts[r]]
        received: dict[int, torch.Tensor] = {}  # slot -> what the reducers decode from our slices
        answers = await self._each_reducer(group, reducers, functools.partial(self._phase1, group, contrib, parts,
                                                                              received), "")
        sets = {c for c, _, _, _ in answers.values()}
        common = self._common(group, sets)
        if members.index(me) not in common:
            self._excluded(group, parts, answers, sets, common, contrib)
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

    def _lone(self, group: Group, contrib: Contribution) -> RoundResult:
        """A round of this node alone: its Δ in fp32 with its own counters (RoundFailed when
        it is not finite)."""
        if not is_finite_contribution(contrib.delta):
            self.stats.failed += 1
            raise RoundFailed(f"round {group.round_id}: our own contribution is not finite")
        self.stats.rounds += 1
        tokens, position, first = self._counters([(contrib.tokens, contrib.steps, contrib.span, contrib.position)])
        return RoundResult([t.detach().to("cpu", torch.float32).clone() for t in contrib.delta], tokens, position,
                           first / FRACTION_GRID, (self.swarm.peer_id,))

    async def _phase1(self, group: Group, contrib: Contribution, parts: tuple[tuple[int, ...], ...],
                      received: dict[int, torch.Tensor],
                      r: int) -> tuple[int, tuple[int, ...], tuple[int, int, int], bytes, bytes]:
        """Send reducer ``r`` our signed slices of its part; returns (r, its contributor set,
        its counters, its signature, its merged slices). Lossy codecs record in ``received``
        what the reducer decodes, for error feedback."""
        frag, members, me = group.key.fragment, group.members, self.swarm.peer_id
        base = {"round": group.round_id, "g": group_fingerprint(group), "tokens": contrib.tokens,
                "steps": contrib.steps, "span": contrib.span, "pos": contrib.position}
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

    def _common(self, group: Group, sets: set[tuple[int, ...]]) -> tuple[int, ...]:
        """The contributor set the round merges over: the reducers' one set, or the members
        every reducer used (phase 2 then merges again over it)."""
        if len(sets) == 1:
            return next(iter(sets))
        common = tuple(sorted(set.intersection(*(set(c) for c in sets))))
        self.stats.reconciled += 1
        log.info("round %s f%d: reducers used different contributor sets %s; merging over %s",
                 group.round_id, group.key.fragment, sorted(sets), list(common))
        return common

    def _excluded(self, group: Group, parts: tuple[tuple[int, ...], ...], answers: dict,
                  sets: set[tuple[int, ...]], common: tuple[int, ...], contrib: Contribution) -> NoReturn:
        """Raise ContributionExcluded for a round merged without our contribution, with its
        result when the reducers agreed on one set and no part is suspect (we follow it)."""
        self.stats.failed += 1
        self.stats.excluded += 1
        why = f"round {group.round_id} of fragment {group.key.fragment} was merged without our contribution " \
              f"(contributor sets {sorted(sets)})"
        result = None
        if len(sets) == 1:  # the bodies are the round's result, which the included members commit
            with contextlib.suppress(RoundFailed):
                result = self._audited(group, parts, self._result(group, parts, answers, common), contrib)
            if result is not None and result.suspects:  # suspect parts of a round without us: follow instead
                result = None
        raise ContributionExcluded(why, result)

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
        own Δ (``core.audit.check_parts``, counted in ``stats.rejected`` by reason): the reducers
        of parts that fail it are named in ``result.suspects`` (the node weighs the round by its
        held-out loss: a straggler's small Δ makes an honest part look oversized)."""
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
