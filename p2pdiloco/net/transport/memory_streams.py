"""The streams of the in-memory network (:mod:`p2pdiloco.net.transport.memory`): one direction
of a link between two peers (:class:`Link`: latency, rate, loss) and one end of a stream
(:class:`Pipe`, an ``asyncio.Transport``), delivering bytes as TCP would over that link:
in order, in segments, after the latency and the serialisation, a lost write delayed by a
retransmission timeout."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass
from random import Random
from typing import Any, Protocol


class StreamNet(Protocol):
    """What a stream asks of its network: the link between two peers, whether they can reach
    each other now, the random numbers of losses, the bytes each peer sent, and to forget a
    stream that ended."""

    rng: Random
    bytes_sent: Counter[str]

    def link(self, src: str, dst: str) -> Link: ...

    def reachable(self, a: str, b: str) -> bool: ...

    def forget(self, pipe: Pipe) -> None: ...


RTO_S = 0.2  # seconds a lost write is delayed by (TCP's minimum retransmission timeout, RFC 6298: 1 s; Linux: 200 ms)
SEGMENT = 64 << 10  # bytes delivered at once (TCP delivers a write progressively; 64 KiB: a loopback segment)
SOCKET_BUFFER = 256 << 10  # bytes in flight a stream holds as a kernel's send buffer would (not "buffered")
HIGH_WATER, LOW_WATER = 64 << 10, 16 << 10  # bytes beyond it at which a writer's drain() waits / resumes


@dataclass(frozen=True)
class Link:
    """One direction of a stream between two peers: ``latency`` (seconds, one way), ``rate``
    (bytes per second; ``float("inf")``: no serialisation time) and ``loss`` (probability that
    a write is delayed by ``RTO_S``)."""

    latency: float = 0.0
    rate: float = float("inf")
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.latency < 0 or not self.rate > 0 or not 0 <= self.loss < 1:
            raise ValueError(f"need latency >= 0, rate > 0 and 0 <= loss < 1, got {self}")


class Pipe(asyncio.Transport):
    """One end of an in-memory stream: ``write`` delivers to the other end's protocol after
    the link's delay; ``close`` delivers EOF after the bytes in flight; ``abort`` resets both
    ends."""

    def __init__(self, net: StreamNet, src: str, dst: str, protocol: asyncio.StreamReaderProtocol):
        super().__init__()
        self._net, self._src, self._dst, self._protocol = net, src, dst, protocol
        self.other: Pipe | None = None
        self._free_at = 0.0  # loop time when the link has serialised everything written so far
        # bytes in flight in the order written (None: the EOF after them), each due at or after
        # the one before it: one timer per entry pops the head, so writes due at the same loop
        # time (virtual time, no latency) arrive in order, and a lost write holds back the
        # writes after it, as TCP's in-order delivery does
        self._due: deque[bytes | None] = deque()
        self._last_at = 0.0  # loop time at which the last entry of _due arrives
        # a partition swallowed bytes of this direction: nothing after them arrives either (TCP
        # retransmits in order, so a stream across a partition stalls until a deadline ends
        # it; it never skips a hole and carries on after the heal)
        self._stalled = False
        self._queued = 0  # bytes written and not yet delivered
        self._paused = self._closing = self._lost = False
        self._loop = asyncio.get_running_loop()

    # ---- asyncio.Transport ---------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._lost or not data:
            return
        data, link, now = bytes(data), self._net.link(self._src, self._dst), self._loop.time()
        delay = link.latency + (RTO_S if link.loss and self._net.rng.random() < link.loss else 0.0)
        self._queued += len(data)
        self._net.bytes_sent[self._src] += len(data)
        self._free_at = max(self._free_at, now)
        for i in range(0, len(data), SEGMENT):  # each segment arrives once serialised
            segment = data[i : i + SEGMENT]
            self._free_at += len(segment) / link.rate
            self._send(segment, self._free_at + delay)
        if not self._paused and self.get_write_buffer_size() > HIGH_WATER:
            self._paused = True
            self._protocol.pause_writing()

    def _send(self, item: bytes | None, at: float) -> None:
        self._last_at = max(self._last_at, at)
        self._due.append(item)
        self._loop.call_at(self._last_at, self._arrive)

    def _arrive(self) -> None:
        item = self._due.popleft()
        if item is None:
            self._eof()
        else:
            self._deliver(item)

    def _deliver(self, data: bytes) -> None:
        self._queued -= len(data)
        if self._paused and self.get_write_buffer_size() <= LOW_WATER:
            self._paused = False
            self._protocol.resume_writing()
        other = self.other
        if other is None or other._lost or self._lost or self._stalled:
            return  # the stream was reset, or stalled
        if not self._net.reachable(self._src, self._dst):
            self._stalled = True  # a partition swallowed the bytes
            return
        other._protocol.data_received(data)

    def get_write_buffer_size(self) -> int:
        """Bytes written beyond what the link holds in flight (``SOCKET_BUFFER``): as for a
        socket, bytes handed to the kernel do not count, and ``close`` still delivers them."""
        return max(0, self._queued - SOCKET_BUFFER)

    def is_closing(self) -> bool:
        return self._closing or self._lost

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.close()

    def close(self) -> None:
        if self._closing or self._lost:
            return
        self._closing = True
        delay = self._net.link(self._src, self._dst).latency
        self._send(None, max(self._free_at, self._loop.time()) + delay)

    def _eof(self) -> None:
        other = self.other
        if other is not None and not other._lost and not self._stalled and self._net.reachable(self._src, self._dst):
            other._protocol.eof_received()
        self._half_closed()

    def _half_closed(self) -> None:
        # both directions closed: the stream is gone for both ends
        other = self.other
        if other is not None and (other._closing or other._lost):
            self._lose(None)
            other._lose(None)

    def abort(self) -> None:
        """Reset the stream: unsent bytes are discarded and the other end reads a reset."""
        self._lose(None)
        if self.other is not None:
            self.other._lose(ConnectionResetError("stream reset by peer"))

    def _lose(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._net.forget(self)
        self._protocol.connection_lost(exc)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self._dst, "sockname": self._src}.get(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # fixed: LOW_WATER and HIGH_WATER

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return LOW_WATER, HIGH_WATER

    def pause_reading(self) -> None:
        pass  # in memory: the reader's buffer is bounded by what the writer's drain lets through

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return not self._lost
