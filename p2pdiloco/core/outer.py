"""Global fragment state and the Nesterov outer step.

Source: DiLoCo (arXiv 2311.08105) outer optimizer, kept per fragment by Decoupled DiLoCo
(arXiv 2604.21428): b ← μ·b + Δ; Θ ← Θ − lr·(Δ + μ·b), i.e. ``torch.optim.SGD(nesterov=True)``
with Δ as the gradient. Θ and b stay fp32 on the CPU.

A round may carry only part of an outer period's progress (a sub-group of the swarm, a node
that merges alone while the others merge after it, an end-of-budget flush): it applies the
step for its fraction f of a period (``core.periods.round_fraction``, :func:`nesterov_outer_step`), so
the rounds of one period add up to about one step and a near-empty round moves Θ by almost
nothing (invariant I9, docs/architecture.md "Partial rounds").
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

from .periods import FRACTION_GRID, MAX_TOKENS, Ledger, round_fraction

__all__ = ["FragmentState", "run_tokens", "fragment_digest", "nesterov_outer_step", "apply_round", "lone_step_size",
           "with_error_feedback"]


def run_tokens(states: Sequence[FragmentState]) -> int:
    """Tokens the swarm has merged into the global model, as these fragment states count them:
    the mean over fragments of ``ledger.total_tokens`` (every inner step's tokens reach every
    fragment once, at that fragment's next round), rounded down; 0 for no states."""
    return sum(s.ledger.total_tokens for s in states) // len(states) if states else 0


def _fp32_cpu(t: Tensor) -> Tensor:
    """A new contiguous fp32 CPU copy of t."""
    out = torch.empty(t.shape, dtype=torch.float32)
    return out.copy_(t.detach())


def fragment_digest(index: int, version: int, theta: Sequence[Tensor], momentum: Sequence[Tensor],
                    ledger: Ledger = Ledger()) -> str:
    """Hex sha256 of a fragment's global state.

    Byte layout (all integers little-endian): ``<qqII`` index, version, len(theta),
    len(momentum); then for each tensor of theta followed by momentum: ``<I`` ndim, ``<q`` per
    dimension, and the tensor's elements as contiguous little-endian fp32 (row-major); then
    the ledger, ``Ledger.pack``.
    """
    h = hashlib.sha256(struct.pack("<qqII", index, version, len(theta), len(momentum)))
    for t in (*theta, *momentum):
        h.update(struct.pack(f"<I{t.dim()}q", t.dim(), *t.shape))
        a = t.detach().to("cpu", torch.float32).contiguous().numpy()
        h.update((a.byteswap() if sys.byteorder == "big" else a).data)
    h.update(ledger.pack())
    return h.hexdigest()


@dataclass(frozen=True)
class FragmentState:
    """Immutable snapshot of the global state of one fragment (treat the tensors as read-only).

    index: fragment index; version: number of outer steps applied (0 = initial weights);
    theta: Θ_p, fp32 CPU, one tensor per slot in slot shapes; momentum: Nesterov buffer b_p,
    same shapes; digest: ``fragment_digest`` of the above; ledger: the swarm's merged tokens
    per period as this state's rounds saw them (:class:`Ledger`). Two states are equal iff
    their digests are equal.
    """

    index: int
    version: int
    theta: tuple[Tensor, ...]
    momentum: tuple[Tensor, ...]
    digest: str
    ledger: Ledger = Ledger()

    @classmethod
    def create(cls, index: int, version: int, theta: Sequence[Tensor], momentum: Sequence[Tensor],
               ledger: Ledger = Ledger()) -> FragmentState:
        """Copy theta and momentum to new fp32 contiguous CPU tensors and compute the digest.
        Raises ValueError on negative index/version, mismatched counts or shapes, or a
        ledger out of range."""
        return cls._seal(index, version, [_fp32_cpu(t) for t in theta], [_fp32_cpu(t) for t in momentum], ledger)

    @classmethod
    def adopt(cls, index: int, version: int, theta: Sequence[Tensor], momentum: Sequence[Tensor],
              ledger: Ledger = Ledger()) -> FragmentState:
        """As :meth:`create`, without copying: ``theta`` and ``momentum`` must be fp32
        contiguous CPU tensors that nothing else holds or writes (a decoded download's own
        buffer, p2pdiloco.net.state.downloads), so a state is held once. Raises ValueError as
        :meth:`create`, and on tensors that are not fp32 contiguous CPU ones."""
        if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                   for t in (*theta, *momentum)):
            raise ValueError("adopt needs fp32 contiguous CPU tensors")
        return cls._seal(index, version, list(theta), list(momentum), ledger)

    @classmethod
    def _seal(cls, index: int, version: int, theta: Sequence[Tensor], momentum: Sequence[Tensor],
              ledger: Ledger) -> FragmentState:
        """Wrap tensors that are already private fp32 contiguous CPU copies."""
        if index < 0 or version < 0:
            raise ValueError(f"index and version must be >= 0, got {index}, {version}")
        if len(theta) != len(momentum) or any(a.shape != b.shape for a, b in zip(theta, momentum)):
            raise ValueError("theta and momentum must have the same number of tensors and shapes")
        if ledger.period_start < -1 or ledger.period_tokens < 0 or not (math.isfinite(ledger.rate)
                                                                        and ledger.rate >= 0) \
                or not 0 <= ledger.period_fraction <= FRACTION_GRID or not 0 <= ledger.total_tokens <= MAX_TOKENS \
                or ledger.period_tokens > MAX_TOKENS:
            raise ValueError(f"ledger out of range: {ledger}")
        return cls(index, version, tuple(theta), tuple(momentum),
                   fragment_digest(index, version, theta, momentum, ledger), ledger)

    def short(self) -> str:
        """First 12 hex characters of the digest (for logs)."""
        return self.digest[:12]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FragmentState) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)


