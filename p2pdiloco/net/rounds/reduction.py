"""A reducer's merge, phase 1 and phase 2 of the butterfly all-reduce (the protocol:
:mod:`p2pdiloco.net.rounds.allreduce`; the slices' intake: :mod:`p2pdiloco.net.rounds.reducer`).

Phase 1 (:meth:`Reduction._decide`, once every member's slice was accepted or rejected, or at
the round's deadline): the robust merge (``core.robust.robust_merge``) of the slices accepted,
weighed by the members' tokens and this node's earned trust in them, with the reducer's own
slice as the reference direction, signed as one statement (contributors, counters, digest of
the merged bytes) that every waiting member receives. Phase 2 (``ar.final``,
:meth:`Reduction._finalize`): every reducer's phase-1 statement verified, the slices merged
again over the contributors all of them kept, signed the same way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from p2pdiloco.core.merge import contribution_weight
from p2pdiloco.core.robust import robust_merge
from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.rounds import reduce_messages as rm
from p2pdiloco.net.transport import clock as swarm_clock

if TYPE_CHECKING:
    from p2pdiloco.core.fragments import Fragment
    from p2pdiloco.net.rounds.reducer import _Round
    from p2pdiloco.net.rounds.results import AllReduceStats
    from p2pdiloco.net.transport.swarm import Header, Swarm

log = logging.getLogger(__name__)

TRIM_LOG_S = 60.0  # seconds between two log lines about one peer's trimmed tensors


class Reduction:
    """The merging side of :class:`~p2pdiloco.net.rounds.reducer.Reducer`, a base of it (which
    holds the state these methods read: rounds, fragments, policy, trust, counters; and
    signs, verifies and rejects)."""

    swarm: Swarm
    fragments: tuple[Fragment, ...]
    precision: str
    outliers: str
    outlier_factor: float
    stats: AllReduceStats
    trust: Callable[[str], float] | None
    trust_used: dict[str, tuple[float, ...]]
    muted: dict[str, frozenset[str]]
    _rounds: dict[str, _Round]
    _trim_logged: dict[str, float]

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
