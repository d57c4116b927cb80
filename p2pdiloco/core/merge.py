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

__all__ = ["contribution_weight", "merge_tensor", "merge_pseudo_gradients", "is_finite_contribution",
           "robust_merge", "RobustMerge", "OUTLIER_POLICIES", "DEFAULT_OUTLIER_FACTOR"]

DIRECTION_MARGIN = 0.1  # cosine below -max(this, 3/sqrt(numel)) against the median direction: misaligned

DIRECTION_EPS = 1e-6  # below this norm of the (normalised) direction sum, use the weighted mean


def contribution_weight(tokens: int, steps: int) -> float:
    """Merge weight of one contribution: tokens**2 / steps (tokens processed times tokens per
    step), 0.0 when steps == 0. Units: tokens (bytes here) squared per inner step.
    Source: arXiv 2604.21428 (token-weighted merge). Raises ValueError on negative arguments."""
    if tokens < 0 or steps < 0:
        raise ValueError(f"tokens and steps must be >= 0, got tokens={tokens} steps={steps}")
    return 0.0 if steps == 0 else float(tokens) ** 2 / steps


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
        dropped: member index -> reason (``non_finite``, ``bad_weight``, ``outlier``).
        clipped: (member index, slot index) of every norm-clipped tensor.
        misaligned: (member index, slot index) of every tensor left out of its slot's merge
            because it points against the members' median direction (``clip`` policy).
        weights: the weight each member was merged with (0.0 for dropped members); differs
            from the input where a weight was clipped.
    """

    merged: list[Tensor]
    kept: tuple[int, ...]
    dropped: dict[int, str] = field(default_factory=dict)
    clipped: tuple[tuple[int, int], ...] = ()
    misaligned: tuple[tuple[int, int], ...] = ()
    weights: tuple[float, ...] = ()


def robust_merge(
    per_member: Sequence[Sequence[Tensor]], weights: Sequence[float], embedding_mask: Sequence[bool],
    *, policy: str = "clip", factor: float = DEFAULT_OUTLIER_FACTOR,
) -> RobustMerge:
    """Token-weighted merge (:func:`merge_tensor`) that a few bad contributions cannot wreck.

    Rule, applied in this order to ``per_member[m][i]`` (member m's Δ for slot i) and its
    weight ``weights[m]``:

    1. A member with any non-finite element is dropped (``non_finite``); one with a
       non-finite or negative weight too (``bad_weight``). Always, whatever the policy.
    2. ``policy == "off"``: merge the rest unchanged.
    3. Weights: ``c = factor × lower median of the positive weights``; every weight above
       ``c`` becomes ``c`` (weights are claimed token counts, which a peer can inflate).
    4. Norms, per slot i, among members with positive weight: ``T_i = factor × lower median
       of ‖Δ_m,i‖`` (skipped when that median is 0). A tensor with ‖Δ_m,i‖ > T_i is
       scaled to norm T_i (``clip``), or its member is dropped from the merge (``drop``,
       reason ``outlier``). Medians are taken once, over the members left after step 1.
    5. Directions, per slot i, when at least 3 members with positive weight and a nonzero Δ
       are left: R_i = coordinate-wise median of their unit vectors Δ_m,i/‖Δ_m,i‖; a member
       whose cosine with R_i is below −max(0.1, 3/√numel_i) points against the group. If
       such members are a strict minority, each is left out of slot i's merge (``clip``:
       weight 0 for that slot) or dropped from the merge (``drop``, reason ``misaligned``).
       The margin keeps nearly orthogonal honest pseudo-gradients (the paper's regime, where
       a random unit vector's cosine is about 1/√numel) from being flagged.
    6. Merge the kept members slot by slot with :func:`merge_tensor`.

    The lower median (``statistics.median_low``) is an element of the set, so with two
    members the smaller norm bounds the larger; like every median rule it needs a majority
    of honest members to hold. With the default ``factor`` 2 one scaled-up contribution
    among M can raise a radial-directional merge's magnitude by at most a factor (M + 1)/M
    (1.5 for M = 2); honest spread (a learner that missed a round brings about twice the
    norm and weight) is left alone or only trimmed.

    Sources: clipping every update to the median of the update norms is FLAME's bound
    (Nguyen et al., "FLAME: Taming Backdoors in Federated Learning", USENIX Security 2022,
    arXiv 2101.02281); norm bounding of updates against scaled ("model replacement")
    updates: Sun et al., "Can You Really Backdoor Federated Learning?", arXiv 1911.07963.
    Here the bound is ``factor`` × the lower median instead of the median itself, so the
    merge of honest learners stays the plain token-weighted merge of arXiv 2604.21428.
    Zero weight for updates whose cosine with a reference direction is negative is FLTrust's
    ReLU-clipped trust score (Cao et al., "FLTrust: Byzantine-robust Federated Learning via
    Trust Bootstrapping", NDSS 2021, arXiv 2012.13995); here the reference is the
    coordinate-wise median of the members' directions (Yin et al., "Byzantine-Robust
    Distributed Learning: Towards Optimal Statistical Rates", ICML 2018, arXiv 1803.01498)
    instead of a gradient on trusted data, which a swarm does not have.

    Deterministic: Python float64 for medians and thresholds, fp32 tensor arithmetic in
    member order, so one reducer's result is reproducible from its inputs.

    Raises:
        ValueError: unknown policy, ``factor`` <= 1, or inputs of mismatched lengths or shapes.
    """
    if policy not in OUTLIER_POLICIES:
        raise ValueError(f"unknown outlier policy {policy!r}; choose one of {OUTLIER_POLICIES}")
    if not factor > 1 or not math.isfinite(factor):
        raise ValueError(f"outlier factor must be a finite number > 1, got {factor}")
    if len(weights) != len(per_member):
        raise ValueError(f"{len(weights)} weights for {len(per_member)} members")
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
    clipped: list[tuple[int, int]] = []
    misaligned: list[tuple[int, int]] = []
    if policy != "off" and len(alive) > 1:
        positive = [ws[m] for m in alive if ws[m] > 0]
        if positive:
            cap = factor * statistics.median_low(positive)
            for m in alive:
                ws[m] = min(ws[m], cap)
        live = [m for m in alive if ws[m] > 0]
        outliers: set[int] = set()
        for i in range(n_slots):
            norms = {m: _norm(deltas[m][i]) for m in live}
            ref = statistics.median_low(norms.values()) if norms else 0.0
            if ref <= 0:
                continue
            bound = factor * ref
            for m, norm in norms.items():
                if norm > bound:
                    if policy == "drop":
                        outliers.add(m)
                    else:
                        deltas[m][i] = deltas[m][i] * (bound / norm)
                        clipped.append((m, i))
        for m in sorted(outliers):
            dropped[m] = "outlier"
        clipped = [(m, i) for m, i in clipped if m not in outliers]
        against = _misaligned([m for m in live if m not in outliers], deltas, n_slots)
        if policy == "drop":
            for m in sorted({m for m, _ in against}):
                dropped[m] = "misaligned"
            against = []
        misaligned = against
    kept = tuple(m for m in alive if m not in dropped)
    if not kept:
        raise ValueError(f"no contribution left to merge: {dropped}")
    muted = set(misaligned)
    merged = [merge_tensor([deltas[m][i] for m in kept], [0.0 if (m, i) in muted else ws[m] for m in kept],
                           embedding_mask[i]) for i in range(n_slots)]
    used = tuple(ws[m] if m in kept else 0.0 for m in range(len(per_member)))
    return RobustMerge(merged, kept, dropped, tuple(clipped), tuple(misaligned), used)


def _misaligned(members: Sequence[int], deltas: dict[int, list[Tensor]], n_slots: int) -> list[tuple[int, int]]:
    """(member, slot) pairs whose Δ points against the coordinate-wise median direction
    (step 5 of :func:`robust_merge`); only a strict minority of a slot's members is flagged."""
    out: list[tuple[int, int]] = []
    for i in range(n_slots):
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
        margin = max(DIRECTION_MARGIN, 3.0 / math.sqrt(ref.numel()))
        bad = [m for m, u in units.items() if _dot(u, ref) / ref_norm < -margin]
        if bad and 2 * len(bad) < len(units):
            out.extend((m, i) for m in bad)
    return sorted(out)
