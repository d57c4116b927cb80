"""The inner optimizer's settings and learning-rate schedule, without torch (the configuration
loads them, and a node's settings are checked before torch is imported: p2pdiloco.cli).

Source: DiLoCo's inner defaults (arXiv 2311.08105): AdamW, lr 4e-4, linear warmup then cosine
decay, weight decay 0.1; :class:`p2pdiloco.core.learner.Learner` applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["InnerConfig", "lr_at"]


@dataclass(frozen=True)
class InnerConfig:
    """AdamW inner optimizer. lr: peak learning rate; weight_decay: decoupled, applied to
    tensors with ndim >= 2 only (nanoGPT convention); betas: Adam betas; warmup_steps: linear
    warmup length (inner steps); total_steps: end of the cosine decay (inner steps), after which
    the lr stays at min_lr_ratio * lr; grad_clip: max global gradient L2 norm (0 disables).
    Raises ValueError on out-of-range values."""

    lr: float = 4e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 100
    total_steps: int = 10_000
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.lr <= 10:
            raise ValueError(f"lr must be in (0, 10], got {self.lr}")
        if not 0 <= self.weight_decay <= 10:
            raise ValueError(f"weight_decay must be in [0, 10], got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two values in [0, 1), got {self.betas}")
        if not 0 <= self.warmup_steps <= self.total_steps <= 10**12 or self.total_steps < 1:
            raise ValueError(f"need 0 <= warmup_steps <= total_steps <= 10^12 and total_steps >= 1: {self}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.grad_clip <= 10**6:
            raise ValueError(f"grad_clip must be in [0, 10^6] (0 disables), got {self.grad_clip}")


def lr_at(step: int, inner: InnerConfig) -> float:
    """Learning rate of the inner step that follows ``step`` completed steps: lr·(step+1)/warmup
    during warmup, then cosine from lr down to min_lr_ratio·lr at total_steps, constant after."""
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    progress = min(1.0, (step - inner.warmup_steps) / max(1, inner.total_steps - inner.warmup_steps))
    return inner.lr * (inner.min_lr_ratio + (1 - inner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
