"""Churn: faults scripted as "fail peer X at round R" on real node processes (issue: churn)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time

import psutil
import pytest

from node.journal import FILE as JOURNAL_FILE
from node.journal import read_journal
from tests.conftest import FAULTS_FILE, TINY, read_report, running, wait_for

pytestmark = pytest.mark.integration


def _log(d) -> str:
    return (d / "node.log").read_text()


def _events(d, kind: str, **match) -> list[dict]:
    """The node's journal events of ``kind`` (node/journal.py) whose fields equal ``match``."""
    return [e for e in read_journal(d / JOURNAL_FILE)
            if e.get("event") == kind and all(e.get(k) == v for k, v in match.items())]


def _status(d) -> dict:
    try:
        return json.loads((d / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _shards(i: int, n: int) -> dict[str, str]:
    return {**TINY, "data.num_shards": str(n), "data.shard_index": str(i)}


@pytest.mark.long
@pytest.mark.timeout(240)
def test_node_killed_in_allreduce_survivors_agree(harness):
    """A node SIGKILLed while its 3rd all-reduce runs: the survivors commit or discard that
    round together, keep merging, and end with equal global states (I1, I2); the dead node's
    p2pd does not outlive it (checked by the harness).
    Long (opt-in): by default, test_memory_net's member killed mid-round (the survivors agree,
    on the real ``Swarm`` and all-reducer in memory), test_inject's fault installed around a real
    all-reduce, and this file's restarted node, SIGKILLed mid-run, cover it."""
    maddr = harness.bootstrap()
    nodes = [harness.node(maddr, f"n{i}", _shards(i, 3), "--duration", "25", "--set", "settle=20",
                          inject=("--fault", "kill-in-allreduce@3") if i == 2 else ()) for i in range(3)]
    codes = [harness.wait(p, 200, d / "node.log") for p, d in nodes]
    assert codes[2] == -signal.SIGKILL, _log(nodes[2][1])[-2000:]
    assert codes[:2] == [0, 0], [_log(d)[-2000:] for _, d in nodes[:2]]
    survivors = [read_report(d) for _, d in nodes[:2]]
    assert survivors[0]["global_digest"] == survivors[1]["global_digest"]
    assert all(r["rounds_committed"] >= 6 for r in survivors)  # they kept merging after the kill
    # no round outlived matchmaking (quorum timeout + grace) and the liveness timeout (TINY: 8 + 3 + 8 s)
    for _, d in nodes[:2]:
        slowest = max(e["seconds"] for e in _events(d, "round"))
        assert slowest < 8 + 3 + 8 + 5, slowest


@pytest.mark.timeout(240)
def test_member_that_loses_a_completed_round_follows_instead_of_retrying(harness):
    """n1 completes its 3rd all-reduce but treats it as lost (fault in the last stage): the
    others commit; n1 follows their state with its own contribution already inside (no
    double contribution, no solo retry at the old version) and ends at the same hash.
    Quorum 3: every round has all three, so the two others commit it (with one late, the
    one committer's state would have one holder, which n1, before it has seen a step of the
    fragment, rightly does not follow: tests/test_targets.py; that failed CI once)."""
    maddr = harness.bootstrap()
    nodes = [harness.node(maddr, f"n{i}", {**_shards(i, 3), "outer.min_quorum": "3"}, "--duration", "20",
                          "--set", "settle=20", inject=("--fault", "fail-last-stage@3") if i == 1 else ())
             for i in range(3)]
    for p, d in nodes:
        assert harness.wait(p, 200, d / "node.log") == 0, _log(d)[-2000:]
    reports = [read_report(d) for _, d in nodes]
    assert len({r["global_digest"] for r in reports}) == 1, [r["fragments"] for r in reports]
    faults = read_journal(nodes[1][1] / FAULTS_FILE)
    assert [e["fault"] for e in faults] == ["fail-last-stage@3"], faults
    frag, version = faults[0]["fragment"], faults[0]["version"]
    after = [e for e in read_journal(nodes[1][1] / JOURNAL_FILE) if e["t"] >= faults[0]["t"]]
    # it never merges that version alone: it follows the swarm's state of it instead
    assert not any(e["event"] == "round" and e["committed"] and (e["fragment"], e["version"], e["members"])
                   == (frag, version, 1) for e in after), after
    assert any(e["event"] == "follow" and (e["fragment"], e["from_version"]) == (frag, version - 1)
               for e in after), after


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
    p0, d0 = harness.node(maddr, "n0", _shards(0, 2), "--duration", "24", "--set", "settle=90")
    # settle outlasts n0's training: n1 keeps following until n0 is done and both agree
    extra = ["--port", str(port), "--set", "checkpoint_every=1", "--set", "settle=90"]
    p1, d1 = harness.node(maddr, "n1", _shards(1, 2), "--duration", "12", *extra)
    # both run; wait until n1 has merged twice and checkpointed (checkpoint_every=1: after each install)
    wait_for(lambda: (d1 / "checkpoint.pt").exists() and _status(d1).get("rounds_committed", 0) >= 2, 90,
             lambda: f"n1 checkpointed after 2 rounds:\n{_log(d1)[-2000:]}", tick=harness.track_daemons)
    daemons = [c for c in psutil.Process(p1.pid).children(recursive=True) if c.name() == "p2pd"]
    assert daemons
    peer_before = _status(d1)["peer_id"]
    os.kill(p1.pid, signal.SIGKILL)  # the main process only, not its group
    p1.wait(10)
    wait_for(lambda: not running(daemons), 10, "n1's p2pd to exit with it", every=0.1)

    d1.rename(d1.with_name("n1-first"))
    first = d1.with_name("n1-first")
    d1.mkdir()
    for name in ("p2p.key", "checkpoint.pt"):
        (first / name).rename(d1 / name)
    p1b, _ = _restart(harness, maddr, d1, extra)
    assert harness.wait(p1b, 150, d1 / "node.log") == 0, _log(d1)[-3000:]
    assert harness.wait(p0, 150, d0 / "node.log") == 0, _log(d0)[-3000:]
    r0, r1 = read_report(d0), read_report(d1)
    assert peer_before == r1["peer_id"]  # same identity
    journal = read_journal(d1 / JOURNAL_FILE)  # the restarted process's (a new data dir)
    assert journal[0]["event"] == "resumed" and journal[0]["step"] > 0, journal[:3]
    assert journal[0]["kept"] == []  # without the old journal nothing shows what was sent: nothing kept
    # caught up at once: a bounded number of downloads before its first committed round (the
    # checkpoint's gap, plus the versions n0 merges alone meanwhile, one a second or so)
    first = next(i for i, e in enumerate(journal) if e["event"] == "round" and e["committed"])
    assert sum(e["event"] == "follow" for e in journal[:first]) <= 3 * len(r1["fragments"]), journal[:first]
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


@pytest.mark.long
@pytest.mark.timeout(200)
def test_lone_node_progresses_then_merges_with_a_newcomer(harness):
    """I5 then I3/I8: a lone node applies its own outer steps and its loss falls; a second
    node that arrives later catches up to its state and they merge together.
    Long (opt-in): by default, test_swarm_integration's lone node and this file's restarted
    node, which catches up from the swarm, cover it."""
    maddr = harness.bootstrap()
    p0, d0 = harness.node(maddr, "n0", _shards(0, 2), "--duration", "45", "--set", "settle=30")
    # n0 merges alone for a few rounds (both fragments moved) before the newcomer starts
    wait_for(lambda: _status(d0).get("rounds_alone", 0) >= 3, 60, lambda: f"n0's lone rounds:\n{_log(d0)[-2000:]}",
             tick=harness.track_daemons)
    started = time.time()
    p1, d1 = harness.node(maddr, "n1", _shards(1, 2), "--duration", "10", "--set", "settle=90")
    for p, d in ((p1, d1), (p0, d0)):
        assert harness.wait(p, 150, d / "node.log") == 0, _log(d)[-2000:]
    r0, r1 = read_report(d0), read_report(d1)
    members = [e["members"] for e in _events(d0, "round", committed=True)]
    assert 1 in members and 2 in members and members.index(1) < members.index(2)  # alone first, then together
    assert r0["end_loss"] < r0["start_loss"]
    follows, rounds = _events(d1, "follow"), _events(d1, "round", committed=True)
    assert follows and follows[0]["t"] <= rounds[0]["t"]  # the newcomer adopted the swarm's state first
    # it trusted nobody: it vetted n0's state by its own held-out loss (node.vetting), then merged
    together = [e["t"] for e in rounds if e["members"] >= 2]
    assert together and together[0] - started <= 30.0, f"first merged round {together[:1]} s, start {started}"
    assert r0["global_digest"] == r1["global_digest"]


@pytest.mark.long
@pytest.mark.timeout(300)
def test_newcomer_survives_a_donor_killed_midway_and_matches_the_swarm_exactly(harness):
    """A newcomer downloads the state from two donors (one fragment each, round-robin); n0
    is SIGKILLed after about half of the first state it serves to a joining node went out.
    The newcomer discards the partial state, takes it from the other donor, continues at the
    swarm's inner step (so the same learning rate), and its first merge lands on the same
    digest as its peer's. (If n0 was not a holder of the newest state when the newcomer
    joined, which can happen for a moment after a round, one more newcomer joins.)
    Long (opt-in): by default, test_protocol's newcomer whose donor dies midway and
    test_transport_limits' kill midway cover it."""
    big = {"model.n_embd": "256", "model.n_head": "4"}  # 0.8M parameters: a fragment's state is 4 frames
    maddr = harness.bootstrap()
    p0, d0 = harness.node(maddr, "n0", {**_shards(0, 3), **big}, "--duration", "150",
                          inject=("--fault", "kill-in-state-transfer@1"))
    p1, d1 = harness.node(maddr, "n1", {**_shards(1, 3), **big}, "--duration", "60", "--set", "settle=120")
    wait_for(lambda: len([e for e in _events(d1, "round", committed=True) if e["members"] == 2]) >= 4, 90,
             lambda: f"four 2-member rounds on n1:\n{_log(d1)[-2000:]}", tick=harness.track_daemons)
    newcomers = []
    for k in range(2, 5):
        newcomers.append(harness.node(maddr, f"n{k}", {**_shards(2, 3), **big}, "--duration", "15",
                                      "--set", "settle=120"))
        d = newcomers[-1][1]
        with contextlib.suppress(AssertionError):  # whether n0 was hit is checked right after
            wait_for(lambda: _events(d, "joined"), 60, "the newcomer joining", tick=harness.track_daemons)
        if p0.poll() is not None:
            break
    p2, d2 = newcomers[-1]
    for p, d in [*newcomers, (p1, d1)]:
        assert harness.wait(p, 200, d / "node.log") == 0, _log(d)[-3000:]
    assert p0.wait(10) == -signal.SIGKILL, _log(d0)[-2000:]  # the fault hit: n0 died serving a state
    assert not (d0 / "report.json").exists()
    journal = read_journal(d2 / JOURNAL_FILE)
    n0_id = _status(d0)["peer_id"]
    # the partial answer was discarded: the download from n0 failed, the next donor served it
    at = next((i for i, e in enumerate(journal) if e["event"] == "download_failed" and e["donor"] == n0_id), None)
    assert at is not None, journal[:20]
    frag = journal[at]["fragment"]
    assert any(e["event"] == "follow" and e["fragment"] == frag and e["from_version"] == 0 for e in journal[at:]), \
        journal[:20]
    # joined at the swarm's schedule position: the inner step its donors published
    assert _events(d2, "joined")[0]["step"] > 0
    # its first merge with n1 gives both the same state
    first = next(e for e in journal if e["event"] == "round" and e["committed"] and e["members"] >= 2)
    assert _events(d1, "round", committed=True, fragment=first["fragment"], version=first["version"],
                   digest=first["digest"]), first
    digests = {read_report(d)["global_digest"] for _, d in [*newcomers, (p1, d1)]}
    assert len(digests) == 1, digests


@pytest.mark.long
@pytest.mark.timeout(200)
def test_ctrl_c_to_a_nodes_process_group_stops_it_gracefully_and_the_swarm_sees_it_done(harness):
    """SIGINT to a training node's whole process group, as a terminal sends Ctrl+C to its job:
    its p2pd, in a process group of its own (``net.transport.process_group._spawn_group``), does not get it, so
    the node finishes (or abandons) its rounds, publishes that it is done and ends its daemon
    itself. The other node then sees a live record marked done (2 nodes, 1 training) instead
    of a record that goes silent; the stopped node exits 0 with its report.
    Long (opt-in): by default, test_stop's SIGTERM to a training node's process group and
    test_status's swarm status of a node that leaves cover it."""
    maddr = harness.bootstrap()
    p0, d0 = harness.node(maddr, "n0", _shards(0, 2), "--duration", "40", "--set", "settle=5")
    p1, d1 = harness.node(maddr, "n1", _shards(1, 2), "--duration", "120", session=False)
    wait_for(lambda: _status(d1).get("rounds_with_peers", 0) >= 3 and _status(d0).get("swarm", {}).get("learners") == 2,
             90, lambda: f"n1 merging with n0: {_status(d1).get('rounds_with_peers')}", tick=harness.track_daemons)
    daemon = psutil.Process(_status(d1)["p2pd_pid"])
    os.killpg(p1.pid, signal.SIGINT)  # p1 leads its own process group (session=False: a shell's job)
    wait_for(lambda: (_status(d0).get("swarm") or {}).get("peers") == 2
             and (_status(d0).get("swarm") or {}).get("learners") == 1, 30,
             lambda: f"n0 seeing n1 done: {_status(d0).get('swarm')}", tick=harness.track_daemons)
    assert harness.wait(p1, 60, d1 / "node.log") == 0
    assert read_report(d1)["state"] == "stopped"
    assert not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE
    assert harness.wait(p0, 90, d0 / "node.log") == 0