OUTER_STEP_RULE = "nesterov-fractional-5"  # changes when the outer step or its fraction changes (protocol tag)
# How a round for a fraction f < 1 of a period applies the outer momentum (nesterov_outer_step):
# "share": the buffer's decay and carry μ²·b in proportion to f, "period": whole, at the
# period's first round, none at its later rounds (Delayed Nesterov, arXiv 2401.09135).
CARRY_RULES = ("share", "period")
OUTER_CARRY = "share"


def nesterov_outer_step(state: FragmentState, merged: Sequence[Tensor], lr: float, momentum: float,
                        fraction: float = 1.0, ledger: Ledger | None = None, carry: str = OUTER_CARRY) -> FragmentState:
    """Apply the outer step for a fraction f of a period with the merged pseudo-gradient Δ;
    returns the next version, carrying ``ledger`` (default: the state's own).

    merged: one tensor per slot (slot shapes, converted to fp32). f = 1 is DiLoCo's Nesterov
    step: b ← μ·b + Δ; Θ ← Θ − lr·(Δ + μ·b), i.e. Θ − lr·((1 + μ)·Δ + μ²·b_old). A round for
    f < 1 applies that step's share f (``carry="share"``), or ties the momentum to the period
    (``carry="period"``, Delayed Nesterov): the rules and their derivation are
    :func:`_step_scalars`'s. f → 0 leaves Θ and b as they were. Every operation is
    one fp32 multiply or add by itself, each rounded once (IEEE 754), by scalars computed from
    f (a multiple of 1/FRACTION_GRID), u and μ in Python floats, so the result is
    bit-identical on every CPU kernel set (``ATEN_CPU_CAPABILITY`` default, avx2, avx512);
    ``torch.optim.SGD``'s ``add(alpha=)`` is a fused multiply-add in the vectorised kernels
    only (invariant I1; ``OUTER_STEP_RULE`` is part of the protocol tag). Source: DiLoCo
    (arXiv 2311.08105) outer Nesterov, kept per fragment by Decoupled DiLoCo (arXiv
    2604.21428); the split of one step over a period's rounds is this project's
    (docs/architecture.md "Partial rounds").
    Raises ValueError on a count/shape mismatch, lr < 0 or non-finite, μ outside [0, 1), f
    outside [0, 1] or off the grid, or an unknown ``carry``.
    """
    if carry not in CARRY_RULES:
        raise ValueError(f"carry must be one of {CARRY_RULES}, got {carry!r}")
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"outer lr must be finite and >= 0, got {lr}")
    if len(merged) != len(state.theta):
        raise ValueError(f"{len(merged)} merged tensors for {len(state.theta)} slots")
    keep, kick, carry_b = _step_scalars(state, momentum, fraction, ledger, carry)
    whole = carry == "period" and fraction != 1.0  # Θ ← Θ − lr·(f·(1 + μ)·Δ + carry_b·b_old)
    theta, buf = [], []
    for th, b, d in zip(state.theta, state.momentum, merged):
        if d.shape != th.shape:
            raise ValueError(f"merged shape {tuple(d.shape)} != slot shape {tuple(th.shape)}")
        d = d.detach().to("cpu", torch.float32)
        nb = b.mul(keep).add_(d.mul(kick) if kick != 1.0 else d)  # b ← c·b + f·Δ
        if fraction == 1.0:
            u = nb.mul(momentum).add_(d)  # Δ + μ·b' (no add(alpha=): that is fused on avx2/avx512 only)
        elif whole:
            u = d.mul(fraction * (1.0 + momentum)).add_(b.mul(carry_b))  # f·(1 + μ)·Δ + μ²·b_old (or + 0)
        else:
            u = d.mul(1.0 + momentum).add_(b.mul(carry_b))  # (1 + μ)·Δ + (μ²/d)·b_old
        theta.append(th.sub(u.mul_(lr if whole else lr * fraction)))  # Θ ← Θ − (lr·f)·u (period: lr·u)
        buf.append(nb)
    return FragmentState._seal(state.index, state.version + 1, theta, buf, state.ledger if ledger is None else ledger)


