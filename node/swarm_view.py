"""The node's one view of the swarm's records (``StateSync.records``: every live node's signed
heads record), shared by its readers: a round's rebase, the catch-up loop, settling, the alone
watch, the audience of its gathering pushes and the schedule. Each DHT read of the records is a
Kademlia traversal whose answers carry every node's record, so a reader that can use a read a
second old takes the last one (``max_age``) instead of reading again (the control
plane's bytes: docs/benchmarks/control_plane.md)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence

from p2pdiloco.errors import NetworkError
from p2pdiloco.net.state.heads import Head, newest_heads
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.state.statesync import StateSync

log = logging.getLogger(__name__)


class SwarmView:
    """The last read of the swarm's records and what it says (one owner: the node reads through it).

    Attributes:
        records: {peer ID: record} of the last successful read ({} after a failed one).
        read_ok: whether the last read succeeded.
        others: the other nodes of the run with our settings in the last read.
        swarm_step: the inner step two other nodes' records reach (one if it is the only other),
            0 before any: ``Node._keep_schedule``.
    """

    def __init__(self, sync: StateSync, me: str):
        self.sync, self.me = sync, me
        self.records: dict[str, HeadsRecord] = {}
        self.read_ok = False
        self.others: set[str] = set()
        self.swarm_step = 0
        self._read_at = -math.inf  # time.monotonic() at which the kept read began

    async def read(self, max_age: float = 0.0, *, fresh: bool = False) -> dict[str, HeadsRecord]:
        """The records: the last read if it succeeded at most ``max_age`` seconds ago, else a
        new read ({} when the DHT cannot be read; never raises for it). ``fresh``: that read goes to
        the DHT, not to the last one (reused for ``StateSync.read_age`` seconds)."""
        started = time.monotonic()
        if self.read_ok and started - self._read_at <= max_age:
            return self.records
        try:
            records = await self.sync.records(0.0 if fresh else self.sync.read_age())  # pushes keep it current
        except NetworkError as e:
            log.debug("records unavailable: %s", e)
            self.records, self.read_ok = {}, False
            return {}
        if started < self._read_at:  # a read that began later has finished first: keep that one
            return records
        self.records, self.read_ok, self._read_at = records, True, started
        self.others = {p for p in records if p != self.me}
        steps = sorted((r.step for p, r in records.items() if p != self.me), reverse=True)
        self.swarm_step = steps[1] if len(steps) > 1 else steps[0] if steps else self.swarm_step
        return records


# ---- the one rule of what a node's fragments are against the swarm ----------------------------
# `node status` (node.main, a node's own fragments against the records it follows) and `swarm
# status` (node.status_view.summarize_swarm, every node's record against the others) both judge
# through these two functions, so that they agree wherever they read the same records.

FragmentClaim = tuple[int, str] | None  # (version, digest) a node holds, None where unknown


def fragment_status(records: Mapping[str, HeadsRecord], me: str,
                    mine: Sequence[FragmentClaim]) -> tuple[list[Head | None], list[str]]:
    """Per fragment, the swarm's newest head as node ``me`` holding ``mine`` counts it, and the
    status of ``mine`` against it: "newest", "behind" (a newer version, or another digest at the
    same one: ``net.state.heads.is_behind``), "ahead", "no record" (no head) or "unknown" (``mine``
    None there). The heads rule is ``net.state.heads.newest_heads`` from ``me``'s seat: a claim counts
    up to ``heads.LEAD`` above the larger of ``me``'s own version and what two other peers hold,
    so a node ahead of stale records is not judged behind them. ``records``: the records the
    node counts ({peer ID: record}; a node passes those of the peers it trusts,
    ``node.vetting.trusted_records``; ``swarm status``, which trusts nobody, every live one)."""
    heads = newest_heads(records, len(mine), me=me, mine=[c[0] if c else -1 for c in mine])
    out = []
    for claim, head in zip(mine, heads):
        if claim is None:
            out.append("unknown")
        elif head is None:
            out.append("no record")
        elif claim == (head.version, head.digest):
            out.append("newest")
        else:
            out.append("behind" if head.version >= claim[0] else "ahead")  # at its version: another digest
    return heads, out


def share(mine: float | None, merged: float | None) -> float | None:
    """A node's share of the run's progress: of the tokens merged into the states it holds
    (``merged``, ``core.outer.run_tokens``: the ``merged`` of its record), the fraction that are
    its own contributions (``mine``: ``NodeStats.tokens_merged``, its record's ``mine``), at most
    1, rounded to 4 digits; None when either is unknown or nothing is merged."""
    if mine is None or not merged:
        return None
    return round(min(1.0, mine / merged), 4)
