"""The server half of the RPC layer: every inbound request, on a stream of its own or in a
session (:mod:`p2pdiloco.net.transport.sessions`; served by :class:`Server`'s base
:class:`~p2pdiloco.net.transport.session_serving.SessionServing`), is read, checked and answered
here (every input from a peer is hostile until parsed: docs/trust.md). Messages are framed as
:mod:`p2pdiloco.net.transport.framing` says; the caller's half is
:meth:`p2pdiloco.net.transport.calls.Calls.call`; the numbers below are
:mod:`p2pdiloco.net.transport.limits`'.

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
from p2pdiloco.net.transport.drops import MAX_DROP_PEERS
from p2pdiloco.net.transport.framing import (
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
from p2pdiloco.net.transport.limits import (
    HEADER_TIMEOUT,
    LINGER_DISCARD_BYTES,
    LINGER_TIMEOUT,
    MAX_STREAMS,
    MAX_STREAMS_PER_PEER,
    TARPIT_MAX,
    TARPIT_PER_PEER,
    TARPIT_S,
    _Drop,
)
from p2pdiloco.net.transport.session_serving import SessionServing, _Live
from p2pdiloco.trust.errors import AccessDenied

if TYPE_CHECKING:
    from p2pdiloco.net.transport.swarm import Swarm

log = logging.getLogger(__name__)

Handler = Callable[[str, Header, bytes], Awaitable[tuple[Header, bytes]]]
_BUSY = frame({"error": "busy"}, 0)


class Server(SessionServing):
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
