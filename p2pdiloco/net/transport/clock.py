"""The swarm's time: this machine's clock offset from its peers', measured over the DHT's own
ping, so that volunteers whose clocks are not synchronized still join and share records.

Where wall-clock time crosses the network (measured with hivemind 1.1.12):

* hivemind's DHT bootstrap (``DHTNode.create``, ``strict=True``) refuses an initial peer whose
  ping answer's time is more than ``MAX_DHT_TIME_DISCREPANCY_SECONDS`` (3 s) off this
  machine's clock: a node more than about 3 s ahead of or behind its initial peers fails to
  join (p2pdiloco used to report it as "none of the initial peers answered"). A node measured
  more than :data:`SKEWED_S` off an initial peer now joins with that check off
  (``strict=False``: hivemind only logs it, and also its check that the peer can dial us back).
* DHT records carry an absolute expiration time; every node drops, by its *own* clock, a
  record whose expiration has passed, both when it is asked to store one and when it reads
  one. A writer whose clock is behind by more than a record's TTL has its records refused by
  everybody; a reader ahead by more than a record's remaining lifetime sees nothing.

So this module estimates, from the answers to hivemind's ``DHTProtocol.rpc_ping`` (which
states the answering node's ``get_dht_time()``, its Unix time), each peer's clock offset
``peer time - our time`` as ``dht_time - (sent + received) / 2`` (within half the round trip,
the smallest of :data:`PINGS` pings), and takes their median (:func:`swarm_offset`), bounded to
±:data:`TOLERANCE_S`, as this machine's correction: :meth:`SwarmClock.now` is the swarm's
time. Before joining, the median is over the initial peers alone (the node defers to the
swarm it joins); afterwards, every :data:`REFRESH_S` seconds, over up to :data:`MAX_PEERS`
connected peers *and this node itself* (offset 0): peers answer with their own clocks, not
their corrected ones, so a node that counted only the others would swap times with its one
peer in a swarm of two, where counting itself puts both at the midpoint. Every node then
follows the median clock of its neighbourhood (the first node of a swarm, which had nobody
to ask at start, included). ``transport.Swarm`` uses the swarm's time for every record's
expiration and adds :data:`TOLERANCE_S` of slack, so that a reader whose uncorrected clock
(the one hivemind filters with) is up to that far ahead still sees every record; nodes stamp
their records' ``t`` fields with it, and readers that need a record's age use ``t``.

A peer's answer is hostile until parsed (:func:`peer_offset`): a time that is not a finite
number, or that is more than :data:`MAX_SANE_OFFSET_S` off, is dropped and counted in
:attr:`SwarmClock.rejected`. One peer cannot move the median past the others' offsets, and no
set of peers can move this node's time by more than :data:`TOLERANCE_S`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from p2pdiloco.errors import ClockSkewError

log = logging.getLogger(__name__)

TOLERANCE_S = 120.0  # seconds: the largest offset from the swarm's time that a node corrects for
MAX_SANE_OFFSET_S = 86400.0  # seconds: a peer's time further off than this is not a clock reading
SKEWED_S = 2.0  # seconds: offsets hivemind's strict bootstrap check (3 s, less a round trip) still passes
PINGS = 2  # pings per peer and measurement; the one with the shortest round trip counts
PING_TIMEOUT_S = 3.0  # seconds for one ping
MAX_PEERS = 8  # peers asked per measurement
REFRESH_S = 300.0  # seconds between two measurements while the node runs
MAX_SAMPLES = 64  # peers whose last offset is kept
MAX_SAMPLE_AGE_S = 3 * REFRESH_S  # seconds a peer's reading counts (it may have left since)
PING_HANDLER = "DHTProtocol.rpc_ping"  # hivemind's DHT ping on the wire (ServicerBase naming)


def monotonic() -> float:
    """Seconds on the running event loop's clock: the one clock that protocol code (``net/``)
    reads for deadlines, ages and durations, the same clock that ``asyncio.sleep`` and
    ``asyncio.timeout`` run on. On asyncio's and uvloop's loops it is ``CLOCK_MONOTONIC``
    (``time.monotonic``); on a loop with virtual time (``looptime``, as in the protocol tests and
    ``bench/scale.py``, the model being trio's ``MockClock`` with autojump) it is that loop's
    time, so the whole protocol runs in virtual seconds. Outside a running loop (a worker
    thread), ``time.monotonic``."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


@dataclass(frozen=True)
class Sample:
    """One peer's clock reading: ``offset`` = its time minus ours (seconds), known within
    ``uncertainty`` (half the ping's round trip, seconds), taken at our Unix time ``at``."""

    offset: float
    uncertainty: float
    at: float


class BadReading(ValueError):
    """A peer's clock reading that is not one; ``reason`` names why (``bad_time``, ``insane``)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def peer_offset(peer_time: Any, sent: float, received: float) -> Sample:
    """A peer's clock offset from one ping: ``peer_time`` (the peer's Unix time when it answered,
    as it stated it) against our Unix times ``sent`` and ``received`` around the call.

    Raises:
        BadReading: ``peer_time`` is not a finite number or ``received < sent`` (``bad_time``),
            or the offset is more than ``MAX_SANE_OFFSET_S`` seconds (``insane``: a broken or
            lying peer, not a clock).
    """
    if type(peer_time) not in (int, float) or not math.isfinite(peer_time):
        raise BadReading("bad_time", "the peer's time is not a finite number")
    if not received >= sent:
        raise BadReading("bad_time", "received before sent")
    offset = float(peer_time) - (sent + received) / 2
    if abs(offset) > MAX_SANE_OFFSET_S:
        raise BadReading("insane", f"the peer's time is {offset:+.0f} s off")
    return Sample(offset, (received - sent) / 2, received)


def swarm_offset(offsets: Iterable[float], bound: float = TOLERANCE_S) -> float:
    """The correction to this machine's clock (seconds, swarm time minus ours): the median of
    peers' ``offsets``, clamped to ±``bound``; 0.0 when there are none."""
    values = [o for o in offsets if math.isfinite(o)]
    if not values:
        return 0.0
    return max(-bound, min(bound, statistics.median(values)))


