"""Reachability (``p2pdiloco.net.transport.reachability``): the rules by hand, and the dial-back check
between real peers over loopback. Behind-NAT cases run in network namespaces:
tests/internet/test_nat.py."""

from __future__ import annotations

import asyncio

import pytest

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.transport import reachability as reach
from p2pdiloco.net.rounds.matchmaking import GroupKey, Matchmaker
from p2pdiloco.net.transport.reachability import Reachability, daemon_options, listen_ports, observed_ip, relays_in

from tests.conftest import swarms

RELAY = "12D3KooWRe1ayRe1ayRe1ayRe1ayRe1ayRe1ayRe1ayRe1ayRe1a"
ME = "12D3KooWMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMeMe"
BOOT = "/ip4/203.0.113.10/tcp/31337/p2p/" + RELAY


def test_daemon_options_per_mode():
    assert daemon_options(None, True, [BOOT]) == {}  # library callers: p2pd decides, as before
    assert daemon_options("auto", True, [BOOT]) == {"use_relay": True, "force_reachability": None,
                                                    "use_auto_relay": True, "trusted_relays": [BOOT]}
    assert daemon_options("private", True, []) == {"use_relay": True, "force_reachability": "private",
                                                   "use_auto_relay": True, "trusted_relays": None}
    # forced private with initial peers: they are its static relays, a slot reserved at once (daemon.start_daemon)
    assert daemon_options("private", True, [BOOT]) == {"use_relay": True, "force_reachability": "private",
                                                       "static_relays": [BOOT]}
    # a public node serves relays (p2pd's relay service runs on public nodes) and reserves none
    assert daemon_options("public", True, [BOOT]) == {"use_relay": True, "force_reachability": "public"}
    assert daemon_options("private", False, [BOOT]) == {"use_relay": False, "force_reachability": "private"}


def test_static_relays_one_address_per_peer():
    """p2pd counts each static relay string as a relay, and autorelay waits for that many
    distinct ones before it reserves: one address per peer, the first given, in order."""
    from p2pdiloco.net.transport.daemon import one_addr_per_peer

    other = BOOT.replace(RELAY, ME)
    assert one_addr_per_peer([BOOT, f"/dns4/relay.example/tcp/31337/p2p/{RELAY}", other, "/ip4/1.2.3.4/tcp/1"]) \
        == [BOOT, other]


def test_addresses_ports_relays_and_observed_ip():
    maddrs = [f"/ip4/10.1.0.2/tcp/4001/p2p/{ME}", f"/ip4/127.0.0.1/tcp/4001/p2p/{ME}", "/ip4/10.1.0.2/udp/4001/quic",
              f"/ip4/203.0.113.10/tcp/31337/p2p/{RELAY}/p2p-circuit/p2p/{ME}", "/ip6/::1/tcp/4002"]
    assert listen_ports(maddrs) == [4001, 4002]  # the relay's port is not ours
    assert relays_in(maddrs) == [RELAY]
    assert relays_in(maddrs[:3]) == []
    assert listen_ports([f"/ip4/1.2.3.4/tcp/{p}" for p in range(1, 10)]) == [1, 2, 3, 4]  # MAX_DIALBACK_PORTS
    assert observed_ip([f"/ip4/203.0.113.10/tcp/1/p2p/{RELAY}/p2p-circuit", "/ip4/198.51.100.7/tcp/5"]) == "198.51.100.7"
    assert observed_ip([f"/ip4/203.0.113.10/tcp/1/p2p/{RELAY}/p2p-circuit"]) is None
    assert observed_ip(["/ip4/999.1.1.1/tcp/5", "/dns4/x/tcp/1"]) is None


