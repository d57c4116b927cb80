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

from p2pdiloco.errors import NetworkError
from p2pdiloco.net.records import HeadsRecord
from p2pdiloco.net.statesync import StateSync

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