def _step_scalars(state: FragmentState, momentum: float, fraction: float, ledger: Ledger | None,
                  carry: str = OUTER_CARRY) -> tuple[float, float, float]:
    """(c, f, μ²/d) of :func:`nesterov_outer_step` with ``carry="share"``: b ← c·b + f·Δ;
    Θ ← Θ − (lr·f)·((1 + μ)·Δ + (μ²/d)·b_old), in Python floats; with ``carry="period"``
    (μ, f, μ²) for the period's first round with progress, else (1, f, 0); (μ, 1, μ) for a
    whole period, DiLoCo's step, under either rule. Raises ValueError on μ outside [0, 1) or f
    outside [0, 1] or off the grid.

    ``carry="share"``: a round for f < 1 applies the share f of DiLoCo's step, linear in f, as
    if the period's rounds together made one step with Δ = Σ f_i·Δ_i: with u the step the
    period's earlier rounds applied (``ledger``'s ``period_fraction`` before this round when
    ``ledger`` continues the state's period, else 0; the new ledger continues the state's
    period when it has the same start and its ``period_fraction`` is the state's plus f, as
    ``round_fraction`` writes it) and d = 1 − u·(1 − μ) (the share of the period-start buffer
    b̂ still in b, so b̂ ≈ b/d): b ← (1 − f·(1 − μ)/d)·b + f·Δ; Θ ← Θ − (lr·f)·((1 + μ)·Δ +
    (μ²/d)·b_old). k rounds of 1/k with equal Δ then give the period-start buffer's decay to
    μ, the Δ's buffer entry and its total (long-run) movement of a full step to within 0.2 %
    (``tests/test_outer.py``); the earlier rule (b ← μ^f·b + f·Δ; Θ ← Θ − lr·f·(Δ + μ·b)) let
    each round's Δ enter the buffer before the next round's step and fell 6.6 % short at k = 4,
    μ = 0.9, which left four learners merging one after another 1.5 % worse in process
    (docs/benchmarks/partial_rounds.md).

    ``carry="period"`` ties the momentum to the period instead of the round (Delayed Nesterov,
    Liu et al., arXiv 2401.09135, sec. 4: the momentum is updated at a fixed cadence, each
    pseudo-gradient that arrives in between is applied without it): the period's first round
    with progress (u = 0, f > 0) decays the buffer and applies its carry whole, b ← μ·b + f·Δ;
    Θ ← Θ − lr·(f·(1 + μ)·Δ + μ²·b_old), a later round of the same period only adds its share,
    b ← b + f·Δ; Θ ← Θ − lr·f·(1 + μ)·Δ. The rounds of one period then make exactly DiLoCo's
    one step with Δ = Σ f_i·Δ_i, and a period whose rounds carry less than one step (a
    straggler's period, merged by the others alone) still moves Θ by the buffer's whole carry;
    a near-empty round that opens a period moves Θ by that carry (what the period's step would
    apply anyway). Measured worse than "share" with a straggler
    (docs/benchmarks/partial_rounds_straggler.md): not the default."""
    if not 0 <= momentum < 1:
        raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
    if not (0.0 <= fraction <= 1.0 and fraction * FRACTION_GRID == round(fraction * FRACTION_GRID)):
        raise ValueError(f"fraction must be a multiple of 1/{FRACTION_GRID} in [0, 1], got {fraction}")
    if fraction == 1.0:  # DiLoCo's step, bit for bit the float32 computation of its formula
        return momentum, 1.0, momentum
    units = round(fraction * FRACTION_GRID)
    same = ledger is not None and ledger.period_start == state.ledger.period_start >= 0 and \
        ledger.period_fraction == min(FRACTION_GRID, state.ledger.period_fraction + units)  # round_fraction's continuation
    used = state.ledger.period_fraction / FRACTION_GRID if same else 0.0
    if carry == "period":  # b decays and carries once per period: at its first round with progress (u = 0)
        opens = used == 0.0 and fraction > 0.0
        return (momentum, fraction, momentum * momentum) if opens else (1.0, fraction, 0.0)
    left = 1.0 - used * (1.0 - momentum)  # d: the share of the period-start buffer still in b, >= μ
    keep = max(0.0, 1.0 - fraction * (1.0 - momentum) / left) if left > 0 else 0.0
    return keep, fraction, (momentum * momentum / left if left > 0 else 0.0)


