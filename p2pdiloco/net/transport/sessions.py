"""Sessions: the small calls to one peer carried on one long-lived libp2p stream.

A call on a stream of its own pays, beyond its two messages, for opening the stream (yamux
SYN, multistream-select negotiation of the protocol name) and for closing it in both
directions: about 10.7 packets and 0.9 kB on the wire per call at 4 nodes
(docs/benchmarks/control_plane.md), more than a heartbeat's record. A session opens one stream
to a peer, on the protocol ``RPC``, and carries call after call on it. Each message is framed
as :mod:`p2pdiloco.net.transport.framing` says, with two more header keys:

- a request carries ``_id`` (int in [0, ``MAX_ID``), the caller numbers its calls 0, 1, 2...)
  and ``_rpc`` (str, the name of the handler, as on a stream of its own);
- a reply carries the ``_id`` of the request it answers. Replies come in any order: the server
  runs each request's handler as soon as the request is read (a long-held ``mm.join`` does not
  hold up the pushes behind it) and writes each reply whole, one reply at a time.

Which calls (:meth:`Swarm.call <p2pdiloco.net.transport.swarm.Swarm.call>`): those whose request
payload and reply limit (``max_reply``) are both at most ``MAX_MESSAGE`` bytes (64 KiB: a message
takes at most 0.5 s at the slowest rate a peer may send, ``framing.MIN_PAYLOAD_RATE``, so no
call waits long behind another's). Bigger transfers (state, deltas, big fragments) take a
stream of their own, as do all calls while ``MAX_SESSIONS`` of ours are open. A caller opens
one session per peer at a time (concurrent first calls share the opening), stops using one
unused for ``IDLE_S`` seconds and opens a new one, and closes it when unused that long; the
server closes a session without a request for ``SERVER_IDLE_S`` > ``IDLE_S`` seconds while none
of its requests is being answered, so a caller never writes into a session the server is
closing for idleness (unless one message takes the difference, a minute, to cross). A server at
its limits closes an idle session for room (below) at any moment: a call written into it just
then fails (``PeerUnreachable``, no drop), and the next opens a new session.

A server applies the transport's rules to every request of a session as to a stream's
(:mod:`p2pdiloco.net.transport.serving`: membership, ``max_payload`` before reading, deadlines, at most
``MAX_STREAMS_PER_PEER`` requests per peer being answered at once, bans and blocks). The first
request must come within ``serving.HEADER_TIMEOUT``, and every header's rest within it once
its length prefix came. A request over ``MAX_MESSAGE``, a malformed header, a bad ``_id``, a
non-member's request (answered) end the session; a payload over the handler's limit or for an
unknown ``_rpc`` is read and thrown away, answered with an error, and the session goes on. At
most ``MAX_SESSIONS_PER_PEER`` sessions per peer and ``MAX_SESSIONS`` in all are open: a new
one closes the least recently active idle one (no request being answered) at the limit, and is
refused when there is none. A caller closes a session on a malformed reply, a reply with an
``_id`` it never sent or already had answered, one over the call's ``max_reply``, and after a
membership refusal (the server closes it); its calls then in flight fail with
``PeerUnreachable``. A call that gives up (its deadline, cancelled) before its reply's header
leaves its ``_id`` expected (the reply is read and thrown away), at most ``MAX_ABANDONED`` of
them. When nothing was heard on the session since its request, the session is probed: a
``PING`` call, which every server answers at once, and closed unless answered within
``PROBE_S`` seconds (a connection lost without a reset); a long-held call beside it (``mm.join``)
is not cut short. A call whose request could not be written out closes it (a peer that does
not read: what we buffer must not grow).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from p2pdiloco.errors import PeerSilent, PeerUnreachable, ProtocolError, ReplyTooLarge
from p2pdiloco.net.transport.clock import monotonic
from p2pdiloco.net.transport.drops import TrafficStats
from p2pdiloco.net.transport.framing import (
    LENGTH_BYTES,
    Header,
    close_stream,
    frame,
    payload_deadline,
    read_header,
    read_payload,
)

log = logging.getLogger(__name__)

RPC = "p2pdiloco.session"  # the protocol name of a session's stream
MAX_MESSAGE = 64 << 10  # bytes: largest request payload, and reply limit, a call may take a session for
IDLE_S = 240.0  # seconds unused after which a caller opens a new session instead (and closes the old one)
SERVER_IDLE_S = 300.0  # seconds without a request, none being answered, after which the server closes a session
PING = "session.ping"  # an RPC every server answers at once, empty: the probe of a session's liveness
PROBE_S = 5.0  # seconds a probe may take before the session counts as dead and is closed
OPEN_TIMEOUT_S = 10.0  # seconds to open a session's stream (dialing and protocol negotiation)
MAX_ID = 1 << 62  # exclusive bound of a request's _id
MAX_ABANDONED = 64  # calls whose caller gave up, awaiting their replies at once, before the session closes
MAX_SESSIONS_PER_PEER = 4  # inbound sessions of one peer at once (one normally)
MAX_SESSIONS = 512  # inbound sessions at once in all; and ours open at once


class _Pending:
    """One call in flight: its reply limit, the reply header's arrival, its outcome."""

    def __init__(self, max_reply: int):
        self.max_reply = max_reply
        self.header = asyncio.Event()
        self.done: asyncio.Future[tuple[Header, bytes, float]] = asyncio.get_running_loop().create_future()

    def fail(self, error: Exception) -> None:
        self.header.set()
        if not self.done.done():
            self.done.set_exception(error)
            self.done.exception()  # retrieved: nobody may be waiting any more


