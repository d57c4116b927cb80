"""The robust merge: the token-weighted merge (:mod:`p2pdiloco.core.merge`) that a few bad
contributions cannot steer (docs/trust.md section 5), as a round's reducer runs it
(``net.rounds.reducer``): :func:`robust_merge` drops non-finite members, caps weights at the
median, multiplies them by the trust the reducer earned in each member, clips (or drops) norms
far above the median and weighs each tensor by its alignment with the reducer's own Δ (or
leaves out a minority pointing against the members' median direction), and says what it did in
a :class:`RobustMerge`. Arithmetic as the token-weighted merge's (its module
docstring): Python float64 for medians, cosines, scores and thresholds, fp32 tensors in member
order, norms and dot products accumulated in float64.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .choices import DEFAULT_OUTLIER_FACTOR, OUTLIER_POLICIES
from .merge import _dot, _norm, is_finite_contribution, merge_tensor

__all__ = ["robust_merge", "RobustMerge", "FULL_TRUST_COSINE"]

DIRECTION_MARGIN = 0.1  # cosine below -max(this, 3/sqrt(numel)) against the median direction: misaligned

FULL_TRUST_COSINE = 0.2  # cosine with the reducer's own Δ from which a member's weight is whole


@dataclass(frozen=True)
class RobustMerge:
    """What :func:`robust_merge` did.

    Attributes:
        merged: one fp32 tensor per slot.
        kept: indices (input order) of the members whose contributions were merged.
        dropped: member index -> reason (``non_finite``, ``bad_weight``, ``outlier``,
            ``misaligned``).
        clipped: (member index, slot index) of every norm-clipped tensor.
        misaligned: (member index, slot index) of every tensor left out of its slot's merge
            (weight 0 there) because it points against the slot's reference direction.
        weights: the weight each member was merged with before the per-slot alignment scores
            (after the median cap and ``trust``; 0.0 for dropped members).
        scores: (member index, slot index, score) of every tensor whose weight was multiplied
            by an alignment score below 1 (0 < score < 1; a score of 0 is in ``misaligned``).
        reference: the member whose own Δ was the reference direction (``own``, in every slot
            where that Δ is nonzero; the median direction in the others), or None where the
            median direction was used throughout.
    """

    merged: list[Tensor]
    kept: tuple[int, ...]
    dropped: dict[int, str] = field(default_factory=dict)
    clipped: tuple[tuple[int, int], ...] = ()
    misaligned: tuple[tuple[int, int], ...] = ()
    weights: tuple[float, ...] = ()
    scores: tuple[tuple[int, int, float], ...] = ()
    reference: int | None = None


def robust_merge(
    per_member: Sequence[Sequence[Tensor]], weights: Sequence[float], embedding_mask: Sequence[bool],
    *, policy: str = "clip", factor: float = DEFAULT_OUTLIER_FACTOR, own: int | None = None,
    trust: Sequence[float] | None = None, full_trust_cosine: float = FULL_TRUST_COSINE,
) -> RobustMerge:
    """Token-weighted merge (:func:`merge_tensor`) that a few bad contributions cannot steer.

    ``per_member[m][i]`` is member m's Δ for slot i (any float dtype, read as fp32),
    ``weights[m]`` its claimed weight (``contribution_weight``), ``own`` the index of the
    calling reducer's own contribution (None: not among these), ``trust[m]`` in [0, 1] a
    multiplier the caller earned locally for member m (default 1.0). The rule, in this order
    (docs/trust.md section 5 gives the reasons and the measurements):

    1. a member with a non-finite element (``non_finite``) or weight (``bad_weight``) is dropped;
    2. ``policy == "off"``: merge the rest with ``weights × trust``, nothing else;
    3. weights above the median of the positive weights are cut to it (the lower median, or
       max(lower, min(w_own, upper)) with ``own``), then multiplied by ``trust``;
    4. per slot, a Δ with norm above ``factor`` × the median norm chosen as the weights' is
       scaled to that bound (``clip``) or its member dropped (``drop``, ``outlier``);
    5. per slot, with a nonzero own Δ as reference R: each other weight × clamp(cos(Δ, R) /
       ``full_trust_cosine``, 0, 1) (0: ``misaligned`` in that slot); else, with 3 or more
       members, R = the coordinate-wise median of their unit vectors and a strict minority
       with cos below −max(0.1, 3/√numel) is left out of the slot (``drop``: dropped);
    6. the kept members are merged slot by slot with :func:`merge_tensor`.

    Sources: the token-weighted radial-directional merge, arXiv 2604.21428; the median norm
    bound, FLAME (arXiv 2101.02281) and Sun et al. (arXiv 1911.07963); the ReLU-cosine score
    against a trusted root gradient (here the reducer's own Δ), FLTrust (arXiv 2012.13995);
    the coordinate-wise median, Yin et al. (arXiv 1803.01498). Deterministic: Python float64
    for medians, cosines, scores and thresholds, fp32 tensor arithmetic in member order.

    Raises:
        ValueError: unknown policy, ``factor`` <= 1, ``full_trust_cosine`` not in (0, 1],
            ``own`` out of range, ``trust`` of another length or outside [0, 1], inputs of
            mismatched lengths or shapes, or no contribution left to merge.
    """
    trusts = _checked_inputs(per_member, weights, embedding_mask, policy, factor, own, trust, full_trust_cosine)
    n_slots = len(embedding_mask)
    dropped, ws = _screened(per_member, weights)
    alive = [m for m in range(len(per_member)) if m not in dropped]
    deltas = {m: [t.detach().to(torch.float32) for t in per_member[m]] for m in alive}
    ref = own if own in deltas else None
    robust = policy != "off" and len(alive) > 1
    positive = [ws[m] for m in alive if ws[m] > 0]
    if robust and positive:
        cap = _median_towards(positive, ws[ref] if ref is not None and ws[ref] > 0 else None)
        ws = [min(w, cap) if m in deltas else w for m, w in enumerate(ws)]
    ws = [w * x for w, x in zip(ws, trusts)]
    steps = _Steps(slot_ws=[ws] * n_slots)
    if robust:
        steps = _norms_and_directions(alive, deltas, ws, ref, n_slots, policy, factor, full_trust_cosine, dropped)
    kept = tuple(m for m in alive if m not in dropped)
    if not kept:
        raise ValueError(f"no contribution left to merge: {dropped}")
    merged = [merge_tensor([deltas[m][i] for m in kept], [steps.slot_ws[i][m] for m in kept], embedding_mask[i])
              for i in range(n_slots)]
    used = tuple(ws[m] if m in kept else 0.0 for m in range(len(per_member)))
    return RobustMerge(merged, kept, dropped, tuple(steps.clipped), tuple(sorted(steps.misaligned)), used,
                       tuple(steps.scores), ref if ref in kept else None)


def _checked_inputs(per_member: Sequence[Sequence[Tensor]], weights: Sequence[float], embedding_mask: Sequence[bool],
                    policy: str, factor: float, own: int | None, trust: Sequence[float] | None,
                    full_trust_cosine: float) -> list[float]:
    """The arguments of :func:`robust_merge` checked (ValueError as it says); returns the
    per-member trust multipliers (1.0 each without ``trust``)."""
    if policy not in OUTLIER_POLICIES:
        raise ValueError(f"unknown outlier policy {policy!r}; choose one of {OUTLIER_POLICIES}")
    if not factor > 1 or not math.isfinite(factor):
        raise ValueError(f"outlier factor must be a finite number > 1, got {factor}")
    if not 0 < full_trust_cosine <= 1:
        raise ValueError(f"full_trust_cosine must be in (0, 1], got {full_trust_cosine}")
    if len(weights) != len(per_member):
        raise ValueError(f"{len(weights)} weights for {len(per_member)} members")
    if own is not None and not 0 <= own < len(per_member):
        raise ValueError(f"own index {own} out of range for {len(per_member)} members")
    trusts = [1.0] * len(per_member) if trust is None else [float(x) for x in trust]
    if len(trusts) != len(per_member) or not all(0.0 <= x <= 1.0 for x in trusts):
        raise ValueError(f"trust must be {len(per_member)} numbers in [0, 1], got {trusts}")
    for m, ts in enumerate(per_member):
        if len(ts) != len(embedding_mask):
            raise ValueError(f"member {m} has {len(ts)} tensors, expected {len(embedding_mask)}")
    return trusts


def _screened(per_member: Sequence[Sequence[Tensor]], weights: Sequence[float]) -> tuple[dict[int, str], list[float]]:
    """Step 1 of :func:`robust_merge`: (member -> ``non_finite`` or ``bad_weight``, the weights
    as Python floats)."""
    dropped: dict[int, str] = {}
    ws = [float(w) for w in weights]
    for m, ts in enumerate(per_member):
        if not is_finite_contribution(ts):
            dropped[m] = "non_finite"
        elif not (math.isfinite(ws[m]) and ws[m] >= 0):
            dropped[m] = "bad_weight"
    return dropped, ws


@dataclass
class _Steps:
    """Steps 4 and 5 of :func:`robust_merge`: per-slot weights and what was clipped, muted, scored."""

    slot_ws: list[list[float]]
    clipped: list[tuple[int, int]] = field(default_factory=list)
    misaligned: list[tuple[int, int]] = field(default_factory=list)
    scores: list[tuple[int, int, float]] = field(default_factory=list)


def _norms_and_directions(alive: Sequence[int], deltas: dict[int, list[Tensor]], ws: list[float], ref: int | None,
                          n_slots: int, policy: str, factor: float, full: float, dropped: dict[int, str]) -> _Steps:
    """Steps 4 and 5 of :func:`robust_merge` over the ``alive`` members: clips ``deltas`` in
    place and adds the members it drops to ``dropped``."""
    clipped: list[tuple[int, int]] = []
    live = [m for m in alive if ws[m] > 0]
    outliers = _clip_norms(live, deltas, n_slots, factor, ref, policy == "drop", clipped)
    for m in sorted(outliers):
        dropped[m] = "outlier"
    clipped = [(m, i) for m, i in clipped if m not in outliers]
    members = [m for m in live if m not in outliers]
    own_slots = [i for i in range(n_slots) if ref is not None and _norm(deltas[ref][i]) > 0]
    slot_ws, scores, muted = _aligned(members, deltas, n_slots, own_slots, ref, ws, full)
    by_median = _misaligned(members, deltas, [i for i in range(n_slots) if i not in own_slots])
    against = {m for m, _ in by_median}  # against the own reference: muted (score 0), never dropped
    if policy == "drop":
        for m in sorted(against):
            dropped[m] = "misaligned"
    else:
        muted += by_median
        for m, i in by_median:
            slot_ws[i][m] = 0.0
    return _Steps(slot_ws, clipped, [(m, i) for m, i in muted if m not in dropped],
                  [(m, i, s) for m, i, s in scores if m not in dropped])


def _clip_norms(live: Sequence[int], deltas: dict[int, list[Tensor]], n_slots: int, factor: float,
                ref: int | None, drop: bool, clipped: list[tuple[int, int]]) -> set[int]:
    """Step 4 of :func:`robust_merge`: scale (in ``deltas``) or collect (``drop``) the tensors of
    ``live`` above ``factor`` × max(lower median, min(own, upper median)) of their norms; returns
    the members to drop and appends (member, slot) of each scaled tensor to ``clipped``."""
    outliers: set[int] = set()
    for i in range(n_slots):
        norms = {m: _norm(deltas[m][i]) for m in live}
        if not norms:
            continue
        base = _median_towards(list(norms.values()), None if ref is None else _norm(deltas[ref][i]))
        if base <= 0:
            continue
        bound = factor * base
        for m, norm in norms.items():
            if norm > bound:
                if drop:
                    outliers.add(m)
                else:
                    deltas[m][i] = deltas[m][i] * (bound / norm)
                    clipped.append((m, i))
    return outliers


def _median_towards(values: Sequence[float], own: float | None) -> float:
    """The lower median of ``values``, or with the reducer's own value: max(lower median,
    min(own, upper median)), the median the own value picks when the count is even (equal to
    the median when it is odd). Never above the upper median, nor above both the lower
    median and ``own``: with an honest reducer, always at most an honest value."""
    low = statistics.median_low(values)
    return low if own is None else max(low, min(own, statistics.median_high(values)))


def _margin(numel: int) -> float:
    """Cosine below minus this: clearly against a direction (3 standard deviations of a random
    unit vector's cosine, at least ``DIRECTION_MARGIN``)."""
    return max(DIRECTION_MARGIN, 3.0 / math.sqrt(numel))


def _aligned(members: Sequence[int], deltas: dict[int, list[Tensor]], n_slots: int, own_slots: Sequence[int],
             ref: int | None, ws: Sequence[float], full: float):
    """Step 5 of :func:`robust_merge` against the own Δ ``ref`` in ``own_slots``: (per-slot
    weights, (member, slot, score) of partial scores, (member, slot) of zero scores)."""
    slot_ws: list[list[float]] = []
    scores: list[tuple[int, int, float]] = []
    muted: list[tuple[int, int]] = []
    for i in range(n_slots):
        row = list(ws)
        if i in own_slots and ref is not None:
            r = deltas[ref][i].reshape(-1)
            r_norm = _norm(r)
            for m in members:
                if m == ref:
                    continue
                d = deltas[m][i].reshape(-1)
                norm = _norm(d)
                cos = _dot(d, r) / (norm * r_norm) if norm > 0 else 0.0
                score = min(1.0, max(0.0, cos / full))
                if score < 1.0:
                    row[m] *= score
                    if score > 0:
                        scores.append((m, i, score))
                    elif norm > 0:
                        muted.append((m, i))
        slot_ws.append(row)
    return slot_ws, scores, muted


def _misaligned(members: Sequence[int], deltas: dict[int, list[Tensor]], slots: Sequence[int]) -> list[tuple[int, int]]:
    """(member, slot) pairs whose Δ points against the coordinate-wise median direction in
    ``slots`` (step 5 of :func:`robust_merge` without an own reference); only a strict
    minority of a slot's members is flagged."""
    out: list[tuple[int, int]] = []
    for i in slots:
        units = {}
        for m in members:
            norm = _norm(deltas[m][i])
            if norm > 0:
                units[m] = deltas[m][i].reshape(-1) / norm
        if len(units) < 3:
            continue
        ref = torch.stack(list(units.values())).median(dim=0).values
        ref_norm = _norm(ref)
        if ref_norm <= 0:
            continue
        margin = _margin(ref.numel())
        bad = [m for m, u in units.items() if _dot(u, ref) / ref_norm < -margin]
        if bad and 2 * len(bad) < len(units):
            out.extend((m, i) for m in bad)
    return sorted(out)
