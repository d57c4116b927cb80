"""Vectorised event primitives shared by the datacenter and swarm models.

Everything here works on whole numpy arrays; no function loops over events or chips in
Python. Times are seconds.
"""

from __future__ import annotations

import numpy as np

SECONDS_PER_YEAR = 365.0 * 86400.0
"""One chip-year, in seconds (365 days)."""


def poisson_arrivals(rng: np.random.Generator, rates: np.ndarray, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times of independent Poisson processes, one per entry of ``rates``.

    Each process is the superposition of many per-chip Poisson processes (rate = chips /
    MTBI), which is again Poisson with the summed rate, so one count and that many uniform
    times per process replace one clock per chip. Returns ``(owner, times)``: the index of
    the process that owns each arrival and its time in ``[0, horizon_s)``, sorted by owner
    and then by time. ``rates`` are events per second.

    Raises ``ValueError`` for a negative rate or horizon.
    """
    rates = np.asarray(rates, dtype=np.float64)
    if horizon_s < 0 or (rates < 0).any():
        raise ValueError("rates and horizon must be >= 0")
    counts = rng.poisson(rates * horizon_s)
    owner = np.repeat(np.arange(rates.size), counts)
    times = rng.uniform(0.0, horizon_s, owner.size)
    order = np.lexsort((times, owner))
    return owner[order], times[order]


def first_of_windows(starts: np.ndarray, windows: np.ndarray | float) -> np.ndarray:
    """Which triggers open a window when each open window swallows the triggers inside it.

    ``starts`` must be sorted. Trigger ``i`` opens the window ``[starts[i], starts[i] +
    windows[i])``; every later trigger that falls inside it is absorbed (it causes no window
    of its own); the first trigger at or after the window's end opens the next one. This is
    the sequential greedy rule of a stall that absorbs the failures occurring during it,
    computed without a Python loop over events: each trigger's successor is found with one
    ``searchsorted``, and the chain starting at trigger 0 is followed by pointer doubling
    (O(n log n) array work). Returns a boolean mask over ``starts``.
    """
    n = starts.size
    if n == 0:
        return np.zeros(0, dtype=bool)
    nxt = np.empty(n + 1, dtype=np.int64)
    nxt[:n] = np.searchsorted(starts, starts + windows, side="left")
    np.maximum(nxt[:n], np.arange(1, n + 1), out=nxt[:n])  # a zero-length window still moves on
    nxt[n] = n  # sentinel: the end of the chain points to itself
    path = np.zeros(1, dtype=np.int64)  # chain positions 0 .. 2^k - 1
    jump = nxt  # jump[i] = the 2^k-th successor of i
    while True:
        ahead = jump[path]
        if ahead[0] >= n:
            break
        path = np.concatenate([path, ahead])
        jump = jump[jump]
    mask = np.zeros(n, dtype=bool)
    mask[path[path < n]] = True
    return mask


def stalled_before(stall_start: np.ndarray, stall_end: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Total stalled time before each instant ``x``, for disjoint sorted stall intervals.

    Differences of this function between two instants of the same job give the time the job
    was stalled between them; all arguments are seconds on one common (possibly offset) axis.
    """
    x = np.asarray(x, dtype=np.float64)
    if stall_start.size == 0:
        return np.zeros_like(x)
    cum = np.concatenate([[0.0], np.cumsum(stall_end - stall_start)])
    j = np.searchsorted(stall_start, x, side="right") - 1  # last stall starting at or before x
    inside = np.where(j >= 0, np.clip(x - stall_start[np.maximum(j, 0)], 0.0,
                                      (stall_end - stall_start)[np.maximum(j, 0)]), 0.0)
    return cum[np.maximum(j, 0)] * (j >= 0) + inside


def down_profile(owner: np.ndarray, start: np.ndarray, end: np.ndarray, weight: np.ndarray,
                 horizon_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Piecewise-constant count and weight of jobs that are down, from their stall intervals.

    ``owner`` says which job each interval belongs to (intervals of one job must not overlap);
    ``weight`` is per job (e.g. its chips). Returns ``(lengths, down_count, down_weight)`` for
    consecutive segments covering ``[0, horizon_s]``: segment lengths in seconds, how many
    jobs are down during it and their summed weight.
    """
    s = np.clip(start, 0.0, horizon_s)
    e = np.clip(end, 0.0, horizon_s)
    keep = e > s
    s, e, w = s[keep], e[keep], weight[owner[keep]]
    t = np.concatenate([[0.0], s, e, [horizon_s]])
    dc = np.concatenate([[0], np.ones(s.size, np.int64), -np.ones(e.size, np.int64), [0]])
    dw = np.concatenate([[0.0], w, -w, [0.0]])
    order = np.argsort(t, kind="stable")
    t, dc, dw = t[order], np.cumsum(dc[order]), np.cumsum(dw[order])
    return np.diff(t), dc[:-1], dw[:-1]
