"""Churn: faults scripted as "fail peer X at round R" on real node processes (issue: churn)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import psutil
import pytest

from tests.conftest import TINY, read_report

pytestmark = pytest.mark.integration


def _log(d) -> str:
    return (d / "node.log").read_text()


def _shards(i: int, n: int) -> dict[str, str]:
    return {**TINY, "data.num_shards": str(n), "data.shard_index": str(i)}


@pytest.mark.timeout(240)
def test_node_killed_in_allreduce_survivors_agree(harness):
    """A node SIGKILLed while its 3rd all-reduce runs: the survivors commit or discard that
    round together, keep merging, and end with equal global states (I1, I2); the dead node's
    p2pd does not outlive it (checked by the harness)."""
    maddr = harness.bootstrap()
    nodes = [harness.node(maddr, f"n{i}", _shards(i, 3), "--duration", "25", "--set", "settle=20",
                          *(["--set", "fault=kill-in-allreduce@3"] if i == 2 else [])) for i in range(3)]
    codes = [harness.wait(p, 200, d / "node.log") for p, d in nodes]
    assert codes[2] == -signal.SIGKILL, _log(nodes[2][1])[-2000:]
    assert codes[:2] == [0, 0], [_log(d)[-2000:] for _, d in nodes[:2]]
    survivors = [read_report(d) for _, d in nodes[:2]]
    assert survivors[0]["global_digest"] == survivors[1]["global_digest"]
    assert all(r["rounds_committed"] >= 6 for r in survivors)  # they kept merging after the kill
    for _, d in nodes[:2]:  # a discarded round never waited past grace + liveness timeout
        for line in _log(d).splitlines():
            if "discarded" in line and "no contribution" in line:
                assert "within 8.0 s" in line


@pytest.mark.timeout(240)
def test_member_that_loses_a_completed_round_follows_instead_of_retrying(harness):
    """n1 completes its 3rd all-reduce but treats it as lost (fault in the last stage): the
    others commit; n1 follows their state with its own contribution already inside (no
    double contribution, no solo retry at the old version) and ends at the same hash."""
    maddr = harness.bootstrap()
    nodes = [harness.node(maddr, f"n{i}", _shards(i, 3), "--duration", "20", "--set", "settle=20",
                          *(["--set", "fault=fail-last-stage@3"] if i == 1 else [])) for i in range(3)]
    for p, d in nodes:
        assert harness.wait(p, 200, d / "node.log") == 0, _log(d)[-2000:]
    reports = [read_report(d) for _, d in nodes]
    assert len({r["global_digest"] for r in reports}) == 1, [r["fragments"] for r in reports]
    log1 = _log(nodes[1][1]).splitlines()
    fault = next(i for i, line in enumerate(log1) if "injected fault fail-last-stage@3" in line)
    frag, version = re.search(r"round f(\d+) v(\d+) discarded", log1[fault]).groups()
    after = log1[fault + 1:]
    # it never merges that version alone: it follows the swarm's state of it instead
    assert not any(f"round f{frag} v{version}: 1 members" in line for line in after), log1[fault:]
    assert any(f"followed fragment {frag}: v{int(version) - 1} -> " in line for line in after), log1[fault:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_killed_node_restarts_with_same_identity_and_port_and_catches_up(harness):
    """SIGKILL of the node's main process alone: its p2pd exits with it; restarted on the same
    data dir and port it keeps its peer ID, resumes from its checkpoint, catches up with a
    bounded number of downloads and ends at the swarm's state."""
    maddr = harness.bootstrap()
    port = _free_port()
    p0, d0 = harness.node(maddr, "n0", _shards(0, 2), "--duration", "50", "--set", "settle=30")
    # settle outlasts n0's training: n1 keeps following until n0 is done and both agree
    extra = ["--port", str(port), "--set", "checkpoint_every=1", "--set", "settle=90"]
    p1, d1 = harness.node(maddr, "n1", _shards(1, 2), "--duration", "12", *extra)
    # both run; wait until n1 has trained and checkpointed
    end = time.monotonic() + 90
    while not (d1 / "checkpoint.pt").exists() and time.monotonic() < end:
        harness.track_daemons()
        time.sleep(0.2)
    assert (d1 / "checkpoint.pt").exists(), _log(d1)[-2000:]
    time.sleep(2)
    daemons = [c for c in psutil.Process(p1.pid).children(recursive=True) if c.name() == "p2pd"]
    assert daemons
    peer_before = (d1 / "status.json").read_text()
    os.kill(p1.pid, signal.SIGKILL)  # the main process only, not its group
    p1.wait(10)
    end = time.monotonic() + 10
    while any(d.is_running() and d.status() != psutil.STATUS_ZOMBIE for d in daemons) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(d.is_running() and d.status() != psutil.STATUS_ZOMBIE for d in daemons), "p2pd outlived its node"

    d1.rename(d1.with_name("n1-first"))
    first = d1.with_name("n1-first")
    d1.mkdir()
    for name in ("p2p.key", "checkpoint.pt"):
        (first / name).rename(d1 / name)
    p1b, _ = _restart(harness, maddr, d1, extra)
    assert harness.wait(p1b, 150, d1 / "node.log") == 0, _log(d1)[-3000:]
    assert harness.wait(p0, 150, d0 / "node.log") == 0, _log(d0)[-3000:]
    r0, r1 = read_report(d0), read_report(d1)
    assert json.loads(peer_before)["peer_id"] == r1["peer_id"]  # same identity
    assert "resumed from" in _log(d1)
    # caught up at once: a bounded number of downloads before its first committed round (the
    # checkpoint's gap, plus the versions n0 merges alone meanwhile, one a second or so)
    restarted = _log(d1).split("resumed from", 1)[1].splitlines()
    first = next(i for i, line in enumerate(restarted) if re.search(r"round f\d+ v\d+: \d+ members", line))
    assert sum("followed fragment" in line for line in restarted[:first]) <= 3 * len(r1["fragments"])
    assert r0["global_digest"] == r1["global_digest"]


