"""Sessions (``p2pdiloco.net.transport.sessions``): small calls to a peer share one long-lived stream.

Over real sockets (in-process swarms, one p2pd each, on 127.0.0.1): calls reuse one session and
their replies come in any order; a hostile caller speaking the session's framing wrongly is
dropped and counted, a refused payload is skipped and the session goes on; an idle session is
closed by the server and the caller opens a new one. On the in-memory transport (protocol
tests beside them): a hostile server's replies to calls never made, or over ``max_reply``,
close the session; a session across a partition that swallowed the request is closed when the
call gives up, and the next call, after the heal, opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from conftest import swarms, until
from hivemind.p2p import PeerID

from p2pdiloco.errors import PeerTimeout, PeerUnreachable, ProtocolError, ReplyTooLarge
from p2pdiloco.net.transport import limits, session_serving, sessions
from p2pdiloco.net.transport.framing import frame, read_header, read_payload
from p2pdiloco.net.transport.memory import Link, MemoryNet
from p2pdiloco.net.transport.swarm import Header, Swarm

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_daemon_left")]


async def echo(peer: str, header: Header, payload: bytes) -> tuple[Header, bytes]:
    await asyncio.sleep(float(header.get("wait", 0.0)))
    return {"n": len(payload)}, payload


async def echo_and_held(a: Swarm) -> asyncio.Event:
    """Serve ``t.echo`` (payloads up to 100 bytes) and ``t.held`` (answered once the event returned is set)."""
    gate = asyncio.Event()

    async def held(peer: str, header: Header, payload: bytes) -> tuple[Header, bytes]:
        await gate.wait()
        return {}, b""
    await a.add_handler("t.echo", echo, max_payload=100)
    await a.add_handler("t.held", held)
    return gate


@contextlib.asynccontextmanager
async def raw_session(src: Swarm, dst: Swarm) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw session stream from ``src`` to ``dst`` (the caller speaks the framing itself)."""
    _, reader, writer = await src._p2p.call_binary_stream_handler(PeerID.from_base58(dst.peer_id), sessions.RPC)
    try:
        yield reader, writer
    finally:
        writer.transport.abort()