def apply_round(state: FragmentState, merged: Sequence[Tensor], tokens: int, position: int, first: float,
                sync_every: int, lr: float, momentum: float, carry: str = OUTER_CARRY) -> tuple[FragmentState, float]:
    """The state a merged round makes from ``state`` (its anchor), and the fraction of a period
    it applied: the one rule every member that commits the round, every member it left out
    (``node.rounds.Rounds._take_excluded``) and every node that replays it later
    (``net.state.deltas.replay_round``) computes, so all hold the same version + 1, bit for bit (same
    digest; invariant I1, docs/architecture.md).

    First the round's fraction f of a period and the ledger it carries, from the anchor's
    ledger and the round's counters (:func:`round_fraction`; invariant I9, docs/architecture.md
    "Partial rounds"), then the fractional Nesterov outer step with the merged Δ
    (:func:`nesterov_outer_step`). Source: DiLoCo (arXiv 2311.08105) outer Nesterov, kept per
    fragment by Decoupled DiLoCo (arXiv 2604.21428, sec. 3); the split of one step over a
    period's rounds is this project's.

    Args:
        state: the anchor, the fragment's committed state the round's group formed at.
        merged: the merged pseudo-gradient Δ, one tensor per slot in slot shapes (converted to
            fp32 on the CPU), the same bytes on every member.
        tokens: tokens the round merges (sum over its contributors), >= 0.
        position: the contributors' lower median schedule position (an inner step), >= 0.
        first: the fraction to use while the ledger knows no rate (:func:`span_fraction`), in
            [0, 1], a multiple of 1/FRACTION_GRID.
        sync_every: H, inner steps per outer period, >= 1.
        lr, momentum: the run's outer learning rate (>= 0, finite) and Nesterov μ in [0, 1).
        carry: how a round for f < 1 applies the momentum (:data:`CARRY_RULES`; default
            :data:`OUTER_CARRY`, the one every node runs).

    Returns:
        (the next state: version + 1, fp32 Θ and b in slot shapes, the new ledger; the fraction
        f of a period its step applied, a multiple of 1/FRACTION_GRID in [0, 1]).

    Raises:
        ValueError: bad counters (:func:`round_fraction`), or a count/shape mismatch, lr or μ
            out of range (:func:`nesterov_outer_step`).
    """
    fraction, ledger = round_fraction(state.ledger, tokens, position, sync_every, first)
    return nesterov_outer_step(state, merged, lr, momentum, fraction, ledger, carry), fraction


def lone_step_size(lr: float, momentum: float, delta_norm: float) -> float:
    """How far (L2 distance of Θ) one full outer step (f = 1) from a zero momentum buffer moves
    the parameters with a merged Δ of L2 norm ``delta_norm``: lr·(1 + μ)·‖Δ‖ (b ← Δ; Θ ← Θ −
    lr·(Δ + μ·Δ), :func:`nesterov_outer_step`). The size of the step a node's own progress
    would make alone, which bounds the states it follows (``net.state.bounded_moves``;
    docs/trust.md, "Earned claims"). Source: DiLoCo (arXiv 2311.08105) outer Nesterov, as in
    Decoupled DiLoCo (arXiv 2604.21428). Floats in, a float out (units of Θ); no checks."""
    return lr * (1 + momentum) * delta_norm


def with_error_feedback(delta: Sequence[Tensor], residual: Sequence[Tensor] | None,
                        decay: float = 1.0) -> list[Tensor]:
    """What a member sends of a fragment: its pseudo-gradient plus what wire coding left out of
    its last committed round, decayed: ``e ← β·e + Δ`` (SparseLoCo, Sarfi et al., arXiv
    2508.15706, section 3, whose decayed error-feedback buffer takes the part of DiLoCo's outer
    momentum). β = 1 carries the residual whole (classic error feedback: nothing is lost, only
    delayed); β < 1 lets an entry that top-k never picks fade instead of piling up
    (docs/benchmarks/codecs.md measures β for ``topk2``).

    delta: one fp32 tensor per slot (slot shapes); residual: the same shapes, or None (nothing
    left out: Δ is returned as it is, as a list). Returns new fp32 tensors, each Δ + β·e
    computed as one multiply then one add (each rounded once).
    Raises ValueError on a count or shape mismatch, or β outside [0, 1].
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"error-feedback decay must be in [0, 1], got {decay}")
    if residual is None:
        return list(delta)
    if len(residual) != len(delta):
        raise ValueError(f"{len(residual)} residual tensors for {len(delta)} slots")
    out = []
    for d, e in zip(delta, residual):
        if d.shape != e.shape:
            raise ValueError(f"residual shape {tuple(e.shape)} != pseudo-gradient shape {tuple(d.shape)}")
        out.append(d + (e if decay == 1.0 else e * decay))
    return out