class Session:
    """Our calls to one peer on one stream (module docstring). Its reader task, which reads
    every reply, is its own and ends with it (:meth:`close`, idempotent; :meth:`wait_closed`).

    Attributes:
        peer: the peer's ID (base58).
        used: ``clock.monotonic()`` of the last request written.
        heard: ``clock.monotonic()`` of the last reply header read.
        closed: no call may start on it any more.
    """

    def __init__(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 drop: Callable[[str, str], None], on_close: Callable[[Session], None], stats: TrafficStats):
        self.peer, self._reader, self._writer = peer, reader, writer
        self._drop, self._on_close, self._stats = drop, on_close, stats
        self._pending: dict[int, _Pending] = {}
        self._abandoned: set[int] = set()
        self._next = 0
        self._write = asyncio.Lock()
        self.used = self.heard = monotonic()
        self.closed = False
        self._probe: asyncio.Task | None = None  # a liveness probe in flight (_gave_up), its own
        self._reads = asyncio.create_task(self._read_replies())

    def stale(self) -> bool:
        """Closed, or unused for ``IDLE_S`` seconds with no call in flight (the server may be closing it)."""
        return self.closed or (not self._pending and monotonic() - self.used > IDLE_S)

    async def call(self, name: str, header: Header, payload: bytes, *, max_reply: int,
                   first_reply: float | None) -> tuple[Header, bytes, float]:
        """One call: (reply header, reply payload, seconds its payload took to arrive). No deadline
        but ``first_reply``'s: the caller wraps it in one.

        Raises:
            PeerSilent: no reply header within ``first_reply`` seconds of the request's writing.
            PeerUnreachable: the session is closed or closes before the reply.
            ProtocolError: the reply is over ``max_reply`` (the session is closed).
        """
        if self.closed:
            raise PeerUnreachable(f"{name} to {self.peer[-8:]} failed: session closed")
        rid, pending = self._next, _Pending(max_reply)
        self._next += 1
        self._pending[rid] = pending
        sent: float | None = None
        written = False
        try:
            head = frame(dict(header, _id=rid, _rpc=name), len(payload))
            async with self._write:  # one message at a time; written whole before any await
                if self.closed:
                    raise PeerUnreachable(f"{name} to {self.peer[-8:]} failed: session closed")
                try:
                    self._writer.writelines((head, payload))  # one send: header and payload travel in one frame
                    self.used = sent = monotonic()
                    await self._writer.drain()
                    written = True
                    self._stats.add(self.peer, n_out=len(payload))
                except (ConnectionError, OSError, RuntimeError) as e:  # uvloop: RuntimeError, handle closed
                    self.close()
                    raise PeerUnreachable(f"{name} to {self.peer[-8:]} failed: session broke ({e})") from None
            try:
                async with asyncio.timeout(first_reply):
                    await pending.header.wait()
            except TimeoutError:
                raise PeerSilent(f"{name} to {self.peer[-8:]} failed: no answer within {first_reply:.3g} s") from None
            return await pending.done
        finally:
            if self._pending.pop(rid, None) is not None and sent is not None and not pending.done.done():
                self._gave_up(rid, pending, sent, written)

    def _gave_up(self, rid: int, pending: _Pending, sent: float, written: bool) -> None:
        if not written:  # cancelled while the peer did not read our request: what we buffer must not grow
            self.close()
            return
        if not pending.header.is_set():
            self._abandoned.add(rid)  # its reply may still come: read and thrown away
        if len(self._abandoned) > MAX_ABANDONED:
            self.close()
        elif self.heard < sent and self._probe is None:  # silent since: the stream may be dead (no reset came)
            self._probe = asyncio.create_task(self._check())

    async def _check(self) -> None:
        """Probe the session (``PING``): closed unless answered within ``PROBE_S`` seconds."""
        self._stats.probes += 1
        try:
            async with asyncio.timeout(PROBE_S):
                await self.call(PING, {}, b"", max_reply=0, first_reply=None)
        except ProtocolError:
            pass  # answered (a refusal): alive
        except (TimeoutError, PeerUnreachable):
            self.close()
        finally:
            self._probe = None

    async def _read_replies(self) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(IDLE_S):  # readexactly consumes nothing unless it returns
                        length = await self._reader.readexactly(LENGTH_BYTES)
                except TimeoutError:
                    if self._pending or monotonic() - self.used < IDLE_S:
                        continue
                    return  # unused: closed here (a server that never closes it holds nothing of ours)
                async with asyncio.timeout(payload_deadline(0)):
                    header, n = await read_header(self._reader, length=length)
                rid = header.pop("_id", None)
                pending = self._pending.get(rid) if type(rid) is int else None
                if pending is None and (type(rid) is not int or rid not in self._abandoned):
                    self._drop(self.peer, "bad_reply")
                    log.debug("session to %s: a reply to no call (_id %.20r)", self.peer[-8:], rid)
                    return
                self._abandoned.discard(rid)
                self.heard = monotonic()
                limit = pending.max_reply if pending is not None else MAX_MESSAGE
                if n > limit:
                    self._drop(self.peer, "reply_too_large")
                    if pending is not None:
                        pending.fail(ReplyTooLarge(f"{self.peer[-8:]} answered with {n} bytes, over the limit of "
                                                   f"{limit}"))
                    return
                if pending is not None:
                    pending.header.set()
                async with asyncio.timeout(payload_deadline(n)):
                    t0 = time.perf_counter()  # a short duration: perf_counter (uvloop's clock has 1 ms steps)
                    body = await read_payload(self._reader, n)
                if pending is not None:  # answered: a second reply with its _id is one to no call
                    del self._pending[rid]
                    if not pending.done.done():
                        pending.done.set_result((header, body, time.perf_counter() - t0))
                if "denied" in header:  # not a member: the server closes the session after its refusal
                    return
        except ProtocolError as e:
            self._drop(self.peer, "bad_reply")
            log.debug("session to %s: malformed reply: %s", self.peer[-8:], e)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, TimeoutError):
            pass  # closed (by the server's idle deadline, a restart) or too slow: calls in flight fail
        finally:
            self.close()

    def close(self) -> None:
        """Close the stream; calls in flight fail with PeerUnreachable. Never raises."""
        if self.closed:
            return
        self.closed = True
        close_stream(self._writer)
        for task in (self._reads, self._probe):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        for pending in self._pending.values():
            pending.fail(PeerUnreachable(f"call to {self.peer[-8:]} failed: session closed"))
        self._on_close(self)

    async def wait_closed(self) -> None:
        """Close, and wait for the reader task to end."""
        self.close()
        await asyncio.gather(self._reads, return_exceptions=True)


async def write_reply(writer: asyncio.StreamWriter, lock: asyncio.Lock, rid: int, reply: Header, body: bytes, *,
                      stop_after: int | None = None) -> bool:
    """Write one reply whole (under ``lock``: replies of one session never interleave), within
    :func:`payload_deadline` of its size, waiting for the lock included; False, and nothing written, if the session ended
    meanwhile. ``stop_after``: write only that many payload bytes (fault injection,
    ``p2pdiloco.chaos.inject``).

    Raises:
        ProtocolError: the header with ``_id`` exceeds ``framing.MAX_HEADER_BYTES``.
        TimeoutError: the caller did not read it in time.
        ConnectionError, OSError: the stream broke.
    """
    head = frame(dict(reply, _id=rid), len(body))
    async with asyncio.timeout(payload_deadline(len(body))):  # waiting for the lock too: replies not read
        async with lock:
            if writer.is_closing():
                return False
            writer.writelines((head, body if stop_after is None else body[:stop_after]))  # one send, one frame
            await writer.drain()
    return True
