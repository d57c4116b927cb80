"""Reputation earned by verified work: what one node believes about its peers, from evidence it
checked itself, never from how many peers say so (docs/trust.md, "Earned trust").

In a public swarm an identity is one key pair, made in a millisecond: a rule that counts peers,
records or signatures is decided by whoever holds the most keys. So a node's trust in a peer
starts at zero for every identity and grows only with work this node verified itself:

* **A merged round** (:meth:`Reputation.merged`): the peer's signed contribution was merged in a
  round this node committed as a member (its slices passed the reducers' checks and the robust
  merge; ``net.rounds.allreduce``): +1.
* **A vetted state** (:meth:`Reputation.vetted`): a node that trusts no live peer (it is
  joining, or it refused every peer it trusted) downloaded the state the peer holds and found
  that it does not raise this node's own held-out loss (``node.vetting``), as Templar's
  Gauntlet scores a peer by the loss before and after its update (arXiv 2505.21684), without
  validators: ``TRUSTED`` at once, so the node follows it, an earlier refusal forgiven.
* **Merge weight** (:meth:`Reputation.merge_weight`): in the merges this node reduces, a peer's
  token weight is multiplied by a factor from ``FRESH_WEIGHT`` (no points) to 1.0
  (``FULL_WEIGHT_AT`` points).
* **A refuted claim** (:meth:`Reputation.refuted`): a state it claimed was refused (not a
  plausible successor, ``net.state.bounded_moves``; or it raised the held-out loss): the score falls
  to zero and ``REFUTED_HOLD`` rounds of credit must be earned again before it counts (or a
  vetted state of it forgives them, above). A refusal does not stop this node grouping with the
  peer: every round is checked on its own (``core.audit``, ``Vetting.weigh_round``), and only a
  refused round's reducers are avoided in matchmaking.

A peer is *trusted* (:meth:`Reputation.trusted`) from ``TRUSTED`` points: only trusted peers'
records move this node's state (``node.vetting.trusted_records``). A trusted peer that turns
hostile still moves Θ by no more than this node's own rounds allow (``net.state.bounded_moves``).

Limits: an attacker that contributes within the merge's bounds for a few rounds earns trust
like an honest peer; what it can do with it is bounded by the merge and by the plausible-move
bound, not prevented. Reputation is per node and in memory: a restarted node trusts nobody and
vets again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["FRESH_WEIGHT", "FULL_WEIGHT_AT", "MAX_PEERS", "REFUTED_HOLD", "TRUSTED", "Reputation", "Standing"]

log = logging.getLogger(__name__)

TRUSTED = 2.0  # points from which a peer's records move this node's state (two merged rounds)
REFUTED_HOLD = 8.0  # points a refuted peer owes before it earns again
FRESH_WEIGHT = 0.25  # merge weight multiplier of a peer with no points (a fresh identity)
FULL_WEIGHT_AT = 4.0  # points from which a peer merges at its full (token) weight
MAX_PEERS = 4096  # peers kept (the lowest scores are forgotten first): bounded against free identities


@dataclass(frozen=True)
class Standing:
    """One peer's standing with this node.

    Attributes:
        score: points earned and not lost (>= 0).
        merged: rounds merged with it.
        refuted: claims of it this node refused.
        owed: points it must earn back before its score grows again (after a refusal).
    """

    score: float = 0.0
    merged: int = 0
    refuted: int = 0
    owed: float = 0.0


class Reputation:
    """This node's local trust in its peers (module docstring). Event-loop only; one per node,
    owned by the node and read by its catch-up (``node.vetting``) and status."""

    def __init__(self) -> None:
        self._peers: dict[str, Standing] = {}

    def standing(self, peer: str) -> Standing:
        """``peer``'s standing (a fresh identity's is all zero)."""
        return self._peers.get(peer, Standing())

    def score(self, peer: str) -> float:
        """``peer``'s points (0.0 for a fresh identity)."""
        return self.standing(peer).score

    def trusted(self, peer: str) -> bool:
        """Whether ``peer`` has earned ``TRUSTED`` points with this node."""
        return self.score(peer) >= TRUSTED

    def merge_weight(self, peer: str) -> float:
        """``peer``'s multiplier of its token weight in merges this node reduces
        (``core.robust.robust_merge``'s ``trust``): ``FRESH_WEIGHT`` with no points, rising
        linearly to 1.0 at ``FULL_WEIGHT_AT`` points. A fresh identity's contribution counts, a
        quarter of an earned one's: a coalition of fresh keys cannot outweigh two members that
        merged with this node before, and an honest newcomer earns its full weight in 4 rounds."""
        return FRESH_WEIGHT + (1.0 - FRESH_WEIGHT) * min(1.0, self.score(peer) / FULL_WEIGHT_AT)

    def merged(self, peer: str) -> None:
        """A round this node committed merged ``peer``'s contribution: +1 (or 1 less owed)."""
        s = self.standing(peer)
        owed = max(0.0, s.owed - 1.0)
        self._set(peer, Standing(s.score + (1.0 if s.owed <= 0 else 0.0), s.merged + 1, s.refuted, owed))

    def vetted(self, peer: str) -> None:
        """``peer``'s state, checked by this node, is within ``VET_TOLERANCE`` of its own held-out
        loss or better (``node.vetting``): trusted at once, points owed for an earlier refusal
        forgiven. The check is the same evidence that trusts a joiner's first donor; without the
        forgiveness an honest peer that once served a state a poisoned round had made (it was
        fooled, not hostile) stayed untrusted, and two honest nodes that had refused each
        other's states trained apart to the end of a run (bench.trust_poison --honest-first
        300 on 5eac509: each of the two merged its rounds alone, held-out loss +15 %). A peer
        that turns again is refused again at its next state (``Vetting.weigh_follow``)."""
        s = self.standing(peer)
        self._set(peer, Standing(max(s.score, TRUSTED), s.merged, s.refuted, 0.0))

    def refuted(self, peer: str, why: str) -> None:
        """A claim of ``peer`` was refused (``why``): score 0, ``REFUTED_HOLD`` points owed."""
        s = self.standing(peer)
        if s.score > 0 or not s.refuted:
            log.info("distrusting %s: %s", peer[-8:], why)
        self._set(peer, Standing(0.0, s.merged, s.refuted + 1, REFUTED_HOLD))

    def trusted_peers(self) -> set[str]:
        """Every peer trusted now."""
        return {p for p, s in self._peers.items() if s.score >= TRUSTED}

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{peer ID: {"score", "merged", "refuted"}} of every peer with a standing (status)."""
        return {p: {"score": s.score, "merged": s.merged, "refuted": s.refuted} for p, s in self._peers.items()}

    def _set(self, peer: str, standing: Standing) -> None:
        self._peers.pop(peer, None)
        self._peers[peer] = standing
        if len(self._peers) > MAX_PEERS:  # bounded: forget the lowest scores (fresh identities) first
            for p in sorted(self._peers, key=lambda q: (self._peers[q].score, self._peers[q].merged))[:MAX_PEERS // 4]:
                del self._peers[p]
