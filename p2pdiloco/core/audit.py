"""A member's check of the merged parts its reducers return (docs/trust.md, "Reducer parts").

In the butterfly all-reduce each reducer merges one part of the fragment alone
(``net.rounds.allreduce``): its signature makes a wrong merge attributable, not impossible. A
reducer that merges against a poisoned reference (its own flipped Δ) or simply returns what it
likes could replace its part of every member's update. Counting reducers cannot help: two
colluders of four are half of them. So each member judges every other reducer's merged part
against the one thing it knows to be honest, its own pseudo-gradient for that part:

* **alignment**: ``cos(merged_r, own_r)`` below ``MIN_ALIGNMENT`` (-0.5) makes the part
  *suspect*, ``misaligned_result``. An update with a negative inner product with ``own_r``
  raises this member's training loss to first order (the reason Zeno and FLTrust score updates
  by their alignment with a trusted one: arXiv 1805.10032, arXiv 2012.13995). But an honest
  reducer mutes a member whose Δ points away from its own (``core.merge``), and its merge is
  then its own direction: honest parts measured down to -0.38 (488 parts of tiny test models
  below 0), a merge reversed by colluders -0.85 to -0.93 (docs/trust.md, "Reducer parts"). A
  cosine alone cannot tell a peer's strong honest disagreement from a reversal, so the caller
  weighs a suspect round by its held-out loss with and without the suspect parts
  (``node.vetting.Vetting.weigh_round``).
* **size**: ``|merged_r| <= NORM_FACTOR * max(1, rho) * |own_r|``, where ``rho`` is
  ``|merged_m| / |own_m|`` on the part ``m`` this member merged itself (its own honest merge:
  how much larger the group's mean is than its own Δ this round, e.g. for a member that ran
  fewer inner steps). A member that reduced nothing (share 0) uses ``NO_REFERENCE_FACTOR``.
  An honest merge's norm is at most ``DEFAULT_OUTLIER_FACTOR`` times the part's median
  (``core.robust.robust_merge`` clips every member there).

A part whose own Δ is zero is not judged (nothing to compare with). A part that fails either
check is *suspect*: the caller weighs the round with and without it by its held-out loss
(``node.vetting.Vetting.weigh_round``; an honest part looks oversized to a straggler whose Δ
is small), and refuses the whole round when it hurts (invariant I2: a member commits all of a
round's result or none of it), distrusting and avoiding its reducer.

Limits: a reducer may still return any part within the size bound at a cosine of at least -0.5
with this member's Δ (not weighed), or one that does not raise its held-out loss: bounded damage
per round, not none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MIN_ALIGNMENT", "NORM_FACTOR", "NO_REFERENCE_FACTOR", "PartCheck", "check_parts"]

MIN_ALIGNMENT = -0.5  # least cosine of a reducer's merged part with this member's own Δ of that part
NORM_FACTOR = 4.0  # a merged part's norm at most this many times the member's own, scaled by rho
NO_REFERENCE_FACTOR = 10.0  # ... when the member merged no part itself (no rho this round)


@dataclass(frozen=True)
class PartCheck:
    """Why one part was refused.

    Attributes:
        reason: ``misaligned_result`` or ``oversized_result``.
        cosine: cos(merged part, own part), in [-1, 1].
        ratio: |merged part| / |own part|.
    """

    reason: str
    cosine: float
    ratio: float


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors as one 1-D fp32 CPU vector (shape (sum of numels,))."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().to("cpu", torch.float32).reshape(-1) for t in tensors])


def check_parts(own: Sequence[Sequence[torch.Tensor]], merged: Sequence[Sequence[torch.Tensor]],
                reference: int | None) -> dict[int, PartCheck]:
    """The parts a member refuses (module docstring).

    Args:
        own: per part r, this member's pseudo-gradient tensors of that part (any shapes and
            float dtypes, as sent before wire coding).
        merged: per part r, the merged tensors the reducer of part r returned, in the same
            shapes as ``own[r]``.
        reference: the index of the part this member merged itself, or None when it merged
            none; that part is never refused.

    Returns:
        {part index: PartCheck} for every part that fails a check (oversized: refused; misaligned: suspect); empty when all pass.

    Raises:
        ValueError: ``own`` and ``merged`` have different numbers of parts.
    """
    if len(own) != len(merged):
        raise ValueError(f"{len(own)} own parts against {len(merged)} merged parts")
    flat_own, flat_merged = [_flat(p) for p in own], [_flat(p) for p in merged]
    factor = NO_REFERENCE_FACTOR
    if reference is not None:
        ref_norm = float(flat_own[reference].norm())
        rho = float(flat_merged[reference].norm()) / ref_norm if ref_norm > 0 else 1.0
        factor = NORM_FACTOR * max(1.0, rho)
    refused: dict[int, PartCheck] = {}
    for r, (o, m) in enumerate(zip(flat_own, flat_merged)):
        o_norm, m_norm = float(o.norm()), float(m.norm())
        if r == reference or o_norm == 0.0:
            continue
        ratio = m_norm / o_norm
        cosine = float(torch.dot(o, m)) / (o_norm * m_norm) if m_norm > 0 else 0.0
        if m_norm > 0 and cosine < MIN_ALIGNMENT:
            refused[r] = PartCheck("misaligned_result", cosine, ratio)
        elif ratio > factor:
            refused[r] = PartCheck("oversized_result", cosine, ratio)
    return refused
