"""Nodes behind NAT on a simulated internet (bench/internet.py): a bootstrap peer and
a public node on the public segment, home nodes each behind its own NAT router. Real nodes,
real p2pd, one command each with default reachability settings; assertions on status and
report JSON only. Minutes long (a relay slot comes about 180 s after a NATed node's start):
not in the default suite; run with ``python -m pytest -q tests/internet``."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from p2pdiloco.procs import Proc
from tests.conftest import TINY, read_report, wait_for
from bench.internet import Internet, unavailable

pytestmark = pytest.mark.usefixtures("no_daemon_left")

# libp2p counts documentation ranges as unroutable: its DHT keeps no such address and autorelay
# announces no relay address through one, so public hosts announce names (resolved per namespace)
RELAY_NAME, PUB_NAME = "relay.example", "pub.example"
REASON = unavailable()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)


def _status(d: Path) -> dict:
    try:
        return json.loads((d / "status.json").read_text())
    except (OSError, ValueError):
        return {}


class Hosts:
    """Processes started inside the namespaces of ``net``, tracked by ``harness`` (killed with
    it; the namespaces' leftovers die with ``net``)."""

    def __init__(self, net: Internet, harness):
        self.net, self.harness = net, harness

    def spawn(self, host: str, args: list[str], log: Path) -> Proc:
        return self.harness.processes.start([*self.net.exec_prefix(host), sys.executable, *args], log,
                                            f"{host}:{log.parent.name}", cwd=Path(__file__).resolve().parents[2])

    def bootstrap(self, host: str, *extra: str) -> str:
        """Start a bootstrap peer on ``host`` announcing ``RELAY_NAME``; returns its multiaddr."""
        path = self.harness.tmp / "bootstrap.txt"
        proc = self.spawn(host, ["-m", "bootstrap", "--host", "0.0.0.0", "--port", "31337", "--maddrs-file", str(path),
                                 "--announce", f"/dns4/{RELAY_NAME}/tcp/31337", *extra], self.harness.tmp / "bootstrap.log")

        def started() -> str | None:
            assert proc.poll() is None, (self.harness.tmp / "bootstrap.log").read_text()
            text = path.read_text().split() if path.exists() else []
            return next((m for m in text if f"/{RELAY_NAME}/" in m), None)

        return wait_for(started, 60, "the bootstrap peer's public multiaddr", every=0.2)

    def node(self, host: str, maddr: str | list[str], settings: dict[str, str], duration: int) -> tuple[Proc, Path]:
        d = self.harness.tmp / host
        d.mkdir()
        args = ["-m", "node", "run", "--initial-peers", *([maddr] if isinstance(maddr, str) else maddr), "--host", "0.0.0.0", "--port", "4001", "--name", host,
                "--data-dir", str(d), "--report-file", str(d / "report.json"), "--status-file", str(d / "status.json"),
                "--run-id", "nat", "--duration", str(duration)]
        for k, v in settings.items():
            args += ["--set", f"{k}={v}"]
        return self.spawn(host, args, d / "node.log"), d


@pytest.fixture
def internet():
    with Internet("p2n" + uuid.uuid4().hex[:5], homes=2, public_hosts=("boot", "pub"),
                  names={RELAY_NAME: "boot", PUB_NAME: "pub"}) as net:
        yield net


@pytest.mark.timeout(1000)
def test_nodes_behind_nat_train_with_a_public_node_through_the_bootstrap_relay(internet, harness):
    """boot (bootstrap peer, relay) and pub on the public segment, h1 and h2 behind two NAT
    routers, all with default settings: pub's dial-back check says public; h1's and h2's say
    unreachable, they restart p2pd forced private and reserve a slot on boot (and on pub, a
    public node that serves as a relay too once p2pd finds itself public); their status turns
    "relayed" naming boot. Then h1's router resets every TCP connection (its relay slot and
    every relayed and direct connection break, rounds and downloads in flight fail) until h1
    has no connection left: h1 merges with peers again, and its status says it lost its relay
    slot (go-libp2p's autorelay backs off from relays it failed to reserve with while the
    router reset everything; p2pd has no setting for that) unless it holds one again. All
    three train one run: rounds with peers on every node, traffic with a peer reached through
    the relay counted, equal final digests."""
    hosts = Hosts(internet, harness)
    maddr = hosts.bootstrap("boot")
    boot_id = maddr.rsplit("/p2p/", 1)[1]
    settings = {**TINY, "settle": "25", "alone_after": "600"}
    nodes = {h: hosts.node(h, maddr, {**settings, **({"swarm.announce": f"/dns4/{PUB_NAME}/tcp/4001"} if h == "pub"
                                                      else {})}, duration=540) for h in ("pub", "h1", "h2")}
    for h in ("h1", "h2"):
        d = nodes[h][1]

        def relayed(d=d) -> bool:
            reach = _status(d).get("reach") or {}
            return _status(d).get("reachability") == "relayed" and boot_id in reach.get("relays", [])

        wait_for(relayed, 280, lambda d=d, h=h: f"{h} relayed through the bootstrap peer: {_status(d).get('reach')}",
                 every=2, tick=harness.track_daemons)
    d1 = nodes["h1"][1]
    wait_for(lambda: _status(d1).get("rounds_with_peers", 0) > 0, 120, lambda: f"h1 merging: {_status(d1)}", every=1,
             tick=harness.track_daemons)
    handle = internet.reset_tcp("h1")
    try:
        wait_for(lambda: _status(d1).get("connections") == 0, 90, lambda: f"h1 cut off: {_status(d1).get('connections')}",
                 every=0.5, tick=harness.track_daemons)
        cut = _status(d1)
    finally:
        internet.restore_tcp("h1", handle)

    def back() -> bool:
        s = _status(d1)
        said = s.get("reachability") == "relayed" or (s.get("reach") or {}).get("lost_relay")
        return said and s.get("rounds_with_peers", 0) >= cut["rounds_with_peers"] + 2

    wait_for(back, 300, lambda: f"h1 merging again, saying how it is reachable: {_status(d1).get('reach')}, "
                                f"{_status(d1).get('rounds_with_peers')} rounds with peers", every=2,
             tick=harness.track_daemons)
    for h, (proc, d) in nodes.items():
        assert harness.wait(proc, 540, d / "node.log") == 0, (d / "node.log").read_text()[-3000:]
    reports = {h: read_report(d) for h, (_, d) in nodes.items()}
    pub = reports["pub"]["reach"]
    assert reports["pub"]["reachability"] == "public" and pub["check"] == "reachable"
    assert pub["observed"] == internet.ip("pub") and pub["checked_by"] == [boot_id] and pub["advice"] is None
    for h in ("h1", "h2"):
        r = reports[h]["reach"]
        if h == "h1" and r["lost_relay"]:  # its slot went with the reset and was not reserved again
            assert reports[h]["reachability"] == "behind NAT" and "restart the node" in r["advice"], r
        else:
            assert reports[h]["reachability"] == "relayed" and boot_id in r["relays"], r  # pub may relay too
        assert r["check"] == "unreachable" and r["observed"] == internet.public_ip(h) and r["restarted"], r
    for h, report in reports.items():
        assert report["rounds_with_peers"] > 0, (h, report["recent_rounds"])
    assert reports["h1"]["bytes_relayed"] + reports["h2"]["bytes_relayed"] > 0, \
        {h: (r["bytes_relayed"], r["reach"]) for h, r in reports.items()}
    assert len({r["global_digest"] for r in reports.values()}) == 1, {h: r["fragments"] for h, r in reports.items()}


@pytest.mark.timeout(300)
def test_two_nat_nodes_without_a_relay_keep_training_and_say_why_they_cannot_merge(internet, harness):
    """The bootstrap peer serves no relay and the nodes have relays off: h1 and h2 see each
    other's records but neither can dial the other. Both keep training (alone rounds), their
    status says "behind NAT" with advice naming the relays, state alone with reason
    "unreachable"; both end on time with exit status 0."""
    hosts = Hosts(internet, harness)
    maddr = hosts.bootstrap("boot", "--no-relay")
    settings = {**TINY, "settle": "0", "alone_after": "15", "swarm.relay": "false"}
    nodes = {h: hosts.node(h, maddr, settings, duration=60) for h in ("h1", "h2")}
    for h, (_, d) in nodes.items():
        def unreachable(d=d) -> bool:
            s = _status(d)
            return s.get("state") == "alone" and (s.get("alone") or {}).get("reason") == "unreachable"

        wait_for(unreachable, 90, lambda d=d, h=h: f"{h} alone, unreachable: {_status(d)}", every=1,
                 tick=harness.track_daemons)
    for h, (proc, d) in nodes.items():
        assert harness.wait(proc, 120, d / "node.log") == 0, (d / "node.log").read_text()[-3000:]
        report = read_report(d)
        reach = report["reach"]
        assert report["reachability"] == "behind NAT" and reach["check"] == "unreachable" and not reach["restarted"]
        assert "relays are off" in reach["advice"] and reach["relays"] == []
        assert report["rounds_with_peers"] == 0 and report["rounds_committed"] == report["rounds_alone"] > 0
        assert report["alone"]["reason"] == "unreachable"
