"""Traffic counters and the link-rate estimate (``transport.Swarm.stats``), and drop
accounting and blocks for one peer's inbound traffic (``transport.Swarm.drops``).

Every inbound message that is not served (malformed, oversized, over a limit, too slow) is a
drop, counted by peer and by reason. A peer with ``DROP_BUDGET`` drops within
``DROP_WINDOW_S`` seconds is blocked: the transport closes its streams unread for ``BLOCK_S``
seconds, doubling with every further block (at most ``BLOCK_MAX_S``). Bounded: at most
``MAX_DROP_PEERS`` peers are remembered (those with the fewest drops, and the oldest windows,
are forgotten first). Drops are logged at DEBUG only: a flood must not flood the log.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from p2pdiloco.net.transport import clock as swarm_clock

log = logging.getLogger(__name__)

DROP_BUDGET = 50  # drops one peer may cause within DROP_WINDOW_S before it is blocked
DROP_WINDOW_S = 60.0
BLOCK_S = 60.0  # seconds the first block lasts; doubles with each further block
BLOCK_MAX_S = 900.0
MAX_DROP_PEERS = 1024  # peers remembered in DropLedger.dropped (the smallest counts are evicted)
RATE_MIN_BYTES = 256 << 10  # payloads at least this large (bytes) are timed for the link rate
RATE_SAMPLES = 16  # the link rate is the median of the last this many timed payloads ...
RATE_MIN_SAMPLES = 3  # ... once there are this many ...
RATE_MAX_AGE_S = 600.0  # ... younger than this (seconds)
HELD_FLOOR = 16.0  # deadlines are held to at most this many times longer than at the ceiling rate


class LinkMeter:
    """This node's link rate (bytes/s), measured on what it receives: the median rate of the
    last ``RATE_SAMPLES`` replies to its own calls with payloads of at least
    ``RATE_MIN_BYTES`` (merged slices from its groups' reducers, state downloads from donors
    it chose), each timed from its first to its last byte (``framing.read_payload``). Requests
    are not timed: any caller could drag the figure down with slow payloads and so stretch
    this node's deadlines. A reply arrives at the slower of the sender's uplink and this
    node's downlink, so with most peers faster than this node the median is this node's link;
    the median ignores the few replies that sat in buffers while the node was busy. Feeds the
    bandwidth-aware shares of all-reduce groups (``shares.bandwidth_shares``) and the
    deadlines of rounds and downloads."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=RATE_SAMPLES)  # (monotonic s, bytes/s)

    def add(self, n_bytes: int, seconds: float) -> None:
        if n_bytes >= RATE_MIN_BYTES and seconds > 0:
            self._samples.append((swarm_clock.monotonic(), n_bytes / seconds))

    def held_to(self, ceiling: float) -> float:
        """The rate (bytes/s) a transfer may be held to: ``ceiling``, or this node's measured
        rate when that is slower (a sample is already one transfer among those in flight), but
        not below ``ceiling`` / ``HELD_FLOOR``: a node on a slow link gives its peers longer
        deadlines rather than blaming them, and slow replies cannot stretch them without end."""
        own = self.estimate()
        return ceiling if own is None else max(ceiling / HELD_FLOOR, min(ceiling, own))

    def estimate(self) -> float | None:
        """Bytes/second, or None with fewer than ``RATE_MIN_SAMPLES`` recent samples."""
        now = swarm_clock.monotonic()
        rates = [r for t, r in self._samples if now - t <= RATE_MAX_AGE_S]
        return statistics.median(rates) if len(rates) >= RATE_MIN_SAMPLES else None


def record_kind(key: str) -> str:
    """A DHT key's kind, for counting: ``mm`` (a matchmaking declaration key) or the key's last
    part (``heads``, ``gathering``, ...; at most 32 characters)."""
    return "mm" if "/mm/" in key else key.rsplit("/", 1)[-1][:32]


