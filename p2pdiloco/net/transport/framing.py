"""The framing of every RPC message on a raw libp2p stream (``transport.Swarm.call`` and its
handlers), for the request and for the reply alike::

    offset 0   4 bytes   L: header length, unsigned big-endian, 1 <= L <= MAX_HEADER_BYTES (64 KiB)
    offset 4   L bytes   header: a msgpack map with string keys; "_n" (int >= 0) = payload length
    offset 4+L _n bytes  payload: opaque bytes (tensors, state), nothing after it

Headers are decoded with msgpack's size limits (strings, bins, arrays and maps no larger than
the header itself); anything that is not a map is a protocol error. Nothing here has a
deadline of its own: the transport wraps every read and write in one (a payload of n bytes
gets :func:`payload_deadline`). What a server accepts, and when, is the transport's
(:mod:`p2pdiloco.net.transport.swarm`).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import Any

import msgpack

from p2pdiloco.errors import ProtocolError

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10  # bytes: largest msgpack header accepted (request or reply)
CHUNK_BYTES = 1 << 20  # bytes: payloads are written and read in pieces of at most this size
PAYLOAD_GRACE = 30.0  # seconds granted to any payload, on top of its size at MIN_PAYLOAD_RATE
MIN_PAYLOAD_RATE = 128 << 10  # bytes/second: slowest payload (request or reply) a peer may send us


def short_error(e: BaseException) -> str:
    """The last line of an exception's text (at most 300 characters), or its type's name."""
    text = str(e).strip().splitlines()
    return text[-1][:300] if text else type(e).__name__


_LENGTH = struct.Struct(">I")
LENGTH_BYTES = _LENGTH.size  # bytes of a message's length prefix

Header = dict[str, Any]


def pack(header: Header) -> bytes:
    """Encode a header dict with msgpack (bytes)."""
    return msgpack.packb(header, use_bin_type=True)


def unpack(data: bytes) -> Header:
    """Decode a msgpack header of at most ``MAX_HEADER_BYTES``.

    No string, bin, array or map inside may be longer than ``len(data)``.

    Raises:
        ProtocolError: ``data`` is too long, not one msgpack object, or not a map.
    """
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(data)} bytes (limit {MAX_HEADER_BYTES})")
    limit = len(data)
    try:
        header = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=limit, max_str_len=limit,
                                 max_array_len=limit, max_map_len=limit, max_ext_len=limit)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable header: {short_error(e)}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a {type(header).__name__}, not a map")
    return header


def frame(header: Header, payload_size: int) -> bytes:
    """The length prefix and header of a message whose payload has ``payload_size`` bytes
    (the payload follows it on the stream; see the module docstring).

    Raises:
        ProtocolError: the encoded header exceeds ``MAX_HEADER_BYTES``.
        TypeError: ``header`` holds something msgpack cannot encode.
    """
    head = pack(dict(header, _n=payload_size))
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(head)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    return _LENGTH.pack(len(head)) + head


async def read_header(reader: asyncio.StreamReader, *, length: bytes | None = None) -> tuple[Header, int]:
    """Read one message's length prefix and header; returns (header without ``_n``, payload size
    in bytes). Reads nothing of the payload. No deadline of its own: wrap it in one.
    ``length``: the prefix, already read (``reader.readexactly(LENGTH_BYTES)``, which consumes
    nothing unless it returns: a wait for the next message that can time out and go on).

    Raises:
        ProtocolError: header length 0 or over ``MAX_HEADER_BYTES``, undecodable header, not a
            map, or ``_n`` missing or not an int >= 0.
        asyncio.IncompleteReadError: the stream ended first.
    """
    size = _LENGTH.unpack(length if length is not None else await reader.readexactly(_LENGTH.size))[0]
    if not 0 < size <= MAX_HEADER_BYTES:
        raise ProtocolError(f"header length {size} outside 1..{MAX_HEADER_BYTES}")
    header = unpack(await reader.readexactly(size))
    n = header.pop("_n", None)
    if type(n) is not int or n < 0:
        raise ProtocolError(f"bad payload length {n!r:.40}")
    return header, n


async def read_payload(reader: asyncio.StreamReader, n: int,
                       progress: Callable[[int, int], None] | None = None) -> bytes | bytearray:
    """Read exactly ``n`` bytes in pieces of at most ``CHUNK_BYTES``. No deadline of its own;
    ``progress(received, n)`` is called after each piece (bytes so far, bytes in all).
    A payload over one piece is written into one ``bytearray`` of ``n`` bytes as it arrives, so
    it is held once (plus one piece), never as pieces and their join (a model's state: docs/operating.md, "Memory").

    Raises:
        asyncio.IncompleteReadError: the stream ended first.
    """
    if n <= CHUNK_BYTES and progress is None:
        return await reader.readexactly(n) if n else b""
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        piece = await reader.readexactly(min(n - got, CHUNK_BYTES))
        view[got:got + len(piece)] = piece
        got += len(piece)
        if progress is not None:
            progress(got, n)
    return out


async def write_message(writer: asyncio.StreamWriter, header: Header, payload: bytes, *,
                        stop_after: int | None = None) -> None:
    """Write one framed message and drain; ``stop_after``: write only that many payload bytes.
    No deadline of its own.

    Raises:
        ProtocolError / TypeError: as :func:`frame`.
        ConnectionError: the stream broke.
    """
    view = memoryview(payload)[: len(payload) if stop_after is None else stop_after]
    writer.writelines((frame(header, len(payload)), view[:CHUNK_BYTES]))  # one send: the header with the first chunk
    await writer.drain()
    for i in range(CHUNK_BYTES, len(view), CHUNK_BYTES):
        writer.write(view[i : i + CHUNK_BYTES])
        await writer.drain()


def payload_deadline(n: int) -> float:
    """Seconds allowed to transfer a payload of ``n`` bytes (at MIN_PAYLOAD_RATE, plus PAYLOAD_GRACE)."""
    return PAYLOAD_GRACE + n / MIN_PAYLOAD_RATE


def close_stream(writer: asyncio.StreamWriter) -> None:
    """Close a stream's socket now: unsent bytes are discarded (a peer that does not read
    them must not keep the descriptor open). Never raises."""
    try:
        transport = writer.transport
        if transport.get_write_buffer_size():
            transport.abort()
        else:
            writer.close()
    except Exception as e:  # already closed, loop shutting down
        log.debug("closing a stream: %s", e)


async def drain(reader: asyncio.StreamReader, seconds: float, discard: int = 1 << 20) -> None:
    """Wait until the other end closes (EOF), ``seconds`` pass, or it sent ``discard`` more
    bytes (read and thrown away), whichever comes first: a server lingering after its answer
    (closing first can reset the stream and lose the answer), or holding a blocked peer's
    stream. Never raises (but CancelledError)."""
    got = 0
    try:
        async with asyncio.timeout(seconds):
            while got < discard and (chunk := await reader.read(65536)):
                got += len(chunk)
    except (TimeoutError, ConnectionError, OSError):
        pass

RATE_SLACK = 1.5  # a payload arriving at a measured rate gets this many times the time that rate needs, ...
RATE_GRACE_S = 5.0  # ... plus these seconds (a link's rate varies: TCP slow start, a burst of other traffic)
RATE_SAMPLE_BYTES = 64 << 10  # the rate is measured once this much of the payload arrived


def stretched_deadline(got: int, total: int, seconds: float, min_rate: float) -> float | None:
    """Seconds from now that a payload of ``total`` bytes, of which ``got`` arrived in
    ``seconds``, may still take: the rest at the rate measured so far, times ``RATE_SLACK``,
    plus ``RATE_GRACE_S``; None (no more time than the call's own deadline) while fewer than
    ``RATE_SAMPLE_BYTES`` arrived or when that rate is under ``min_rate`` bytes/s (a peer that
    trickles its answer to hold us is held to the call's deadline)."""
    if got < min(total, RATE_SAMPLE_BYTES) or seconds <= 0:
        return None
    rate = got / seconds
    if rate < min_rate:
        return None
    return (total - got) / rate * RATE_SLACK + RATE_GRACE_S
