"""Whether other peers can dial this node: the dial-back check, circuit relays, and what
``node status`` says about it (docs/operating.md "Running a node at home").

A node behind a NAT router dials out but cannot be dialled. libp2p's AutoNAT (in p2pd)
answers this on the internet, but its servers dial back only globally routable addresses
(go-multiaddr's ``IsPublicAddr``: never inside a private or documentation network), and p2pd
gives its verdict to no client. So the node checks for itself: it asks up to ``CHECKERS`` of
its initial peers (``net.dialback``) to open a TCP connection to its listening ports at the
IP address they see its connection come from. Any success: ``reachable``; answers without
one: ``unreachable``; no answer: ``unknown``.

Modes (``swarm.reachability``; :func:`daemon_options`):

* ``auto`` (default): check; then (:meth:`Reachability.restart_mode`) a node found
  unreachable with relays on restarts p2pd forced private with its initial peers as static
  relays, so that it reserves a slot on them at once and announces a ``/p2p-circuit``
  address (circuit relay v2); a node found reachable (not on loopback) restarts it forced
  public, so that it relays for the run's nodes behind NAT.
* ``public``: p2pd forced public, no check; with relays on it serves as a relay for others
  (p2pd's relay service runs only on a public node). Bootstrap peers run this way.
* ``private``: forced private with the initial peers as static relays, no check.

Measured with hivemind 1.1.12's p2pd (go-libp2p v0.32.1) in network namespaces
(tests/internet/test_nat_fast.py: two nodes each behind its own NAT router, one public
bootstrap peer): started through ``P2P.create``, which leaves p2pd's relay discovery on,
autorelay waits for 4 candidate relays or its 3-minute boot delay (``RELAY_BOOT_DELAY_S``)
before its first reservation: no merged round within the nodes' 240 s run (relayed some
180 s after the start; 194 s to the first merge in an earlier measurement). With static
relays (p2pd ``-relayDiscovery=0 -trustedRelays``, which ``P2P.create`` cannot pass:
``daemon.start_daemon`` starts that p2pd itself and joins it with ``P2P.replicate``) the slot
comes at once: first merged round 7.3 s after the start. Autorelay then waits for every
static relay: one initial peer that is down or serves no relay (a NATed one) brings back the
3-minute wait. Hole punching (DCUtR) is on (p2pd's ``-autonat``), but go-libp2p starts it only
once the node knows a public address of its own, confirmed by 4 peers' observations: not in
tests/internet, where each home node has one direct peer. Once every relay is gone, a NATed
node says so (``lost_relay``, ``lost_at``; the node's "alone" reason ``no_relay``). Relay
limits are p2pd's defaults, which hivemind's ``P2P.create`` cannot change: 128 reservations,
16 circuits per peer, each relayed connection reset after 30 min or 4 GiB each way (our RPCs
then open a new one).

Served checks are bounded: one per peer per ``MIN_INTERVAL_S``, ``MAX_CONCURRENT`` at once and
``MAX_PER_INTERVAL`` per ``MIN_INTERVAL_S`` in all, at most ``records.MAX_DIALBACK_PORTS`` ports, each a single TCP connect with a
``CONNECT_TIMEOUT_S`` deadline, and only to the caller's own observed IP address (no
third party can be made a target).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.errors import NetworkError, ProtocolError
from p2pdiloco.net.records.parse import MAX_DIALBACK_PORTS, DialbackAnswer, parse_dialback_answer, parse_dialback_request

if TYPE_CHECKING:
    from p2pdiloco.net.transport.swarm import Swarm

log = logging.getLogger(__name__)

ReachabilityMode = Literal["auto", "public", "private"]
Verdict = Literal["reachable", "unreachable", "unknown"]

RPC = "net.dialback"
CHECKERS = 3  # initial peers asked
CALL_TIMEOUT_S = 10.0  # seconds for one peer's whole answer (its connects included)
CONNECT_TIMEOUT_S = 3.0  # seconds for one TCP connect of a checker
MIN_INTERVAL_S = 10.0  # a peer gets one check per this many seconds ...
MAX_CONCURRENT = 4  # ... at most this many checks run at once ...
MAX_PER_INTERVAL = 32  # ... and at most this many start per MIN_INTERVAL_S (peer IDs are free to make)
MAX_REMEMBERED = 4096  # peers whose last check time is kept (oldest forgotten)
RELAY_BOOT_DELAY_S = 180.0  # autorelay's boot delay: its first reservation with relay discovery, < 4 candidates
LOST_AFTER = 2  # refreshes in a row (5 s apart) without the relay address before a slot counts as lost


def daemon_options(mode: ReachabilityMode | None, relay: bool, initial_peers: Sequence[str]) -> dict[str, Any]:
    """Keyword arguments of hivemind's ``P2P.create`` for a node in ``mode`` (None: leave
    reachability to p2pd's AutoNAT, no relay reservation: library callers and tests)."""
    if mode is None:
        return {}
    options: dict[str, Any] = {"use_relay": relay, "force_reachability": None if mode == "auto" else mode}
    if relay and mode == "private" and initial_peers:  # a slot at once (daemon.start_daemon, static relays)
        options["static_relays"] = list(initial_peers)
    elif relay and mode != "public":
        options.update(use_auto_relay=True, trusted_relays=list(initial_peers) or None)
    return options


