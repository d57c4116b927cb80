"""Two home nodes, each behind its own NAT router, and one public bootstrap peer (the only
public peer): how soon they merge, whether they go on merging once the bootstrap peer is
gone, and what a node that lost every relay says (docs/operating.md "Running a node at
home"). Real nodes and p2pd in network namespaces (tests/internet/topology.py); assertions on
status JSON only. Run with ``python -m pytest -q tests/internet/test_nat_fast.py``.

``FIRST_MERGE_WAIT_S`` only bounds how long the test waits, so that a slow first merge is
measured (and printed) rather than cut off; the assertion is ``FIRST_MERGE_S``."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.conftest import TINY, wait_for
from tests.internet.test_nat import PUB_NAME, RELAY_NAME, Hosts, _status
from tests.internet.topology import Internet, unavailable

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
    wait_for(lambda: all(_merged(d) > 0 for _, d in nodes.values()), FIRST_MERGE_WAIT_S,
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
        proc.terminate()
        harness.wait(proc, 60, d / "node.log")
