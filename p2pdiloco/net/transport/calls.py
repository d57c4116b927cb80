"""Our calls to peers, the caller's half of the RPC layer (:meth:`Calls.call`; the server's
half: :mod:`p2pdiloco.net.transport.serving`): a call whose request and reply both fit
``sessions.MAX_MESSAGE`` takes our session to the peer (:mod:`p2pdiloco.net.transport.sessions`,
one long-lived stream, opened once for concurrent callers), any other a stream of its own. A
caller reads the reply while it still writes (a refusal arrives before the request is fully
sent) and checks the reply's ``_n`` against its ``max_reply``. Every call has a deadline.
:class:`Calls` is a base of :class:`~p2pdiloco.net.transport.swarm.Swarm`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING

from hivemind.p2p import P2P, PeerID

from p2pdiloco.errors import PeerSilent, PeerTimeout, PeerUnreachable, ProtocolError, ReplyTooLarge
from p2pdiloco.net.transport import admission
from p2pdiloco.net.transport import sessions
from p2pdiloco.net.transport.drops import TrafficStats
from p2pdiloco.net.transport.framing import (
    Header,
    close_stream,
    frame,
    read_header,
    read_payload,
    stretched_deadline,
    write_message,
)
from p2pdiloco.net.transport.framing import short_error as _short

if TYPE_CHECKING:
    from p2pdiloco.trust.certificates import Membership

DEFAULT_MAX_REPLY = sessions.MAX_MESSAGE  # bytes: reply payload a call accepts unless told otherwise (64 KiB: in a session)


class Calls:
    """The calling side of :class:`~p2pdiloco.net.transport.swarm.Swarm` (which holds the state
    these methods read: the daemon, our sessions and their openings, membership, traffic
    counters; and counts drops)."""

    _p2p: P2P
    membership: Membership
    stats: TrafficStats
    _sessions: dict[str, sessions.Session]
    _opening: dict[str, asyncio.Task]
    _waiting: Counter[str]
    _closing: bool

    def sessions(self) -> list[str]:
        """Peers we hold an open session to (:mod:`p2pdiloco.net.transport.sessions`)."""
        return [peer for peer, session in self._sessions.items() if not session.closed]

    async def _session(self, peer: str) -> sessions.Session | None:
        """Our session to ``peer``: the open one, or a new one (concurrent callers share its
        opening); None while ``sessions.MAX_SESSIONS`` of ours are open (a stream of its own)."""
        session = self._sessions.get(peer)
        if session is not None and not session.stale():
            return session
        opening = self._opening.get(peer)
        if opening is None:
            if self._closing:
                raise PeerUnreachable("the transport is shutting down")
            if session is not None:
                session.close()  # unused for IDLE_S: the server may be closing it
            if len(self._sessions) >= sessions.MAX_SESSIONS:
                return None
            opening = self._opening[peer] = asyncio.create_task(self._open_session(peer))
            opening.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved
        self._waiting[peer] += 1
        try:
            return await asyncio.shield(opening)  # one caller giving up does not cancel the others' opening
        except asyncio.CancelledError:
            if opening.cancelled() and not asyncio.current_task().cancelling():  # shutdown, not us
                raise PeerUnreachable(f"session to {peer[-8:]} not opened: shutting down") from None
            raise
        finally:
            self._waiting[peer] -= 1
            if self._waiting[peer] <= 0:  # nobody waits for it any more (a dial into a black hole)
                del self._waiting[peer]
                if not opening.done():
                    opening.cancel()
                    if self._opening.get(peer) is opening:
                        del self._opening[peer]

    async def _open_session(self, peer: str) -> sessions.Session:
        try:
            async with asyncio.timeout(sessions.OPEN_TIMEOUT_S):
                _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), sessions.RPC)
        except Exception as e:
            raise PeerUnreachable(f"session to {peer[-8:]} not opened: {_short(e)}") from None
        finally:
            if self._opening.get(peer) is asyncio.current_task():
                del self._opening[peer]
        if self._closing:
            close_stream(writer)
            raise PeerUnreachable("the transport is shutting down")
        self.stats.sessions += 1
        session = self._sessions[peer] = sessions.Session(peer, reader, writer, self.drop, self._session_closed,
                                                          self.stats)
        return session

    def _session_closed(self, session: sessions.Session) -> None:
        if self._sessions.get(session.peer) is session:
            del self._sessions[session.peer]

    async def call(
        self, peer_id: str, name: str, header: Header, payload: bytes = b"", *, timeout: float,
        max_reply: int = DEFAULT_MAX_REPLY, first_reply: float | None = None, min_rate: float | None = None,
    ) -> tuple[Header, bytes]:
        """Call RPC ``name`` on ``peer_id`` and return its (header, payload).

        A call whose ``payload`` and ``max_reply`` are both at most ``sessions.MAX_MESSAGE``
        bytes takes our session to the peer (:mod:`p2pdiloco.net.transport.sessions`); any other a stream
        of its own, on which the request is written while the reply is awaited (a refusal
        arrives before a large request is fully sent), closed in every case.

        Args:
            timeout: seconds for the whole call (connect, request, reply).
            max_reply: largest reply payload accepted (bytes); a reply declaring more is
                refused before its payload is read (counted by :meth:`drop`).
            first_reply: seconds (within ``timeout``) from the stream's opening (dialing and
                protocol negotiation count against ``timeout`` only), or from the request's
                writing on a session, to the reply's header; None: no separate limit. A handler
                that answers from memory answers its header about one round trip after the
                request, so a staller is caught well before a large payload's deadline.
            min_rate: bytes/s; when given, a reply payload that arrives (on a stream of its
                own) at least this fast, measured over the bytes received so far, gets the time
                its rate needs (``stretched_deadline``): a slow peer is slow, not a failure.

        Raises:
            PeerSilent: no reply header within ``first_reply`` seconds (a PeerTimeout).
            PeerTimeout: no full answer within ``timeout`` seconds, stretched by ``min_rate``
                (a PeerUnreachable).
            PeerUnreachable: the stream could not be opened or broke.
            AccessDenied: the peer refused us (not a member of its private swarm), or its
                answer is dropped (it is not a member of ours).
            ProtocolError: the peer answered with an error (``busy``, too large...), or a
                malformed reply, or one over ``max_reply``.
        """
        header = self._request_header(name, header, payload)
        try:
            async with asyncio.timeout(timeout) as deadline:
                small = len(payload) <= sessions.MAX_MESSAGE and max_reply <= sessions.MAX_MESSAGE
                if small and (session := await self._session(peer_id)) is not None:
                    reply, body, received = await session.call(name, header, payload, max_reply=max_reply,
                                                               first_reply=first_reply)
                else:
                    reply, body, received = await self._stream_call(peer_id, name, header, payload, max_reply,
                                                                    first_reply, None if min_rate is None else
                                                                    (deadline, min_rate))
        except (ProtocolError, PeerUnreachable):
            self.stats.calls_failed += 1
            raise
        except TimeoutError:
            self.stats.calls_failed += 1
            raise PeerTimeout(f"{name} to {peer_id[-8:]} failed: timeout after {timeout:g} s") from None
        except Exception as e:
            self.stats.calls_failed += 1
            raise PeerUnreachable(f"{name} to {peer_id[-8:]} failed: {_short(e)}") from None
        n = len(body)
        self.stats.add(peer_id, n_in=n, seconds=received)
        self.stats.header_bytes[name] += len(frame(reply, n))  # as received (re-encoded: same size)
        admission.check_answer(self, peer_id, name, reply)
        return reply, body

    def _request_header(self, name: str, header: Header, payload: bytes) -> Header:
        """A call's ``header`` as sent: with our certificate in a private swarm; the call and its
        header's bytes counted (``stats``). Raises ProtocolError: it cannot be framed."""
        self.stats.calls_out += 1
        self.stats.calls_by[name] += 1
        if self.membership.private:
            header = dict(header, _cert=self.membership.own_certificate)
        try:
            self.stats.header_bytes[name] += len(frame(header, len(payload)))
        except (ProtocolError, TypeError, ValueError) as e:
            self.stats.calls_failed += 1
            raise ProtocolError(f"{name} request not sent: {_short(e)}") from None
        return header

    async def _stream_call(self, peer_id: str, name: str, header: Header, payload: bytes, max_reply: int,
                           first_reply: float | None, stretch: tuple[asyncio.Timeout, float] | None = None
                           ) -> tuple[Header, bytes, float]:
        """A call on a stream of its own: (reply header, reply payload, seconds the payload took).
        ``stretch``: the call's deadline, moved later while the payload arrives at least at the
        rate given (bytes/s; ``stretched_deadline``)."""
        writer: asyncio.StreamWriter | None = None
        sending: asyncio.Task | None = None
        try:
            _, reader, writer = await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
            sending = asyncio.create_task(write_message(writer, header, payload))
            try:
                async with asyncio.timeout(first_reply):
                    reply, n = await read_header(reader)
            except TimeoutError:
                raise PeerSilent(f"{name} to {peer_id[-8:]} failed: no answer within {first_reply:.3g} s") from None
            except ProtocolError as e:
                self.drop(peer_id, "bad_reply")
                raise ProtocolError(f"{peer_id[-8:]} answered {name} with a malformed reply: {e}") from None
            if n > max_reply:
                self.drop(peer_id, "reply_too_large")
                raise ReplyTooLarge(f"{peer_id[-8:]} answered {name} with {n} bytes, over the limit of {max_reply}")
            # a short duration, not a deadline: perf_counter (the loop's clock has 1 ms steps on uvloop)
            t0, loop = time.perf_counter(), asyncio.get_running_loop()

            def progress(got: int, total: int) -> None:
                if stretch is not None and (when := stretch[0].when()) is not None:
                    later = stretched_deadline(got, total, time.perf_counter() - t0, stretch[1])
                    if later is not None and loop.time() + later > when:
                        stretch[0].reschedule(loop.time() + later)

            body = await read_payload(reader, n, progress if stretch is not None else None)
            return reply, body, time.perf_counter() - t0
        finally:
            if sending is not None:
                sending.cancel()  # done: no-op; still writing: the reply came first (a refusal)
                sent = await asyncio.gather(sending, return_exceptions=True)
                if sent[0] is None:
                    self.stats.add(peer_id, n_out=len(payload))
            if writer is not None:
                close_stream(writer)
