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

Trust (docs/trust.md): the daemon runs with the node's Ed25519 identity
(:mod:`p2pdiloco.trust.identity`), so the peer ID libp2p authenticates on every connection
is the key that signs. Every DHT record is wrapped in a signed envelope (:class:`SignedRecords`,
a hivemind ``RecordValidatorBase``) and a record whose subkey is a peer ID can be written only
by that peer. In a private swarm every request and reply carries the sender's membership
certificate in the header field ``_cert``, and records carry it in their envelope;
non-members are refused with :class:`~p2pdiloco.trust.errors.AccessDenied`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import shutil
from pathlib import Path

import msgpack
import psutil
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.dht import DHTNode
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils import get_dht_time

from p2pdiloco.errors import NetworkError, PeerUnreachable, ProtocolError
from p2pdiloco.trust import signing
from p2pdiloco.trust.certificates import Membership
from p2pdiloco.trust.errors import AccessDenied, IdentityError
from p2pdiloco.trust.identity import Identity, is_peer_id

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



_ENVELOPE_FORMAT = 1


class SignedRecords(RecordValidatorBase):
    """Signs every DHT record this node stores and rejects records that fail the checks.

    A record's stored value is the envelope
    ``msgpack([1, author peer ID (str), value (bin), signature (bin, 64), certificate (bin or nil)])``
    where ``value`` is what the application stored (hivemind's msgpack) and ``signature`` is
    the author's over ``signing.message("dht.record", [key id, subkey bytes, value,
    expiration time])``: the DHT key (hashed to its 20-byte id), the subkey and the expiry are
    all covered, so a record cannot be moved to another key, subkey or lifetime.

    :meth:`validate` (run by hivemind when another peer asks us to store a record and on
    every record a peer returns to our lookups) accepts a record only if the envelope
    decodes, the signature verifies with the key inlined in the author's peer ID, a subkey
    that is an Ed25519 peer ID equals the author (owner-only records: ``{run}/heads``,
    matchmaking declarations), and, in a private swarm, the certificate admits the author.
    Rejections are counted in :attr:`rejected` by reason. hivemind drops a whole
    dictionary value when one of its entries fails, so a forged entry never reaches the
    application.
    """

    def __init__(self, identity: Identity, membership: Membership):
        self.identity, self.membership = identity, membership
        self.rejected: Counter[str] = Counter()
        self.seconds = 0.0  # CPU time spent signing and validating records
        self.signed = self.validated = 0
        self._valid: dict[tuple, float] = {}  # records that passed: until when to trust that (60 s at most)

    @staticmethod
    def _fields(record: DHTRecord, value: bytes) -> list[Any]:
        return [record.key, record.subkey, value, float(record.expiration_time)]

    def sign_value(self, record: DHTRecord) -> bytes:
        t0 = time.perf_counter()
        sig = signing.sign(self.identity, "dht.record", self._fields(record, record.value))
        envelope = [_ENVELOPE_FORMAT, self.identity.peer_id, record.value, sig, self.membership.own_certificate]
        self.signed += 1
        self.seconds += time.perf_counter() - t0
        return msgpack.packb(envelope, use_bin_type=True)

    @staticmethod
    def _open(value: bytes) -> tuple[str, bytes, bytes, bytes | None] | None:
        try:
            fmt, author, inner, sig, cert = msgpack.unpackb(value, raw=False)
        except Exception:  # not an envelope (unsigned or foreign record)
            return None
        if fmt != _ENVELOPE_FORMAT or not isinstance(author, str) or not isinstance(inner, bytes) \
                or not isinstance(sig, bytes) or not (cert is None or isinstance(cert, bytes)):
            return None
        return author, inner, sig, cert

    def validate(self, record: DHTRecord) -> bool:
        t0 = time.perf_counter()
        try:
            fingerprint = (record.key, record.subkey, record.value, record.expiration_time)
            valid_until = self._valid.get(fingerprint)
            if valid_until is not None and time.time() < valid_until:
                return True  # the same bytes passed before (lookups return each record many times)
            ok = self._validate(record)
            if ok:
                if len(self._valid) >= 8192:
                    self._valid.clear()
                self._valid[fingerprint] = min(time.time() + 60.0, float(record.expiration_time) + 60.0)
            return ok
        finally:
            self.validated += 1
            self.seconds += time.perf_counter() - t0

    def _validate(self, record: DHTRecord) -> bool:
        opened = self._open(record.value)
        if opened is None:
            return self._reject("unsigned", record)
        author, inner, sig, cert = opened
        if not signing.verify_by_peer(author, "dht.record", self._fields(record, inner), sig):
            return self._reject("bad_signature", record, author)
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False) if record.subkey else None
        except Exception:
            subkey = None
        if is_peer_id(subkey) and subkey != author:
            return self._reject("not_owner", record, author)
        try:
            self.membership.check(author, cert)
        except AccessDenied as e:
            return self._reject(e.reason, record, author)
        return True

    def _reject(self, reason: str, record: DHTRecord, author: str = "?") -> bool:
        self.rejected[reason] += 1
        log.debug("rejected DHT record from %s: %s (subkey %r)", author[-8:], reason, record.subkey[:60])
        return False

    def strip_value(self, record: DHTRecord) -> bytes:
        opened = self._open(record.value)
        return opened[1] if opened is not None else record.value

    @property
    def priority(self) -> int:
        return 10  # outermost: validated before anything else looks at the value


