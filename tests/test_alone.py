"""A node that merges with nobody says so (state "alone", with the likely reason), and its
report says it never merged: real nodes over loopback, a bootstrap peer, `alone_after` 4 s."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import TINY, read_report, wait_for

pytestmark = pytest.mark.usefixtures("no_daemon_left")


def _status(d) -> dict:
    try:
        return json.loads((d / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _without_peers(harness, name: str, settings: dict[str, str], *budget: str):
    """A node started with no --initial-peers at all (it starts a swarm of its own)."""
    d = harness.tmp / name
    d.mkdir()
    args = ["-m", "node", "run", "--host", "127.0.0.1", "--port", "0", "--name", name, "--data-dir", str(d),
            "--report-file", str(d / "report.json"), "--status-file", str(d / "status.json"), "--run-id", "test",
            *(budget or ("--duration", "20")), *(a for k, v in settings.items() for a in ("--set", f"{k}={v}"))]
    return harness.spawn(args, d / "node.log"), d


@pytest.mark.timeout(180)
def test_a_node_merging_with_nobody_shows_state_alone_with_the_reason(harness):
    """n0 and n1 share a run id but n1's model differs (another protocol tag): each sees the
    other's record, can never merge with it, and says "other_settings"; n2 has another run id
    and sees no node of its run: "no_peers"; n3, started with no initial peers at all, "started_alone".
    All four within a few seconds of `alone_after`, and their reports count no round with another
    node; stopped by a signal, each exits 0."""
    maddr = harness.bootstrap()
    base = {**TINY, "alone_after": "4", "settle": "0"}
    nodes = {
        "n0": (harness.node(maddr, "n0", base, "--duration", "20"), "other_settings"),
        "n1": (harness.node(maddr, "n1", {**base, "model.n_embd": "32"}, "--duration", "20"), "other_settings"),
        "n2": (harness.node(maddr, "n2", base, "--run-id", "another-run", "--duration", "20"), "no_peers"),
        "n3": (_without_peers(harness, "n3", base), "started_alone"),
    }
    for name, ((_, d), reason) in nodes.items():
        def alone(d=d, reason=reason):
            s = _status(d)
            return s.get("state") == "alone" and (s.get("alone") or {}).get("reason") == reason
        wait_for(alone, 60, lambda d=d, name=name: f"{name} alone ({reason}): {_status(d)}", tick=harness.track_daemons)
    for name, ((proc, d), _) in nodes.items():  # then stopped as a supervisor would, not at the end of their budget
        wait_for(lambda d=d: _status(d).get("rounds_committed", 0) > 0, 60, f"{name} to commit a round")
        os.kill(proc.pid, signal.SIGTERM)
    for name, ((proc, d), reason) in nodes.items():
        assert harness.wait(proc, 90, d / "node.log") == 0
        report = read_report(d)
        assert report["rounds_with_peers"] == 0 and report["rounds_committed"] == report["rounds_alone"] > 0, name
        assert report["alone"]["reason"] == reason and report["alone"]["since_s"] >= 4, report["alone"]
        assert report["exit_code"] == 0


@pytest.mark.timeout(180)
def test_a_node_that_reaches_nobody_says_so_from_the_start_and_exits_3(harness):
    """With `alone_after` at 600 s, so that only the verdicts made from the first seconds can
    show: a node given a bootstrap peer whose run has no other node says "no_peers", one whose
    outer.min_quorum (2) exceeds the nodes of its run (1) says "quorum" and names the setting,
    one started with no peers at all "started_alone"; at the end of their budget (--max-steps)
    the two given peers exit 3 (never merged), the one started alone on purpose exits 0."""
    maddr = harness.bootstrap()
    base = {**TINY, "alone_after": "600", "settle": "0"}
    nodes = {
        "gone": (harness.node(maddr, "gone", base, "--max-steps", "60"), "no_peers", 3),
        "quorum": (harness.node(maddr, "quorum", {**base, "outer.min_quorum": "2"}, "--run-id", "q",
                                "--max-steps", "60"), "quorum", 3),
        "solo": (_without_peers(harness, "solo", base, "--max-steps", "60"), "started_alone", 0),
    }
    for name, ((proc, d), reason, _) in nodes.items():
        def said(d=d, reason=reason, proc=proc):
            s = _status(d)
            assert proc.poll() is None or s.get("state") == "stopped", f"{name} ended before its status said so"
            return (s.get("alone") or {}).get("reason") == reason and s.get("state") in ("alone", "stopped")
        wait_for(said, 90, lambda d=d, name=name: f"{name} alone ({reason}): {_status(d)}", tick=harness.track_daemons)
    for name, ((proc, d), reason, code) in nodes.items():
        assert harness.wait(proc, 90, d / "node.log") == code, name
        report = read_report(d)
        assert report["exit_code"] == code and report["rounds_with_peers"] == 0, name
        assert report["alone"]["reason"] == reason, report["alone"]
    assert "outer.min_quorum" in read_report(nodes["quorum"][0][1])["alone"]["detail"]


def test_the_verdicts_made_from_the_first_seconds_and_the_exit_code():
    """node.alone.AloneWatch on its own: the verdicts that need no `alone_after` wait, their
    clearing once nodes of the run are seen, and the exit code at the end of a run."""
    from node.alone import NEVER_MERGED_EXIT, AloneWatch

    solo = AloneWatch(600, "r", "t", meant_to_join=False)
    solo.started()
    assert solo.alone.reason == "started_alone"
    assert solo.exit_code(0, budget_ended=True) == 0  # alone on purpose
    joiner = AloneWatch(600, "r", "t", min_quorum=1)
    joiner.started()
    assert joiner.alone is None
    joiner.check(0, {}, read=False)  # nothing read yet: no verdict
    assert joiner.alone is None
    joiner.check(0, {})
    assert joiner.alone.reason == "no_peers"
    joiner.check(1, {})  # a node of the run seen: it gets alone_after to merge
    assert joiner.alone is None
    assert joiner.exit_code(0, budget_ended=True) == NEVER_MERGED_EXIT == 3
    assert joiner.exit_code(0, budget_ended=False) == 0 and joiner.exit_code(2, budget_ended=True) == 0
    quorum = AloneWatch(600, "r", "t", min_quorum=3)
    quorum.started()
    quorum.check(1, {})
    assert quorum.alone.reason == "quorum" and "outer.min_quorum" in quorum.alone.detail
    quorum.check(2, {})
    assert quorum.alone is None
    quorum.merged()
    assert quorum.alone is None
    # behind NAT, every relay slot lost: said at once, before "no_peers" (its peers may be gone only for it)
    nat = AloneWatch(600, "r", "t")
    nat.started()
    nat.merged()
    nat.check(0, {}, relay_lost_at=time.time())
    assert nat.alone.reason == "no_relay"
    nat.merged()  # a round with a peer since (a direct path): not alone, even with the relay still lost
    nat.check(1, {}, relay_lost_at=time.time() - 5)
    assert nat.alone is None
