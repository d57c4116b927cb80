"""Parameter checks shared by the simulator's frozen dataclasses; each raises ConfigError."""

from __future__ import annotations

import math

from p2pdiloco.errors import ConfigError


def require(ok: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` unless ``ok``."""
    if not ok:
        raise ConfigError(msg)


def require_positive(obj: object, *names: str, allow_inf: bool = False) -> None:
    """Each named attribute of ``obj`` must be > 0 and finite (or ``inf`` if ``allow_inf``)."""
    for name in names:
        v = getattr(obj, name)
        require(v > 0 and (allow_inf or math.isfinite(v)), f"{name} must be {'' if allow_inf else 'finite and '}> 0, "
                f"got {v}")


def require_nonneg(obj: object, *names: str) -> None:
    """Each named attribute of ``obj`` must be finite and >= 0."""
    for name in names:
        v = getattr(obj, name)
        require(math.isfinite(v) and v >= 0, f"{name} must be finite and >= 0, got {v}")
