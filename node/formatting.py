"""Figures as a person reads them in the terminal views (``node status``, the live view,
``swarm status``, the demo): numbers, bytes, counts, ages, link rates; "-" where unknown."""

from __future__ import annotations

from typing import Any


def fmt_link(rate: object) -> str:
    """A measured link rate (bytes/s) in Mbit/s, or "not measured yet"."""
    return f"{float(rate) * 8 / 1e6:.1f} Mbit/s" if isinstance(rate, (int, float)) and rate > 0 else "not measured yet"


def fmt_num(x: Any, spec: str = ".3f") -> str:
    return "-" if not isinstance(x, (int, float)) or x != x else format(x, spec)


def fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return "-"


def fmt_count(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    return f"{n / 1e9:.2f}G" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else str(n)


def fmt_age(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
