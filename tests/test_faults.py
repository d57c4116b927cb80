"""Faults of a volunteer's machine, on real node processes (docs/operating.md, "Faults of the
machine"): a disk that fills up under a running node, its libp2p daemon killed, a run whose
nodes are all gone, donors on a slow link."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from node.checkpoint import read_global_states
from p2pdiloco.status import read_status
from tests.conftest import TINY, private_tmpfs, read_report, wait_for

pytestmark = pytest.mark.integration


def _status(d: Path) -> dict:
    """The node's status JSON as written (checked against the schema by read_status), {} before it."""
    status = read_status(d / "status.json")
    return status.to_json() if status is not None else {}


def _log(d: Path) -> str:
    return (d / "node.log").read_text()


def _fill(path: Path) -> int:
    """Write zeros to ``path`` until its filesystem is full; returns the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        chunk = bytes(1 << 16)
        while True:
            try:
                written += f.write(chunk) or 0
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return written


@pytest.mark.timeout(240)
def test_a_full_disk_costs_the_checkpoint_not_the_run(harness, tmp_path):
    """The data dir is a real filesystem of 16 MiB (a tmpfs in a mount namespace of the node's
    own) that the test fills up once the node has checkpointed: each checkpoint write then fails
    with ENOSPC. The node trains on (its step grows by two outer periods), its status says
    ``checkpoint_error`` (ENOSPC, an earlier checkpoint kept), the checkpoint it wrote before
    stays readable; once space is freed the next checkpoint clears the error; SIGTERM then ends
    it with exit 0 and no traceback."""
    maddr = harness.bootstrap()
    disk = tmp_path / "n0" / "disk"
    prefix = private_tmpfs(disk, "16m")
    if prefix is None:
        pytest.skip("no mount namespace here (unshare -m, or -rm without root)")
    p0, d0 = harness.node(maddr, "n0", {**TINY, "checkpoint_every": "1", "inner.total_steps": "100000"},
                          "--data-dir", str(disk), "--duration", "600", prefix=prefix)
    inside = Path(f"/proc/{p0.pid}/root") / disk.relative_to("/")  # the node's view of its tmpfs

    def alive() -> None:
        harness.track_daemons()
        assert p0.poll() is None, _log(d0)[-3000:]

    wait_for(lambda: (inside / "checkpoint.pt").exists() and _status(d0).get("step", 0) > 0, 120,
             lambda: f"n0's first checkpoint:\n{_log(d0)[-2000:]}", tick=alive)
    assert _status(d0)["checkpoint_error"] is None
    _fill(inside / "filler")
    error = wait_for(lambda: _status(d0).get("checkpoint_error"), 60, "checkpoint_error in n0's status", tick=alive)
    assert error["errno"] == "ENOSPC" and error["kept"], error
    step = _status(d0)["step"]
    period = int(TINY["outer.sync_every"])

    def trained_on() -> dict | None:
        st = _status(d0)
        return st if st.get("step", 0) >= step + 2 * period and (st.get("checkpoint_error") or {}).get(
            "failures", 0) >= 2 else None

    st = wait_for(trained_on, 60, lambda: f"n0 training on a full disk: {_status(d0).get('checkpoint_error')}",
                  tick=alive)
    assert st["state"] in ("training", "alone") and st["checkpoint_error"]["errno"] == "ENOSPC", st
    kept = [p for p in (inside / "checkpoint.pt", inside / "checkpoint-sent.pt") if p.exists()]
    assert kept, "the earlier checkpoint is gone"
    if kept[0].name == "checkpoint.pt":  # readable (a checkpoint set aside is loaded the same way)
        assert read_global_states(inside)
    (inside / "filler").unlink()
    wait_for(lambda: _status(d0).get("checkpoint_error", 1) is None, 60, "n0 checkpointing again", tick=alive)
    assert (inside / "checkpoint.pt").exists() and not (inside / "checkpoint-sent.pt").exists()
    os.kill(p0.pid, signal.SIGTERM)
    assert harness.wait(p0, 60, d0 / "node.log") == 0, _log(d0)[-3000:]
    assert read_report(d0)["checkpoint_error"] is None
    assert "Traceback" not in _log(d0), _log(d0)[-3000:]


@pytest.mark.timeout(300)
def test_a_killed_daemon_is_started_again_and_the_node_merges_again(harness):
    """SIGKILL to the p2pd of a node that merges with another: within 30 s the node runs a new
    p2pd (``p2pd_restarts`` 1, a new PID, the same peer ID) and merges with the other node
    again; both end with exit 0 and no traceback."""
    maddr = harness.bootstrap()
    shards = {**TINY, "data.num_shards": "2", "settle": "30"}
    p0, d0 = harness.node(maddr, "n0", {**shards, "data.shard_index": "0"}, "--duration", "100")
    p1, d1 = harness.node(maddr, "n1", {**shards, "data.shard_index": "1"}, "--duration", "100")

    def alive() -> None:
        harness.track_daemons()
        for p, d in ((p0, d0), (p1, d1)):
            assert p.poll() is None, _log(d)[-3000:]

    wait_for(lambda: _status(d1).get("rounds_with_peers", 0) >= 2, 120,
             lambda: f"n1 merging with n0:\n{_log(d1)[-2000:]}", tick=alive)
    before = _status(d1)
    os.kill(before["p2pd_pid"], signal.SIGKILL)
    wait_for(lambda: _status(d1).get("p2pd_restarts") == 1, 30, lambda: f"n1's p2pd started again:\n{_log(d1)[-2000:]}",
             tick=alive)
    after = _status(d1)
    assert after["p2pd_pid"] != before["p2pd_pid"] and after["peer_id"] == before["peer_id"]
    merged = after["rounds_with_peers"]  # counted once the new daemon runs: rounds with n0 through it
    wait_for(lambda: _status(d1).get("rounds_with_peers", 0) > merged, 30, lambda: f"n1 merging again:\n{_log(d1)[-2000:]}",
             tick=alive)
    for p, d in ((p1, d1), (p0, d0)):
        assert harness.wait(p, 200, d / "node.log") == 0, _log(d)[-3000:]
        assert "Traceback" not in _log(d), _log(d)[-3000:]
    assert read_report(d1)["p2pd_restarts"] == 1


@pytest.mark.timeout(180)
def test_a_daemon_that_cannot_be_started_again_ends_the_node_in_one_line(harness):
    """The node's p2pd killed after its only initial peer (the bootstrap) is gone: the new
    daemon finds no peer to join through, so the node stops with exit code 4
    (node.alone.DAEMON_LOST_EXIT), the reason in its report's ``exit_reason``, no traceback."""
    from node.alone import DAEMON_LOST_EXIT  # noqa: PLC0415

    maddr = harness.bootstrap()
    p0, d0 = harness.node(maddr, "n0", TINY, "--duration", "600")
    wait_for(lambda: _status(d0).get("step", 0) > 0, 120, lambda: f"n0 training:\n{_log(d0)[-2000:]}",
             tick=harness.track_daemons)
    boot = next(p for p in harness.procs if p.log.name == "bootstrap.log")
    harness.processes.kill(boot)
    os.kill(_status(d0)["p2pd_pid"], signal.SIGKILL)
    assert harness.wait(p0, 90, d0 / "node.log") == DAEMON_LOST_EXIT, _log(d0)[-3000:]
    report = read_report(d0)
    assert report["exit_code"] == DAEMON_LOST_EXIT and report["exit_reason"], report["exit_reason"]
    assert "Traceback" not in _log(d0), _log(d0)[-3000:]


