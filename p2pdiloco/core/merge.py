"""Token-weighted merge of pseudo-gradients (Decoupled DiLoCo, arXiv 2604.21428).

Source: the paper's token-weighted merge. Weight w_m = tokens_m**2 / steps_m. Embedding
tensors get the weighted mean; every other tensor gets radial-directional averaging, which
keeps the merged norm independent of the number of (nearly orthogonal) contributions, so the
outer learning rate does not need retuning when the quorum size changes.

All tensor arithmetic is fp32 and accumulates in the given member order (the caller sorts
members, e.g. by peer id); weights are normalised in Python float64 first. Elementwise work is
single multiplies and adds, each rounded once (no ``add(alpha=)``, a fused multiply-add in
torch's vectorised CPU kernels only), and norms and dot products accumulate in float64
(``_norm``, ``_dot``), whose summation order, which differs between kernel sets, moves the
result far below what survives the rounding of the scalar to fp32: a merge gives the same bytes
under ``ATEN_CPU_CAPABILITY`` default, avx2 and avx512 (``tests/test_cpu_kernels.py``). Only
the round's reducer computes a merged tensor; its members receive its bytes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .choices import DEFAULT_OUTLIER_FACTOR, OUTLIER_POLICIES

__all__ = ["age_gate", "contribution_weight", "merge_tensor", "merge_pseudo_gradients", "is_finite_contribution",
           "robust_merge", "RobustMerge", "OUTLIER_POLICIES", "DEFAULT_OUTLIER_FACTOR", "FULL_TRUST_COSINE"]

DIRECTION_MARGIN = 0.1  # cosine below -max(this, 3/sqrt(numel)) against the median direction: misaligned

FULL_TRUST_COSINE = 0.2  # cosine with the reducer's own Δ from which a member's weight is whole

DIRECTION_EPS = 1e-6  # below this norm of the (normalised) direction sum, use the weighted mean


def contribution_weight(tokens: int, steps: int) -> float:
    """Merge weight of one contribution: tokens**2 / steps (tokens processed times tokens per
    step), 0.0 when steps == 0. Units: tokens (bytes here) squared per inner step.
    Source: arXiv 2604.21428 (token-weighted merge). Raises ValueError on negative arguments."""
    if tokens < 0 or steps < 0:
        raise ValueError(f"tokens and steps must be >= 0, got tokens={tokens} steps={steps}")
    return 0.0 if steps == 0 else float(tokens) ** 2 / steps


def age_gate(age: int, alpha: float, cutoff: int) -> float:
    """The factor σ(τ) = γ(τ)·e^(−ατ) by which a contribution of age τ enters the outer step:
    Cosine-Gated Adam-Decay (Shah and Sun, arXiv 2605.09126), whose exponential models the
    decay of the information in a pseudo-gradient computed τ outer rounds ago and whose cosine
    gate γ(τ) = ½·(1 + cos(π·τ/cutoff)) for τ < cutoff, else 0, zeroes contributions past the
    cutoff. 1.0 at τ = 0. Here τ = span − 1: the rounds that merged the fragment while the
    contribution's progress was made, before the one it enters (``Learner.span``). Measured
    with a straggler in ``bench.partial_rounds --straggler`` (worse than no gate there); no
    node applies it (it would go where the reducers weigh contributions, ``net.rounds.reducer``).
    age: rounds (int >= 0); alpha: per round (>= 0, finite); cutoff: rounds (>= 1). Raises
    ValueError otherwise."""
    if age < 0 or cutoff < 1 or not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"age gate needs age >= 0, cutoff >= 1, alpha >= 0: got {age}, {cutoff}, {alpha}")
    if age >= cutoff:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * age / cutoff)) * math.exp(-alpha * age)


def is_finite_contribution(tensors: Iterable[Tensor]) -> bool:
    """True when every element of every tensor is finite (no NaN / inf)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _normalised(weights: Sequence[float], n: int) -> list[float]:
    """Weights divided by their sum (float64); [] when the sum is 0. ValueError if bad."""
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} contributions")
    ws = [float(w) for w in weights]
    if not all(math.isfinite(w) and w >= 0 for w in ws):
        raise ValueError(f"weights must be finite and >= 0, got {ws}")
    total = math.fsum(ws)
    return [w / total for w in ws] if total > 0 else []