def describe(offset: float) -> str:
    """``"45 s behind"`` / ``"20 s ahead of"``: how this machine's clock stands, for ``offset``
    = swarm time minus ours (seconds)."""
    amount = f"{abs(offset):.0f}" if abs(offset) >= 10 else f"{abs(offset):.1f}"
    return f"{amount} s behind" if offset > 0 else f"{amount} s ahead of"


def skew_message(offset: float, samples: Mapping[str, Sample]) -> str:
    """One line naming this machine's clock as the cause, with each peer's measured offset."""
    peers = ", ".join(f"…{p[-8:]} {s.offset:+.1f} s" for p, s in sorted(samples.items())[:4])
    more = f" and {len(samples) - 4} more" if len(samples) > 4 else ""
    return (f"this machine's clock is {describe(offset)} the swarm's (peers {peers}{more}); nodes more than "
            f"{TOLERANCE_S:.0f} s off cannot share records: turn on time sync (timedatectl set-ntp true)")


class SwarmClock:
    """This node's estimate of the swarm's time (module docstring).

    Args:
        local: this machine's clock, Unix seconds (``time.time``; tests pass their own).

    Attributes:
        samples: {peer ID: its last :class:`Sample`}, at most ``MAX_SAMPLES``.
        rejected: answers dropped at parsing, by reason (``bad_time``, ``insane``).
        offset: the correction in use (seconds, swarm time minus ours, within ±TOLERANCE_S).
        raw: the median before clamping (seconds); beyond ±TOLERANCE_S it cannot be corrected.
    """

    def __init__(self, local: Callable[[], float] = time.time):
        self.local = local
        self.samples: dict[str, Sample] = {}
        self.rejected: Counter[str] = Counter()
        self.offset = self.raw = 0.0
        self.measured_at: float | None = None  # our Unix time of the last measurement with an answer
        self._warned = False

    def now(self) -> float:
        """The swarm's time: this machine's Unix time plus :attr:`offset` (seconds)."""
        return self.local() + self.offset

    def read(self, peer: str, peer_time: Any, sent: float, received: float) -> Sample | None:
        """Parse one ping's reading (:func:`peer_offset`); None, counted in :attr:`rejected`,
        when it is dropped. Does not keep it: :meth:`add` does."""
        try:
            return peer_offset(peer_time, sent, received)
        except BadReading as e:
            self.rejected[e.reason] += 1
            log.debug("clock reading of %s dropped: %s", peer[-8:], e)
            return None

    def add(self, peer: str, sample: Sample) -> None:
        """Keep ``sample`` as ``peer``'s reading (replacing its last one; the oldest peers'
        are forgotten past ``MAX_SAMPLES``). :meth:`update` applies it."""
        self.samples[peer] = sample
        if len(self.samples) > MAX_SAMPLES:
            for p in sorted(self.samples, key=lambda q: self.samples[q].at)[:len(self.samples) - MAX_SAMPLES]:
                del self.samples[p]

    def update(self, with_self: bool = False) -> float:
        """Recompute :attr:`offset` from the samples younger than ``MAX_SAMPLE_AGE_S`` (older
        ones are forgotten), with this node's own clock (offset 0) among them when
        ``with_self`` (module docstring); returns it. Logs one warning the first time the
        clock is more than ``SKEWED_S`` off, and each time it is beyond ``TOLERANCE_S`` (then
        the correction stops at the bound). Without samples nothing changes."""
        now = self.local()
        self.samples = {p: s for p, s in self.samples.items() if abs(now - s.at) <= MAX_SAMPLE_AGE_S}
        if not self.samples:
            return self.offset
        self.raw = statistics.median([s.offset for s in self.samples.values()] + ([0.0] if with_self else []))
        self.offset = swarm_offset([self.raw])
        self.measured_at = now
        if abs(self.raw) > TOLERANCE_S:
            log.warning("%s", skew_message(self.raw, self.samples))
        elif abs(self.raw) > SKEWED_S and not self._warned:
            self._warned = True
            log.warning("this machine's clock is %s the swarm's: using the swarm's time; turn on time sync "
                        "(timedatectl set-ntp true)", describe(self.raw))
        return self.offset

    @property
    def beyond(self) -> bool:
        """The measured offset is more than ``TOLERANCE_S``: this node cannot share records."""
        return abs(self.raw) > TOLERANCE_S

    def status(self) -> dict[str, Any]:
        """JSON-able figures: ``offset_s`` (the correction in use, s), ``measured_s`` (the median
        offset, s), ``uncertainty_s`` (largest half round trip among the samples, s),
        ``peers`` (samples), ``age_s`` (seconds since the last measurement, None: never),
        ``synced`` (within ``SKEWED_S``), ``rejected`` (readings dropped, by reason)."""
        return {
            "offset_s": round(self.offset, 3), "measured_s": round(self.raw, 3),
            "uncertainty_s": round(max((s.uncertainty for s in self.samples.values()), default=0.0), 3),
            "peers": len(self.samples),
            "age_s": None if self.measured_at is None else round(self.local() - self.measured_at, 1),
            "synced": abs(self.raw) <= SKEWED_S, "rejected": dict(self.rejected),
        }


