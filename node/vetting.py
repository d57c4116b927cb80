"""Whose records may move this node's state: earned trust, and the vetting of a joiner's first
donor (docs/trust.md, "Earned trust").

A node with a state follows only the records of peers it trusts (``Reputation.trusted``: peers
whose contributions it merged in rounds of its own): :func:`trusted_records`. Fresh identities,
however many, hold no head for it, whatever they claim.

A node that trusts no live peer (it is joining, restarted, or every peer it merged with has
gone) has no such evidence, and identities are free, so no count of holders can stand in for
it. It vets instead (:meth:`Vetting.vet`): it downloads the states up to ``VET_CANDIDATES``
peers hold (chosen at random among those claiming a newer state, so that many identities do not
decide whom it asks first), puts each in its own model and measures the held-out loss (the
same held-out bytes on every node, ``p2pdiloco.data``). The candidate with the lowest loss is
trusted (``Reputation.vetted``) when that loss is at most ``VET_TOLERANCE`` above the loss of
the state this node holds. Refused and struck: every candidate above that bound, and every one
that claims a version at least as new as the best candidate's but gives a loss more than
``VET_TOLERANCE`` above it (a peer a few versions behind the best is not refused: it is older,
not false). A candidate this node refused before is trusted again on the same terms. The idea is
Templar's Gauntlet's (arXiv 2505.21684: score a peer by the loss before and after its update),
without validators: each node scores with its own evaluation.

The same score weighs a merged round that a member's check of its reducers' parts found
suspect (:meth:`Vetting.weigh_round`; ``core.audit``: a part pointing clearly against the
member's own Δ, which is a peer's honest disagreement or a reversed merge): the round is
committed only if the model with the suspect parts has a held-out loss no higher than the same
outer step with those parts left out; else it is refused, and its suspect reducers distrusted
and avoided.

A node with trusted peers checks every newer state it follows the same way
(:meth:`Vetting.weigh_follow`): one that raises its held-out loss by more than ``VET_TOLERANCE``
is refused and its holders distrusted, so a peer that earned trust and then turns (colluders
after honest work) cannot move it by serving reversed states between two rounds. The holders
are not avoided in matchmaking (a refused round's reducers are): an honest holder may have been
fooled by a poisoned round, and a node that stopped grouping with it trained apart from it to
the end of the run, each on its own lineage (bench.trust_poison --honest-first 300 on 5eac509).
Rounds with a holder are checked like any other; once the node trusts no live peer it vets, and
a refused peer whose newer state passes that check is trusted again (``Reputation.vetted``).

Limits: a state that is worse than the honest swarm's but better than the joiner's own (a
trained model slightly shrunk) passes when no honest holder is among the candidates asked; the
joiner then trains on a lineage that no established node follows (they do not trust it), and
moves to an honest state once one is vetted better. Vetting costs one state download and one
evaluation per candidate.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence

from p2pdiloco.core.outer import FragmentState
from p2pdiloco.errors import StateSyncError
from p2pdiloco.net.state.heads import Head, is_behind
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.rounds.results import ResultRefused
from p2pdiloco.net.state.statesync import StateSync
from p2pdiloco.trust.reputation import Reputation

__all__ = ["ROUND_TOLERANCE", "VET_CANDIDATES", "VET_TOLERANCE", "Vetting", "trusted_records"]

log = logging.getLogger(__name__)

VET_CANDIDATES = 3  # peers whose states one vetting downloads and evaluates at most
VET_TOLERANCE = 0.02  # a vetted state's held-out loss may exceed ours by this fraction (evaluation noise)
ROUND_TOLERANCE = 0.0  # suspect parts may not raise the held-out loss above leaving them out (fraction)


def trusted_records(records: Mapping[str, HeadsRecord], me: str,
                    reputation: Reputation) -> dict[str, HeadsRecord] | None:
    """The records of this node (``me``) and of the peers it trusts, or None when no other
    trusted peer is among ``records`` (the node must vet: :class:`Vetting`)."""
    out = {p: r for p, r in records.items() if p == me or reputation.trusted(p)}
    return out if any(p != me for p in out) else None


class Vetting:
    """A joining node's choice of whom to trust first (module docstring). Event-loop only.

    Args:
        sync: the node's StateSync (downloads, refusals).
        reputation: the node's Reputation (a vetted donor is trusted, a refused one refuted).
        evaluate: held-out loss (nats per byte, float) of the model holding the given states, one
            per fragment; blocking (run in a thread).
        me: this node's peer ID (seeds the order candidates are asked in).
    """

    def __init__(self, sync: StateSync, reputation: Reputation,
                 evaluate: Callable[[Sequence[FragmentState]], float], me: str):
        self.sync, self.reputation, self.evaluate, self.me = sync, reputation, evaluate, me
        self._rng = random.Random(me)
        self.vetted = self.refused = 0  # candidates trusted / refused so far (status)

    def candidates(self, records: Mapping[str, HeadsRecord], states: Sequence[FragmentState]) -> list[str]:
        """Peers whose records claim a state of some fragment that ``states`` should move to (a
        newer version, or another digest at the same one), in a random order."""
        out = [peer for peer, r in records.items() if peer != self.me and any(
            c is not None and is_behind(st, Head(c[0], c[1], (peer,))) for st, c in zip(states, r.fragments))]
        self._rng.shuffle(out)
        return out

    async def vet(self, records: Mapping[str, HeadsRecord], states: Sequence[FragmentState]) -> str | None:
        """Download and evaluate the states of up to ``VET_CANDIDATES`` candidates; trust the best
        one within ``VET_TOLERANCE`` of this node's own held-out loss (a candidate this node
        refused before too: tested stricter, below its own loss, two honest nodes that had
        refused each other's rounds at the end of a run never met again) and keep its states for the follow (``StateSync.keep_vetted``);
        refuse the others above the tolerance. Returns the trusted peer, or None. Never raises
        for a peer."""
        chosen = self.candidates(records, states)[:VET_CANDIDATES]
        if not chosen:
            return None
        own = await asyncio.to_thread(self.evaluate, states)
        tried: list[tuple[float, str, list[FragmentState]]] = []
        for peer in chosen:
            got = await self._fetch(peer, records[peer], states)
            if got:
                mixed = [next((g for g in got if g.index == st.index), st) for st in states]
                tried.append((await asyncio.to_thread(self.evaluate, mixed), peer, got))
        bound = own * (1 + VET_TOLERANCE)
        good = sorted((loss, peer, got) for loss, peer, got in tried if math.isfinite(loss) and loss <= bound)
        best = good[0] if good else None
        for loss, peer, got in tried:
            if not (math.isfinite(loss) and loss <= bound):
                why = f"its state raises this node's held-out loss from {own:.4f} to {loss:.4f}"
            elif best is not None and loss > best[0] * (1 + VET_TOLERANCE) and _newest(got) >= _newest(best[2]):
                why = f"its state, claimed as new as the best one ({best[0]:.4f}), gives held-out loss {loss:.4f}"
            else:
                continue
            self.refused += 1
            self.sync.refuse(got, (peer,), why)
        if best is None:
            return None
        loss, peer, got = best
        self.vetted += 1
        self.reputation.vetted(peer)
        self.sync.keep_vetted(got)
        log.info("trusting %s: its state gives held-out loss %.4f (this node's %.4f)", peer[-8:], loss, own)
        return peer

    async def weigh_round(self, states: Sequence[FragmentState], new: FragmentState, without: FragmentState,
                          suspects: Sequence[str], round_id: str) -> None:
        """Commit or refuse a round with suspect parts (module docstring). ``states``, one per
        fragment, hold the round's anchor; ``new`` is the round's result for its fragment, and
        ``without`` the same outer step with the suspects' parts of the merged Δ set to zero.
        Raises ResultRefused naming ``suspects`` when the held-out loss (nats per byte) with
        ``new`` is above the loss with ``without`` by more than ``ROUND_TOLERANCE`` (the
        suspects' parts make the model worse than leaving them out), or is not finite."""
        def put(state: FragmentState) -> list[FragmentState]:
            return [state if st.index == state.index else st for st in states]

        with_parts = await asyncio.to_thread(self.evaluate, put(new))
        without_parts = await asyncio.to_thread(self.evaluate, put(without))
        names = sorted(p[-8:] for p in suspects)
        if math.isfinite(with_parts) and with_parts <= without_parts * (1 + ROUND_TOLERANCE):
            log.info("round %s: the parts of %s point against our own Δ but do not raise the held-out loss "
                     "(%.4f with them, %.4f without): committed", round_id, names, with_parts, without_parts)
            return
        raise ResultRefused(f"round {round_id}: the merged parts of {names}, which point against our own Δ, raise "
                            f"the held-out loss to {with_parts:.4f} from {without_parts:.4f} without them",
                            dict.fromkeys(suspects, "raised_loss"))

    async def weigh_follow(self, states: Sequence[FragmentState], state: FragmentState, holders: Sequence[str]) -> bool:
        """Whether to install ``state``, a newer state of one fragment downloaded from trusted
        ``holders`` (``states``: this node's, one per fragment): True unless the held-out loss
        with it is above the loss with ``states`` by more than ``VET_TOLERANCE``; then the state
        is refused and its holders struck and refuted (``StateSync.refuse``). A peer that earned
        trust and then serves a reversed or shrunk state moves nobody that checks it (the
        Gauntlet's score, arXiv 2505.21684, applied to every follow)."""
        before = await asyncio.to_thread(self.evaluate, states)
        after = await asyncio.to_thread(self.evaluate, [state if st.index == state.index else st for st in states])
        if math.isfinite(after) and after <= before * (1 + VET_TOLERANCE):
            return True
        self.refused += 1
        self.sync.refuse([state], holders, f"its state raises this node's held-out loss from {before:.4f} to {after:.4f}")
        return False

    async def _fetch(self, peer: str, record: HeadsRecord, states: Sequence[FragmentState]) -> list[FragmentState]:
        """The states ``peer`` claims that ``states`` should move to, downloaded from it alone
        (verified against their digests and bounded moves); [] when any fails. A fragment the
        peer moved on since its record is taken at its newer version (``newer``): a candidate
        training fast would otherwise never be vetted, every download finding it a round
        further (bench.trust_poison, ec00fad)."""
        got = []
        for st, claim in zip(states, record.fragments):
            head = Head(claim[0], claim[1], (peer,)) if claim is not None else None
            if head is None or not is_behind(st, head):
                continue
            try:
                got.append(await self.sync.download(st.index, head, joining=True, newer=True))
            except StateSyncError as e:
                log.info("vetting %s: fragment %d: %s", peer[-8:], st.index, e)
                return []
        return got


def _newest(states: Sequence[FragmentState]) -> int:
    """The highest version among ``states`` (a candidate's claim, compared between candidates)."""
    return max(st.version for st in states)