def listen_ports(maddrs: Sequence[str]) -> list[int]:
    """TCP ports of the direct (not relayed) addresses among ``maddrs``, at most
    ``MAX_DIALBACK_PORTS``."""
    ports = []
    for m in maddrs:
        parts = m.strip("/").split("/")
        if "p2p-circuit" not in parts and "tcp" in parts:
            i = parts.index("tcp") + 1
            if i < len(parts) and parts[i].isdigit() and 0 < int(parts[i]) < 65536 and int(parts[i]) not in ports:
                ports.append(int(parts[i]))
    return ports[:MAX_DIALBACK_PORTS]


def relays_in(maddrs: Sequence[str]) -> list[str]:
    """Peer IDs of the relays in ``maddrs`` (``.../p2p/RELAY/p2p-circuit/...``)."""
    out = []
    for m in maddrs:
        parts = m.strip("/").split("/")
        for i, part in enumerate(parts[:-1]):
            if part == "p2p" and parts[i + 2:i + 3] == ["p2p-circuit"] and parts[i + 1] not in out:
                out.append(parts[i + 1])
    return out


@dataclass
class Reachability:
    """What this node knows about being dialled. One owner: the node's :class:`Swarm`
    (:meth:`check` at start, :meth:`refresh` from the node's swarm view)."""

    mode: ReachabilityMode = "auto"
    relay: bool = True
    verdict: Verdict = "unknown"
    observed: str | None = None  # this node's IP address as the checkers saw it
    checked_by: list[str] = field(default_factory=list)
    restarted: bool = False  # p2pd was restarted forced private after the check
    maddrs: list[str] = field(default_factory=list)  # announced addresses, last read
    relayed_peers: frozenset[str] = frozenset()  # peers connected to us only through a relay
    lost_relay: bool = False  # held a relay slot, then lost every one (its connection was reset, the relay gone)
    lost_at: float | None = None  # Unix time (s) of that loss; None while it holds a slot
    _relay_misses: int = 0  # refreshes in a row without the relay address once held

    async def check(self, swarm: Swarm, initial_peers: Sequence[str]) -> Verdict:
        """Ask up to ``CHECKERS`` of ``initial_peers`` (multiaddrs with /p2p/) to dial us back
        at our listening ports; sets :attr:`verdict`, :attr:`observed`, :attr:`checked_by`. A
        failure of the check itself (the daemon's answers) leaves the verdict ``unknown``."""
        try:
            return await self._check(swarm, initial_peers)
        except Exception as e:  # informative only: the node runs without a verdict
            log.info("dial-back check failed: %s", e)
            return self.verdict

    async def _check(self, swarm: Swarm, initial_peers: Sequence[str]) -> Verdict:
        self.maddrs = await swarm.visible_maddrs()
        ports = listen_ports(self.maddrs)
        peers = list(dict.fromkeys(m.rsplit("/p2p/", 1)[-1] for m in initial_peers if "/p2p/" in m))
        peers = [p for p in peers if p != swarm.peer_id]
        random.shuffle(peers)
        if not ports or not peers:
            return self.verdict

        async def ask(peer: str) -> tuple[str, DialbackAnswer | None]:
            try:
                header, _ = await swarm.call(peer, RPC, {"ports": ports}, timeout=CALL_TIMEOUT_S, max_reply=0)
                return peer, parse_dialback_answer(header)
            except (NetworkError, ProtocolError) as e:
                log.debug("dial-back check by %s: %s", peer[-8:], e)
                return peer, None

        answers = [(p, a) for p, a in await asyncio.gather(*(ask(p) for p in peers[:CHECKERS])) if a is not None]
        self.checked_by = [p for p, _ in answers]
        if answers:
            self.observed = answers[0][1].observed
            self.verdict = "reachable" if any(a.reachable for _, a in answers) else "unreachable"
        log.info("dial-back check: %s (%d of %d peers answered%s)", self.verdict, len(answers), min(len(peers), CHECKERS),
                 f", seen as {self.observed}" if self.observed else "")
        return self.verdict

    async def refresh(self, swarm: Swarm) -> int:
        """Re-read the announced addresses (a relay reservation adds ``/p2p-circuit`` ones)
        and which peers reach us only through a relay (their traffic is counted as relayed);
        returns the number of peers connected now."""
        had, self.maddrs = relays_in(self.maddrs) or self._relay_misses, await swarm.visible_maddrs(latest=True)
        if relays_in(self.maddrs):
            self.lost_relay, self.lost_at, self._relay_misses = False, None, 0
        elif had:  # a slot held, now gone: lost after LOST_AFTER refreshes in a row (not a blip)
            self._relay_misses += 1
            if self._relay_misses == LOST_AFTER:
                self.lost_relay, self.lost_at = True, time.time()
                log.warning("lost the relay slot: peers cannot dial this node until it gets one again")
        conns = await swarm.connections()
        self.relayed_peers = frozenset(p for p, addrs in conns.items()
                                       if addrs and all("/p2p-circuit" in a for a in addrs))
        swarm.stats.relayed = self.relayed_peers
        return len(conns)

    def restart_mode(self) -> ReachabilityMode | None:
        """How p2pd should run after the check in mode ``auto`` with relays on: ``private``
        (unreachable: static relays, a slot at once), ``public`` (a checker dialled us back at
        a non-loopback address: serve as a relay), None (keep it as it is: unknown, or a
        loopback-only swarm)."""
        if self.mode != "auto" or not self.relay:
            return None
        if self.verdict == "unreachable":
            return "private"
        if self.verdict == "reachable" and self.observed is not None and not ipaddress.ip_address(self.observed).is_loopback:
            return "public"
        return None

    def state(self, maddrs: Sequence[str] | None = None) -> str:
        """One of: ``relayed`` (behind NAT, reachable through a relay), ``behind NAT`` (not
        dialable, no relay slot yet or relays off), ``public`` (a peer dialled us back),
        ``loopback only``, ``direct``, ``direct, private network only`` (not checked: from the
        announced addresses alone)."""
        maddrs = list(self.maddrs if maddrs is None else maddrs)
        if relays_in(maddrs):
            return "relayed"
        kinds = _address_kinds(maddrs)
        if not kinds or kinds == {"loopback"}:
            return "loopback only"
        if self.verdict == "unreachable" or self.mode == "private":
            return "behind NAT"
        if self.verdict == "reachable" or self.mode == "public":
            return "public"
        return "direct" if "global" in kinds else "direct, private network only"

    def advice(self, maddrs: Sequence[str] | None = None) -> str | None:
        """What the person running the node can do, or None when nothing is needed."""
        if self.state(maddrs) != "behind NAT":
            return None
        if not self.relay:
            return ("peers cannot dial this node and relays are off (swarm.relay = false): it merges only with peers "
                    "it can dial itself; turn relays on, or forward a port and set swarm.announce")
        if self.lost_relay:
            return ("this node lost every relay slot (the relay is gone, or the connection to it was reset) and libp2p's autorelay "
                    "may not reserve one again for a long while: it merges only with peers it can dial itself; "
                    "restart the node to reserve a new slot, or forward a port and set swarm.announce")
        return (f"peers cannot dial this node yet: it asked its initial peers for a relay slot (seconds after the "
                f"start when every initial peer serves as a relay, else about {RELAY_BOOT_DELAY_S:.0f} s: give only "
                "public peers as initial peers); until then it merges only with peers it can dial itself. A forwarded "
                "port with swarm.announce avoids the relay")

    def status(self, bytes_relayed: int, maddrs: Sequence[str] | None = None) -> dict[str, Any]:
        """JSON-able: ``state`` (:meth:`state`), ``mode``, ``relay`` (relays on), ``check``
        (the dial-back verdict), ``observed`` (IP), ``checked_by`` (peer IDs), ``relays``
        (peer IDs of our relays), ``lost_relay`` (a slot it held is gone), ``relayed_peers`` (count), ``bytes_relayed`` (RPC payload
        bytes, both directions, with peers reached only through a relay), ``advice``;
        ``maddrs``: the announced addresses (default: as last read)."""
        maddrs = list(self.maddrs if maddrs is None else maddrs)
        return {"state": self.state(maddrs), "mode": self.mode, "relay": self.relay, "check": self.verdict,
                "observed": self.observed, "checked_by": list(self.checked_by), "restarted": self.restarted,
                "relays": relays_in(maddrs), "lost_relay": self.lost_relay, "relayed_peers": len(self.relayed_peers),
                "bytes_relayed": bytes_relayed, "advice": self.advice(maddrs)}