async def measure(clock: SwarmClock, p2p: Any, peers: Iterable[Any], *, with_self: bool = False,
                  timeout: float = PING_TIMEOUT_S) -> int:
    """Ping each of ``peers`` (hivemind ``PeerID``s, at most ``MAX_PEERS``) ``PINGS`` times over
    hivemind's DHT ping on ``p2p`` (a ``hivemind.p2p.P2P``), concurrently, add the readings to
    ``clock`` and update it (:meth:`SwarmClock.update`, ``with_self``). A peer that does not
    answer within ``timeout`` seconds is skipped. Returns the number of peers that answered."""
    from hivemind.proto import dht_pb2  # noqa: PLC0415  (imports hivemind)

    async def one(peer: Any) -> bool:
        best: Sample | None = None
        for _ in range(PINGS):
            try:
                sent = clock.local()
                async with asyncio.timeout(timeout):
                    reply = await p2p.call_protobuf_handler(peer, PING_HANDLER, dht_pb2.PingRequest(),
                                                            dht_pb2.PingResponse)
                received = clock.local()
            except Exception as e:  # unreachable, not a DHT node, timeout: no reading
                log.debug("clock ping to %s: %s", str(peer)[-8:], e)
                break
            sample = clock.read(peer.to_base58(), reply.dht_time, sent, received)
            if sample is not None and (best is None or sample.uncertainty < best.uncertainty):
                best = sample
        if best is not None:
            clock.add(peer.to_base58(), best)
        return best is not None

    answered = sum(await asyncio.gather(*(one(p) for p in list(peers)[:MAX_PEERS])))
    if answered:
        clock.update(with_self)
    return answered


async def check_initial(clock: SwarmClock, p2p: Any, initial_peers: Sequence[str]) -> bool:
    """Measure this machine's clock against ``initial_peers`` (multiaddrs with /p2p/) before the
    DHT joins through them; returns whether hivemind's strict bootstrap can be kept (every
    answering peer within ``clock.SKEWED_S`` seconds). Nobody answering leaves the verdict to
    the bootstrap, which then reports the peers unreachable.

    Raises:
        ClockSkewError: the median offset is beyond ``clock.TOLERANCE_S`` seconds.
    """
    from hivemind.p2p import PeerID  # noqa: PLC0415  (imports hivemind)

    ids = []
    for maddr in initial_peers:
        try:
            ids.append(PeerID.from_base58(str(maddr).rsplit("/p2p/", 1)[1].split("/")[0]))
        except Exception:  # not ours to judge here: the bootstrap reports a bad address
            continue
    ids = list({i.to_base58(): i for i in ids}.values())
    random.shuffle(ids)
    if not ids or not await measure(clock, p2p, ids):
        return True
    if clock.beyond:
        raise ClockSkewError(skew_message(clock.raw, clock.samples), clock.raw)
    return all(abs(s.offset) <= SKEWED_S for s in clock.samples.values())


async def measure_connected(clock: SwarmClock, p2p: Any) -> int:
    """Measure the offset to up to ``MAX_PEERS`` random connected peers of ``p2p`` now and
    update ``clock`` (the median counts this node too); returns how many answered."""
    infos = await p2p.list_peers()
    peers = random.sample(infos, min(len(infos), MAX_PEERS))
    return await measure(clock, p2p, [i.peer_id for i in peers], with_self=True)


async def watch(clock: SwarmClock, p2p: Any, first: float = 30.0) -> None:
    """Measure against connected peers after ``first`` seconds, then every ``REFRESH_S``
    seconds (the swarm's time follows the median; the first node of a swarm, which had nobody
    to ask at start, adopts the others' time here). Runs until cancelled; a failed
    measurement keeps the last estimate."""
    await asyncio.sleep(first)
    while True:
        try:
            await measure_connected(clock, p2p)
        except Exception as e:  # never let the watch die: the last estimate stays in use
            log.debug("clock measurement failed: %s", e)
        await asyncio.sleep(REFRESH_S)