@pytest.mark.parametrize("mode, relay, verdict, maddrs, state, advice", [
    ("auto", True, "unknown", ["/ip4/127.0.0.1/tcp/1"], "loopback only", False),
    ("auto", True, "unknown", ["/ip4/8.8.8.8/tcp/1"], "direct", False),
    ("auto", True, "unknown", ["/ip4/192.168.1.5/tcp/1"], "direct, private network only", False),
    ("auto", True, "reachable", ["/ip4/203.0.113.11/tcp/1"], "public", False),
    ("public", True, "unknown", ["/ip4/203.0.113.10/tcp/1"], "public", False),
    ("auto", True, "unreachable", ["/ip4/10.1.0.2/tcp/1"], "behind NAT", True),
    ("private", False, "unknown", ["/ip4/10.1.0.2/tcp/1"], "behind NAT", True),
    ("private", True, "unreachable", ["/ip4/10.1.0.2/tcp/1", f"/ip4/203.0.113.10/tcp/1/p2p/{RELAY}/p2p-circuit"],
     "relayed", False),
])
def test_state_and_advice(mode, relay, verdict, maddrs, state, advice):
    r = Reachability(mode, relay, verdict, maddrs=maddrs)
    assert r.state() == state
    assert (r.advice() is not None) == advice
    if advice:
        assert ("relays are off" in r.advice()) == (not relay)
    status = r.status(bytes_relayed=7)
    assert status["state"] == state and status["check"] == verdict and status["bytes_relayed"] == 7
    assert status["relays"] == ([RELAY] if state == "relayed" else [])


def test_how_p2pd_runs_after_the_check():
    assert Reachability("auto", True, "unreachable", observed="203.0.113.21").restart_mode() == "private"
    assert Reachability("auto", True, "reachable", observed="203.0.113.11").restart_mode() == "public"  # relays
    assert Reachability("auto", True, "reachable", observed="127.0.0.1").restart_mode() is None  # one machine
    assert Reachability("auto", True, "unknown").restart_mode() is None
    assert Reachability("auto", False, "unreachable", observed="203.0.113.21").restart_mode() is None
    assert Reachability("private", True, "unreachable").restart_mode() is None  # no check, as set