def _restart(harness, maddr, d, extra):
    args = ["-m", "node", "run", "--initial-peers", maddr, "--host", "127.0.0.1", "--name", "n1",
            "--data-dir", str(d), "--report-file", str(d / "report.json"), "--status-file", str(d / "status.json"),
            "--run-id", "test", "--duration", "12", *extra]
    for k, v in _shards(1, 2).items():
        args += ["--set", f"{k}={v}"]
    return harness.spawn(args, d / "node.log"), d


def test_fresh_nodes_with_different_local_seeds_start_identical():
    """I8: the run seed alone fixes the initial global state; peer-derived data seeds differ."""
    from p2pdiloco.config import load_config
    from node.setup import Setup

    cfg = load_config(overrides={**TINY, "data.max_bytes": "50000"})
    a = Setup.build(cfg, "a", "QmPeerA")
    b = Setup.build(cfg, "b", "QmPeerB")
    assert [s.digest for s in a.learner.global_states] == [s.digest for s in b.learner.global_states]
    xa, _ = a.sampler.next()
    xb, _ = b.sampler.next()
    assert not (xa == xb).all()


@pytest.mark.timeout(200)
def test_lone_node_progresses_then_merges_with_a_newcomer(harness):
    """I5 then I3/I8: a lone node applies its own outer steps and its loss falls; a second
    node that arrives later catches up to its state and they merge together."""
    maddr = harness.bootstrap()
    p0, d0 = harness.node(maddr, "n0", _shards(0, 2), "--duration", "45", "--set", "settle=30")
    end = time.monotonic() + 60
    while "1 members" not in _log(d0) and time.monotonic() < end:
        harness.track_daemons()
        time.sleep(0.2)
    time.sleep(3)
    p1, d1 = harness.node(maddr, "n1", _shards(1, 2), "--duration", "10", "--set", "settle=90")
    for p, d in ((p1, d1), (p0, d0)):
        assert harness.wait(p, 150, d / "node.log") == 0, _log(d)[-2000:]
    r0, r1 = read_report(d0), read_report(d1)
    log0 = _log(d0)
    assert log0.index("1 members") < log0.index("2 members")  # alone first, then together
    assert r0["end_loss"] < r0["start_loss"]
    assert "followed fragment" in _log(d1)  # the newcomer adopted the swarm's state first
    assert r0["global_digest"] == r1["global_digest"]


