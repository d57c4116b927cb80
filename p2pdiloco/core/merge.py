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
the round's reducer computes a merged tensor; its members receive its bytes. The merge that a
few bad contributions cannot steer is :mod:`p2pdiloco.core.robust`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["age_gate", "contribution_weight", "merge_tensor", "merge_pseudo_gradients", "is_finite_contribution"]

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