def test_a_lost_relay_slot_is_said_with_its_remedy():
    r = Reachability("private", True, "unreachable", maddrs=["/ip4/10.1.0.2/tcp/1"], lost_relay=True)
    status = r.status(bytes_relayed=0)
    assert status["state"] == "behind NAT" and status["lost_relay"] is True and "restart the node" in status["advice"]
    r.maddrs.append(f"/ip4/203.0.113.10/tcp/1/p2p/{RELAY}/p2p-circuit")  # holds a slot again: nothing to advise
    assert r.state() == "relayed" and r.advice() is None


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_private_node_runs_its_own_p2pd_with_static_relays(no_daemon_left):
    """Forced private with initial peers, p2pd is started by us (static relays, joined with
    ``P2P.replicate``; daemon.start_daemon): it runs with the node's identity, answers RPCs
    both ways, is the daemon the swarm names, and ends with the swarm."""
    import psutil

    from p2pdiloco.net.transport.swarm import Swarm

    async with swarms(1) as (boot,):
        peers = await boot.visible_maddrs()
        node = await Swarm.start(initial_peers=peers, reachability="private")
        try:
            assert node.daemon_pid is not None and psutil.Process(node.daemon_pid).name() == "p2pd"
            assert "-relayDiscovery=0" in psutil.Process(node.daemon_pid).cmdline()
            assert await boot.hello(node.peer_id) == await node.hello(boot.peer_id)
        finally:
            await node.shutdown()
        assert not psutil.pid_exists(node.daemon_pid) or psutil.Process(node.daemon_pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_dialback_between_real_peers_on_loopback(monkeypatch, no_daemon_left):
    """b asks a to dial it back: reachable at b's own port, seen as 127.0.0.1; a closed port is
    not reachable; a second check within MIN_INTERVAL_S and a malformed request are refused
    (answered as errors, nothing else happens); a checker that is gone gives "unknown"."""
    async with swarms(3) as (a, b, c):
        a_maddrs = await a.visible_maddrs()
        assert await b.reach.check(b, a_maddrs) == "reachable"
        assert b.reach.observed == "127.0.0.1" and b.reach.checked_by == [a.peer_id]
        with pytest.raises(ProtocolError, match="busy"):
            await b.call(a.peer_id, reach.RPC, {"ports": [1]}, timeout=10)
        with pytest.raises(ProtocolError, match="ports"):
            await c.call(a.peer_id, reach.RPC, {"ports": list(range(1, 100))}, timeout=10)
        monkeypatch.setattr(reach, "MIN_INTERVAL_S", 0.0)
        closed = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = closed.sockets[0].getsockname()[1]
        closed.close()
        await closed.wait_closed()
        header, _ = await c.call(a.peer_id, reach.RPC, {"ports": [port]}, timeout=10)
        assert header == {"observed": "127.0.0.1", "reachable": []}
        gone = a_maddrs
        await a.shutdown()
        fresh = Reachability()
        assert await fresh.check(c, gone) == "unknown" and fresh.checked_by == []


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_group_of_peers_that_cannot_deliver_their_state_does_not_make_a_node_late(no_daemon_left):
    """b closed a group at a's version (its declaration under the key is closed): a is "late"
    and would catch up with b's result. When b is among the peers a cannot fetch states from
    (both behind NAT without a relay: ``StateSync.ignoring``), catching up is impossible, so a
    merges on its own instead of waiting for a state it can never download; a closer it can
    fetch from (c) still makes it late."""
    async with swarms(3) as (a, b, c):
        key = GroupKey(0, 3, "c" * 64)
        mm_a = Matchmaker(a, "run", 1)
        await mm_a.start()
        await b.store(key.dht_key("run"), b.peer_id, {"open": False, "t": b.clock.now()}, 60)
        assert await mm_a.form_group(key, grace=0.5, quorum_timeout=2.0, expected=2) == ("late", None)
        mm_a.undeliverable = lambda: {b.peer_id}
        outcome, group = await mm_a.form_group(key, grace=0.5, quorum_timeout=2.0, expected=3)
        assert outcome == "group" and group.members == (a.peer_id,)
        # another closer whose state a can fetch: late again (it catches up from that one)
        await c.store(key.dht_key("run"), c.peer_id, {"open": False, "t": c.clock.now()}, 60)
        assert await mm_a.form_group(key, grace=0.5, quorum_timeout=2.0, expected=3) == ("late", None)


class _Connections:
    """The one call ``DialbackServer`` makes of its transport: every peer is connected from
    127.0.0.1; answers wait until ``release`` is set (holds checks in flight)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def connections(self) -> dict[str, list[str]]:
        await self.release.wait()
        return {p: ["/ip4/127.0.0.1/tcp/5"] for p in PEERS}


PEERS = [f"peer{i}" for i in range(40)]


@pytest.mark.asyncio
async def test_dialback_limits_concurrent_and_total_checks(monkeypatch):
    """Checks from distinct peers (peer IDs cost nothing): at most MAX_CONCURRENT in flight,
    counted before the handler's first await (six arriving together: four run, two are
    refused busy), and at most MAX_PER_INTERVAL started per MIN_INTERVAL_S in all."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = _Connections()
    dialback = reach.DialbackServer(transport)
    calls = [asyncio.create_task(dialback(p, {"ports": [port]}, b"")) for p in PEERS[:6]]
    done = await asyncio.gather(*calls[4:], return_exceptions=True)  # the two over the limit: refused at once
    assert all(isinstance(e, ProtocolError) and "busy" in str(e) for e in done)
    transport.release.set()
    answers = await asyncio.gather(*calls[:4])
    assert all(a == ({"observed": "127.0.0.1", "reachable": [port]}, b"") for a in answers)
    # 4 started so far; 28 more fit in this interval, the next is refused
    for p in PEERS[6:6 + reach.MAX_PER_INTERVAL - 4]:
        await dialback(p, {"ports": [port]}, b"")
    with pytest.raises(ProtocolError, match="busy"):
        await dialback(PEERS[-1], {"ports": [port]}, b"")
    server.close()
    await server.wait_closed()
