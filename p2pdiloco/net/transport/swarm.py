"""The swarm transport: one libp2p daemon (p2pd) and one in-process DHT node per peer.

This package (``p2pdiloco.net``) is the only place that imports hivemind. Everything here
wraps hivemind's public API (``hivemind.p2p.P2P``, ``hivemind.dht.DHTNode``) and translates
its errors into :mod:`p2pdiloco.errors`.

Lifecycle: :mod:`p2pdiloco.net.transport.daemon` starts p2pd and an in-process ``DHTNode`` (p2pd is the
only child and exits with its owner, SIGKILL included); :meth:`Swarm.rejoin` dials the initial
peers again after every connection was lost; :meth:`Swarm.shutdown` stops both.

RPCs (:meth:`Swarm.call`, :meth:`Swarm.add_handler`) run on hivemind's raw libp2p streams
(``P2P.call_binary_stream_handler`` / ``P2P.add_binary_stream_handler``): small calls to a peer
on one long-lived stream, our session to it (:mod:`p2pdiloco.net.transport.sessions`), bigger ones on a
stream each; every message framed as :mod:`p2pdiloco.net.transport.framing` says (length-prefixed
msgpack header with the payload length ``_n``, then the payload). Reserved header keys: ``_n``,
``_cert`` (membership certificate, bin, in a private swarm), in sessions ``_id`` and ``_rpc``; a
reply with ``error`` (str) is a refusal, with ``denied`` (str) a membership refusal. The server
half, with its limits and deadlines, is :mod:`p2pdiloco.net.transport.serving`; the caller's half,
:mod:`p2pdiloco.net.transport.calls`. Every call has a deadline.

Time (:mod:`p2pdiloco.net.transport.clock`): a node more than ``clock.TOLERANCE_S`` seconds off its
initial peers' clocks is refused; a smaller offset is corrected (:attr:`Swarm.clock`, the
swarm's time; record expiries get ``clock.TOLERANCE_S`` of slack for readers ahead).

Trust (docs/trust.md): the daemon runs with the node's Ed25519 identity (``trust.identity``),
so the peer ID libp2p authenticates on every connection is the key that signs. Every DHT record is wrapped in a signed envelope (:class:`SignedRecords`,
a hivemind ``RecordValidatorBase``) and a record whose subkey is a peer ID can be written only
by that peer. In a private swarm every request and reply carries the sender's membership
certificate in the header field ``_cert``, and records carry it in their envelope;
non-members are refused with :class:`~p2pdiloco.trust.errors.AccessDenied`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import psutil
from hivemind.dht import DHTNode
from hivemind.p2p import P2P

from p2pdiloco.errors import NetworkError
from p2pdiloco.net.transport import admission
from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.net.transport import sessions
from p2pdiloco.net.transport.calls import Calls
from p2pdiloco.net.transport.daemon import (listening_maddrs, private_sockets, quiet_dead_daemon_tasks, rejoin_dht,
                                            start_daemon, start_dht)
from p2pdiloco.net.transport.dht_access import DHTAccess
from p2pdiloco.net.transport.drops import DropLedger, TrafficStats
from p2pdiloco.net.transport.framing import Header
from p2pdiloco.net.transport.identity_check import own_identity
from p2pdiloco.net.transport.reachability import RPC as DIALBACK
from p2pdiloco.net.transport.reachability import DialbackServer, Reachability, ReachabilityMode, daemon_options
from p2pdiloco.net.transport.serving import Handler, Server
from p2pdiloco.net.records.signed import SignedRecords
from p2pdiloco.trust.certificates import Membership
from p2pdiloco.trust.errors import IdentityError
from p2pdiloco.trust.identity import Identity

log = logging.getLogger(__name__)


class Swarm(Calls, DHTAccess):
    """A peer's transport: daemon, DHT and framed RPCs. Create with :meth:`start`.

    Attributes:
        peer_id: this peer's libp2p peer ID (base58 string), the identity's public key.
        identity: the Ed25519 key pair behind ``peer_id``; signs records and contributions.
        membership: who may talk to us (public swarm, or a private swarm's members).
        bans: peer ID -> reason, peers excluded for the rest of the run (a contribution
            of theirs failed verification); consulted by matchmaking and the all-reduce.
        refused: requests refused because the caller is not a member, by reason.
        drops: the :class:`~p2pdiloco.net.transport.drops.DropLedger` of inbound messages not served;
            ``dropped`` (by peer), ``drop_reasons`` and ``blocked`` are its counters. Reasons
            here: ``busy``, ``header_timeout``, ``bad_header``, ``bad_cert``, ``too_large``,
            ``payload_timeout``, ``truncated``, ``closed``, ``reply_timeout``, ``reply_broken``;
            for our calls ``bad_reply``, ``reply_too_large``; ``blocked`` for streams of
            blocked or banned peers closed unread; other modules add the records they drop.
        stats: traffic counters (RPC payload bytes, both directions).
    """

    def __init__(self, p2p: P2P, dht: DHTNode, daemon_pid: int | None, identity: Identity,
                 membership: Membership, records: SignedRecords, clock: swarm_clock.SwarmClock | None = None):
        self._p2p, self._dht = p2p, dht
        self.clock = clock if clock is not None else swarm_clock.SwarmClock()
        self._clock_task: asyncio.Task | None = None
        self.peer_id: str = p2p.peer_id.to_base58()
        self.daemon_pid = daemon_pid
        self.identity, self.membership, self.records = identity, membership, records
        self.bans: dict[str, str] = {}
        self.refused: Counter[str] = Counter()
        self.drops = DropLedger(self.peer_id)
        # the ledger's own counters, under the names status and the other modules read
        self.dropped, self.drop_reasons, self.blocked = self.drops.dropped, self.drops.reasons, self.drops.blocked
        self.server = Server(self, p2p)
        self._sessions: dict[str, sessions.Session] = {}  # our session to each peer (one at a time)
        self._opening: dict[str, asyncio.Task] = {}  # peer -> the opening of our session to it ...
        self._waiting: Counter[str] = Counter()  # ... and how many calls wait for it
        self._closing = False  # shutdown() began: no session opens
        self.admitted = False  # a member of the swarm accepted us (check_admission)
        self.stats = TrafficStats()
        self.reach = Reachability()  # how peers can dial us (start() sets its mode and checks)
        self.started_at, self.initial_peers = time.time(), []  # start() sets the peers it joined through
        self.restarts = 0  # times p2pd was started again under this peer (restart)
        self._daemon_args: dict[str, Any] = {}  # how start() started p2pd and the DHT (restart does it again)

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
        reachability: ReachabilityMode | None = None,
        relay: bool = True,
        record_swarm: bytes | None = None,
    ) -> Swarm:
        """Start p2pd and join the DHT through ``initial_peers`` (multiaddr strings).

        Args:
            identity: the node's key pair; else ``identity_path``'s; else a new one (``identity_check.own_identity``).
            membership: the private swarm this node belongs to; default: public swarm.
            admission_key: a DHT key of records under peer IDs (``{run}/heads``): when given,
                :meth:`check_admission` runs before returning.
            reachability, relay: ``p2pdiloco.net.transport.reachability`` (None: p2pd decides, no
                dial-back check; ``auto``: :attr:`reach` holds the check's verdict).
            record_swarm: for a node of a public ``membership`` (a bootstrap peer): the raw
                32-byte public key of a private swarm whose members alone may store DHT
                records here (their certificates are checked as a member checks them; the
                node's RPCs stay open to everybody, as it holds no certificate of its own).

        Raises:
            IdentityError: the identity file is unusable, or a running peer of the swarm
                already uses this identity (``identity_check.own_identity``).
            ClockSkewError: this machine's clock is more than ``clock.TOLERANCE_S`` seconds
                off the initial peers' (the median of their offsets); the daemon is shut down.
            NetworkError: the daemon did not start (port in use...) or none of the initial
                peers answered within ``bootstrap_timeout`` seconds.
            AccessDenied: ``admission_key`` given and the swarm refuses this node; the daemon
                is shut down.
        """
        identity = await own_identity(identity, identity_path, initial_peers)
        membership = membership if membership is not None else Membership()
        with private_sockets():  # p2pd's socket, and hivemind's, bound by the first handler: owner-only
            swarm, strict = await cls._launch(identity, membership, initial_peers, host_maddrs, announce_maddrs,
                                              startup_timeout, daemon_options(reachability, relay, initial_peers),
                                              bootstrap_timeout, record_swarm)
        swarm.reach, swarm.initial_peers = Reachability(reachability or "auto", relay), list(initial_peers)
        swarm._daemon_args = dict(host_maddrs=list(host_maddrs), bound=listening_maddrs(host_maddrs, swarm.daemon_pid),
                                  rest=(announce_maddrs, startup_timeout, daemon_options(reachability, relay, initial_peers)),
                                  bootstrap_timeout=bootstrap_timeout, strict=strict)
        log.info("peer %s up (p2pd pid %s, %s)", swarm.peer_id, swarm.daemon_pid, membership.name)
        await swarm._check_in(admission_key, reachability, initial_peers)
        return swarm

    async def _check_in(self, admission_key: str | None, reachability: ReachabilityMode | None,
                        initial_peers: Sequence[str]) -> None:
        """The checks a started swarm passes before :meth:`start` returns it: admission under
        ``admission_key`` (when given) and, for ``reachability`` ``auto``, the dial-back check of
        how peers reach us (through ``initial_peers``). Raises as :meth:`start`, the daemon shut
        down."""
        try:  # on any failure, also cancellation (Ctrl+C), the daemon must not outlive us
            if admission_key is not None:
                await self.check_admission(admission_key)
            if reachability == "auto":
                await self.reach.check(self, initial_peers)
        except BaseException:
            await self.shutdown()
            raise

    @classmethod
    async def _launch(cls, identity: Identity, membership: Membership, initial_peers: Sequence[str],
                      host_maddrs: Sequence[str], announce_maddrs: Sequence[str], startup_timeout: float,
                      options: Any, bootstrap_timeout: float, record_swarm: bytes | None) -> tuple[Swarm, bool]:
        """Start p2pd (``options``: ``daemon_options``), check our clock against the initial peers'
        and join the DHT; then serve (clock watch, RPC server, ``trust.hello``, dial-backs).
        Returns (the swarm, whether the clock check was strict). Raises as :meth:`start`, and
        ValueError when ``record_swarm`` names another swarm than ``membership``; the daemon is
        shut down on a failure after it started."""
        p2p, daemon_pid = await start_daemon(identity, initial_peers, host_maddrs, announce_maddrs,
                                             startup_timeout, options)
        clock = swarm_clock.SwarmClock()
        try:
            strict = await swarm_clock.check_initial(clock, p2p, initial_peers)
        except BaseException:
            await p2p.shutdown()
            raise
        if record_swarm is not None and membership.private and record_swarm != membership.swarm:
            await p2p.shutdown()
            raise ValueError("record_swarm names another swarm than membership")
        records = SignedRecords(identity, Membership(record_swarm) if record_swarm is not None else membership)
        dht = await start_dht(p2p, initial_peers, bootstrap_timeout, records, strict=strict)
        swarm = cls(p2p, dht, daemon_pid, identity, membership, records, clock)
        if swarm.peer_id != identity.peer_id:  # p2pd must run with exactly our key
            await swarm.shutdown()
            raise IdentityError(f"p2pd runs as {swarm.peer_id}, not as the identity's {identity.peer_id}")
        swarm._clock_task = asyncio.create_task(swarm_clock.watch(swarm.clock, p2p))
        await swarm.server.start()
        await swarm.add_handler("trust.hello", swarm._on_hello)
        await swarm.add_handler(DIALBACK, DialbackServer(swarm))
        return swarm, strict

    async def restart(self) -> None:
        """Start p2pd again under this running peer after it died (killed, crashed, OOM): the
        same identity, so the same peer ID; the listen addresses it had (a TCP port picked at
        start, port 0, is asked for again, so that peers' address books stay right), its
        announce addresses and options; a new DHT node joins through the initial peers; every
        handler served before serves again (``Server.rebind``). Sessions and streams of the
        dead daemon are closed (their calls fail as on a lost connection); the DHT records this
        node held for others are gone (their owners store them again).

        Raises:
            NetworkError: the daemon did not start, or none of the initial peers answered; the
                transport stays down (the caller ends the node).
        """
        args = self._daemon_args
        quiet_dead_daemon_tasks(asyncio.get_running_loop())
        for session in list(self._sessions.values()):
            session.close()
        for task in list(self._opening.values()):
            task.cancel()
        await self.server.close()
        if self._clock_task is not None:
            self._clock_task.cancel()
        for old in (self._dht.shutdown(), self._p2p.shutdown()):  # the daemon is gone: each fails or returns at once
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old, 2.0)
        with private_sockets():
            start = (self.identity, self.initial_peers)
            try:
                p2p, pid = await start_daemon(*start, args["bound"], *args["rest"])
            except NetworkError:  # the port it had is taken meanwhile: any port, as at the start
                if args["bound"] == args["host_maddrs"]:
                    raise
                p2p, pid = await start_daemon(*start, args["host_maddrs"], *args["rest"])
            try:
                dht = await start_dht(p2p, self.initial_peers, args["bootstrap_timeout"], self.records,
                                      strict=args["strict"])
                if p2p.peer_id.to_base58() != self.peer_id:
                    raise NetworkError(f"p2pd restarted as {p2p.peer_id.to_base58()}, not as {self.peer_id}")
                await self.server.rebind(p2p)
            except BaseException:
                await p2p.shutdown()
                raise
        self._p2p, self._dht, self.daemon_pid = p2p, dht, pid
        self._clock_task = asyncio.create_task(swarm_clock.watch(self.clock, p2p))
        self.restarts += 1

    async def rejoin(self) -> int:
        """Dial the initial peers again, back into the DHT (``daemon.rejoin_dht``); how many answered."""
        return await rejoin_dht(self._dht, self.initial_peers)

    async def measure_clock(self) -> int:
        """Measure the clock offset to up to ``clock.MAX_PEERS`` random connected peers now and
        update :attr:`clock` (the median counts this node too: ``p2pdiloco.net.transport.clock``);
        returns how many answered."""
        return await swarm_clock.measure_connected(self.clock, self._p2p)

    async def _on_hello(self, peer: str, header: Header, _: bytes) -> tuple[Header, bytes]:
        return {"swarm": self.membership.name}, b""

    async def check_admission(self, key: str, tries: int = 3) -> None:
        """Whether the swarm accepts this node: :func:`p2pdiloco.net.transport.admission.check_admission`
        (raises AccessDenied when every peer that answered refused us)."""
        await admission.check_admission(self, key, tries)

    async def hello(self, peer: str, timeout: float = 5.0) -> str:
        """Ask ``peer`` whether it accepts us; returns its swarm's name. Raises AccessDenied
        (``peer`` refused us: not a member of its private swarm) or NetworkError (no answer)."""
        reply, _ = await self.call(peer, "trust.hello", {}, timeout=timeout)
        return str(reply.get("swarm", "?"))

    async def visible_maddrs(self, latest: bool = False) -> list[str]:
        """Multiaddrs (with /p2p/ID) that peers can dial (``latest``: ask p2pd again)."""
        return [str(m) for m in await self._p2p.get_visible_maddrs(latest=latest)]

    async def connections(self) -> dict[str, list[str]]:
        """Peer ID -> remote multiaddrs of the daemon's open connections to it."""
        out: dict[str, list[str]] = {}
        for info in await self._p2p.list_peers():  # one entry per connection
            out.setdefault(info.peer_id.to_base58(), []).extend(str(a) for a in info.addrs)
        return out

    # ---- RPC ----------------------------------------------------------------------------
    def drop(self, peer: str, reason: str) -> None:
        """Count an inbound message from ``peer`` that was not served (malformed, oversized,
        over a limit, too slow), and block the peer past its budget (:class:`DropLedger`)."""
        self.drops.drop(peer, reason)

    def blocking(self) -> dict[str, float]:
        """Peers whose streams are closed unread now, {peer ID: seconds left}."""
        return self.drops.blocking()

    def open_streams(self, peer: str | None = None) -> int:
        """Inbound requests being served now: from ``peer``, or from everybody."""
        return self.server.open_streams(peer)

    async def add_handler(self, name: str, handler: Handler, *, max_payload: int = 0) -> None:
        """Serve RPC ``name``: ``handler(peer_id, header, payload) -> (header, payload)``, on
        streams of its own and in sessions (:meth:`serving.Server.add_handler` has the rules).

        Args:
            max_payload: largest request payload accepted (bytes); a request declaring more is
                refused before any of its payload is read.

        Raises:
            ValueError: ``max_payload`` < 0.
        """
        await self.server.add_handler(name, handler, max_payload=max_payload)

    def daemon_running(self) -> bool:
        """Whether p2pd still runs (True when its PID is unknown)."""
        with contextlib.suppress(psutil.Error):
            return self.daemon_pid is None or psutil.Process(self.daemon_pid).status() != psutil.STATUS_ZOMBIE
        return False

    async def shutdown(self) -> None:
        """Stop the DHT node and the daemon; waits for p2pd to exit."""
        if self._clock_task is not None:
            self._clock_task.cancel()
        self._closing = True
        for task in list(self._opening.values()):
            task.cancel()
        await self.server.close()
        await asyncio.gather(*(s.wait_closed() for s in list(self._sessions.values())), *self._opening.values(),
                             return_exceptions=True)
        try:  # a daemon answers in milliseconds; one that is exiting too (SIGTERM to the group) never does
            await asyncio.wait_for(self._dht.shutdown(), 1.0 if self.daemon_running() else 0.5)
        except Exception as e:
            log.debug("DHT shutdown: %s", e)
        try:
            await asyncio.wait_for(self._p2p.shutdown(), 10)
        except Exception as e:
            log.debug("p2p shutdown: %s", e)
        if self.daemon_pid is not None and psutil.pid_exists(self.daemon_pid):
            with contextlib.suppress(psutil.Error):
                daemon = psutil.Process(self.daemon_pid)
                daemon.kill()
                # a p2pd we started ourselves (daemon.start_daemon, static relays) is reaped by asyncio's
                # child watcher, not by hivemind's shutdown: wait for its exit here
                for _ in range(250):
                    if daemon.status() == psutil.STATUS_ZOMBIE:
                        break
                    await asyncio.sleep(0.02)

