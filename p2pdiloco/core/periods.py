"""The outer period's account (invariant I9, docs/architecture.md "Partial rounds"): how much
of one outer period's step a round applies. A fragment's :class:`Ledger`, part of its global
state and covered by its digest, counts the tokens the swarm merges per period; from it and a
round's counters, :func:`round_fraction` gives the fraction f of a period the round's outer step
is for (:func:`span_fraction` from the contributors' counters alone, while the ledger knows no
rate yet), so the rounds of one period add up to about one step, whoever merges them and how
(a sub-group of the swarm, a node that merges alone while the others merge after it, an
end-of-budget flush). The step itself: :mod:`p2pdiloco.core.outer`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from .merge import contribution_weight

__all__ = ["Ledger", "span_fraction", "round_fraction", "FRACTION_GRID", "MAX_SPAN", "RATE_DECAY"]

FRACTION_GRID = 1024  # a round's fraction is a multiple of 1/FRACTION_GRID (exact in fp32)
MAX_SPAN = 64  # a contribution is counted as spread over at most this many rounds
RATE_DECAY = 0.5  # weight of the previous estimate when a period completes (Ledger.rate)
RATE_GROWTH = 4.0  # a completed period counts at most this many times the previous rate
MAX_TOKENS = 2**53  # a ledger's token counts saturate here (what a state answer may carry: net.records.parse.MAX_COUNT)


@dataclass(frozen=True)
class Ledger:
    """Fragment p's account of how much the swarm merges per outer period: part of its global
    state and covered by its digest, so every holder of a version computes the same fraction
    for the next round (``round_fraction``; invariant I9).

    Attributes:
        period_start: schedule position (an inner step: the contributors' lower median
            ``position``) of the current period's first round; -1 before any round.
        period_tokens: tokens merged into p by the current period's rounds so far.
        rate: tokens the swarm merges into p per period: over completed periods, new =
            RATE_DECAY·old + (1 − RATE_DECAY)·period (the first: the period itself), each
            period counted at most RATE_GROWTH times the old rate; 0.0 while unknown.
        period_fraction: the outer step the current period's rounds have applied so far, in
            units of 1/FRACTION_GRID, in [0, FRACTION_GRID] (the period's step budget).
        total_tokens: tokens merged into p by every round so far (the run's progress as
            every holder of this version counts it).
    """

    period_start: int = -1
    period_tokens: int = 0
    rate: float = 0.0
    period_fraction: int = 0
    total_tokens: int = 0

    def pack(self) -> bytes:
        """``<qqdqq`` little-endian: period_start, period_tokens, rate, period_fraction,
        total_tokens (the digest's tail)."""
        return struct.pack("<qqdqq", self.period_start, self.period_tokens, self.rate, self.period_fraction,
                           self.total_tokens)

    def to_list(self) -> list:
        """[period_start, period_tokens, rate, period_fraction, total_tokens]: the wire and
        checkpoint form."""
        return [self.period_start, self.period_tokens, self.rate, self.period_fraction, self.total_tokens]


def _units(f: float, any_progress: bool) -> int:
    """f in [0, 1] as a count of 1/FRACTION_GRID units, at least one with progress."""
    if not any_progress:
        return 0
    return max(1, min(FRACTION_GRID, round(f * FRACTION_GRID)))


def round_fraction(ledger: Ledger, tokens: int, position: int, sync_every: int,
                   first: float) -> tuple[float, Ledger]:
    """The fraction f in [0, 1] of an outer period a round's step is for, and the ledger its
    result carries.

    ledger: the anchor state's; tokens: the tokens the round merges (sum over its
    contributors); position: their lower median schedule position (inner step,
    ``Learner.step`` at sending); sync_every: H; first: the fraction to use while the ledger knows no
    rate yet (:func:`span_fraction`). A round at a position at least H/2 past the current
    period's first round starts a new period (the start moves at most 2H at once), completing
    the old one into ``rate`` (a moving average of the completed periods' tokens, ``RATE_DECAY``,
    except that a period with fewer tokens than the rate, but some, sets it: a swarm that lost
    learners for good, two colluders shut out of four, took 0.73 of a step per round for the
    rest of a run before, measured with bench/trust_poison.py; the first period's tokens scaled by H / its start, at most 1:
    they are the progress of its start's steps since step 0, e.g. H + offset(p) for fragment
    p's first, staggered send; counted as one period, they made the next rounds of fragment 3
    of 4 take 0.57 of a step for a whole period's progress), and so does a round more than 2H
    before the period's start,
    which no honest ledger has (the period restarts at its position: a forged start far ahead
    cannot freeze the fraction); any other round adds its tokens to the current period. Then
    f = min(1, tokens / rate): the share of a period's merged tokens this round carries, but
    never more than what is left of the period's one step (``period_fraction``): the rounds
    of one period add up to at most one outer step (at least one grid unit each with
    progress), so learners that merge one after the other, each alone, each carry their
    share, a swarm that grew faster than ``rate`` follows does not take several steps in one
    period, and neither does the first period, whose rounds cannot know how many others will
    follow (``first`` is an upper bound of each one's share). A near-empty round (an
    end-of-budget flush) moves Θ by almost nothing; a slower learner's rounds, behind the
    schedule, count in the period they arrive in. Computed by every member from the anchor's
    ledger and the counters the reducers state under their signatures, never from a node's
    own view of the swarm (invariant I9; docs/architecture.md "Partial rounds"). Token counts
    saturate at ``MAX_TOKENS``, so claimed counts cannot make a state unsendable. Raises
    ValueError on negative tokens or position, sync_every < 1 or ``first`` outside [0, 1]."""
    if tokens < 0 or position < 0 or sync_every < 1 or not 0.0 <= first <= 1.0:
        raise ValueError(f"bad round counters: tokens={tokens} position={position} H={sync_every} first={first}")
    future = ledger.period_start > position + 2 * sync_every  # never an honest ledger's: begin anew here
    if ledger.period_start < 0 or future or position >= ledger.period_start + sync_every // 2:  # a new period begins
        rate = ledger.rate
        if ledger.period_start >= 0:
            # the first period's rounds carry the progress since step 0, which their position is:
            # H + offset(p) steps for fragment p's first send, up to 2H (a period and a half of it)
            first = float(ledger.period_tokens) * min(1.0, sync_every / max(1, ledger.period_start))
            done = first if rate == 0 else float(min(ledger.period_tokens, RATE_GROWTH * rate))  # a float on the wire
            shrunk = 0 < done < rate  # the swarm merged fewer tokens this period: its rounds are whole steps again
            rate = done if rate == 0 or shrunk else RATE_DECAY * rate + (1 - RATE_DECAY) * done
        start = position if ledger.period_start < 0 or future else min(position, ledger.period_start + 2 * sync_every)
        start_tokens, used = 0, 0
    else:
        start, start_tokens, rate, used = ledger.period_start, ledger.period_tokens, ledger.rate, ledger.period_fraction
    units = _units(min(1.0, tokens / rate) if rate > 0 else first, tokens > 0)
    if units:
        units = max(1, min(units, FRACTION_GRID - used))
    return units / FRACTION_GRID, Ledger(start, min(MAX_TOKENS, start_tokens + tokens), rate,
                                         min(FRACTION_GRID, used + units), min(MAX_TOKENS, ledger.total_tokens + tokens))


def span_fraction(counters: Sequence[tuple[int, int, int]], sync_every: int) -> float:
    """The share of one outer period's progress a round carries, from its contributors'
    counters alone, f in [0, 1]: ``round_fraction``'s rule until a fragment's ledger knows
    the swarm's rate (its first period).

    counters: one (tokens, steps, span) per contributor the round merged, as signed in its
    contribution: tokens and inner steps since it last received the fragment, and span =
    anchor version − version at which those counters started + 1 (>= 1; the rounds that
    merged the fragment while this progress was made, this one included). sync_every: H,
    inner steps per period. Each contributor's share is min(1, steps / (H·min(span,
    MAX_SPAN))): the steps it worked per round merged meanwhile, as a part of a period (two
    learners merging one after the other each carry half a period; a flush after 3 steps
    carries 3/H; progress left out of one round and offered at the next, 2H steps over 2
    rounds, a whole one). f is the average share under the merge's own weights (tokens²/steps,
    ``contribution_weight``), rounded to a multiple of 1/FRACTION_GRID, and at least one grid
    step when any contributor took a step. Every member computes it from the same signed
    counters (invariant I9; docs/architecture.md "Partial rounds"). It cannot tell that a
    learner merging first and alone will be followed by others in the same period.
    Raises ValueError on negative counters, span < 1 or sync_every < 1."""
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    num = den = 0.0
    for tokens, steps, span in counters:
        if span < 1:
            raise ValueError(f"span must be >= 1, got {span}")
        w = contribution_weight(tokens, steps)
        num += w * min(1.0, steps / (sync_every * min(span, MAX_SPAN)))
        den += w
    return _units(num / den, True) / FRACTION_GRID if den > 0.0 else 0.0
