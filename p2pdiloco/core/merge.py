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
    ``weights[m]`` its claimed weight (``contribution_weight``: tokens²/steps), ``own`` the
    index of the calling reducer's own contribution (None: the reducer is not a member, or its
    slice is not among these), ``trust[m]`` in [0, 1] a multiplier the caller earned locally
    for member m (default 1.0 for all). Rule, in this order:

    1. A member with any non-finite element is dropped (``non_finite``); one with a
       non-finite or negative weight too (``bad_weight``). Always, whatever the policy.
    2. ``policy == "off"``: merge the rest with ``weights × trust``, nothing else.
    3. Weights: every weight above the median of the positive weights becomes that median,
       so claimed tokens never raise a member above the group's median member: the lower
       median, or when ``own`` is given, max(lower median, min(w_own, upper median)) (with an
       even count the reducer's own weight picks between the two medians: two honest learners
       of different speeds keep their token weighting in the slots the faster one reduces;
       measured, the lower median alone cost up to 2.0 % held-out loss in
       ``bench/mixed_speeds.py``). Then
       each weight is multiplied by ``trust[m]`` (a reputation the node earned for the peer,
       e.g. small for a fresh identity; applied after the cap so a low trust never lowers the
       cap). Medians below are over the members whose weight is then positive.
    4. Norms, per slot i, of the members with positive weight: ``T_i = factor × b_i`` with
       ``b_i`` their median norm chosen as the weights' (the own norm picks between the lower
       and upper median; skipped when ``b_i`` is 0). A tensor with ‖Δ_m,i‖ > T_i
       is scaled to norm T_i (``clip``), or its member is dropped from the merge (``drop``,
       reason ``outlier``); the own Δ too. With an even count the own norm picks between the
       two medians, so two colluders of 4 that send tiny Δ cannot shrink the honest ones to
       their norm, and two that send huge Δ cannot raise the bound above an honest norm.
    5. Directions, per slot i, against a reference direction R_i:
       * ``own`` given, kept, and Δ_own,i ≠ 0: R_i = Δ_own,i, the reducer's own pseudo-gradient,
         which it knows to be honest (FLTrust's root gradient, see Sources). Every other
         member's weight in slot i is multiplied by the score
         ``s = clamp(cos(Δ_m,i, R_i) / full_trust_cosine, 0, 1)``: whole for a Δ at least that
         aligned, proportional below, 0 at or below orthogonal (then the pair is
         ``misaligned``: left out of slot i), with ``drop`` as with ``clip``: one learner's Δ
         is evidence enough to mute a tensor, not to drop a member (honest learners of a small
         model early in a run point against each other now and then: dropped, they lost their
         rounds, tests/test_trust_integration.py).
       * otherwise, when at least 3 members with positive weight and a nonzero Δ are left:
         R_i = coordinate-wise median of their unit vectors; a member whose cosine with R_i is
         below −max(0.1, 3/√numel_i) points against the group. If such members are a strict
         minority, each is left out of slot i's merge (``clip``) or dropped (``drop``, reason
         ``misaligned``). No scores: a median is only as good as its honest majority.
    6. Merge the kept members slot by slot with :func:`merge_tensor`.

    Why the own reference: each reducer is a member and merges its part of the fragment alone
    (``net.rounds.allreduce``); its own Δ is the one contribution it can trust, whereas a median
    direction is steered by colluders that make up half of a group of 4. The score is a
    Δ's share of FLTrust's ReLU-cosine trust; ``full_trust_cosine`` (0.2) lies below the
    cosines honest learners' Δ of this project's model have with each other (measured, per
    tensor, 0.36 to 0.98 for 4 learners of the default GPT after 300 steps, >= 0.92 at the
    start; ``bench/merge_attacks.py``), so an honest group's merge is the plain merge up to the
    median cap and the norm bound, and far above a random direction's cosine (about
    1/√numel). Measured on real pseudo-gradients (docs/trust.md §5): one poisoner of 4 at 1.7x
    the median norm in a direction of its choice reaches a cosine of at most ~0.05 with that
    direction, two of 4 sending −2x their Δ leave the progress along the honest direction at
    1.0. Limits: a Δ with cosine ``full_trust_cosine`` towards the reference and the rest of its
    norm in a direction of its choice gets full weight (at most 1/4 of the directional sum in a
    group of 4); colluders with honest-looking Δ can shrink the merged norm (their norms count
    in the magnitude average) but not turn it; a reducer that is itself malicious controls its
    part of the fragment (signed, so attributable). Groups of larger models whose honest Δ are
    nearly orthogonal need a lower ``full_trust_cosine``.

    The lower median (``statistics.median_low``) is an element of the set, so with two
    members the smaller norm bounds the larger. With the default ``factor`` 1.25 one scaled-up
    contribution among M raises a radial-directional merge's magnitude by at most
    (M + 0.25)/M over equal honest norms (1.06 for M = 4); honest spread (a learner that missed
    a round brings about twice the norm) is trimmed.

    Sources: the token-weighted radial-directional merge: arXiv 2604.21428. Clipping every
    update to the median of the update norms is FLAME's bound (Nguyen et al., "FLAME: Taming
    Backdoors in Federated Learning", USENIX Security 2022, arXiv 2101.02281); norm bounding of
    updates against scaled ("model replacement") updates: Sun et al., "Can You Really Backdoor
    Federated Learning?", arXiv 1911.07963. Trust scores ReLU(cos) against a trusted root
    gradient, and magnitudes normalised to it: FLTrust (Cao et al., "FLTrust: Byzantine-robust
    Federated Learning via Trust Bootstrapping", NDSS 2021, arXiv 2012.13995); here the root
    gradient is the reducer's own Δ and the score saturates at ``full_trust_cosine``. The
    median fallback: coordinate-wise median (Yin et al., "Byzantine-Robust Distributed
    Learning: Towards Optimal Statistical Rates", ICML 2018, arXiv 1803.01498).

    Deterministic: Python float64 for medians, cosines, scores and thresholds, fp32 tensor
    arithmetic in member order, so one reducer's result is reproducible from its inputs.

    Raises:
        ValueError: unknown policy, ``factor`` <= 1, ``full_trust_cosine`` not in (0, 1],
            ``own`` out of range, ``trust`` of another length or outside [0, 1], or inputs of
            mismatched lengths or shapes.
    """
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
    n_slots = len(embedding_mask)
    for m, ts in enumerate(per_member):
        if len(ts) != n_slots:
            raise ValueError(f"member {m} has {len(ts)} tensors, expected {n_slots}")
    dropped: dict[int, str] = {}
    ws = [float(w) for w in weights]
    for m, ts in enumerate(per_member):
        if not is_finite_contribution(ts):
            dropped[m] = "non_finite"
        elif not (math.isfinite(ws[m]) and ws[m] >= 0):
            dropped[m] = "bad_weight"
    alive = [m for m in range(len(per_member)) if m not in dropped]
    deltas = {m: [t.detach().to(torch.float32) for t in per_member[m]] for m in alive}
    ref = own if own in deltas else None
    clipped: list[tuple[int, int]] = []
    misaligned: list[tuple[int, int]] = []
    scores: list[tuple[int, int, float]] = []
    robust = policy != "off" and len(alive) > 1
    positive = [ws[m] for m in alive if ws[m] > 0]
    if robust and positive:
        cap = _median_towards(positive, ws[ref] if ref is not None and ws[ref] > 0 else None)
        ws = [min(w, cap) if m in deltas else w for m, w in enumerate(ws)]
    ws = [w * x for w, x in zip(ws, trusts)]
    slot_ws = [ws] * n_slots
    if robust:
        live = [m for m in alive if ws[m] > 0]
        outliers = _clip_norms(live, deltas, n_slots, factor, ref, policy == "drop", clipped)
        for m in sorted(outliers):
            dropped[m] = "outlier"
        clipped = [(m, i) for m, i in clipped if m not in outliers]
        members = [m for m in live if m not in outliers]
        own_slots = [i for i in range(n_slots) if ref is not None and _norm(deltas[ref][i]) > 0]
        slot_ws, scores, muted = _aligned(members, deltas, n_slots, own_slots, ref, ws, full_trust_cosine)
        by_median = _misaligned(members, deltas, [i for i in range(n_slots) if i not in own_slots])
        against = {m for m, _ in by_median}  # against the own reference: muted (score 0), never dropped
        if policy == "drop":
            for m in sorted(against):
                dropped[m] = "misaligned"
        else:
            muted += by_median
            for m, i in by_median:
                slot_ws[i][m] = 0.0
        misaligned = [(m, i) for m, i in muted if m not in dropped]
        scores = [(m, i, s) for m, i, s in scores if m not in dropped]
    kept = tuple(m for m in alive if m not in dropped)
    if not kept:
        raise ValueError(f"no contribution left to merge: {dropped}")
    merged = [merge_tensor([deltas[m][i] for m in kept], [slot_ws[i][m] for m in kept], embedding_mask[i])
              for i in range(n_slots)]
    used = tuple(ws[m] if m in kept else 0.0 for m in range(len(per_member)))
    return RobustMerge(merged, kept, dropped, tuple(clipped), tuple(sorted(misaligned)), used, tuple(scores),
                       ref if ref in kept else None)


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
