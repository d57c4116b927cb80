"""The swarm transport: one libp2p daemon (p2pd) and one in-process DHT node per peer.

This package (``p2pdiloco.net``) is the only place that imports hivemind. Everything here
wraps hivemind's public API (``hivemind.p2p.P2P``, ``hivemind.dht.DHTNode``) and translates
its errors into :mod:`p2pdiloco.errors`.

Lifecycle (brief section 5): hivemind's ``DHT`` class runs its node in a child process that
keeps the daemon alive after its parent is SIGKILLed. We run ``DHTNode`` inside the caller's
event loop instead, so the only child is p2pd, which exits as soon as its owner's control
connection closes, including on SIGKILL.

RPCs are framed as a stream of ``BytesValue`` chunks: one msgpack header, then the payload
in chunks of at most ``CHUNK_BYTES``; the reply is framed the same way. Every call has a
deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import psutil
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.dht import DHTNode
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils import get_dht_time

from p2pdiloco.errors import NetworkError, PeerUnreachable, ProtocolError

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # 1 MiB per stream message, well under p2pd's 4 MiB limit
MAX_HEADER_BYTES = 1 << 20

Header = dict[str, Any]
Handler = Callable[[str, Header, bytes], Awaitable[tuple[Header, bytes]]]


@dataclass
class TrafficStats:
    """Bytes of RPC payload and headers that this peer sent and received (bytes)."""

    bytes_out: int = 0
    bytes_in: int = 0
    calls_out: int = 0
    calls_failed: int = 0


def pack(header: Header) -> bytes:
    """Encode a header dict with msgpack (bytes)."""
    return msgpack.packb(header, use_bin_type=True)


def unpack(data: bytes) -> Header:
    """Decode a msgpack header; raises ProtocolError on anything that is not a dict."""
    try:
        header = msgpack.unpackb(data, raw=False, max_bin_len=MAX_HEADER_BYTES)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable header: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    return header


def _frames(header: Header, payload: bytes) -> list[BytesValue]:
    head = dict(header, _n=len(payload))
    frames = [BytesValue(value=pack(head))]
    view = memoryview(payload)
    for i in range(0, len(payload), CHUNK_BYTES):
        frames.append(BytesValue(value=bytes(view[i : i + CHUNK_BYTES])))
    return frames


async def _read_frames(stream: AsyncIterator[BytesValue]) -> tuple[Header, bytes]:
    first = await anext(stream, None)
    if first is None:
        raise ProtocolError("empty message")
    header = unpack(first.value)
    size = header.pop("_n", 0)
    if not isinstance(size, int) or size < 0:
        raise ProtocolError("bad payload length")
    parts, got = [], 0
    while got < size:
        frame = await anext(stream, None)
        if frame is None:
            raise ProtocolError(f"payload truncated at {got} of {size} bytes")
        parts.append(frame.value)
        got += len(frame.value)
    if got != size:
        raise ProtocolError(f"payload has {got} bytes, header said {size}")
    return header, b"".join(parts)


class Swarm:
    """A peer's transport: daemon, DHT and framed RPCs. Create with :meth:`start`.

    Attributes:
        peer_id: this peer's libp2p peer ID (base58 string).
        stats: traffic counters (bytes of RPC frames, both directions).
    """

    def __init__(self, p2p: P2P, dht: DHTNode, daemon_pid: int | None):
        self._p2p, self._dht = p2p, dht
        self.peer_id: str = p2p.peer_id.to_base58()
        self.daemon_pid = daemon_pid
        self.stats = TrafficStats()
        self.started_at = time.time()

    @classmethod
    async def start(
        cls,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: str | None = None,
        bootstrap_timeout: float = 10.0,
        startup_timeout: float = 20.0,
    ) -> Swarm:
        """Start p2pd and join the DHT through ``initial_peers`` (multiaddr strings).

        Raises:
            NetworkError: the daemon did not start (port in use, bad identity...) or none of
                the initial peers answered within ``bootstrap_timeout`` seconds.
        """
        known = {c.pid for c in psutil.Process().children()}
        try:
            p2p = await P2P.create(
                initial_peers=list(initial_peers) or None,
                host_maddrs=list(host_maddrs),
                announce_maddrs=list(announce_maddrs) or None,
                identity_path=identity_path,
                startup_timeout=startup_timeout,
                idle_timeout=365 * 24 * 3600,  # quiet inner phases must not kill the daemon
            )
        except Exception as e:
            if initial_peers and "bootstrap" in str(e):
                raise NetworkError(_no_peers_message(initial_peers)) from None
            raise NetworkError(f"the libp2p daemon did not start: {_short(e)}") from None
        daemon = [c.pid for c in psutil.Process().children() if c.pid not in known and c.name() == "p2pd"]
        try:
            dht = await DHTNode.create(
                p2p=p2p,
                initial_peers=list(initial_peers) or None,
                bootstrap_timeout=bootstrap_timeout,
                wait_timeout=3,
            )
        except Exception as e:
            await p2p.shutdown()
            if initial_peers:
                raise NetworkError(_no_peers_message(initial_peers)) from None
            raise NetworkError(f"the DHT did not start: {_short(e)}") from None
        swarm = cls(p2p, dht, daemon[0] if daemon else None)
        log.info("peer %s up (p2pd pid %s)", swarm.peer_id, swarm.daemon_pid)
        return swarm

    async def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/ID) that other peers can dial, as strings."""
        maddrs = await self._p2p.get_visible_maddrs()
        return [str(m) for m in maddrs]

    async def num_connected(self) -> int:
        """Number of peers the daemon is connected to now."""
        return len(await self._p2p.list_peers())

    # ---- DHT ----------------------------------------------------------------------------
    async def store(self, key: str, subkey: str, value: Any, ttl: float) -> bool:
        """Store ``value`` (msgpack-able) under ``key``/``subkey`` for ``ttl`` seconds."""
        try:
            return bool(await self._dht.store(key, value, get_dht_time() + ttl, subkey=subkey))
        except Exception as e:
            raise NetworkError(f"DHT store of {key!r} failed: {_short(e)}") from None

    async def get(self, key: str) -> dict[str, Any]:
        """Latest non-expired values under ``key`` as {subkey: value}; {} when none."""
        try:
            found = await self._dht.get(key, latest=True)
        except Exception as e:
            raise NetworkError(f"DHT get of {key!r} failed: {_short(e)}") from None
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(sub): item.value for sub, item in found.value.items()}

    # ---- RPC ----------------------------------------------------------------------------
    async def add_handler(self, name: str, handler: Handler) -> None:
        """Serve RPC ``name``: ``handler(peer_id, header, payload) -> (header, payload)``.

        A handler that raises ProtocolError answers ``{"error": message}``; other errors are
        logged and answered the same way, so a bad request never kills the node.
        """

        async def serve(requests: AsyncIterator[BytesValue], ctx: P2PContext) -> AsyncIterator[BytesValue]:
            remote = ctx.remote_id.to_base58()
            try:
                header, payload = await _read_frames(requests)
                self.stats.bytes_in += len(payload)
                reply, body = await handler(remote, header, payload)
            except ProtocolError as e:
                log.warning("dropped %s request from %s: %s", name, remote[-8:], e)
                reply, body = {"error": str(e)}, b""
            except Exception as e:  # a handler bug must not take the daemon connection down
                log.exception("handler %s failed for %s", name, remote[-8:])
                reply, body = {"error": f"internal error: {_short(e)}"}, b""
            self.stats.bytes_out += len(body)
            for frame in _frames(reply, body):
                yield frame

        await self._p2p.add_protobuf_handler(name, serve, BytesValue, stream_input=True, stream_output=True)

    async def call(
        self, peer_id: str, name: str, header: Header, payload: bytes = b"", *, timeout: float
    ) -> tuple[Header, bytes]:
        """Call RPC ``name`` on ``peer_id`` and return its (header, payload).

        Raises:
            PeerUnreachable: no full answer within ``timeout`` seconds or the stream broke.
            ProtocolError: the peer answered with an error or a malformed reply.
        """
        self.stats.calls_out += 1
        self.stats.bytes_out += len(payload)
        try:
            async with asyncio.timeout(timeout):
                requests = _aiter(_frames(header, payload))
                stream = await self._p2p.iterate_protobuf_handler(
                    PeerID.from_base58(peer_id), name, requests, BytesValue
                )
                reply, body = await _read_frames(stream)
        except ProtocolError:
            self.stats.calls_failed += 1
            raise
        except (TimeoutError, Exception) as e:
            self.stats.calls_failed += 1
            raise PeerUnreachable(f"{name} to {peer_id[-8:]} failed: {_short(e) or 'timeout'}") from None
        self.stats.bytes_in += len(body)
        if "error" in reply:
            raise ProtocolError(f"{peer_id[-8:]} refused {name}: {reply['error']}")
        return reply, body

    async def shutdown(self) -> None:
        """Stop the DHT node and the daemon; waits for p2pd to exit."""
        try:
            await asyncio.wait_for(self._dht.shutdown(), 5)
        except Exception as e:
            log.debug("DHT shutdown: %s", e)
        try:
            await asyncio.wait_for(self._p2p.shutdown(), 10)
        except Exception as e:
            log.debug("p2p shutdown: %s", e)
        if self.daemon_pid is not None and psutil.pid_exists(self.daemon_pid):
            try:
                psutil.Process(self.daemon_pid).kill()
            except psutil.Error:
                pass


async def _aiter(items: Sequence[BytesValue]) -> AsyncIterator[BytesValue]:
    for item in items:
        yield item


def _no_peers_message(initial_peers: Sequence[str]) -> str:
    return (f"none of the initial peers answered ({', '.join(initial_peers)}); check the addresses, "
            "or start a new swarm with `p2pdiloco bootstrap` and join its printed multiaddr")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1][:300] if text else type(e).__name__
