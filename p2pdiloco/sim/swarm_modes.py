"""The two training modes of the swarm model, run on the same peer sessions.

Rules, units and sources: :mod:`p2pdiloco.sim.swarm`. :func:`decoupled` is fully
vectorised; :func:`synchronous` steps round by round (each round's length depends on who
is in it) with numpy over the online peers.
"""

from __future__ import annotations

import logging

import numpy as np

from p2pdiloco.sim.swarm import Sessions, SwarmParams, SwarmResult, budget_time, make_sessions

log = logging.getLogger(__name__)


def _live_count(ready: np.ndarray, end: np.ndarray, t: np.ndarray) -> np.ndarray:
    """How many sessions train at each instant of ``t`` (ready < t < end; needs ready < end)."""
    return np.searchsorted(np.sort(ready), t, side="left") - np.searchsorted(np.sort(end), t, side="right")


def _live_speed(ready: np.ndarray, end: np.ndarray, speed: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Summed tokens/s of the sessions training at each instant of ``t``."""
    r, e = np.argsort(ready), np.argsort(end)
    up = np.concatenate([[0.0], np.cumsum(speed[r])])[np.searchsorted(ready[r], t, side="left")]
    gone = np.concatenate([[0.0], np.cumsum(speed[e])])[np.searchsorted(end[e], t, side="right")]
    return up - gone


def decoupled(p: SwarmParams, s: Sessions) -> SwarmResult:
    """Decoupled DiLoCo merges with quorum ``min_quorum`` and a grace window (non-blocking).

    Merge ``k`` (fragment ``k mod P``) starts at ``t_k = k * period`` with ``period =
    round_compute_s / P``, stretched to the longest merge window if the network cannot keep
    up, among the peers training then; it completes ``grace + all-reduce`` seconds later.
    A member that leaves inside that window is dropped from it and its unmerged tokens are
    lost; the survivors complete the merge (no one waits beyond the window, invariant I4).
    The merge happens if at least ``min_quorum`` members survive; otherwise every member's
    tokens carry over. Returns a :class:`SwarmResult` with ``mode="decoupled"``.
    """
    T, P = p.horizon_s, p.fragments
    trains = s.ready < s.end
    ready, end, speed = s.ready[trains], s.end[trains], s.speed[trains]
    period = p.round_compute_s / P
    widest = p.grace_s + float(p.allreduce_s(p.peers))
    if widest > period:
        log.info("decoupled: a merge window (%.1f s) is longer than the merge period (%.1f s); merges slow down",
                 widest, period)
        period = widest
    t = period * np.arange(1, int(T / period) + 1)
    n = _live_count(ready, end, t)
    done = t + np.where(n > 1, p.grace_s + p.allreduce_s(n), 0.0)  # alone: a local outer step (invariant I5)
    k = np.searchsorted(t, end, side="left") - 1  # the last merge to start before each session ends
    kk = np.maximum(k, 0)
    dies = (k >= 0) & (end <= done[kk]) & (ready < t[kk])  # leaves inside that merge's window
    dying = np.bincount(k[dies], minlength=t.size)
    dying_speed = np.bincount(k[dies], weights=speed[dies], minlength=t.size)
    slot = done <= T  # merges that complete within the horizon
    ok = (n - dying >= p.min_quorum) & slot
    members_speed = _live_speed(ready, end, speed, t) - dying_speed
    frag = np.arange(t.size) % P
    merged = np.zeros(ready.size)
    inc = np.zeros(t.size)
    for f in range(P):
        idx = np.flatnonzero(ok & (frag == f))
        if idx.size == 0:
            continue
        tf, df = t[idx], done[idx]
        prev = np.concatenate([[0.0], tf[:-1]])
        last = np.searchsorted(df, end, side="left") - 1  # last merge of f completed before leaving
        merged += speed * np.maximum(np.where(last >= 0, tf[np.maximum(last, 0)], 0.0) - ready, 0.0) / P
        inc[idx] += members_speed[idx] * (tf - prev) / P
        first = np.searchsorted(tf, ready, side="right")  # first merge of f after joining
        fc = np.minimum(first, idx.size - 1)
        joins = (first < idx.size) & (df[fc] < end)
        np.add.at(inc, idx[first[joins]], -speed[joins] * (ready[joins] - prev[first[joins]]) / P)
    cum = np.cumsum(inc[ok])
    online = s.online_s(T)
    total = float(merged.sum())
    log.debug("decoupled: %d merges, %d without quorum, %d members lost mid-merge, merged %.4g tokens (series %.4g)",
              int(ok.sum()), int((slot & ~ok).sum()), int(dies.sum()), total, float(cum[-1]) if cum.size else 0.0)
    return SwarmResult("decoupled", float((merged / speed).sum() / online) if online else 0.0, total / T, total,
                       budget_time(done[ok], cum, p.token_budget), float(ok.sum() / max(1, slot.sum())),
                       int(ok.sum()), int((slot & ~ok).sum()), online / T)


def synchronous(p: SwarmParams, s: Sessions) -> SwarmResult:
    """Synchronous DiLoCo rounds: everyone online waits for the slowest, then a blocking
    all-reduce; a death discards the round and costs ``round_timeout_s``.

    Returns a :class:`SwarmResult` with ``mode="synchronous"``.
    """
    T = p.horizon_s
    order = np.argsort(s.ready, kind="stable")
    ready, end = s.ready[order], s.end[order]
    work = p.round_compute_s * p.tokens_per_s / s.speed[order]  # seconds of one round's work per peer
    round_tokens = p.round_compute_s * p.tokens_per_s  # every peer does the same work per round
    active = np.zeros(0, dtype=np.int64)
    nxt, now = 0, 0.0
    useful = good_time = 0.0
    ok = failed = 0
    done_at: list[float] = []
    cum: list[float] = []
    while now < T:
        joined = int(np.searchsorted(ready, now, side="right"))
        active = np.concatenate([active, np.arange(nxt, joined)])
        nxt = joined
        active = active[end[active] > now]
        if active.size == 0:
            later = np.flatnonzero(end[nxt:] > ready[nxt:])
            if later.size == 0:
                break
            now = float(ready[nxt + later[0]])
            continue
        slowest = float(work[active].max())
        finish = now + slowest + float(p.allreduce_s(active.size))
        if finish > T:
            break
        gone = end[active] < finish
        if gone.any():
            failed += 1
            now = max(now + slowest, float(end[active][gone].min())) + p.round_timeout_s
            continue
        ok += 1
        useful += float(work[active].sum())
        good_time += finish - now
        done_at.append(finish)
        cum.append((cum[-1] if cum else 0.0) + round_tokens * active.size)
        now = finish
    online = s.online_s(T)
    total = cum[-1] if cum else 0.0
    return SwarmResult("synchronous", useful / online if online else 0.0, total / T, total,
                       budget_time(np.asarray(done_at), np.asarray(cum), p.token_budget), good_time / T,
                       ok, failed, online / T)


def simulate_swarm(p: SwarmParams) -> dict[str, SwarmResult]:
    """Run both modes on the same sessions (drawn from ``p.seed``) and return
    ``{"decoupled": ..., "synchronous": ...}``. Rules and sources: :mod:`p2pdiloco.sim.swarm`."""
    sessions = make_sessions(p, np.random.default_rng(p.seed))
    log.debug("swarm: %d sessions, join %.1f s, all-reduce %.1f s among %d", sessions.start.size, p.join_s,
              float(p.allreduce_s(p.peers)), p.peers)
    return {"decoupled": decoupled(p, sessions), "synchronous": synchronous(p, sessions)}