@pytest.mark.timeout(300)
def test_a_run_restarted_from_scratch_says_so_and_a_returning_node_takes_its_checkpoint(harness):
    """Every node of a run gone, its bootstrap up: a new node (no checkpoint) says in its status
    that it started the run afresh (``started_from`` "initial"); the departed node, back on its
    data dir, starts from its own checkpoint (``started_from`` "checkpoint", at least the
    versions it ended with), not from the initial model."""
    maddr = harness.bootstrap()
    settings = {**TINY, "checkpoint_every": "1", "settle": "0"}

    def stopped(p, d: Path) -> dict:
        os.kill(p.pid, signal.SIGTERM)
        assert harness.wait(p, 60, d / "node.log") == 0, _log(d)[-3000:]
        return read_report(d)

    p0, d0 = harness.node(maddr, "n0", settings, "--duration", "600")
    wait_for(lambda: min((v for v, _ in _status(d0).get("fragments", [[0, ""]])), default=0) >= 2, 120,
             lambda: f"n0 at v2 on every fragment:\n{_log(d0)[-2000:]}", tick=harness.track_daemons)
    assert _status(d0)["started_from"] == "initial"
    ended = [v for v, _ in stopped(p0, d0)["fragments"]]

    p1, d1 = harness.node(maddr, "n1", settings, "--duration", "600")
    st1 = wait_for(lambda: _status(d1).get("started_from") and _status(d1), 120,
                   lambda: f"n1 training:\n{_log(d1)[-2000:]}", tick=harness.track_daemons)
    assert st1["started_from"] == "initial", st1["started_from"]
    stopped(p1, d1)

    (d0 / "node.log").rename(d0 / "first.log")
    args = ["-m", "node", "run", "--initial-peers", maddr, "--host", "127.0.0.1", "--port", "0", "--name", "n0",
            "--data-dir", str(d0), "--report-file", str(d0 / "report.json"), "--status-file", str(d0 / "status.json"),
            "--run-id", "test", "--duration", "600"]
    (d0 / "status.json").unlink()
    p0b = harness.spawn([*args, *(a for k, v in settings.items() for a in ("--set", f"{k}={v}"))], d0 / "node.log")
    st0 = wait_for(lambda: _status(d0).get("started_from") and _status(d0), 120,
                   lambda: f"n0 back:\n{_log(d0)[-2000:]}", tick=harness.track_daemons)
    assert st0["started_from"] == "checkpoint", st0["started_from"]
    assert all(v >= e for (v, _), e in zip(st0["fragments"], ended)), (st0["fragments"], ended)
    stopped(p0b, d0)
