"""An in-memory network: many :class:`~p2pdiloco.net.transport.swarm.Swarm` peers in one process.

The protocol services (matchmaking, all-reduce, state sync, records) talk to the network only
through ``Swarm``; ``Swarm`` talks to libp2p through two objects, a stream host (hivemind's
``P2P``: open a stream to a peer under a protocol name, serve a name) and a DHT node
(hivemind's ``DHTNode``: ``store`` and ``get`` of signed, expiring sub-keyed records). This
module implements both in memory, so that ``Swarm`` itself, with its framing, limits,
deadlines, drop ledger, bans and membership checks, runs unchanged over it: what a peer sends
is parsed at the same boundary as over p2pd. Used by protocol tests and the scale benchmark;
production nodes use p2pd (``Swarm.start``).

Model (per :class:`MemoryNet`):
- Streams are asyncio ``StreamReader`` / ``StreamWriter`` pairs over a :class:`~p2pdiloco.net.transport.memory_streams.Pipe`
  transport (``asyncio.Transport``, the public base class for transports). Each direction of
  a stream delivers its bytes after the link's one-way ``latency`` (seconds) plus their
  serialisation at ``rate`` (bytes/s), in order, in segments of at most ``SEGMENT`` bytes
  (a write's first bytes arrive before its last, as over TCP: a header sent in one write
  with a large payload is read before the payload has crossed); ``loss`` (probability per
  write) adds a retransmission timeout (``RTO_S``) to that write, as TCP turns a lost segment
  into delay.
  Links are per stream, not shared between a peer's streams (no congestion between them).
- ``partition(groups)``: peers in different groups cannot open streams (the dial hangs until
  the caller's deadline, as a dial into a black hole does) and bytes in flight between them
  are never delivered, nor anything that stream carries later (it stalls until a deadline
  ends it, as TCP does; no hole is skipped); ``heal()`` ends every partition.
- ``kill(peer)``: the peer dies: its streams are reset (the other end reads a
  ``ConnectionResetError``), its handlers are gone, dials to it hang, and its DHT replica is
  lost.
- DHT: every peer holds a replica. A store writes the signed record (``SignedRecords``, the
  same envelope and checks as on the real DHT) into the replicas of every live peer the
  storer can reach; a get reads the reader's own replica and validates each record as
  hivemind does on lookups (a dictionary with one invalid entry is dropped whole). Expired
  records are dropped by the reader's clock. A real Kademlia get visits ``beam_size`` peers;
  this one costs nothing, so DHT traffic is counted (:attr:`MemoryNet.dht_stores`,
  ``dht_gets``), not timed. Streams opened are counted by RPC name (``streams``), bytes
  written by peer (``bytes_sent``, framing headers included).
- Time: every peer reads the running loop's clock (``clock.monotonic``) and a wall clock that
  runs with it (:meth:`MemoryNet.wall`: Unix seconds at the network's first peer plus the
  loop's time since), so on a loop with virtual time (``looptime``) the whole network, record
  expiries included, runs in virtual seconds.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.net.records.signed import SignedRecords
from p2pdiloco.net.transport.memory_streams import SEGMENT, Link, Pipe  # noqa: F401  (SEGMENT: named here too)
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.trust.certificates import Membership
from p2pdiloco.trust.identity import Identity


@dataclass
class _StreamInfo:
    """What a handler learns about an inbound stream (``peer_id``, as hivemind's StreamInfo)."""

    peer_id: PeerID
    addrs: tuple = ()


class MemoryHost:
    """A peer's stream host: the part of hivemind's ``P2P`` that ``Swarm`` uses."""

    def __init__(self, net: MemoryNet, peer_id: str):
        self.net, self.peer_id = net, PeerID.from_base58(peer_id)
        self._id = peer_id
        self.handlers: dict[str, Callable] = {}

    async def add_binary_stream_handler(self, name: str, handler: Callable) -> None:
        self.handlers[name] = handler

    async def call_binary_stream_handler(self, peer: PeerID, name: str):
        dst = peer.to_base58()
        self.net.streams[name] += 1
        host = self.net.hosts.get(dst)
        if host is None or not self.net.reachable(self._id, dst) or self._id not in self.net.hosts:
            await asyncio.Event().wait()  # a dial into a black hole: the caller's deadline ends it
        await asyncio.sleep(2 * self.net.link(self._id, dst).latency)  # the stream's opening: one round trip
        handler = host.handlers.get(name)
        if handler is None or dst not in self.net.hosts:
            raise ConnectionRefusedError(f"{dst[-8:]} does not serve {name}")
        (r_here, w_here), (r_there, w_there) = self.net.stream_pair(self._id, dst)
        task = asyncio.get_running_loop().create_task(
            handler(_StreamInfo(PeerID.from_base58(self._id)), r_there, w_there))
        self.net.track(dst, task)
        return _StreamInfo(peer), r_here, w_here

    async def list_peers(self) -> list[_StreamInfo]:
        return [_StreamInfo(PeerID.from_base58(p)) for p in self.net.hosts
                if p != self._id and self.net.reachable(self._id, p)]

    async def get_visible_maddrs(self, latest: bool = False) -> list[str]:
        return [f"/memory/{self._id}/p2p/{self._id}"]

    async def shutdown(self) -> None:
        self.net.kill(self._id)


class MemoryDHT:
    """A peer's DHT node: the part of hivemind's ``DHTNode`` that ``Swarm`` uses, over the
    replicas of :class:`MemoryNet` (see the module docstring; a search's ``beam_size`` changes
    nothing here: every reachable peer holds a replica)."""

    def __init__(self, net: MemoryNet, peer_id: str, validator: SignedRecords):
        self.net, self.peer_id, self.validator = net, peer_id, validator

    async def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None, beam_size: int = 0) -> bool:
        self.net.dht_stores[self.peer_id] += 1
        key_id = DHTID.generate(source=key).to_bytes()
        subkey_bytes = MSGPackSerializer.dumps(subkey)
        record = DHTRecord(key_id, subkey_bytes, MSGPackSerializer.dumps(value), expiration_time)
        signed = self.validator.sign_value(record)
        if not self.validator.validate(DHTRecord(key_id, subkey_bytes, signed, expiration_time)):
            return False
        for peer in self.net.hosts:
            if self.net.reachable(self.peer_id, peer):
                entries = self.net.replicas.setdefault(peer, {}).setdefault(key_id, {})
                old = entries.get(subkey_bytes)
                if old is None or old[1] <= expiration_time:  # a later store with the same expiry replaces (time moved)
                    entries[subkey_bytes] = (signed, expiration_time)
        return True

    async def get(self, key: str, latest: bool = True, beam_size: int = 0) -> ValueWithExpiration | None:
        self.net.dht_gets[self.peer_id] += 1
        key_id = DHTID.generate(source=key).to_bytes()
        now = self.net.wall()
        entries = self.net.replicas.get(self.peer_id, {}).get(key_id, {})
        live = {s: v for s, v in entries.items() if v[1] >= now}
        if not live:
            return None
        out = {}
        for subkey_bytes, (signed, expiration) in live.items():
            record = DHTRecord(key_id, subkey_bytes, signed, expiration)
            if not self.validator.validate(record):  # within Swarm.get's lookup every entry passes (to its filter)
                return None  # hivemind drops a dictionary with an invalid entry whole
            value = MSGPackSerializer.loads(self.validator.strip_value(record))
            out[MSGPackSerializer.loads(subkey_bytes)] = ValueWithExpiration(value, expiration)
        return ValueWithExpiration(out, max(e for _, e in live.values()))

    async def shutdown(self) -> None:
        pass


