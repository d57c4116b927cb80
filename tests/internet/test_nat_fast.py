"""Two home nodes, each behind its own NAT router, and one public bootstrap peer (the only
public peer): how soon they merge, whether they go on merging once the bootstrap peer is
gone, and what a node that lost every relay says (docs/operating.md "Running a node at
home"). Real nodes and p2pd in network namespaces (bench/internet.py); assertions on
status JSON only. Run with ``python -m pytest -q tests/internet/test_nat_fast.py``.

``FIRST_MERGE_WAIT_S`` only bounds how long the test waits, so that a slow first merge is
measured (and printed) rather than cut off; the assertion is ``FIRST_MERGE_S``."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from tests.conftest import TINY, wait_for
from tests.internet.test_nat import PUB_NAME, RELAY_NAME, Hosts, _status
from bench.internet import Internet, unavailable

pytestmark = pytest.mark.usefixtures("no_daemon_left")

REASON = unavailable()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)

FIRST_MERGE_S = 30.0  # seconds from the nodes' start to a round merged on both
FIRST_MERGE_WAIT_S = 260.0


@pytest.fixture
def internet():
    with Internet("p2f" + uuid.uuid4().hex[:5], homes=2, public_hosts=("boot", "pub"),
                  names={RELAY_NAME: "boot", PUB_NAME: "pub"}) as net:
        yield net


def _merged(d) -> int:
    return _status(d).get("rounds_with_peers", 0)


def _running(nodes) -> None:
    """Fail at once, with its log's end, when a node has exited."""
    for h, (proc, d) in nodes.items():
        assert proc.poll() is None, (h, (d / "node.log").read_text()[-2000:])


@pytest.mark.timeout(600)
def test_two_nat_nodes_merge_within_seconds_and_say_when_their_only_relay_is_gone(internet, harness):
    """boot (bootstrap peer, the only public peer, a relay), h1 and h2 behind two NAT
    routers with default settings: both merge a round with the other within
    ``FIRST_MERGE_S`` of their start (each reserves a slot on boot at once). Then boot is
    killed: their relay slots go with it, and each says so in its status (``alone`` reason
    ``no_relay``, ``reach.lost_relay``) instead of blaming its initial peers."""
    hosts = Hosts(internet, harness)
    maddr = hosts.bootstrap("boot")
    settings = {**TINY, "settle": "0", "alone_after": "600"}
    t0 = time.monotonic()
    nodes = {h: hosts.node(h, maddr, settings, duration=240) for h in ("h1", "h2")}
    wait_for(lambda: _running(nodes) or all(_merged(d) > 0 for _, d in nodes.values()), FIRST_MERGE_WAIT_S,
             lambda: f"h1 and h2 merging: {[(_status(d).get('reach'), _merged(d)) for _, d in nodes.values()]}",
             every=0.5, tick=harness.track_daemons)
    first = time.monotonic() - t0
    print(f"\nfirst merged round on both NATed nodes {first:.1f} s after their start")
    assert first <= FIRST_MERGE_S, f"first merge {first:.1f} s after the start"

    internet.kill_host("boot")
    for h, (_, d) in nodes.items():
        def says(d=d) -> bool:
            s = _status(d)
            return (s.get("reach") or {}).get("lost_relay") and (s.get("alone") or {}).get("reason") == "no_relay"

        wait_for(says, 60, lambda d=d, h=h: f"{h} saying it lost its only relay: {_status(d).get('alone')}, "
                                            f"{_status(d).get('reach')}", every=0.5, tick=harness.track_daemons)
        assert _status(d)["reachability"] == "behind NAT"
    for h, (proc, d) in nodes.items():
        proc.signal_group(signal.SIGTERM)
        harness.wait(proc, 60, d / "node.log")


@pytest.mark.timeout(600)
def test_two_nat_nodes_keep_merging_through_a_member_relay_once_the_bootstrap_is_gone(internet, harness):
    """boot (bootstrap peer), pub (a node of the run on the public segment) and h1, h2 behind
    two NAT routers, given boot and pub as initial peers, default settings. pub's dial-back
    check says reachable: it runs p2pd forced public, a relay. h1 and h2 reserve slots on both
    at once and merge within ``FIRST_MERGE_S``. boot is killed: they keep merging, h1 and h2
    through pub's relay (their traffic with a peer reached only through a relay grows)."""
    hosts = Hosts(internet, harness)
    maddr = hosts.bootstrap("boot")
    settings = {**TINY, "settle": "0", "alone_after": "600"}
    pub = hosts.node("pub", maddr, {**settings, "swarm.announce": f"/dns4/{PUB_NAME}/tcp/4001"}, duration=300)[1]
    pub_id = wait_for(lambda: _status(pub).get("reach", {}).get("restarted") and _status(pub).get("peer_id"), 90,
                      lambda: f"pub restarted public after its check: {_status(pub).get('reach')}", every=0.5,
                      tick=harness.track_daemons)
    assert _status(pub)["reachability"] == "public"
    t0 = time.monotonic()
    nodes = {h: hosts.node(h, [maddr, f"/dns4/{PUB_NAME}/tcp/4001/p2p/{pub_id}"], settings, duration=240)
             for h in ("h1", "h2")}
    wait_for(lambda: _running(nodes) or all(_merged(d) > 0 and pub_id in (_status(d).get("reach") or {}).get("relays", [])
                         for _, d in nodes.values()), FIRST_MERGE_WAIT_S,
             lambda: f"h1 and h2 merging, relayed by pub: {[_status(d).get('reach') for _, d in nodes.values()]}",
             every=0.5, tick=harness.track_daemons)
    first = time.monotonic() - t0
    print(f"\nfirst merged round on both NATed nodes {first:.1f} s after their start (with a member relay)")
    assert first <= FIRST_MERGE_S, f"first merge {first:.1f} s after the start"

    internet.kill_host("boot")
    at_kill = {h: (_merged(d), _status(d).get("bytes_relayed", 0)) for h, (_, d) in nodes.items()}

    def going_on() -> bool:
        return all(_merged(d) >= at_kill[h][0] + 3 and _status(d).get("bytes_relayed", 0) > at_kill[h][1]
                   for h, (_, d) in nodes.items())

    wait_for(going_on, 150, lambda: f"h1 and h2 merging without boot: {at_kill} -> "
                                    f"{[(_merged(d), _status(d).get('bytes_relayed')) for _, d in nodes.values()]}",
             every=1, tick=harness.track_daemons)
    for h, (proc, d) in nodes.items():
        assert _status(d).get("alone") is None, (h, _status(d).get("alone"))
        proc.signal_group(signal.SIGTERM)
        harness.wait(proc, 60, d / "node.log")
