"""Sessions: the small calls to one peer carried on one long-lived libp2p stream (issue 13).

A call on a stream of its own pays, beyond its two messages, for opening the stream (yamux
SYN, multistream-select negotiation of the protocol name) and for closing it in both
directions: about 10.7 packets and 0.9 kB on the wire per call at 4 nodes
(docs/benchmarks/control_plane.md), more than a heartbeat's record. A session opens one stream
to a peer, on the protocol ``RPC``, and carries call after call on it. Each message is framed
as :mod:`p2pdiloco.net.framing` says, with two more header keys:

- a request carries ``_id`` (int in [0, ``MAX_ID``), the caller numbers its calls 0, 1, 2...)
  and ``_rpc`` (str, the name of the handler, as on a stream of its own);
- a reply carries the ``_id`` of the request it answers. Replies come in any order: the server
  runs each request's handler as soon as the request is read (a long-held ``mm.join`` does not
  hold up the pushes behind it) and writes each reply whole, one reply at a time.

Which calls (:meth:`Swarm.call <p2pdiloco.net.transport.Swarm.call>`): those whose request
payload and reply limit (``max_reply``) are both at most ``MAX_MESSAGE`` bytes. Bigger
transfers (state, deltas, big fragments) take a stream of their own, so that no call waits
long behind another's message. A caller stops using a session unused for ``IDLE_S`` seconds
and opens a new one; the server closes a session silent for ``SERVER_IDLE_S`` > ``IDLE_S``
seconds, so a caller never writes into a session the server is closing (unless one message
takes the difference, a minute, to cross).

A server applies the transport's rules to every request of a session as to a stream's
(membership, ``max_payload`` before reading, deadlines, at most ``MAX_STREAMS_PER_PEER``
requests per peer served at once, bans and blocks; ``p2pdiloco.net.transport``), and closes
the session on any message it cannot serve without losing the framing's place: a malformed
header, a bad ``_id`` or an unknown ``_rpc``, a payload it refuses to read. A caller closes
it on a malformed reply, a reply with an ``_id`` it never sent or already had answered, or one
over the call's ``max_reply``; its calls then in flight fail with ``PeerUnreachable``. A
caller's call that gave up (its deadline) leaves its ``_id`` expected (its reply is read and
thrown away), at most ``MAX_ABANDONED`` of them before the session is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from p2pdiloco.errors import PeerSilent, PeerUnreachable, ProtocolError
from p2pdiloco.net.framing import Header, close_stream, frame, payload_deadline, read_header, read_payload

log = logging.getLogger(__name__)

RPC = "p2pdiloco.session"  # the protocol name of a session's stream
MAX_MESSAGE = 1 << 20  # bytes: largest request payload, and reply limit, a call may take a session for
IDLE_S = 240.0  # seconds unused after which a caller opens a new session instead
SERVER_IDLE_S = 300.0  # seconds without a request after which the server closes a session
MAX_ID = 1 << 62  # exclusive bound of a request's _id
MAX_ABANDONED = 64  # calls whose caller gave up, awaiting their replies at once, before the session closes
MAX_SESSIONS_PER_PEER = 4  # inbound sessions of one peer at once (one normally; a new one replaces an idle one)
MAX_SESSIONS = 512  # inbound sessions at once in all


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
    every reply, is its own and ends with it; :meth:`close` is idempotent.

    Attributes:
        peer: the peer's ID (base58).
        used: ``time.monotonic()`` of the last request written.
        closed: no call may start on it any more.
    """

    def __init__(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 drop: Callable[[str, str], None], on_close: Callable[[Session], None]):
        self.peer, self._reader, self._writer = peer, reader, writer
        self._drop, self._on_close = drop, on_close
        self._pending: dict[int, _Pending] = {}
        self._abandoned: set[int] = set()
        self._next = 0
        self._write = asyncio.Lock()
        self.used, self.closed = time.monotonic(), False
        self.heard = self.used  # time.monotonic() of the last reply header read
        self._reads = asyncio.create_task(self._read_replies())

    def stale(self) -> bool:
        """Closed, or unused for ``IDLE_S`` seconds with no call in flight (the server may be closing it)."""
        return self.closed or (not self._pending and time.monotonic() - self.used > IDLE_S)

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
        try:
            head = frame(dict(header, _id=rid, _rpc=name), len(payload))
            async with self._write:  # one message at a time; written whole before any await
                if self.closed:
                    raise PeerUnreachable(f"{name} to {self.peer[-8:]} failed: session closed")
                try:
                    self._writer.write(head)
                    self._writer.write(payload)
                    self.used = sent = time.monotonic()
                    await self._writer.drain()
                except (ConnectionError, OSError) as e:
                    self.close()
                    raise PeerUnreachable(f"{name} to {self.peer[-8:]} failed: session broke ({e})") from None
            try:
                async with asyncio.timeout(first_reply):
                    await pending.header.wait()
            except TimeoutError:
                raise PeerSilent(f"{name} to {self.peer[-8:]} failed: no answer within {first_reply:.3g} s") from None
            return await pending.done
        finally:
            if self._pending.pop(rid, None) is not None and not pending.done.done() and sent is not None:
                # given up (deadline, cancelled): silent since the request, the stream may be dead
                # (a connection lost without a reset); else its reply may still come, thrown away
                self._abandoned.add(rid)
                if self.heard < sent or len(self._abandoned) > MAX_ABANDONED:
                    self.close()

    async def _read_replies(self) -> None:
        try:
            while True:
                header, n = await read_header(self._reader)  # no deadline: idle between calls
                rid = header.pop("_id", None)
                pending = self._pending.get(rid) if type(rid) is int else None
                if pending is None and (type(rid) is not int or rid not in self._abandoned):
                    self._drop(self.peer, "bad_reply")
                    log.debug("session to %s: a reply to no call (_id %.20r)", self.peer[-8:], rid)
                    return
                self._abandoned.discard(rid)
                limit = pending.max_reply if pending is not None else MAX_MESSAGE
                if n > limit:
                    self._drop(self.peer, "reply_too_large")
                    if pending is not None:
                        pending.fail(ProtocolError(f"{self.peer[-8:]} answered with {n} bytes, over the limit of "
                                                   f"{limit}"))
                    return
                self.heard = time.monotonic()
                if pending is not None:
                    pending.header.set()
                async with asyncio.timeout(payload_deadline(n)):
                    t0 = time.perf_counter()
                    body = await read_payload(self._reader, n)
                if pending is not None and not pending.done.done():
                    pending.done.set_result((header, body, time.perf_counter() - t0))
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
        if asyncio.current_task() is not self._reads:
            self._reads.cancel()
        for pending in self._pending.values():
            pending.fail(PeerUnreachable(f"call to {self.peer[-8:]} failed: session closed"))
        self._on_close(self)


async def write_reply(writer: asyncio.StreamWriter, lock: asyncio.Lock, rid: int, reply: Header, body: bytes, *,
                      stop_after: int | None = None) -> None:
    """Write one reply whole (under ``lock``: replies of one session never interleave), within
    :func:`payload_deadline` of its size; ``stop_after``: write only that many payload bytes
    (fault injection, ``p2pdiloco.chaos.inject``).

    Raises:
        TimeoutError: the caller did not read it in time.
        ConnectionError, OSError: the stream broke.
    """
    head = frame(dict(reply, _id=rid), len(body))
    async with lock:
        async with asyncio.timeout(payload_deadline(len(body))):
            writer.write(head)
            writer.write(body if stop_after is None else body[:stop_after])
            await writer.drain()
