"""Adaptive grace window of the minimum quorum (Decoupled DiLoCo, arXiv 2604.21428, sec. 3).

After K learners have contributed to a fragment's merge, the merge waits at most a grace
window for more. The paper bounds the window by the slack the overlap leaves:

    grace <= gamma * (tau * t_step - t_quorum - t_sync),   gamma < 1

with each term tracked by an exponential moving average. Pure arithmetic, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ema:
    """Exponential moving average of a duration (seconds); ``None`` until the first sample."""

    alpha: float = 0.2
    value: float | None = None

    def update(self, sample: float) -> float:
        if sample < 0:
            raise ValueError(f"a duration cannot be negative, got {sample}")
        self.value = sample if self.value is None else (1 - self.alpha) * self.value + self.alpha * sample
        return self.value


@dataclass
class GraceWindow:
    """Tracks t_step, t_quorum and t_sync and yields the current grace window (seconds).

    The paper's bound can be zero or negative when the network is slow relative to the
    inner step (always the case on a volunteer swarm with small models); ``minimum`` and
    ``maximum`` clamp it so matchmaking over a DHT can still gather a group.
    """

    tau: int
    gamma: float = 0.5
    minimum: float = 0.5
    maximum: float = 5.0
    t_step: Ema = field(default_factory=Ema)
    t_quorum: Ema = field(default_factory=Ema)
    t_sync: Ema = field(default_factory=Ema)

    def __post_init__(self) -> None:
        if not 0 < self.gamma < 1:
            raise ValueError(f"gamma must be in (0, 1), got {self.gamma}")
        if not 0 <= self.minimum <= self.maximum:
            raise ValueError(f"need 0 <= minimum <= maximum, got {self.minimum}, {self.maximum}")
        if self.tau < 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")

    def seconds(self) -> float:
        """The grace window to use now (seconds), clamped to [minimum, maximum]."""
        if self.t_step.value is None:
            return self.minimum
        slack = self.tau * self.t_step.value - (self.t_quorum.value or 0.0) - (self.t_sync.value or 0.0)
        return min(self.maximum, max(self.minimum, self.gamma * slack))