class Swarm:
    """A peer's transport: daemon, DHT and framed RPCs. Create with :meth:`start`.

    Attributes:
        peer_id: this peer's libp2p peer ID (base58 string), the identity's public key.
        identity: the Ed25519 key pair behind ``peer_id``; signs records and contributions.
        membership: who may talk to us (public swarm, or a private swarm's members).
        bans: peer ID -> reason, peers excluded for the rest of the run (a contribution
            of theirs failed verification); consulted by matchmaking and the all-reduce.
        refused: requests refused because the caller is not a member, by reason.
        stats: traffic counters (bytes of RPC frames, both directions).
    """

    def __init__(self, p2p: P2P, dht: DHTNode, daemon_pid: int | None, identity: Identity,
                 membership: Membership, records: SignedRecords):
        self._p2p, self._dht = p2p, dht
        self.peer_id: str = p2p.peer_id.to_base58()
        self.daemon_pid = daemon_pid
        self.identity, self.membership, self.records = identity, membership, records
        self.bans: dict[str, str] = {}
        self.refused: Counter[str] = Counter()
        self.admitted = False  # a member of the swarm accepted us (check_admission)
        self.stats = TrafficStats()
        self.started_at = time.time()
        # injected fault: RPC name -> (matching answers left before the kill, which requests count)
        self._kill_midway: dict[str, tuple[int, Callable[[Header], bool]]] = {}

    def inject_kill_midway(self, rpc: str, nth: int, when: Callable[[Header], bool] = lambda _: True) -> None:
        """Fault injection (tests, chaos runs): SIGKILL this process while it streams its
        ``nth`` answer to an ``rpc`` request whose header satisfies ``when``, after about half
        of the answer's frames went out."""
        self._kill_midway[rpc] = (nth, when)

    def ban(self, peer: str, reason: str) -> None:
        """Exclude ``peer`` for the rest of the run (logged once)."""
        if peer != self.peer_id and peer not in self.bans:
            self.bans[peer] = reason
            log.warning("excluding peer %s for the rest of the run: %s", peer[-8:], reason)

    @classmethod
    async def start(
        cls,
        *,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        announce_maddrs: Sequence[str] = (),
        identity_path: str | None = None,
        identity: Identity | None = None,
        membership: Membership | None = None,
        admission_key: str | None = None,
        bootstrap_timeout: float = 10.0,
        startup_timeout: float = 20.0,
    ) -> Swarm:
        """Start p2pd and join the DHT through ``initial_peers`` (multiaddr strings).

        Args:
            identity: the node's key pair; else loaded from (or created at) ``identity_path``;
                else a new key held in memory (a new peer ID every start).
            membership: the private swarm this node belongs to; default: public swarm.
            admission_key: a DHT key of records under peer IDs (``{run}/heads``): when given,
                :meth:`check_admission` runs before returning.

        Raises:
            IdentityError: the identity file is unusable, or a running peer of the swarm
                already uses this identity (checked through ``initial_peers`` before the
                daemon starts, for an identity loaded from an existing file).
            NetworkError: the daemon did not start (port in use...) or none of the initial
                peers answered within ``bootstrap_timeout`` seconds.
            AccessDenied: ``admission_key`` given and the swarm refuses this node; the daemon
                is shut down.
        """
        if identity is None:
            identity = Identity.load_or_create(identity_path)[0] if identity_path else Identity.generate()
        membership = membership if membership is not None else Membership()
        if identity.path is not None and not identity.created and initial_peers:
            if await identity_in_use(identity.peer_id, initial_peers):
                raise IdentityError(
                    f"identity {identity.path} (peer ID {identity.peer_id}) is already used by a running node of "
                    "this swarm; a second node with the same identity would steal its connections. Stop the "
                    "other node, or give this one its own --data-dir (or trust.identity) to get a new identity")
        key_file = identity.path if identity.path is not None else identity.write_temporary()
        known = {c.pid for c in psutil.Process().children()}
        try:
            p2p = await P2P.create(
                initial_peers=list(initial_peers) or None,
                host_maddrs=list(host_maddrs),
                announce_maddrs=list(announce_maddrs) or None,
                identity_path=str(key_file),
                check_if_identity_free=False,  # done above: hivemind's check reads RSA keys only
                startup_timeout=startup_timeout,
                idle_timeout=365 * 24 * 3600,  # quiet inner phases must not kill the daemon
            )
        except Exception as e:
            if initial_peers and "bootstrap" in str(e):
                raise NetworkError(_no_peers_message(initial_peers)) from None
            raise NetworkError(f"the libp2p daemon did not start: {_short(e)}") from None
        finally:
            if identity.path is None:  # p2pd has read the temporary key file
                shutil.rmtree(Path(key_file).parent, ignore_errors=True)
        daemon = [c.pid for c in psutil.Process().children() if c.pid not in known and c.name() == "p2pd"]
        records = SignedRecords(identity, membership)
        try:
            dht = await DHTNode.create(
                p2p=p2p,
                initial_peers=list(initial_peers) or None,
                bootstrap_timeout=bootstrap_timeout,
                wait_timeout=3,
                record_validator=records,
            )
        except Exception as e:
            await p2p.shutdown()
            if initial_peers:
                raise NetworkError(_no_peers_message(initial_peers)) from None
            raise NetworkError(f"the DHT did not start: {_short(e)}") from None
        swarm = cls(p2p, dht, daemon[0] if daemon else None, identity, membership, records)
        if swarm.peer_id != identity.peer_id:  # p2pd must run with exactly our key
            await swarm.shutdown()
            raise IdentityError(f"p2pd runs as {swarm.peer_id}, not as the identity's {identity.peer_id}")
        await swarm.add_handler("trust.hello", swarm._on_hello)
        log.info("peer %s up (p2pd pid %s, %s)", swarm.peer_id, swarm.daemon_pid, membership.name)
        if admission_key is not None:
            try:
                await swarm.check_admission(admission_key)
            except BaseException:
                await swarm.shutdown()
                raise
        return swarm

    async def _on_hello(self, peer: str, header: Header, _: bytes) -> tuple[Header, bytes]:
        return {"swarm": self.membership.name}, b""

    async def check_admission(self, key: str, tries: int = 3) -> None:
        """Ask up to ``tries`` owners of records under ``key`` (random order) whether they
        accept this node (``trust.hello``). Returns at the first acceptance, when nobody
        published a record or answered, or at once when an earlier check passed.

        Raises:
            AccessDenied: every peer that answered refused us (for instance: this node has no
                valid certificate of the private swarm those peers belong to).
        """
        if self.admitted:
            return
        try:
            peers = [p for p in await self.get(key) if is_peer_id(p) and p != self.peer_id]
        except NetworkError:
            return
        random.shuffle(peers)
        refusal: AccessDenied | None = None
        for peer in peers[:tries]:
            try:
                await self.hello(peer)
                self.admitted = True
                return
            except AccessDenied as e:
                refusal = e
            except NetworkError as e:
                log.debug("hello to %s: %s", peer[-8:], e)
        if refusal is not None:
            raise AccessDenied(f"the swarm refused this node ({self.peer_id}): {refusal}", refusal.reason)

    async def hello(self, peer: str, timeout: float = 5.0) -> str:
        """Ask ``peer`` whether it accepts us; returns its swarm's name.

        Raises:
            AccessDenied: ``peer`` refused us (we are not a member of its private swarm).
            NetworkError: no answer.
        """
        reply, _ = await self.call(peer, "trust.hello", {}, timeout=timeout)
        return str(reply.get("swarm", "?"))

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
            request: Header = {}
            try:
                header, payload = await _read_frames(requests)
                request = dict(header)
                async for _ in requests:  # wait for the caller's end of stream: answering (and closing)
                    pass  # before it arrives can reset the stream and lose the answer (seen on refusals)
                self.stats.bytes_in += len(payload)
                try:
                    self.membership.check(remote, header.pop("_cert", None))
                except AccessDenied as e:
                    self.refused[e.reason] += 1
                    log.warning("refused %s from %s: %s", name, remote[-8:], e)
                    reply, body = {"error": str(e), "denied": e.reason}, b""
                else:
                    reply, body = await handler(remote, header, payload)
                    if self.membership.private:
                        reply = dict(reply, _cert=self.membership.own_certificate)
            except ProtocolError as e:
                log.warning("dropped %s request from %s: %s", name, remote[-8:], e)
                reply, body = {"error": str(e)}, b""
            except Exception as e:  # a handler bug must not take the daemon connection down
                log.exception("handler %s failed for %s", name, remote[-8:])
                reply, body = {"error": f"internal error: {_short(e)}"}, b""
            self.stats.bytes_out += len(body)
            frames = _frames(reply, body)
            kill_at = self._kill_at(name, request, len(frames))
            for i, frame in enumerate(frames):
                if i == kill_at:
                    await asyncio.sleep(0.5)  # let the frames sent so far reach the caller
                    log.warning("injected fault: killed while answering %s (%d of %d frames sent)", name, i, len(frames))
                    logging.shutdown()
                    os.kill(os.getpid(), signal.SIGKILL)
                yield frame

        await self._p2p.add_protobuf_handler(name, serve, BytesValue, stream_input=True, stream_output=True)

    def _kill_at(self, name: str, request: Header, n_frames: int) -> int:
        """Frame index at which the injected kill-midway fault hits this answer, or -1."""
        left, when = self._kill_midway.get(name, (0, None))
        if when is None or not when(request):
            return -1
        self._kill_midway[name] = (left - 1, when)
        if left - 1 > 0:
            return -1
        return 1 + (n_frames - 1) // 2  # the header and about half of the payload's frames went out

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
        if self.membership.private:
            header = dict(header, _cert=self.membership.own_certificate)
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
            if "denied" in reply:
                raise AccessDenied(f"{peer_id[-8:]} refused {name}: {reply['error']}", str(reply["denied"]))
            raise ProtocolError(f"{peer_id[-8:]} refused {name}: {reply['error']}")
        try:
            self.membership.check(peer_id, reply.pop("_cert", None))
        except AccessDenied as e:
            self.refused[e.reason] += 1
            raise AccessDenied(f"answer of {peer_id[-8:]} to {name} dropped: {e}", e.reason) from None
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


