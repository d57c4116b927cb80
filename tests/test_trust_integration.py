"""Trust with real node processes: a private swarm refuses outsiders while its members train
on; a second node with an identity already in use refuses to start."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from p2pdiloco.net.transport.identity_check import probe_verdict
from p2pdiloco.trust.certificates import SwarmKey
from p2pdiloco.trust.identity import Identity

from tests.conftest import TINY, read_report, wait_for

pytestmark = pytest.mark.integration


def _wait_training(harness, proc, d: Path, timeout: float = 90) -> None:
    def training() -> bool:
        assert proc.poll() is None, (d / "node.log").read_text()[-3000:]
        try:
            # a node that sees no other node of its run yet says "alone" while it trains (node.alone)
            return json.loads((d / "status.json").read_text()).get("state") in ("training", "alone")
        except (OSError, ValueError):
            return False

    wait_for(training, timeout, lambda: f"{d.name} training:\n{(d / 'node.log').read_text()[-3000:]}",
             every=0.3, tick=harness.track_daemons)


def _log(d: Path) -> str:
    return (d / "node.log").read_text()


@pytest.mark.timeout(300)
def test_private_swarm_refuses_outsiders_and_members_carry_on(harness, tmp_path: Path):
    owner = SwarmKey.generate()
    keys = tmp_path / "keys"
    keys.mkdir()
    swarm = ["--set", f"trust.swarm_key={owner.public_key.hex()}"]

    def member(name: str, valid_for: float = 3600, now: float | None = None) -> list[str]:
        ident, _ = Identity.load_or_create(keys / f"{name}.key")
        owner.admit(ident.public_key, valid_for=valid_for, now=now).save(keys / f"{name}.cert")
        return [*swarm, "--set", f"trust.identity={keys / f'{name}.key'}",
                "--set", f"trust.certificate={keys / f'{name}.cert'}"]

    maddr = harness.bootstrap()
    settings = {**TINY, "data.num_shards": "2"}
    members = [harness.node(maddr, f"m{i}", {**settings, "data.shard_index": str(i)}, "--duration", "25",
                            *member(f"m{i}")) for i in range(2)]
    for proc, d in members:
        _wait_training(harness, proc, d)
    # an outsider with no swarm key: the members' records tell it the run is private, they refuse it
    outsider, od = harness.node(maddr, "outsider", settings, "--duration", "10")
    # a former member whose certificate expired an hour ago: refused before it joins
    lapsed, ld = harness.node(maddr, "lapsed", settings, "--duration", "10",
                              *member("lapsed", valid_for=600, now=time.time() - 4200))
    assert harness.wait(outsider, 120, od / "node.log") == 1, _log(od)[-3000:]
    assert "p2pdiloco: the swarm refused this node" in _log(od)
    assert "not a member of private swarm" in _log(od) and "presented no membership certificate" in _log(od)
    assert harness.wait(lapsed, 60, ld / "node.log") == 2, _log(ld)[-3000:]
    assert "p2pdiloco: this node cannot join private swarm" in _log(ld) and "expired at" in _log(ld)
    for proc, d in members:
        assert harness.wait(proc, 180, d / "node.log") == 0, _log(d)[-3000:]
    reports = [read_report(d) for _, d in members]
    assert reports[0]["global_digest"] == reports[1]["global_digest"]
    assert any(r["rounds_committed"] > r["rounds_alone"] for r in reports), "the members never merged together"
    assert sum(sum(r["refused"].values()) for r in reports) >= 1  # they saw and refused the outsider


def test_identity_probe_verdicts():
    """p2pd's answers to the identity probe's dial (messages as p2pd 1.1 words them, seen on
    this machine): up (protocol refused), not up (no route, or every dial failed), and not
    known yet (an empty routing table, right after the probe daemon started: asked again)."""
    assert probe_verdict("Connect failed. msg=failed to negotiate protocol: protocols not supported: "
                         "[p2pdiloco.identity-probe]") is True
    assert probe_verdict("Connect failed. msg=routing: not found") is False
    assert probe_verdict("Connect failed. msg=failed to dial: failed to dial 12D3KooW...: all dials failed") is False
    assert probe_verdict("Connect failed. msg=failed to find any peer in table") is None


@pytest.mark.long
@pytest.mark.timeout(240)
def test_second_node_with_the_same_identity_refuses_to_start(harness, tmp_path: Path):
    """Long (opt-in): by default, test_trust_net's test of the same name (the identity-in-use
    check between two real peers, in process) covers it."""
    key = tmp_path / "shared.key"
    Identity.load_or_create(key)
    maddr = harness.bootstrap()
    first, d0 = harness.node(maddr, "first", TINY, "--duration", "15", "--set", f"trust.identity={key}")
    _wait_training(harness, first, d0)
    second, d1 = harness.node(maddr, "second", TINY, "--duration", "15", "--set", f"trust.identity={key}")
    assert harness.wait(second, 60, d1 / "node.log") == 2, _log(d1)[-3000:]  # a configuration error
    assert not (d1 / "report.json").exists()  # refused before training
    assert first.poll() is None  # the first node trains on; stopped as a supervisor would (test_stop)
    os.killpg(first.pid, signal.SIGTERM)
    assert harness.wait(first, 60, d0 / "node.log") == 0, _log(d0)[-3000:]


@pytest.mark.timeout(240)
def test_an_excluded_contribution_is_counted_and_its_node_ends_with_the_swarm(harness):
    """Three members with the drop policy, one sending its pseudo-gradient x1000 (``p2pdiloco.chaos.inject --poison scale``):
    the reducers drop it as a norm outlier (factor 50: far above any honest spread, so only the
    poisoner is ever dropped) and the two others commit without it. The poisoner
    counts those rounds as excluded, not failed (its progress stays, rebased on the state it
    follows, for its next round: ``Node._round``), and all three end at the same digest."""
    maddr = harness.bootstrap()
    settings = {**TINY, "data.num_shards": "3", "trust.outliers": "drop", "trust.outlier_factor": "50"}
    nodes = [harness.node(maddr, f"n{i}", {**settings, "data.shard_index": str(i)}, "--duration", "15",
                          "--set", "settle=20", inject=("--poison", "scale") if i == 2 else ()) for i in range(3)]
    for proc, d in nodes:
        assert harness.wait(proc, 180, d / "node.log") == 0, _log(d)[-3000:]
    reports = [read_report(d) for _, d in nodes]
    assert len({r["global_digest"] for r in reports}) == 1, [r["fragments"] for r in reports]
    assert reports[2]["rounds_excluded"] >= 1, reports[2]["recent_rounds"]
    assert reports[0]["rounds_excluded"] == reports[1]["rounds_excluded"] == 0, [r["rejected"] for r in reports]
    assert sum(r["rejected"].get("outlier", 0) for r in reports) >= reports[2]["rounds_excluded"]