def _address_kinds(maddrs: Sequence[str]) -> set[str]:
    kinds = set()
    for m in maddrs:
        parts = m.strip("/").split("/")
        if len(parts) >= 2 and parts[0].startswith("dns"):
            kinds.add("global")
        elif len(parts) >= 2 and parts[0] in ("ip4", "ip6") and "p2p-circuit" not in parts:
            try:
                ip = ipaddress.ip_address(parts[1])
            except ValueError:
                continue
            kinds.add("loopback" if ip.is_loopback else "global" if ip.is_global else "private")
    return kinds


class DialbackServer:
    """The ``net.dialback`` handler: open a TCP connection to the caller's observed IP at each
    port it asks for (bounded as the module docstring says)."""

    def __init__(self, swarm: Swarm):
        self.swarm = swarm
        self.last: OrderedDict[str, float] = OrderedDict()  # peer -> time of its last check
        self.running = 0

    async def __call__(self, peer: str, header: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        ports = parse_dialback_request(header)
        now = swarm_clock.monotonic()
        recent = sum(1 for t in self.last.values() if now - t < MIN_INTERVAL_S)  # at most MAX_REMEMBERED
        if now - self.last.get(peer, -MIN_INTERVAL_S) < MIN_INTERVAL_S or self.running >= MAX_CONCURRENT \
                or recent >= MAX_PER_INTERVAL:
            raise ProtocolError(f"busy: one dial-back check per peer per {MIN_INTERVAL_S:g} s, "
                                f"{MAX_CONCURRENT} at once, {MAX_PER_INTERVAL} per {MIN_INTERVAL_S:g} s")
        self.last[peer] = now
        self.last.move_to_end(peer)
        while len(self.last) > MAX_REMEMBERED:
            self.last.popitem(last=False)
        self.running += 1  # counted before the first await: concurrent requests see it
        try:
            ip = observed_ip((await self.swarm.connections()).get(peer, []))
            if ip is None:
                raise ProtocolError("no direct connection from you: cannot tell your address")
            opened = await asyncio.gather(*(_connects(ip, port) for port in ports))
        finally:
            self.running -= 1
        return {"observed": ip, "reachable": [p for p, ok in zip(ports, opened) if ok]}, b""


def observed_ip(remote_maddrs: Sequence[str]) -> str | None:
    """The IP address of the first direct connection among a peer's ``remote_maddrs``."""
    for m in remote_maddrs:
        parts = m.strip("/").split("/")
        if len(parts) >= 2 and parts[0] in ("ip4", "ip6") and "p2p-circuit" not in parts:
            try:
                return str(ipaddress.ip_address(parts[1]))
            except ValueError:
                continue
    return None


async def _connects(ip: str, port: int) -> bool:
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            _, writer = await asyncio.open_connection(ip, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
