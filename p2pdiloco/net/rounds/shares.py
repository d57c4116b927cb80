"""Bandwidth-aware all-reduce shares: how a group's leader splits a fragment among its members
by their link rates (after hivemind's butterfly load balancing), and the bound every member
checks a leader's split against. ``matchmaking`` uses them; ``allreduce`` reduces by them."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence

from hivemind.averaging.load_balancing import load_balance_peers

from p2pdiloco.net.records import parse as rec

__all__ = ["bandwidth_shares", "max_share"]

log = logging.getLogger(__name__)


def bandwidth_shares(rates: Sequence[float | None]) -> tuple[int, ...]:
    """All-reduce shares of a group's members (integers summing to ``records.SHARE_GRID``)
    from their link rates (bytes/s, same order; None: not measured).

    Rates above the lower median of the measured ones count at it; unmeasured
    members count at the mean (hivemind's rule). The split is hivemind's
    ``load_balance_peers``: a linear program minimising max_i (1 + (n - 2) x_i) / rate_i, the
    traffic of member i in a butterfly all-reduce where it reduces the fraction x_i, over its
    rate (``hivemind.averaging.load_balancing.optimize_parts_lp``). Returns ``()`` (equal
    shares) for groups of 1 or 2 (every split moves the same bytes) or with fewer than two
    measured rates, or when hivemind's solver fails. Only the leader calls it; members check
    the integers it sends against :func:`max_share`.
    """
    known = [r for r in rates if r is not None and r > 0]
    if len(rates) < 3 or len(known) < 2:
        return ()
    cap = statistics.median_low(known)
    capped = [None if r is None or r <= 0 else min(float(r), cap) for r in rates]
    try:
        shares = tuple(int(x) for x in load_balance_peers(rec.SHARE_GRID, capped))
    except Exception as e:  # scipy's solver, inside hivemind: equal shares rather than no group
        log.warning("load balancing failed (%s): equal all-reduce shares", e)
        return ()
    return shares if sum(shares) == rec.SHARE_GRID and min(shares) >= 0 and max(shares) <= max_share(len(rates)) \
        else ()


def max_share(n: int) -> int:
    """The largest share (of ``records.SHARE_GRID``) a group of ``n`` may give one member:
    2/n of the fragment, rounded up, plus 1 for the LP's rounding. With rates capped at the
    lower median at least half the members count at the top rate and split at least as
    much as any other, so an honest split never exceeds it; all of it for n <= 2."""
    return rec.SHARE_GRID if n <= 2 else -(-2 * rec.SHARE_GRID // n) + 1