async def identity_in_use(peer_id: str, initial_peers: Sequence[str], timeout: float = 8.0) -> bool:
    """Whether a running peer reachable through ``initial_peers`` already has ``peer_id``.

    Starts a throwaway daemon with a random identity and asks libp2p's routing for the peer:
    a connection that fails only at protocol negotiation means the peer is up ("routing:
    not found" or a dial failure means it is not). The throwaway daemon is always shut down.
    Any failure of the check itself counts as "not in use" (logged).
    """
    probe = None
    try:
        probe = await P2P.create(initial_peers=list(initial_peers), dht_mode="client", startup_timeout=15,
                                 check_if_identity_free=False)
        try:
            async with asyncio.timeout(timeout):
                await probe.call_protobuf_handler(PeerID.from_base58(peer_id), "p2pdiloco.identity-probe",
                                                  BytesValue(), BytesValue)
            return True  # nobody serves this name, but an answer means someone is there
        except Exception as e:
            text = str(e).lower()
            return "protocol" in text and "not supported" in text
    except Exception as e:
        log.info("could not check whether identity %s is in use: %s", peer_id[-8:], _short(e))
        return False
    finally:
        if probe is not None:
            try:
                await asyncio.wait_for(probe.shutdown(), 10)
            except Exception as e:
                log.debug("probe shutdown: %s", e)


async def _aiter(items: Sequence[BytesValue]) -> AsyncIterator[BytesValue]:
    for item in items:
        yield item


def _no_peers_message(initial_peers: Sequence[str]) -> str:
    return (f"none of the initial peers answered ({', '.join(initial_peers)}); check the addresses, "
            "or start a new swarm with `p2pdiloco bootstrap` and join its printed multiaddr")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1][:300] if text else type(e).__name__