async def reply(reader: asyncio.StreamReader) -> tuple[Header, bytes]:
    async with asyncio.timeout(10):
        header, n = await read_header(reader)
        return header, await read_payload(reader, n)


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the other end closed the stream (EOF or reset) within 10 s, reading nothing else."""
    try:
        async with asyncio.timeout(10):
            return await reader.read(1) == b""
    except (ConnectionError, OSError):
        return True


@pytest.mark.asyncio
async def test_calls_share_one_session_and_replies_come_in_any_order():
    """40 calls from b to a: one session opened; a call held 1.5 s by its handler does not hold up
    10 calls made after it, which all return first; a 2 MiB call takes a stream of its own."""
    async with swarms(2) as (a, b):
        await a.add_handler("t.echo", echo, max_payload=4 << 20)
        for i in range(19):
            assert await b.call(a.peer_id, "t.echo", {}, bytes([i]) * i, timeout=10) == ({"n": i}, bytes([i]) * i)
        assert b.stats.sessions == 1 and b.sessions() == [a.peer_id]
        done: list[str] = []

        async def call(tag: str, wait: float) -> None:
            await b.call(a.peer_id, "t.echo", {"wait": wait}, tag.encode(), timeout=10)
            done.append(tag)
        slow = asyncio.create_task(call("slow", 1.5))
        await until(lambda: a.open_streams(b.peer_id) == 1, 5, "the slow call at a")
        await asyncio.gather(*(call(f"fast{i}", 0.0) for i in range(10)))
        assert len(done) == 10 and "slow" not in done
        await slow
        assert done[-1] == "slow"
        big = bytes(range(256)) * (8 << 10)  # 2 MiB: over sessions.MAX_MESSAGE
        assert await b.call(a.peer_id, "t.echo", {}, big, timeout=30, max_reply=4 << 20) == ({"n": len(big)}, big)
        assert b.stats.sessions == 1 and b.stats.calls_out == 31 and b.stats.calls_failed == 0
        assert a.dropped == {} and b.dropped == {}


@pytest.mark.asyncio
async def test_a_hostile_caller_is_dropped_per_message_and_a_refused_payload_is_skipped():
    """On a raw session: a payload over the handler's ``max_payload`` (within MAX_MESSAGE), or for
    an unknown ``_rpc``, is read, thrown away and refused, and the next request on the same
    session is answered; a busy answer comes once the peer has MAX_STREAMS_PER_PEER requests in
    flight; an ``_id`` that is not an int is a ``bad_header`` drop and ends the session; so does a
    declared payload over MAX_MESSAGE, after its refusal."""
    async with swarms(2) as (a, b):
        gate = await echo_and_held(a)
        async with raw_session(b, a) as (reader, writer):
            writer.write(frame({"_id": 0, "_rpc": "t.echo"}, 1000) + bytes(1000))
            writer.write(frame({"_id": 1, "_rpc": "t.echo"}, 3) + b"abc")
            head, _ = await reply(reader)
            assert head["_id"] == 0 and "exceeds the limit" in head["error"]
            assert await reply(reader) == ({"_id": 1, "n": 3}, b"abc")
            assert a.drop_reasons["too_large"] == 1

            for i in range(limits.MAX_STREAMS_PER_PEER + 1):
                writer.write(frame({"_id": 10 + i, "_rpc": "t.held"}, 0))
            head, _ = await reply(reader)  # the 17th, answered at once
            assert head == {"_id": 10 + limits.MAX_STREAMS_PER_PEER, "error": "busy"}
            assert a.open_streams(b.peer_id) == limits.MAX_STREAMS_PER_PEER
            gate.set()
            ids = {(await reply(reader))[0]["_id"] for _ in range(limits.MAX_STREAMS_PER_PEER)}
            assert ids == set(range(10, 10 + limits.MAX_STREAMS_PER_PEER))
            await until(lambda: a.open_streams() == 0, 5, "the held requests to end")

            writer.write(frame({"_id": 3, "_rpc": "no.such"}, 5) + b"12345")
            writer.write(frame({"_id": 4, "_rpc": "t.echo"}, 2) + b"ok")
            head, _ = await reply(reader)
            assert head["_id"] == 3 and "no handler" in head["error"]
            assert await reply(reader) == ({"_id": 4, "n": 2}, b"ok")

            writer.write(frame({"_id": "2", "_rpc": "t.echo"}, 0))
            assert await closed(reader)
        async with raw_session(b, a) as (reader, writer):
            writer.write(frame({"_id": 5, "_rpc": "t.echo"}, 4 << 20))
            head, _ = await reply(reader)
            assert head["_id"] == 5 and "in a session" in head["error"]
            assert await closed(reader)
        assert a.drop_reasons["bad_header"] == 1 and a.drop_reasons["too_large"] == 2
        assert a.drop_reasons["busy"] == 1 and a.drop_reasons["bad_rpc"] == 1
        assert (await b.call(a.peer_id, "t.echo", {}, b"ok", timeout=10))[1] == b"ok"  # still served


@pytest.mark.asyncio
async def test_an_idle_session_is_closed_by_the_server_and_the_caller_opens_a_new_one(monkeypatch):
    monkeypatch.setattr(sessions, "SERVER_IDLE_S", 1.0)
    async with swarms(2) as (a, b):
        await a.add_handler("t.echo", echo, max_payload=100)
        assert (await b.call(a.peer_id, "t.echo", {}, b"1", timeout=10))[1] == b"1"
        assert b.sessions() == [a.peer_id]
        await until(lambda: b.sessions() == [], 10, "a to close the idle session")
        assert (await b.call(a.peer_id, "t.echo", {}, b"2", timeout=10))[1] == b"2"
        assert b.stats.sessions == 2 and b.stats.calls_failed == 0 and a.dropped == {} and b.dropped == {}


async def _hostile_server(net: MemoryNet, answer) -> tuple[Swarm, Swarm]:
    """Two memory peers; the first serves sessions with ``answer(header, writer)`` per request."""
    a, b = await net.swarm(), await net.swarm()

    async def serve(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                header, n = await read_header(reader)
                await read_payload(reader, n)
                answer(header, writer)
    await a._p2p.add_binary_stream_handler(sessions.RPC, serve)
    return a, b


@pytest.mark.asyncio
@pytest.mark.parametrize("lie", ["unknown_id", "id_not_int", "over_max_reply"])
async def test_a_hostile_servers_reply_closes_the_session(lie):
    net = MemoryNet()
    try:
        def answer(header: Header, writer: asyncio.StreamWriter) -> None:
            rid = header["_id"]
            if lie == "unknown_id":
                writer.write(frame({"_id": rid + 7}, 0))
            elif lie == "id_not_int":
                writer.write(frame({"_id": [rid]}, 0))
            else:
                writer.write(frame({"_id": rid}, 200) + bytes(200))
        a, b = await _hostile_server(net, answer)
        error = ReplyTooLarge if lie == "over_max_reply" else PeerUnreachable
        with pytest.raises(error):
            await b.call(a.peer_id, "t.any", {}, b"", timeout=5, max_reply=100)
        assert b.sessions() == [] and b.stats.calls_failed == 1
        assert b.drop_reasons == {"reply_too_large" if lie == "over_max_reply" else "bad_reply": 1}
    finally:
        await net.close()


@pytest.mark.asyncio
async def test_a_late_reply_is_thrown_away_and_a_silent_session_is_closed_when_its_call_gives_up():
    """A call that gives up while replies still come (a slow handler) leaves the session open and
    its late reply is read and thrown away, no drop; a call across a partition that swallowed its
    request, with nothing heard since, has the session probed, and the probe unanswered within
    PROBE_S closes it; after the heal the next call opens a new one."""
    net = MemoryNet(default=Link(latency=0.01))
    try:
        a, b = await net.swarm(), await net.swarm()
        await a.add_handler("t.echo", echo, max_payload=100)
        late = asyncio.create_task(b.call(a.peer_id, "t.echo", {"wait": 1.0}, b"late", timeout=0.5))
        await until(lambda: a.open_streams() == 1, 5, "the late call at a", every=0.005)
        for _ in range(3):
            assert (await b.call(a.peer_id, "t.echo", {}, b"x", timeout=5))[1] == b"x"
        with pytest.raises(PeerTimeout):
            await late
        await until(lambda: a.open_streams() == 0, 5, "the slow handler to answer")
        assert (await b.call(a.peer_id, "t.echo", {}, b"y", timeout=5))[1] == b"y"
        assert b.stats.sessions == 1 and b.dropped == {} and a.dropped == {}

        net.partition([[a.peer_id]])
        with pytest.raises(PeerTimeout):
            await b.call(a.peer_id, "t.echo", {}, b"lost", timeout=0.5)
        assert b.sessions() == [a.peer_id]  # probed first (PING): a slow peer is not cut off
        await until(lambda: b.sessions() == [], sessions.PROBE_S + 5, "the unanswered probe to close the session")
        net.heal()
        assert (await b.call(a.peer_id, "t.echo", {}, b"back", timeout=5))[1] == b"back"
        assert b.stats.sessions == 2 and b.stats.probes == 1
    finally:
        await net.close()


@pytest.mark.asyncio
async def test_a_silent_session_is_closed_and_idle_ones_make_room_for_new_ones(monkeypatch):
    """A session without a first request within HEADER_TIMEOUT is closed (no drop: a caller that
    gave up while it opened leaves one so); at MAX_SESSIONS_PER_PEER, a new session closes the
    least recently active idle one; one whose request is being answered is never closed for room
    (the new one is refused, a ``busy`` drop)."""
    monkeypatch.setattr(session_serving, "HEADER_TIMEOUT", 1.0)
    monkeypatch.setattr(sessions, "MAX_SESSIONS_PER_PEER", 2)
    async with swarms(2) as (a, b):
        gate = await echo_and_held(a)
        async with raw_session(b, a) as (reader, _):
            assert await closed(reader)
        assert a.dropped == {}
        async with contextlib.AsyncExitStack() as stack:
            first, second = [await stack.enter_async_context(raw_session(b, a)) for _ in range(2)]
            for i, (reader, writer) in enumerate((first, second)):
                writer.write(frame({"_id": i, "_rpc": "t.echo"}, 1) + b"x")
                assert (await reply(reader))[0] == {"_id": i, "n": 1}
            second[1].write(frame({"_id": 9, "_rpc": "t.held"}, 0))
            await until(lambda: a.open_streams(b.peer_id) == 1, 5, "the held request")
            third = await stack.enter_async_context(raw_session(b, a))
            assert await closed(first[0])  # the idle one made room
            third[1].write(frame({"_id": 0, "_rpc": "t.echo"}, 1) + b"y")
            assert (await reply(third[0]))[0] == {"_id": 0, "n": 1}
            third[1].write(frame({"_id": 1, "_rpc": "t.held"}, 0))
            await until(lambda: a.open_streams(b.peer_id) == 2, 5, "both held requests")
            fourth = await stack.enter_async_context(raw_session(b, a))
            assert await closed(fourth[0])  # no idle one left: refused
            gate.set()
            assert (await reply(second[0]))[0] == {"_id": 9}
        assert a.drop_reasons["busy"] == 1


@pytest.mark.asyncio
async def test_a_call_giving_up_beside_a_call_in_flight_leaves_the_session_open():
    """A call that gives up with nothing heard since its request, while another call still waits
    on a reply that is coming, keeps the session (its probe is answered): the other call's reply
    arrives."""
    net = MemoryNet(default=Link(latency=0.01))
    try:
        a, b = await net.swarm(), await net.swarm()
        await a.add_handler("t.echo", echo, max_payload=100)
        slow = asyncio.create_task(b.call(a.peer_id, "t.echo", {"wait": 1.5}, b"slow", timeout=10))
        await until(lambda: a.open_streams() == 1, 5, "the slow call at a")
        with pytest.raises(PeerTimeout):
            await b.call(a.peer_id, "t.echo", {"wait": 1.0}, b"quick", timeout=0.3)
        assert (await slow)[1] == b"slow"  # 1.2 s later: the probe was answered within milliseconds
        assert b.sessions() == [a.peer_id] and b.stats.probes == 1 and b.stats.calls_failed == 1
        assert b.stats.sessions == 1 and b.dropped == {} and a.dropped == {}
    finally:
        await net.close()


@pytest.mark.asyncio
async def test_a_reply_repeated_for_an_answered_call_closes_the_session():
    """A hostile server answering each request twice in one write: the call gets the first
    answer, the second is a reply to no call (``bad_reply``) and closes the session."""
    net = MemoryNet()
    try:
        a, b = await _hostile_server(net, lambda header, writer: writer.write(
            frame({"_id": header["_id"], "v": 1}, 0) + frame({"_id": header["_id"], "v": 2}, 0)))
        assert await b.call(a.peer_id, "t.any", {}, b"", timeout=5) == ({"v": 1}, b"")
        await until(lambda: b.sessions() == [], 5, "the repeated reply to close the session")
        assert b.drop_reasons == {"bad_reply": 1}
    finally:
        await net.close()


@pytest.mark.asyncio
async def test_a_burst_over_the_peers_share_is_answered_busy_and_the_session_carries_on():
    """40 calls at once to a handler that takes 0.5 s, in one session: MAX_STREAMS_PER_PEER are
    served, the others answered busy at once (a drop each, as on streams of their own), and the
    session, with the calls being served, stays open."""
    net = MemoryNet(default=Link(latency=0.005))
    try:
        a, b = await net.swarm(), await net.swarm()
        await a.add_handler("t.echo", echo, max_payload=100)
        results = await asyncio.gather(*(b.call(a.peer_id, "t.echo", {"wait": 0.5}, b"", timeout=5)
                                         for _ in range(40)), return_exceptions=True)
        served = [r for r in results if not isinstance(r, BaseException)]
        busy = [r for r in results if isinstance(r, ProtocolError) and "busy" in str(r)]
        assert len(served) == limits.MAX_STREAMS_PER_PEER and len(busy) == 40 - len(served), results
        assert b.stats.sessions == 1 and b.sessions() == [a.peer_id]
        assert a.drop_reasons == {"busy": 40 - limits.MAX_STREAMS_PER_PEER}
    finally:
        await net.close()
