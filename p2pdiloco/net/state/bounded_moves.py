"""Bounded moves: whether a downloaded fragment state is a plausible successor of this node's
(``StateSync`` refuses it otherwise; docs/trust.md, "Earned claims").

A state is refused when it is not finite, or moves Θ away from this node's committed state by
more than ``FOLLOW_RELATIVE`` × (versions apart) × ‖Θ‖ (before a step was seen, when larger:
``FOLLOW_FACTOR`` × the outer step of this node's own last contribution to that fragment,
``StateSync.own_step``, at most ``OWN_RELATIVE`` × ‖Θ‖, per version: early with a large H one
honest step moves Θ by several ‖Θ‖), or, once this node has seen a step of that fragment, more
than ``FOLLOW_FACTOR`` × (versions apart) × the largest of the last ``FOLLOW_HISTORY``
per-version steps it saw or, when larger, its own step (at most ``OWN_RELATIVE`` /
``FOLLOW_FACTOR`` × ‖Θ‖): a peer merging alone after group rounds steps by one learner's
unaveraged progress, which may exceed ten group steps. The own step counts the periods of
progress one version may hold (:func:`periods_per_version`: a learner trains on while its
round waits, up to ``grace_max``). Versions apart count both paths from the last state this node knows
another peer held too (a group formed at it, or a download: ``StateSync.shared``): two honest
nodes that both merged alone for a while are as far apart as the sum of their lone runs, not
as their version gap, counted at most ``MAX_GAP``: a claimed gap never widens the bound further
(a billion versions ahead is 16). The steps seen are those of rounds this node took part in
(``StateSync``): a state it merely followed is not evidence of a step size, or each followed
state would widen the bound for the next one (a ratchet). The state's
momentum buffer b is held to one version's bound too: its next outer step moves Θ by at least
lr·μ²·‖b‖ (``core.outer.nesterov_outer_step``), so a state that leaves Θ in place with a huge b
is refused. A bound on sizes is evidence, not proof: the claimers get strikes, not bans.

Source: the same median-norm bound as the robust merge (``core.robust.robust_merge``; Yin et
al., arXiv 1803.01498), applied to outer steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from p2pdiloco.config import OuterConfig
from p2pdiloco.core.outer import FragmentState, lone_step_size

__all__ = ["FOLLOW_FACTOR", "FOLLOW_HISTORY", "FOLLOW_RELATIVE", "MAX_GAP", "OWN_RELATIVE", "SPAN_PERIODS", "distance",
           "implausible", "own_step", "periods_per_version"]

FOLLOW_FACTOR = 10.0  # a followed state may move Θ this many times the largest recent step per version
FOLLOW_HISTORY = 16  # recent per-version steps kept per fragment
FOLLOW_RELATIVE = 4.0  # ... and at most this many times ‖Θ‖ per version, even before any step was seen
OWN_RELATIVE = 16.0  # ... or, before any step was seen, FOLLOW_FACTOR x our own step, up to this many times ‖Θ‖
SPAN_PERIODS = 32.0  # most periods beyond the first one version is taken to hold (periods_per_version)
MAX_GAP = 16  # versions apart counted at most: a claimed gap of a billion versions widens nothing


def periods_per_version(grace_max: float, sync_every: int, t_step: float | None) -> float:
    """How many periods of one learner's progress a version may hold: 1 + grace_max / (H × t_step),
    at most 1 + ``SPAN_PERIODS``; 1 while the step time is unknown (None or 0).

    A learner trains on while its round of a fragment is in flight (up to ``grace_max`` seconds
    in the gathering), and its next contribution carries that progress: where a period (H inner
    steps) is shorter than the grace window, a peer merging alone after a long round steps by
    several periods' progress at once. The node's own step (``StateSync.own_step``) is scaled by
    this factor; it comes from the node's own settings and step time, which no peer sets.

    Args:
        grace_max: the grace window's upper bound (seconds, ``outer.grace_max``).
        sync_every: H, inner steps per period.
        t_step: this node's seconds per inner step (an average), or None.
    """
    if not t_step or t_step <= 0 or not math.isfinite(t_step):
        return 1.0
    return 1.0 + min(grace_max / (sync_every * t_step), SPAN_PERIODS)


def own_step(outer: OuterConfig, delta: Sequence[torch.Tensor], steps: int, t_step: float | None) -> float:
    """The outer step (L2 distance of Θ) this node's contribution ``delta`` (fp32 tensors, the
    fragment's slots) of ``steps`` inner steps would make alone, from a zero momentum buffer:
    lr·(1 + μ)·‖Δ‖ (``core.outer.lone_step_size``) per H steps of progress, times the periods
    one version may hold (:func:`periods_per_version`). ``StateSync.own_step`` keeps it."""
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(d)) ** 2 for d in delta))
    return (lone_step_size(outer.lr, outer.momentum, norm) * outer.sync_every / max(steps, outer.sync_every)
            * periods_per_version(outer.grace_max, outer.sync_every, t_step))


def distance(a: FragmentState, b: FragmentState) -> float:
    """L2 distance between two states' Θ (over all tensors of the fragment, fp32)."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(x - y)) ** 2 for x, y in zip(a.theta, b.theta)))


