"""Stopping a node by signal (docs/operating.md, "Start a node"): a supervisor's SIGTERM to the node's whole
process group mid-round, and Ctrl+C while the node starts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from node.journal import FILE as JOURNAL_FILE
from node.journal import read_journal
from tests.conftest import TINY, default_sigint, read_report, running, until, wait_for

pytestmark = pytest.mark.integration


def _status(d: Path) -> dict:
    try:
        return json.loads((d / "status.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_sigterm_to_a_training_nodes_process_group_mid_round_is_a_clean_leave(no_daemon_left, harness):
    """SIGTERM to the whole process group of a node that leads its group (a shell's job;
    ``kill -- -PGID``, ``timeout``) while one of its rounds is in flight: its p2pd, started
    in a process group of its own (``net.transport.process_group._spawn_group``), is not signalled, so the node
    finishes that round or abandons it (``runtime.LEAVE_S``), publishes its record marked
    done, ends its daemon and exits 0. Within 5 s of the signal the swarm's DHT holds the
    record marked done and the process has exited; no traceback in its output; the round in
    flight is in its journal as committed or abandoned."""
    from node.control import ControlUnreachable, query  # noqa: PLC0415
    from node.status_view import summarize_swarm  # noqa: PLC0415
    from p2pdiloco.net.transport.swarm import Swarm  # noqa: PLC0415

    maddr = harness.bootstrap()
    settings = {**TINY, "data.num_shards": "2"}
    p0, d0 = harness.node(maddr, "n0", {**settings, "data.shard_index": "0"}, "--duration", "90", session=False)
    p1, d1 = harness.node(maddr, "n1", {**settings, "data.shard_index": "1"}, "--duration", "90", session=False)
    observer = await Swarm.start(initial_peers=[maddr])
    try:
        def merged() -> bool:
            harness.track_daemons()
            assert p1.poll() is None, (d1 / "node.log").read_text()[-3000:]
            return _status(d1).get("rounds_with_peers", 0) >= 2

        await until(merged, 120, lambda: f"n1 merging with n0: {_status(d1).get('rounds_with_peers')}")

        merging: list[int] = []

        async def in_flight() -> bool:  # asked on its control socket: status.json is a second old
            try:
                snap = await asyncio.to_thread(query, str(d1 / "control.sock"), 2.0)
            except ControlUnreachable:
                return False
            merging[:] = snap["merging"] if snap.get("state") == "training" else []
            return bool(merging)

        await until(in_flight, 60, "a round of n1 in flight", every=0.05)
        daemon = psutil.Process(_status(d1)["p2pd_pid"])
        t0 = time.monotonic()
        os.killpg(p1.pid, signal.SIGTERM)  # p1 leads its own process group (harness: session=False)

        async def done_in_dht() -> bool:
            view = summarize_swarm("test", await observer.get("test/heads"), observer.clock.now())
            return any(p["name"] == "n1" and p["done"] for p in view["peers"])

        await until(done_in_dht, 5, "n1's record marked done in the DHT", every=0.1)
        await until(lambda: p1.poll() is not None, max(0.0, t0 + 5 - time.monotonic()), "n1's exit", every=0.05)
        took = time.monotonic() - t0
    finally:
        await observer.shutdown()
    log = (d1 / "node.log").read_text()
    assert p1.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert read_report(d1)["state"] == "stopped"
    assert took <= 5.0
    wait_for(lambda: not running([daemon]), 5, "n1's p2pd to exit")
    rounds = [e for e in read_journal(d1 / JOURNAL_FILE) if e.get("event") == "round"]
    for p in merging:  # the round in flight at the signal: its last record
        last = [e for e in rounds if e["fragment"] == p][-1]
        assert last["committed"] or last["reason"] == "abandoned: stopping", last
    assert p0.poll() is None, "n0 carries on"


class _SilentPeer:
    """A TCP port that accepts connections (the kernel completes the handshake for its
    backlog) and never answers: a node joining through it passes the reachability preflight
    and then waits in p2pd's bootstrap, so it is still starting seconds later."""

    def __init__(self):
        from p2pdiloco.trust.identity import Identity  # noqa: PLC0415

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.maddr = f"/ip4/127.0.0.1/tcp/{self.sock.getsockname()[1]}/p2p/{Identity.generate().peer_id}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after", [0.5, 1.0, 2.0, 4.0])
def test_ctrl_c_while_a_node_starts_prints_one_line_and_exits_130(after, tmp_path):
    """SIGINT to the process group of ``node run`` (a terminal's Ctrl+C) ``after`` seconds
    from its start (imports, configuration, the reachability check, model and data, p2pd
    bootstrapping through a peer that never answers): exactly ``p2pdiloco: interrupted`` on
    stderr and exit code 130 (128 + SIGINT), whatever it was doing (``cli.main``,
    ``cli.run_async``); no p2pd is left. Log level WARNING: start-up progress is INFO."""
    peer = _SilentPeer()
    args = [sys.executable, "-m", "node", "run", "--initial-peers", peer.maddr, "--host", "127.0.0.1", "--port", "0",
            "--data-dir", str(tmp_path / "n"), "--run-id", "test", "--no-progress"]
    for k, v in TINY.items():
        args += ["--set", f"{k}={v}"]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            process_group=0, preexec_fn=default_sigint,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "P2PDILOCO_LOG": "WARNING"})
    daemons: set[psutil.Process] = set()

    def track() -> None:
        with contextlib.suppress(psutil.Error):
            daemons.update(c for c in psutil.Process(proc.pid).children() if c.name() == "p2pd")

    try:
        time.sleep(after)
        track()
        assert proc.poll() is None, proc.communicate()
        def interrupt() -> bool:  # ESRCH: the node is in another group for a few ms while it forks p2pd
            try:
                os.killpg(proc.pid, signal.SIGINT)
                return True
            except ProcessLookupError:
                return False

        wait_for(interrupt, 1, "the node's process group to take the signal", every=0.01)
        wait_for(lambda: proc.poll() is not None, 60, "the node's exit", every=0.05, tick=track)
        out, err = proc.communicate()
        assert (proc.returncode, err.decode().splitlines()) == (130, ["p2pdiloco: interrupted"]), err.decode()
        wait_for(lambda: not running(daemons), 5, "the node's p2pd to exit")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        for d in daemons:
            with contextlib.suppress(psutil.Error):
                d.kill()
        peer.sock.close()


def test_stop_signals_within_a_second_are_one_request(monkeypatch):
    """``node.main.once_per_burst``: coreutils ``timeout`` signals its child, then its whole
    group (timeout.c, ``cleanup``), so a node under it gets SIGTERM twice at once; that is one
    stop request, and only a signal more than ``STOP_BURST_S`` later is the second one, after
    which ``Node.stop`` exits at once."""
    import node.main as m  # noqa: PLC0415

    now, calls = [100.0], []
    monkeypatch.setattr(m.time, "monotonic", lambda: now[0])
    handler = m.once_per_burst(lambda: calls.append(now[0]))
    handler()
    now[0] += 0.001
    handler()  # the group's copy of the same signal
    now[0] += m.STOP_BURST_S
    handler()  # a second Ctrl+C
    assert calls == [100.0, 100.001 + m.STOP_BURST_S]
