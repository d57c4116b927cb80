"""The swarm's DHT records, as a peer stores and reads them (:class:`DHTAccess`, a base of
:class:`~p2pdiloco.net.transport.swarm.Swarm`): every value stored for a lifetime of the swarm's
time plus the clock slack, every entry of a lookup validated on its own
(``SignedRecords.lookup``), the entries this node itself holds for the DHT included, and the
searches narrowed to ``NARROW_BEAM`` candidates when the caller asks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hivemind.dht import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.errors import NetworkError
from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.net.transport.drops import TrafficStats, record_kind
from p2pdiloco.net.transport.framing import short_error as _short

if TYPE_CHECKING:
    from p2pdiloco.net.records.signed import SignedRecords

NARROW_BEAM = 5  # DHT peers a search keeps (hivemind's num_replicas: those that hold a value), instead of the
# bucket size, 20, which at 16 nodes visits all of them, each answer carrying every record under the key


class DHTAccess:
    """The DHT side of :class:`~p2pdiloco.net.transport.swarm.Swarm` (which holds the DHT node,
    the swarm's clock, the record validator and the traffic counters these methods use)."""

    _dht: DHTNode
    clock: swarm_clock.SwarmClock
    records: SignedRecords
    stats: TrafficStats

    async def store(self, key: str, subkey: str, value: Any, ttl: float, *, beam: int | None = None) -> bool:
        """Store ``value`` (msgpack-able) under ``key``/``subkey`` for ``ttl`` seconds of the
        swarm's time (:attr:`clock`), plus ``clock.TOLERANCE_S`` seconds of slack: every node
        drops a record by its own clock, and one whose clock is up to that far ahead must still
        see it. Readers that need a record's age read its ``t`` field (swarm time), not the
        DHT's expiry. ``beam``: the search for the peers nearest the key keeps this many
        candidates (hivemind's ``beam_size``; None: its bucket size, 20; ``NARROW_BEAM``)."""
        expiration = self.clock.now() + ttl + swarm_clock.TOLERANCE_S
        self.stats.dht[f"store:{record_kind(key)}"] += 1
        narrow = {} if beam is None else {"beam_size": beam}
        try:
            return bool(await self._dht.store(key, value, expiration, subkey=subkey, **narrow))
        except Exception as e:
            raise NetworkError(f"DHT store of {key!r} failed: {_short(e)}") from None

    async def get(self, key: str, *, beam: int | None = None) -> dict[str, Any]:
        """Latest non-expired values under ``key`` as {subkey: value}, merged from this node's
        own share of the DHT and every peer the search visits; {} when none. ``beam`` as in
        :meth:`store`.

        Every entry is validated on its own (:meth:`SignedRecords.lookup`): a bad entry in a
        peer's answer is dropped and counted (``records.read_dropped``), the rest of that
        answer kept; of the valid entries under one subkey the one that expires last wins."""
        self.stats.dht[f"get:{record_kind(key)}"] += 1
        narrow = {} if beam is None else {"beam_size": beam}
        key_id = DHTID.generate(source=key)
        with self.records.lookup(key_id.to_bytes(), get_dht_time()) as entries:
            for record in self._held_records(key_id):  # hivemind adds these unchecked: checked here
                entries.offer(record)
            try:
                await self._dht.get(key, latest=True, **narrow)  # its merged answer is ignored (lookup())
            except Exception as e:
                raise NetworkError(f"DHT get of {key!r} failed: {_short(e)}") from None
        return {str(sub): value for sub, value in entries.values().items()}

    def _held_records(self, key_id: DHTID) -> list[DHTRecord]:
        """The entries of ``key_id`` this node stores for the DHT, as stored (signed envelopes);
        read through hivemind's public ``DHTNode.protocol.storage`` ([] for a DHT without one: the
        in-memory network's ``MemoryDHT`` answers its own replica through ``get``)."""
        protocol = getattr(self._dht, "protocol", None)
        if protocol is None:
            return []
        found = protocol.storage.get(key_id)
        if found is None or not hasattr(found.value, "items"):  # none, or a plain value (we store none)
            return []
        return [DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(sub), item.value, item.expiration_time)
                for sub, item in found.value.items()]

    def held(self, key: str) -> dict[str, bytes]:
        """What this node itself stores for the DHT under ``key``: {subkey: signed envelope},
        unchecked (what it would answer a lookup with); for tests and diagnostics."""
        return {str(MSGPackSerializer.loads(r.subkey)): r.value for r in self._held_records(DHTID.generate(source=key))}
