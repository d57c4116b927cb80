"""Global fragment state and the Nesterov outer step.

Source: DiLoCo (arXiv 2311.08105) outer optimizer, kept per fragment by Decoupled DiLoCo
(arXiv 2604.21428): b ← μ·b + Δ; Θ ← Θ − lr·(Δ + μ·b), i.e. ``torch.optim.SGD(nesterov=True)``
with Δ as the gradient. Θ and b stay fp32 on the CPU.
The digest backs the swarm's invariant I1 (same version, same state; docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FragmentState", "fragment_digest", "nesterov_outer_step"]


def _fp32_cpu(t: Tensor) -> Tensor:
    """A new contiguous fp32 CPU copy of t."""
    out = torch.empty(t.shape, dtype=torch.float32)
    return out.copy_(t.detach())


def fragment_digest(index: int, version: int, theta: Sequence[Tensor], momentum: Sequence[Tensor]) -> str:
    """Hex sha256 of a fragment's global state.

    Byte layout (all integers little-endian): ``<qqII`` index, version, len(theta),
    len(momentum); then for each tensor of theta followed by momentum: ``<I`` ndim, ``<q`` per
    dimension, and the tensor's elements as contiguous little-endian fp32 (row-major).
    """
    h = hashlib.sha256(struct.pack("<qqII", index, version, len(theta), len(momentum)))
    for t in (*theta, *momentum):
        h.update(struct.pack(f"<I{t.dim()}q", t.dim(), *t.shape))
        a = t.detach().to("cpu", torch.float32).contiguous().numpy()
        h.update((a.byteswap() if sys.byteorder == "big" else a).data)
    return h.hexdigest()


@dataclass(frozen=True)
class FragmentState:
    """Immutable snapshot of the global state of one fragment (treat the tensors as read-only).

    index: fragment index; version: number of outer steps applied (0 = initial weights);
    theta: Θ_p, fp32 CPU, one tensor per slot in slot shapes; momentum: Nesterov buffer b_p,
    same shapes; digest: ``fragment_digest`` of the above. Two states are equal iff their
    digests are equal.
    """

    index: int
    version: int
    theta: tuple[Tensor, ...]
    momentum: tuple[Tensor, ...]
    digest: str

    @classmethod
    def create(cls, index: int, version: int, theta: Sequence[Tensor], momentum: Sequence[Tensor]) -> FragmentState:
        """Copy theta and momentum to new fp32 contiguous CPU tensors and compute the digest.
        Raises ValueError on negative index/version or mismatched counts or shapes."""
        return cls._seal(index, version, [_fp32_cpu(t) for t in theta], [_fp32_cpu(t) for t in momentum])

    @classmethod
    def _seal(cls, index: int, version: int, theta: Sequence[Tensor], momentum: Sequence[Tensor]) -> FragmentState:
        """Wrap tensors that are already private fp32 contiguous CPU copies."""
        if index < 0 or version < 0:
            raise ValueError(f"index and version must be >= 0, got {index}, {version}")
        if len(theta) != len(momentum) or any(a.shape != b.shape for a, b in zip(theta, momentum)):
            raise ValueError("theta and momentum must have the same number of tensors and shapes")
        return cls(index, version, tuple(theta), tuple(momentum), fragment_digest(index, version, theta, momentum))

    def short(self) -> str:
        """First 12 hex characters of the digest (for logs)."""
        return self.digest[:12]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FragmentState) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)


OUTER_STEP_RULE = "nesterov-unfused-1"  # changes when the outer step's rounding changes (protocol tag)


def nesterov_outer_step(state: FragmentState, merged: Sequence[Tensor], lr: float, momentum: float) -> FragmentState:
    """Apply one outer step with the merged pseudo-gradient Δ; returns the next version.

    merged: one tensor per slot (slot shapes, converted to fp32). b ← μ·b + Δ;
    Θ ← Θ − lr·(Δ + μ·b), into new tensors: the input state is never modified. Every
    operation is one fp32 multiply or add by itself, each rounded once (IEEE 754), so the
    result is bit-identical on every CPU kernel set (``ATEN_CPU_CAPABILITY`` default, avx2,
    avx512) and equals a plain float32 NumPy computation; ``torch.optim.SGD``'s
    ``add(alpha=)`` is a fused multiply-add in the vectorised kernels only, so it agrees with
    this step to within rounding but not bit for bit (invariant I1, docs/architecture.md;
    ``OUTER_STEP_RULE`` is part of the protocol tag). Source: DiLoCo (arXiv 2311.08105) outer
    Nesterov, kept per fragment by Decoupled DiLoCo (arXiv 2604.21428).
    Raises ValueError on a count/shape mismatch, lr < 0 or non-finite, μ outside [0, 1).
    """
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"outer lr must be finite and >= 0, got {lr}")
    if not 0 <= momentum < 1:
        raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
    if len(merged) != len(state.theta):
        raise ValueError(f"{len(merged)} merged tensors for {len(state.theta)} slots")
    theta, buf = [], []
    for th, b, d in zip(state.theta, state.momentum, merged):
        if d.shape != th.shape:
            raise ValueError(f"merged shape {tuple(d.shape)} != slot shape {tuple(th.shape)}")
        d = d.detach().to("cpu", torch.float32)
        nb = b.mul(momentum).add_(d)  # b ← μ·b + Δ
        u = nb.mul(momentum).add_(d)  # Δ + μ·b (no add(alpha=): that is fused on avx2/avx512 only)
        theta.append(th.sub(u.mul_(lr)))  # Θ ← Θ − lr·u
        buf.append(nb)
    return FragmentState._seal(state.index, state.version + 1, theta, buf)