@dataclass
class MemoryNet:
    """Peers, links, partitions and DHT replicas of one in-memory network (module docstring).

    Args:
        default: the link every pair of peers uses unless :meth:`set_link` says otherwise.
        seed: of the random numbers that decide losses.
    """

    default: Link = field(default_factory=Link)
    seed: int = 0
    hosts: dict[str, MemoryHost] = field(default_factory=dict)
    replicas: dict[str, dict[bytes, dict[bytes, tuple[bytes, float]]]] = field(default_factory=dict)
    bytes_sent: Counter[str] = field(default_factory=Counter)
    dht_stores: Counter[str] = field(default_factory=Counter)
    dht_gets: Counter[str] = field(default_factory=Counter)
    streams: Counter[str] = field(default_factory=Counter)  # streams opened (one per RPC call), by RPC name

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._links: dict[tuple[str, str], Link] = {}
        self._group: dict[str, int] = {}  # peer -> its side of the partition (absent: not partitioned)
        self._streams: set[Pipe] = set()
        self._tasks: dict[str, set[asyncio.Task]] = {}
        self._epoch: float | None = None  # Unix seconds at loop time 0 (set at the first peer)

    def wall(self) -> float:
        """The network's Unix time (seconds): runs with the loop's clock (module docstring)."""
        if self._epoch is None:
            self._epoch = time.time() - swarm_clock.monotonic()
        return self._epoch + swarm_clock.monotonic()

    async def swarm(self, identity: Identity | None = None, membership: Membership | None = None) -> Swarm:
        """A new peer on this network: a ``Swarm`` over a :class:`MemoryHost` and a
        :class:`MemoryDHT` (no daemon, no clock measurement: every peer reads the network's
        clock, :meth:`wall`)."""
        identity = identity if identity is not None else Identity.generate()
        membership = membership if membership is not None else Membership()
        if identity.peer_id in self.hosts:
            raise ValueError(f"peer {identity.peer_id} is already on this network")
        records = SignedRecords(identity, membership)
        host = MemoryHost(self, identity.peer_id)
        self.hosts[identity.peer_id] = host
        swarm = Swarm(host, MemoryDHT(self, identity.peer_id, records), None, identity, membership, records,
                      swarm_clock.SwarmClock(local=self.wall))
        await swarm.server.start()
        await swarm.add_handler("trust.hello", swarm._on_hello)
        return swarm

    # ---- links and faults ----------------------------------------------------------------
    def forget(self, pipe: Pipe) -> None:
        """A stream ended: it is no longer one of the network's (``kill`` resets the others)."""
        self._streams.discard(pipe)

    def link(self, src: str, dst: str) -> Link:
        """The link bytes from ``src`` to ``dst`` travel over."""
        return self._links.get((src, dst), self.default)

    def set_link(self, a: str, b: str, link: Link) -> None:
        """Use ``link`` between ``a`` and ``b``, both directions."""
        self._links[a, b] = self._links[b, a] = link

    def reachable(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` are both alive and on the same side of every partition."""
        return a in self.hosts and b in self.hosts and self._group.get(a, -1) == self._group.get(b, -1)

    def partition(self, groups: Sequence[Sequence[str]]) -> None:
        """Cut the network into ``groups`` (peer IDs); peers not listed form one more group."""
        self._group = {peer: i for i, group in enumerate(groups) for peer in group}

    def heal(self) -> None:
        """End every partition."""
        self._group = {}

    def kill(self, peer: str) -> None:
        """The peer dies: streams reset, handlers and DHT replica gone (module docstring)."""
        if self.hosts.pop(peer, None) is None:
            return
        self.replicas.pop(peer, None)
        for pipe in [p for p in self._streams if peer in (p._src, p._dst)]:
            pipe.abort()
        for task in self._tasks.pop(peer, set()):
            task.cancel()

    # ---- streams -------------------------------------------------------------------------
    def stream_pair(self, a: str, b: str):
        """Two connected (reader, writer) pairs: ``a``'s end and ``b``'s end."""
        loop = asyncio.get_running_loop()
        ends = []
        for src, dst in ((a, b), (b, a)):
            reader = asyncio.StreamReader(limit=2**20)
            protocol = asyncio.StreamReaderProtocol(reader)
            pipe = Pipe(self, src, dst, protocol)
            protocol.connection_made(pipe)
            ends.append((reader, asyncio.StreamWriter(pipe, protocol, reader, loop), pipe))
        ends[0][2].other, ends[1][2].other = ends[1][2], ends[0][2]
        self._streams.update((ends[0][2], ends[1][2]))
        return (ends[0][0], ends[0][1]), (ends[1][0], ends[1][1])

    def track(self, peer: str, task: asyncio.Task) -> None:
        """A handler task of ``peer``'s: cancelled if the peer dies."""
        tasks = self._tasks.setdefault(peer, set())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def close(self) -> None:
        """Kill every peer and wait for their handler tasks."""
        tasks = [t for ts in self._tasks.values() for t in ts]
        for peer in list(self.hosts):
            self.kill(peer)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