@dataclass
class TrafficStats:
    """RPC payload bytes this peer sent and received (headers not counted), calls made (also
    by RPC name, with their framed request and reply headers' bytes: ``calls_by``,
    ``header_bytes``), the
    bytes of both directions with ``relayed`` peers (reached only through a relay), and the
    link rate measured on inbound payloads (``link``), and DHT operations by kind (``dht``)."""

    bytes_out: int = 0
    bytes_in: int = 0
    calls_out: int = 0
    calls_failed: int = 0
    bytes_relayed: int = 0
    relayed: frozenset[str] = frozenset()
    dht: Counter[str] = field(default_factory=Counter)  # DHT operations by "get:" / "store:" and record kind
    calls_by: Counter[str] = field(default_factory=Counter)  # calls made, by RPC name
    sessions: int = 0  # sessions opened to peers (p2pdiloco.net.transport.sessions) ...
    probes: int = 0  # ... and probes of their liveness (a call gave up with nothing heard since its request)
    header_bytes: Counter[str] = field(default_factory=Counter)  # framed request + reply header bytes, by RPC name
    link: LinkMeter = field(default_factory=LinkMeter)

    def add(self, peer: str, n_in: int = 0, n_out: int = 0, seconds: float = 0.0) -> None:
        """Count payload bytes with ``peer``; ``seconds``: how long the ``n_in`` bytes took to arrive."""
        self.bytes_in, self.bytes_out = self.bytes_in + n_in, self.bytes_out + n_out
        self.link.add(n_in, seconds)
        self.bytes_relayed += (n_in + n_out) if peer in self.relayed else 0


class DropLedger:
    """Drops and blocks of one peer's transport; ``me`` (this peer's ID) is never blocked.

    Attributes:
        dropped: inbound messages not served, by peer ID (at most ``MAX_DROP_PEERS`` peers).
        reasons: the same drops by reason (the transport's and other modules' reasons).
        blocked: peer ID -> until when (``clock.monotonic()`` seconds) its streams are closed unread.
    """

    def __init__(self, me: str):
        self.me = me
        self.dropped: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.blocked: dict[str, float] = {}
        self._blocks: dict[str, int] = {}  # peer -> times it was blocked
        self._window: dict[str, tuple[float, int]] = {}  # peer -> (window start, drops in it)

    def drop(self, peer: str, reason: str) -> None:
        """Count one message from ``peer`` that was not served; block the peer when it reaches
        its budget (module docstring). Never raises."""
        self.dropped[peer] += 1
        self.reasons[reason] += 1
        if len(self.dropped) > MAX_DROP_PEERS:
            for victim, _ in self.dropped.most_common()[MAX_DROP_PEERS * 3 // 4:]:
                del self.dropped[victim]
        log.debug("dropped a message from %s: %s", peer[-8:], reason)
        now = swarm_clock.monotonic()
        start, n = self._window.get(peer, (now, 0))
        if now - start > DROP_WINDOW_S:
            start, n = now, 0
        self._window[peer] = (start, n + 1)
        if n + 1 >= DROP_BUDGET and peer != self.me:
            del self._window[peer]
            k = self._blocks[peer] = self._blocks.get(peer, 0) + 1
            seconds = min(BLOCK_MAX_S, BLOCK_S * 2 ** (k - 1))
            self.blocked[peer] = now + seconds
            log.warning("blocking %s for %.0f s: %d malformed or over-limit messages within %.0f s",
                        peer[-8:], seconds, DROP_BUDGET, DROP_WINDOW_S)
        if len(self._window) > MAX_DROP_PEERS:  # bounded: forget the oldest windows
            for victim in sorted(self._window, key=lambda q: self._window[q][0])[:MAX_DROP_PEERS // 4]:
                del self._window[victim]

    def is_blocked(self, peer: str) -> bool:
        return self.blocked.get(peer, 0.0) > swarm_clock.monotonic()

    def blocking(self) -> dict[str, float]:
        """Peers blocked now, {peer ID: seconds left}; expired blocks are forgotten (in place)."""
        now = swarm_clock.monotonic()
        for p in [p for p, t in self.blocked.items() if t <= now]:
            del self.blocked[p]
        return {p: round(t - now, 1) for p, t in self.blocked.items()}

    def windows(self) -> int:
        """Peers whose drop window is remembered now (bounded by ``MAX_DROP_PEERS``)."""
        return len(self._window)
