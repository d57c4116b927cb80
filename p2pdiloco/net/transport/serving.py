"""The server half of the RPC layer: every inbound request, on a stream of its own or in a
session (:mod:`p2pdiloco.net.transport.sessions`), is read, checked and answered here (every
input from a peer is hostile until parsed: docs/trust.md). Messages are framed as
:mod:`p2pdiloco.net.transport.framing` says; the caller's half is
:meth:`p2pdiloco.net.transport.swarm.Swarm.call`.

A server never buffers what it has not decided to accept: it reads a stream's header within
``HEADER_TIMEOUT`` seconds, checks the caller's membership and ``_n`` against the handler's
``max_payload`` *before* reading the payload, then reads the payload within
``framing.payload_deadline(_n)`` seconds. At most ``MAX_STREAMS_PER_PEER`` requests per peer
and ``MAX_STREAMS`` in all are served at once (a stream's or a session's); a stream over the
limit is answered ``{"error": "busy"}`` without being read and closed at once, so that it holds
no descriptor (best effort: the close can reset the stream before the answer arrives, and the
caller then sees the stream closed, a failed call either way); a session's request over it is
answered busy, after being read. After answering on a stream of its own, the server waits up to
``LINGER_TIMEOUT`` seconds for the caller to close its end (closing first can reset the stream
and lose the answer).

Every malformed, oversized, over-limit or late inbound message is a drop (``drops.DropLedger``:
a peer over its drop budget is blocked for a doubling while); a blocked peer's streams (and
sessions) are closed unread, up to ``TARPIT_PER_PEER`` of them (``TARPIT_MAX`` in all) after
being held unanswered for ``TARPIT_S`` seconds, so that a caller that waits for its answers
slows down instead of opening stream after stream. Every request of a banned peer counts as a
drop (its handlers refuse it), so a banned peer that keeps calling is blocked too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.transport import sessions
from p2pdiloco.net.transport.clock import monotonic
from p2pdiloco.net.transport.drops import MAX_DROP_PEERS
from p2pdiloco.net.transport.framing import (
    LENGTH_BYTES,
    Header,
    close_stream,
    drain,
    frame,
    payload_deadline,
    read_header,
    read_payload,
    write_message,
)
from p2pdiloco.net.transport.framing import short_error as _short
from p2pdiloco.trust.errors import AccessDenied

if TYPE_CHECKING:
    from p2pdiloco.net.transport.swarm import Swarm

log = logging.getLogger(__name__)

HEADER_TIMEOUT = 10.0  # seconds an inbound stream may take to deliver its request header
LINGER_TIMEOUT = 5.0  # seconds a server waits for the caller to close after the answer
LINGER_DISCARD_BYTES = 8 << 20  # bytes a server reads and discards while it lingers, at most
TARPIT_S = 10.0  # seconds a blocked peer's stream is held unanswered before it is closed ...
TARPIT_PER_PEER = 16  # ... for this many of its streams at once (the others are closed at once)
TARPIT_MAX = 256  # ... and this many in all
MAX_STREAMS_PER_PEER = 16  # requests served at once for one peer (mm.join holds one ~2 min)
MAX_STREAMS = 512  # requests served at once in all

Handler = Callable[[str, Header, bytes], Awaitable[tuple[Header, bytes]]]
_BUSY = frame({"error": "busy"}, 0)


class _Drop(Exception):
    """An inbound request that is not served: counted under ``reason``; answered ``message``
    unless ``answer`` is false (the stream is gone)."""

    def __init__(self, reason: str, message: str, answer: bool = True):
        super().__init__(message)
        self.reason, self.answer = reason, answer


class _Live:
    """One inbound session: its peer, stream, write lock, last activity (``clock.monotonic``),
    requests read and requests being answered (their tasks)."""

    def __init__(self, remote: str, writer: asyncio.StreamWriter):
        self.remote, self.writer, self.write = remote, writer, asyncio.Lock()
        self.active, self.requests, self.tasks = monotonic(), 0, set[asyncio.Task]()
        self.reading = False  # a request is being read (or refused) now


class Server:
    """The requests a :class:`~p2pdiloco.net.transport.swarm.Swarm` serves (module docstring). It owns
    the handlers and the counts of what is being served; it reads the swarm's ``membership``,
    ``bans``, ``drops`` and counts into its ``refused``, ``stats`` and drops (``Swarm.drop``)."""

    def __init__(self, swarm: Swarm, p2p: Any):
        self.swarm, self._p2p = swarm, p2p
        self._handlers: dict[str, tuple[Handler, int]] = {}
        self._tarpit: Counter[str] = Counter()  # blocked peer -> its streams held unanswered now
        self._refused_peers: set[str] = set()  # refused at least once (logged at INFO once)
        self._streams: Counter[str] = Counter()  # requests being served, by peer
        self._streams_total = 0
        self._live: set[_Live] = set()  # inbound sessions open
        self._tasks: set[asyncio.Task] = set()  # requests of sessions being answered (also of sessions closed)

    async def start(self) -> None:
        """Accept sessions (``sessions.RPC``) and answer their probes (``sessions.PING``)."""
        await self._p2p.add_binary_stream_handler(sessions.RPC, self._serve_session)
        await self.add_handler(sessions.PING, self._ping)

    async def rebind(self, p2p: Any) -> None:
        """Serve on ``p2p``, a daemon started again after the previous one died
        (``Swarm.restart``): sessions, and every handler added so far, with its limits."""
        self._p2p = p2p
        await p2p.add_binary_stream_handler(sessions.RPC, self._serve_session)
        for name, (handler, max_payload) in list(self._handlers.items()):
            await self.add_handler(name, handler, max_payload=max_payload)

    @staticmethod
    async def _ping(peer: str, header: Header, payload: bytes) -> tuple[Header, bytes]:
        return {}, b""

    def open_streams(self, peer: str | None = None) -> int:
        """Requests being served now (on streams of their own or in sessions): from ``peer``, or from everybody."""
        return self._streams.get(peer, 0) if peer is not None else self._streams_total

    def serving(self) -> int:
        """Peers' sessions open to us now."""
        return len(self._live)

    def _over_limit(self, remote: str) -> str | None:
        """Why a new request of ``remote`` cannot be served now: ``busy`` (its own requests fill
        its share: a drop), ``full`` (everybody's fill the total: not its fault, not charged), or None."""
        return "busy" if self._streams[remote] >= MAX_STREAMS_PER_PEER else (
            "full" if self._streams_total >= MAX_STREAMS else None)

    def _refused(self, remote: str, why: str) -> None:
        """Count a request (or session) refused for room: ``busy`` is a drop charged to ``remote``;
        another reason (the limit of all peers together) is counted, not charged to it."""
        if why == "busy":
            self.swarm.drop(remote, "busy")
        else:
            self.swarm.drop_reasons[why] += 1

    def _served(self, remote: str) -> None:
        self._streams_total -= 1
        self._streams[remote] -= 1
        if self._streams[remote] <= 0:
            del self._streams[remote]

    async def _accept(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      busy: Callable[[str], str | None], *, answer_busy: bool = True) -> str | None:
        """The caller's peer ID if its inbound stream is to be served; else None and the stream
        closed (a blocked peer's after the tarpit; over a limit: answered busy first)."""
        try:
            remote = info.peer_id.to_base58()
        except Exception:  # the daemon always sends one; never let a stream leak
            close_stream(writer)
            return None
        if self.swarm.drops.is_blocked(remote):
            self.swarm.drop_reasons["blocked"] += 1
            if self._tarpit[remote] < TARPIT_PER_PEER and sum(self._tarpit.values()) < TARPIT_MAX:
                self._tarpit[remote] += 1  # held unanswered: a caller that waits for answers slows down
                try:
                    await drain(reader, TARPIT_S)
                finally:
                    self._tarpit[remote] -= 1
                    if self._tarpit[remote] <= 0:
                        del self._tarpit[remote]
            close_stream(writer)
            return None
        if (why := busy(remote)) is not None:
            self._refused(remote, why)
            try:
                if answer_busy:
                    writer.write(_BUSY)  # a few bytes into an empty socket buffer: never blocks
            except Exception as e:  # the stream is already gone
                log.debug("busy answer to %s: %s", remote[-8:], e)
            close_stream(writer)
            return None
        return remote

    async def add_handler(self, name: str, handler: Handler, *, max_payload: int = 0) -> None:
        """Serve RPC ``name``: ``handler(peer_id, header, payload) -> (header, payload)``.

        Args:
            max_payload: largest request payload accepted (bytes); a request declaring more is
                refused before any of its payload is read.

        Per request (see the module docstring for the framing and deadlines): over
        ``MAX_STREAMS_PER_PEER`` / ``MAX_STREAMS`` open streams, answers ``{"error": "busy"}``
        unread; reads the header within ``HEADER_TIMEOUT`` s; refuses a non-member
        (``{"error", "denied"}``, counted in :attr:`refused`) and a payload over
        ``max_payload`` before reading the payload; reads the payload within
        :func:`payload_deadline`. A handler raising ProtocolError answers
        ``{"error": message}``; any other exception is logged and answered as an internal
        error. Nothing a peer sends raises out of the stream handler, and every stream is
        closed (its descriptor released) on every path. Drops are counted by ``Swarm.drop``.
        Requests for ``name`` in a session are served by the same rules, the session's reading
        standing in for the stream's (:meth:`_session_request`).

        Raises:
            ValueError: ``max_payload`` < 0.
        """
        if max_payload < 0:
            raise ValueError(f"max_payload must be >= 0, got {max_payload}")

        async def serve(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            remote = await self._accept(info, reader, writer, self._over_limit)
            if remote is None:
                return
            if remote in self.swarm.bans:  # served (handlers refuse it with the reason), but every request counts
                self.swarm.drop(remote, "banned")
            self._streams[remote] += 1
            self._streams_total += 1
            try:
                await self._serve(name, handler, max_payload, remote, reader, writer)
            except Exception:  # a bug here must not reach asyncio's connection callback
                log.exception("serving %s for %s failed", name, remote[-8:])
            finally:
                close_stream(writer)
                self._served(remote)

        self._handlers[name] = (handler, max_payload)
        await self._p2p.add_binary_stream_handler(name, serve)

    async def _serve(self, name: str, handler: Handler, max_payload: int, remote: str,
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            reply, body = await self._answer(name, handler, max_payload, remote, reader)
        except _Drop as d:
            self.swarm.drop(remote, d.reason)
            if not d.answer:
                return
            reply, body = {"error": str(d)}, b""
        try:
            async with asyncio.timeout(payload_deadline(len(body))):
                await write_message(writer, reply, body)
        except (TimeoutError, ConnectionError, OSError) as e:
            self.swarm.drop(remote, "reply_timeout" if isinstance(e, TimeoutError) else "reply_broken")
            return
        self.swarm.stats.add(remote, n_out=len(body))
        await drain(reader, LINGER_TIMEOUT, LINGER_DISCARD_BYTES)

    async def _answer(self, name: str, handler: Handler, max_payload: int, remote: str,
                      reader: asyncio.StreamReader) -> tuple[Header, bytes]:
        """Read and serve one request on a stream of its own: (reply header, reply payload).
        Raises _Drop for a request that is not served."""
        try:
            async with asyncio.timeout(HEADER_TIMEOUT):
                header, n = await read_header(reader)
        except TimeoutError:
            raise _Drop("header_timeout", f"no request header within {HEADER_TIMEOUT:g} s") from None
        except ProtocolError as e:
            raise _Drop("bad_header", str(e)) from None
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            raise _Drop("closed", "stream closed before the header", answer=False) from None
        request = await self._read_request(name, max_payload, remote, header, n, reader)
        if isinstance(request, dict):
            return request, b""
        return await self._run(name, handler, remote, header, request)

    async def _read_request(self, name: str, max_payload: int, remote: str, header: Header, n: int,
                            reader: asyncio.StreamReader) -> bytes | Header:
        """The payload of a request whose header was read (``_cert`` popped from ``header``),
        or the refusal to answer a non-member with (its payload unread). Raises _Drop."""
        cert = header.pop("_cert", None)
        if cert is not None and not isinstance(cert, bytes):
            raise _Drop("bad_cert", "_cert is not bytes")
        try:
            self.swarm.membership.check(remote, cert)
        except AccessDenied as e:
            self.swarm.refused[e.reason] += 1
            level = logging.DEBUG if remote in self._refused_peers else logging.INFO
            if len(self._refused_peers) < MAX_DROP_PEERS:
                self._refused_peers.add(remote)
            log.log(level, "refused %s from %s: %s", name, remote[-8:], e)
            return {"error": str(e), "denied": e.reason}
        if n > max_payload:
            raise _Drop("too_large", f"{name} payload of {n} bytes exceeds the limit of {max_payload}")
        try:
            async with asyncio.timeout(payload_deadline(n)):
                payload = await read_payload(reader, n)
        except TimeoutError:
            raise _Drop("payload_timeout", f"payload of {n} bytes not received within "
                                           f"{payload_deadline(n):.0f} s") from None
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            raise _Drop("truncated", "stream closed inside the payload", answer=False) from None
        self.swarm.stats.add(remote, n_in=n)  # not timed: any caller may send a slow payload
        return payload

    async def _run(self, name: str, handler: Handler, remote: str, header: Header, payload: bytes) -> tuple[Header, bytes]:
        """The handler's answer to a request read whole; its errors become error replies."""
        try:
            reply, body = await handler(remote, header, payload)
            if self.swarm.membership.private:
                reply = dict(reply, _cert=self.swarm.membership.own_certificate)
            frame(reply, len(body))  # fails here (answered as an error) rather than half-written
        except ProtocolError as e:
            log.debug("%s request from %s refused: %s", name, remote[-8:], e)
            return {"error": str(e)}, b""
        except Exception as e:  # a handler bug must not take the node down
            log.exception("handler %s failed for %s", name, remote[-8:])
            return {"error": f"internal error: {_short(e)}"}, b""
        return reply, body

    # ---- sessions (p2pdiloco.net.transport.sessions) ----------------------------------------------
    async def close(self) -> None:
        """Close every inbound session and cancel the requests of sessions being answered (shutdown)."""
        for live in list(self._live):
            close_stream(live.writer)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)

    def _no_room(self, remote: str) -> str | None:
        """Why a new session of ``remote`` must be refused (``busy``: its own fill its share, a drop;
        ``sessions_full``: everybody's fill the total, not charged), or None: at the limit per peer
        (or in all), the least recently active idle session of ``remote`` (of anyone) is closed
        to make room, one waiting for its next request with none being answered."""
        mine = [live for live in self._live if live.remote == remote]
        pool, why = (mine, "busy") if len(mine) >= sessions.MAX_SESSIONS_PER_PEER else (
            (list(self._live), "sessions_full") if len(self._live) >= sessions.MAX_SESSIONS else (None, None))
        if pool is None:
            return None
        idle = [live for live in pool if not live.tasks and not live.reading]
        if not idle:
            return why
        victim = min(idle, key=lambda live: live.active)
        self._live.discard(victim)
        close_stream(victim.writer)  # its loop, waiting for a length prefix, ends without a drop
        return None

    async def _serve_session(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one inbound session until it closes, idles, breaks the framing or its peer is blocked."""
        remote = await self._accept(info, reader, writer, self._no_room, answer_busy=False)
        if remote is None:
            return
        live = _Live(remote, writer)
        self._live.add(live)
        cancelled = False
        try:
            while not self.swarm.drops.is_blocked(remote) and await self._session_request(live, reader):
                live.active, live.reading = monotonic(), False
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception:  # a bug here must not reach asyncio's connection callback
            log.exception("serving a session of %s failed", remote[-8:])
        finally:
            close_stream(writer)
            self._live.discard(live)
            for task in live.tasks if cancelled else ():
                task.cancel()
            # requests being answered run to their own deadlines (a handler counts what it refuses), replies unsent
            await asyncio.gather(*live.tasks, return_exceptions=True)

    async def _session_request(self, live: _Live, reader: asyncio.StreamReader) -> bool:
        """Read one request of a session and start answering it; False: end the session."""
        remote = live.remote
        await asyncio.sleep(0)  # the answers started last run first: busy ones are written and gone
        first = asyncio.get_running_loop().time() + HEADER_TIMEOUT  # the first request, whole, by then
        length = await self._next_length(live, reader)
        if length is None:
            return False
        live.reading = True  # from its length prefix until it is being answered: not evicted
        try:
            async with asyncio.timeout_at(first) if not live.requests else asyncio.timeout(HEADER_TIMEOUT):
                header, n = await read_header(reader, length=length)
        except (TimeoutError, ProtocolError, asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            self.swarm.drop(remote, "header_timeout" if isinstance(e, TimeoutError) else
                            "bad_header" if isinstance(e, ProtocolError) else "truncated")
            return False
        live.requests += 1
        rid, name = header.pop("_id", None), header.pop("_rpc", None)
        if type(rid) is not int or not 0 <= rid < sessions.MAX_ID:
            self.swarm.drop(remote, "bad_header")
            return False
        if remote in self.swarm.bans:
            self.swarm.drop(remote, "banned")
        served = self._handlers.get(name) if type(name) is str else None
        try:
            if n > sessions.MAX_MESSAGE:  # a caller takes a stream of its own for it: cannot be skipped
                raise _Drop("too_large", f"payload of {n} bytes in a session (limit {sessions.MAX_MESSAGE})")
            if served is None:
                raise _Drop("bad_rpc", f"no handler {name!r:.60}")
            request = await self._read_request(name, served[1], remote, header, n, reader)
        except _Drop as d:
            self.swarm.drop(remote, d.reason)
            if n > sessions.MAX_MESSAGE or d.reason not in ("too_large", "bad_rpc") or not await self._skip(remote, reader, n):
                if d.answer:
                    await self._session_reply(live, rid, {"error": str(d)}, b"")
                return False
            return await self._session_reply(live, rid, {"error": str(d)}, b"")  # skipped: the session goes on
        if not isinstance(request, bytes):  # a non-member, its payload unread: answered, then closed
            await self._session_reply(live, rid, request, b"")
            return False
        if len(live.tasks) >= 2 * MAX_STREAMS_PER_PEER:  # answers not read either: a caller that does not read
            self.swarm.drop(remote, "busy")
            return False
        self._start_answer(live, rid, name, served[0], header, request)
        return True

    async def _next_length(self, live: _Live, reader: asyncio.StreamReader) -> bytes | None:
        """The next request's length prefix; None when the session ends: idle past
        ``sessions.SERVER_IDLE_S`` with nothing being answered, never used within
        ``HEADER_TIMEOUT``, or closed between requests (or evicted)."""
        while True:  # readexactly consumes nothing unless it returns: a timeout loses no byte
            try:
                async with asyncio.timeout(HEADER_TIMEOUT if not live.requests else sessions.SERVER_IDLE_S):
                    return await reader.readexactly(LENGTH_BYTES)
            except TimeoutError:
                if not live.requests or not live.tasks:
                    return None  # idle, or never used (a caller that gave up while it opened): closed
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                return None  # closed between requests (or evicted)

    def _start_answer(self, live: _Live, rid: int, name: str, handler: Handler, header: Header,
                      request: bytes) -> None:
        """Answer a session's request in a task of its own, or busy when the peer or the
        server is at its limit (``MAX_STREAMS_PER_PEER``, ``MAX_STREAMS``)."""
        remote = live.remote
        if (why := self._over_limit(remote)) is not None:
            self._refused(remote, why)
            task = asyncio.create_task(self._session_reply(live, rid, {"error": why}, b""))
        else:
            self._streams[remote] += 1
            self._streams_total += 1
            task = asyncio.create_task(self._session_answer(live, name, handler, rid, header, request))
            task.add_done_callback(lambda _: self._served(remote))  # also if cancelled before it started
        live.tasks.add(task)
        task.add_done_callback(live.tasks.discard)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _session_answer(self, live: _Live, name: str, handler: Handler, rid: int, header: Header,
                              payload: bytes) -> None:
        reply, body = await self._run(name, handler, live.remote, header, payload)
        if len(body) > sessions.MAX_MESSAGE:  # the caller's limit is lower: its fault would be ours
            reply, body = {"error": f"reply of {len(body)} bytes over the session limit of {sessions.MAX_MESSAGE}"}, b""
        await self._session_reply(live, rid, reply, body)

    async def _session_reply(self, live: _Live, rid: int, reply: Header, body: bytes) -> bool:
        """Write one reply of a session; False if it could not be (the session is then closed)."""
        try:
            if not await sessions.write_reply(live.writer, live.write, rid, reply, body):
                return False  # the session ended while the handler ran: nobody to answer, no fault of the caller
        except ProtocolError as e:  # the reply's header, with its _id, over the limit
            return await self._session_reply(live, rid, {"error": f"internal error: {_short(e)}"}, b"")
        except (TimeoutError, ConnectionError, OSError) as e:
            self.swarm.drop(live.remote, "reply_timeout" if isinstance(e, TimeoutError) else "reply_broken")
            close_stream(live.writer)  # the session's reading ends with it
            return False
        self.swarm.stats.add(live.remote, n_out=len(body))
        return True

    async def _skip(self, remote: str, reader: asyncio.StreamReader, n: int) -> bool:
        """Read and throw away a refused payload of ``n`` <= ``sessions.MAX_MESSAGE`` bytes
        within its deadline, so that the session keeps its place; False: it did not come."""
        try:
            async with asyncio.timeout(payload_deadline(n)):
                await read_payload(reader, n)
            return True
        except TimeoutError:
            self.swarm.drop(remote, "payload_timeout")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            self.swarm.drop(remote, "truncated")
        return False