def _norm(t: Tensor) -> float:
    """‖t‖₂ accumulated in float64 (see the module docstring)."""
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))


def _dot(a: Tensor, b: Tensor) -> float:
    """a · b of two 1-D tensors, accumulated in float64."""
    return float(torch.dot(a.to(torch.float64), b.to(torch.float64)))


def _weighted_sum(ds: Sequence[Tensor], ws: Sequence[float]) -> Tensor:
    acc = torch.zeros_like(ds[0])
    for d, w in zip(ds, ws):
        if w > 0:
            acc.add_(d.mul(w))
    return acc


def merge_tensor(deltas: Sequence[Tensor], weights: Sequence[float], is_embedding: bool) -> Tensor:
    """Merge one tensor's pseudo-gradients from M members.

    deltas: M tensors of one shape (any float dtype, converted to fp32); weights: M finite
    weights >= 0 (from ``contribution_weight``), same order. Returns a new fp32 tensor of that
    shape (never an alias of an input):
      embedding: Σ wΔ / Σ w;
      otherwise: magnitude = Σ w‖Δ‖ / Σ w, direction = Σ w (Δ/‖Δ‖) / Σ w (a zero Δ adds no
      direction), merged = magnitude · direction/‖direction‖, or the weighted mean when
      ‖direction‖ < 1e-6. Σ w == 0 (nobody took a step) gives zeros. With a single member of
      positive weight the result is exactly its Δ (what the formula gives, without rounding).
    Source: arXiv 2604.21428, token-weighted merge with radial-directional averaging.
    Raises ValueError on empty input, length or shape mismatch, bad weights, non-finite Δ.
    """
    if not deltas:
        raise ValueError("no contributions to merge")
    ds = [d.detach().to(torch.float32) for d in deltas]
    if any(d.shape != ds[0].shape for d in ds):
        raise ValueError(f"shape mismatch among contributions: {[tuple(d.shape) for d in ds]}")
    ws = _normalised(weights, len(ds))
    if not is_finite_contribution(ds):
        raise ValueError("non-finite pseudo-gradient; filter with is_finite_contribution first")
    if not ws:
        return torch.zeros_like(ds[0])
    live = [m for m, w in enumerate(ws) if w > 0]
    if len(live) == 1:
        return ds[live[0]].clone()
    if is_embedding:
        return _weighted_sum(ds, ws)
    norms = [_norm(d) for d in ds]
    magnitude = math.fsum(w * n for w, n in zip(ws, norms))
    direction = torch.zeros_like(ds[0])
    for d, w, n in zip(ds, ws, norms):
        if w > 0 and n > 0:
            direction.add_(d.mul(w / n))
    dnorm = _norm(direction)
    if dnorm < DIRECTION_EPS:
        return _weighted_sum(ds, ws)
    return direction.mul_(magnitude / dnorm)


def merge_pseudo_gradients(
    per_member: Sequence[Sequence[Tensor]], weights: Sequence[float], embedding_mask: Sequence[bool]
) -> list[Tensor]:
    """Merge a fragment: ``per_member[m][i]`` is member m's Δ for slot i (slot shapes);
    ``weights[m]`` its weight; ``embedding_mask[i]`` selects the mean for slot i.
    Returns one fp32 tensor per slot (see ``merge_tensor``). Source: arXiv 2604.21428.
    Raises ValueError on empty input or mismatched lengths (and as ``merge_tensor``)."""
    if not per_member:
        raise ValueError("no contributions to merge")
    if len(weights) != len(per_member):
        raise ValueError(f"{len(weights)} weights for {len(per_member)} members")
    for m, ts in enumerate(per_member):
        if len(ts) != len(embedding_mask):
            raise ValueError(f"member {m} has {len(ts)} tensors, expected {len(embedding_mask)}")
    return [merge_tensor([ts[i] for ts in per_member], weights, e) for i, e in enumerate(embedding_mask)]


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
