"""What a fragment round takes and gives: a learner's contribution, the round's result, the
all-reducer's counters, a group's fingerprint and a reducer's wait (``p2pdiloco.net.rounds.allreduce``
runs the rounds)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from p2pdiloco.errors import RoundFailed

if TYPE_CHECKING:
    from p2pdiloco.net.rounds.matchmaking import Group

__all__ = ["AllReduceStats", "Contribution", "ContributionExcluded", "ResultRefused", "RoundResult",
           "group_fingerprint", "round_wait"]

TRANSFER_SLACK = 3.0  # a round may take this many times the transfer time its link rates predict ...
MAX_WAIT_FACTOR = 4.0  # ... but at most this many times the liveness timeout
MAX_ROUND_WAIT_S = 600.0  # ... and never longer than this (seconds)
GROUP_WAIT_S = 10.0  # a reducer waits this long for its own matchmaking to give it a request's group


def group_fingerprint(group: Group) -> bytes:
    """16 bytes naming ``group`` in ``ar.reduce`` requests: the sha256 prefix of its round ID,
    key, members, shares and rates (everything a reducer takes from the group)."""
    k = group.key
    fields = [group.round_id, k.fragment, k.version, k.digest, list(group.members), list(group.shares),
              list(group.rates)]
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).digest()[:16]


def round_wait(timeout: float, fragment_bytes: int, shares: Sequence[int], rates: Sequence[int]) -> float:
    """Seconds a reducer waits for missing slices after a round's first (deadlines scale with
    payload size over bandwidth): ``timeout`` (the node's liveness timeout), or longer when
    the members' link ``rates`` (KiB/s as the leader had them, 0: unknown; ``Group.rates``)
    predict a slower transfer: ``TRANSFER_SLACK`` x max_m S·(1 + (n − 2)·x_m) / rate_m, the
    bytes member m moves in one direction when it reduces the fraction x_m (``shares``; 1/n
    when empty) of a fragment of S bytes on the wire (hivemind's load-balancing model), at
    most ``MAX_WAIT_FACTOR`` x ``timeout`` and ``MAX_ROUND_WAIT_S`` (rates are reports: a member
    claiming a slow link, then silent, holds a round that long; raise ``liveness_timeout`` for
    large models on slow links). Plain IEEE double arithmetic: every member gets the same value.
    """
    n = len(rates)
    if n < 2 or not any(rates):
        return timeout
    total = sum(shares) if shares else n
    x = [s / total for s in shares] if shares else [1 / n] * n
    slowest = max(fragment_bytes * (1 + (n - 2) * xm) / (1024 * r) for xm, r in zip(x, rates) if r > 0)
    return min(MAX_ROUND_WAIT_S, MAX_WAIT_FACTOR * timeout, max(timeout, TRANSFER_SLACK * slowest))



class ContributionExcluded(RoundFailed):
    """The round merged without this member's contribution (a reducer rejected it, or it
    arrived after a reducer's deadline). The others may have committed: take their result,
    but keep the local progress, which is not inside it.

    Attributes:
        result: the round's merged result, as every included member gets it (same tensors
            and counters), when every reducer merged over one contributor set in phase 1;
            else None (the others re-merged in phase 2 without us: follow them through the
            records).
    """

    def __init__(self, message: str, result: RoundResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class ResultRefused(RoundFailed):
    """This member refused the round's result: the merged part of one or more reducers failed
    its check against its own pseudo-gradient (``core.audit.check_parts``). Nothing is
    committed; the node distrusts and avoids those reducers.

    Attributes:
        reducers: {reducer peer ID: reason} (``misaligned_result`` or ``oversized_result``).
    """

    def __init__(self, message: str, reducers: dict[str, str]) -> None:
        super().__init__(message)
        self.reducers = reducers


@dataclass(frozen=True)
class Contribution:
    """One learner's input to a fragment round.

    Attributes:
        delta: pseudo-gradient Θ_p(anchor) − θ_p, fp32, one tensor per fragment slot.
        tokens: tokens processed since the fragment was last received.
        steps: inner steps since the fragment was last received.
        span: rounds this progress spans (``Learner.span``: anchor version − version the
            counters started at + 1, >= 1).
        position: the learner's schedule position when it sent this (``Learner.step``).
    """

    delta: tuple[torch.Tensor, ...]
    tokens: int
    steps: int
    span: int = 1
    position: int = 0


@dataclass(frozen=True)
class RoundResult:
    """What a completed round gives its members.

    Attributes:
        delta: the merged pseudo-gradient, fp32, one tensor per fragment slot,
            bit-identical on every member.
        tokens: tokens merged (sum over the contributors).
        position: the contributors' lower median schedule position.
        first: ``core.periods.span_fraction`` of the contributors' counters, a multiple of
            1/FRACTION_GRID in [0, 1].
        contributors: peer IDs whose contributions it merges.
        All the same on every member (``core.periods.round_fraction``'s inputs), except
        residual: this member's own quantisation error, fp32, one tensor per slot: its Δ
            minus what the reducers decoded from its slices (None when nothing was lost: fp32
            on the wire, or a lone round). The caller keeps it and adds it to its next Δ of
            the fragment (error feedback, as in SparseLoCo, arXiv 2508.15706).
        wire: the merged slices as the reducers sent them, (slot indices, bytes in the run's
            wire precision) per reducer: what a node behind is sent to compute the same
            state (``net.state.deltas``); () for a lone round (its Δ never went through the codec).
        suspects: {reducer peer ID: the slot indices of its part} for parts pointing against
            this member's own Δ (``core.audit``: a peer's honest disagreement, or a reversed
            merge); the node takes the round only if those parts do not raise its held-out loss
            (docs/trust.md, "Reducer parts").
    """

    delta: list[torch.Tensor]
    tokens: int
    position: int
    first: float
    contributors: tuple[str, ...]
    residual: list[torch.Tensor] | None = None
    wire: tuple[tuple[tuple[int, ...], bytes], ...] = ()
    suspects: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class AllReduceStats:
    """Counters of this node's all-reduces.

    Attributes:
        rounds: rounds this member completed with a result.
        failed: rounds that ended without a result (including ``excluded``).
        excluded: rounds merged without our contribution.
        reconciled: rounds that needed phase 2 (reducers used different contributor sets).
        rejected: slices this node rejected as a reducer, by reason (see the module
            docstring), plus ``bad_result`` for a reducer answer that failed verification.
        clipped: tensors norm-clipped by the robust merge.
        misaligned: tensors left out of a merge for pointing against the group's median
            direction (``clip`` policy; with ``drop`` the member is rejected as ``misaligned``).
        sign_seconds, verify_seconds: CPU time spent hashing and signing our slices and
            statements, and hashing and verifying others' (the cost of signed updates).
    """

    rounds: int = 0
    failed: int = 0
    excluded: int = 0
    reconciled: int = 0
    rejected: Counter = field(default_factory=Counter)
    clipped: int = 0
    misaligned: int = 0
    sign_seconds: float = 0.0
    verify_seconds: float = 0.0