@pytest.mark.timeout(300)
def test_newcomer_survives_a_donor_killed_midway_and_matches_the_swarm_exactly(harness):
    """A newcomer downloads the state from two donors (one fragment each, round-robin); n0
    is SIGKILLed after about half of the first state it serves to a joining node went out.
    The newcomer discards the partial state, takes it from the other donor, continues at the
    swarm's inner step (so the same learning rate), and its first merge lands on the same
    digest as its peer's. (If n0 was not a holder of the newest state when the newcomer
    joined, which can happen for a moment after a round, one more newcomer joins.)"""
    big = {"model.n_embd": "256", "model.n_head": "4"}  # 0.8M parameters: a fragment's state is 4 frames
    maddr = harness.bootstrap()
    p0, d0 = harness.node(maddr, "n0", {**_shards(0, 3), **big}, "--duration", "150",
                          "--set", "fault=kill-in-state-transfer@1")
    p1, d1 = harness.node(maddr, "n1", {**_shards(1, 3), **big}, "--duration", "60", "--set", "settle=120")
    end = time.monotonic() + 90
    while _log(d1).count("2 members") < 4 and time.monotonic() < end:
        harness.track_daemons()
        time.sleep(0.2)
    assert _log(d1).count("2 members") >= 4, _log(d1)[-2000:]
    newcomers = []
    for k in range(2, 5):
        newcomers.append(harness.node(maddr, f"n{k}", {**_shards(2, 3), **big}, "--duration", "15",
                                      "--set", "settle=120"))
        d = newcomers[-1][1]
        end = time.monotonic() + 60
        while "joined at the swarm's inner step" not in _log(d) and time.monotonic() < end:
            harness.track_daemons()
            time.sleep(0.2)
        if p0.poll() is not None:
            break
    p2, d2 = newcomers[-1]
    for p, d in [*newcomers, (p1, d1)]:
        assert harness.wait(p, 200, d / "node.log") == 0, _log(d)[-3000:]
    assert p0.wait(10) == -signal.SIGKILL, _log(d0)[-2000:]  # the fault hit: n0 died serving a state
    assert "injected fault: killed while answering state.get" in _log(d0)
    assert not (d0 / "report.json").exists()
    log2 = _log(d2)
    n0_id = json.loads((d0 / "status.json").read_text())["peer_id"]
    # the partial answer was discarded: the download from n0 failed, the next donor served it
    failed = re.search(rf"state download of fragment (\d) from {n0_id[-8:]} failed", log2)
    assert failed, log2[:4000]
    frag = failed.group(1)
    assert re.search(rf"followed fragment {frag}: v0 -> v\d+", log2[failed.end():]), log2[:4000]
    # joined at the swarm's schedule position: the inner step its donors published
    assert int(re.search(r"joined at the swarm's inner step (\d+)", log2).group(1)) > 0
    # its first merge with n1 gives both the same state
    m = re.search(r"round f(\d) v(\d+): [2-9] members, [\d.]+ s, digest (\w+)", log2)
    assert m, log2[-3000:]
    assert re.search(rf"round f{m.group(1)} v{m.group(2)}: [2-9] members, [\d.]+ s, digest {m.group(3)}", _log(d1))
    digests = {read_report(d)["global_digest"] for _, d in [*newcomers, (p1, d1)]}
    assert len(digests) == 1, digests