def implausible(state: FragmentState, mine: FragmentState, shared_version: int, steps: Iterable[float],
                own_step: float, outer_lr: float, outer_momentum: float) -> str | None:
    """Why ``state`` is not a plausible successor of ``mine`` (this node's committed state of
    the same fragment), or None (module docstring).

    Args:
        shared_version: the last version of the fragment another peer held too.
        steps: the per-version steps (L2 norms of Θ moves) seen lately, FOLLOW_HISTORY at most.
        own_step: the outer step this node's own last contribution would make (0: none yet).
        outer_lr, outer_momentum: the run's outer lr and μ (the momentum buffer's bound).
    """
    if not all(bool(torch.isfinite(t).all()) for t in (*state.theta, *state.momentum)):
        return "it is not finite"
    steps = tuple(steps)
    # versions between the two states through their last common one (lone rounds on
    # either side since: both paths count, not only the claimed lead)
    common = min(state.version, shared_version, mine.version)
    k = min(MAX_GAP, max(1, (state.version - common) + (mine.version - common)))
    jump = distance(mine, state)
    size = math.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2 for t in mine.theta))
    own = min(FOLLOW_FACTOR * own_step, OWN_RELATIVE * size)  # 10 x our own step, at most 16 x |Θ|
    largest = max(steps) if steps else 0.0
    # the largest, not the median: a round for a small fraction of a period (a flush, a
    # sub-group's share: core.periods.round_fraction) makes a small step by design; and never
    # below our own step: a peer that merges alone after group rounds steps by one learner's
    # unaveraged progress, momentum on top, over 10 x the group's steps (a restarted node that
    # had seen only group rounds refused such a step and forked, tests/test_churn.py)
    reference, named = max((largest, "the largest recent step"), (own / FOLLOW_FACTOR, "this node's own step"))

    def bounds(n: int) -> list[tuple[float, str]]:  # what n versions may move Θ by
        if not steps and own > FOLLOW_RELATIVE * size:  # no step seen yet, but progress of our own: its size
            out = [(n * own, f"{n} version(s) x {FOLLOW_FACTOR:g} x this node's own step (at most "
                             f"{OWN_RELATIVE:g} x |theta| {size:.3g})")]
        else:
            out = [(FOLLOW_RELATIVE * n * size, f"{FOLLOW_RELATIVE:g} x {n} version(s) x |theta| {size:.3g}")]
        if largest > 0:
            out.append((FOLLOW_FACTOR * n * reference, f"{FOLLOW_FACTOR:g} x {n} version(s) x {named} {reference:.3g}"))
        return out

    # the buffer b moves Θ by at least lr·μ²·‖b‖ in the state's next outer step
    # (core.outer.nesterov_outer_step): one version's bound holds it too, or a state that
    # leaves Θ in place with a huge b would pass and wreck the step after it
    kick = outer_lr * outer_momentum ** 2 * math.sqrt(sum(float(torch.linalg.vector_norm(t)) ** 2
                                                          for t in state.momentum))
    over = [text for bound, text in bounds(k) if jump > bound]
    kicks = [text for bound, text in bounds(1) if kick > bound]
    if over:
        return f"it moves the parameters by {jump:.3g}, over {over[-1]}"
    if kicks:
        return f"its momentum buffer moves the parameters by {kick:.3g} in the next outer step, over {kicks[-1]}"
    return None
