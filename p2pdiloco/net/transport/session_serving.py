"""The server half of sessions (:mod:`p2pdiloco.net.transport.sessions`): a peer's long-lived
stream to us carries its small requests, each framed with its ``_id`` and ``_rpc``, and our
replies, in any order. :class:`SessionServing`, a base of
:class:`~p2pdiloco.net.transport.serving.Server`, serves each inbound session by the rules of a
stream of its own (the session's reading stands in for the stream's: ``serving``'s module
docstring), at most ``sessions.MAX_SESSIONS_PER_PEER`` sessions per peer and
``sessions.MAX_SESSIONS`` in all (the least recently active idle one makes room), closed when
idle past ``sessions.SERVER_IDLE_S``, never used within ``HEADER_TIMEOUT``, when the framing
breaks or its peer is blocked.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.transport import sessions
from p2pdiloco.net.transport.clock import monotonic
from p2pdiloco.net.transport.framing import LENGTH_BYTES, Header, close_stream, payload_deadline, read_header, read_payload
from p2pdiloco.net.transport.framing import short_error as _short
from p2pdiloco.net.transport.limits import HEADER_TIMEOUT, MAX_STREAMS_PER_PEER, _Drop

if TYPE_CHECKING:
    from p2pdiloco.net.transport.serving import Handler
    from p2pdiloco.net.transport.swarm import Swarm

log = logging.getLogger(__name__)


class _Live:
    """One inbound session: its peer, stream, write lock, last activity (``clock.monotonic``),
    requests read and requests being answered (their tasks)."""

    def __init__(self, remote: str, writer: asyncio.StreamWriter):
        self.remote, self.writer, self.write = remote, writer, asyncio.Lock()
        self.active, self.requests, self.tasks = monotonic(), 0, set[asyncio.Task]()
        self.reading = False  # a request is being read (or refused) now


class SessionServing:
    """The session side of :class:`~p2pdiloco.net.transport.serving.Server` (which holds the
    handlers and the counts of what is being served, and accepts, reads, limits and answers
    each request as on a stream of its own)."""

    swarm: Swarm
    _handlers: dict[str, tuple[Handler, int]]
    _streams: Counter[str]
    _streams_total: int
    _live: set[_Live]
    _tasks: set[asyncio.Task]

    def serving(self) -> int:
        """Peers' sessions open to us now."""
        return len(self._live)

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
