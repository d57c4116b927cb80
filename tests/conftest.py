"""Process harness for integration tests: real bootstrap and node processes on 127.0.0.1.

Every process starts in its own session; teardown terminates, then kills, each process
group, and fails the test if any p2pd daemon the test started is still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

# A model small enough for several nodes on 2 cores; real text, real sockets.
TINY = {
    "model.n_layer": "1", "model.n_embd": "64", "model.n_head": "2", "model.block_size": "64",
    "inner.lr": "3e-3", "inner.warmup_steps": "10", "inner.total_steps": "400",
    "outer.fragments": "2", "outer.sync_every": "20", "outer.momentum": "0.5", "outer.min_quorum": "1",
    "outer.grace_min": "1.0", "outer.grace_max": "3", "outer.quorum_timeout": "8",
    "outer.liveness_timeout": "8",
    "data.batch_size": "8", "data.max_bytes": "200000", "data.eval_batches": "4", "eval_every": "40",
}


class Harness:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.daemons: set[psutil.Process] = set()

    def spawn(self, args: list[str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(proc)
        return proc

    def track_daemons(self) -> None:
        """Remember every p2pd under our processes (to check that none outlives the test)."""
        for proc in self.procs:
            try:
                self.daemons |= {c for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == "p2pd"}
            except psutil.Error:
                pass

    def bootstrap(self) -> str:
        path = self.tmp / "bootstrap.txt"
        proc = self.spawn(["-m", "bootstrap", "--host", "127.0.0.1", "--port", "0", "--maddrs-file", str(path)],
                          self.tmp / "bootstrap.log")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if path.exists() and path.read_text().strip():
                return path.read_text().split()[0]
            assert proc.poll() is None, (self.tmp / "bootstrap.log").read_text()
            time.sleep(0.1)
        raise AssertionError("bootstrap did not start")

    def node(self, maddr: str, name: str, settings: dict[str, str], *extra: str) -> tuple[subprocess.Popen, Path]:
        d = self.tmp / name
        d.mkdir()
        args = ["-m", "node", "run", "--initial-peers", maddr, "--host", "127.0.0.1", "--port", "0",
                "--name", name, "--data-dir", str(d), "--report-file", str(d / "report.json"),
                "--status-file", str(d / "status.json"), "--run-id", "test", *extra]
        for k, v in settings.items():
            args += ["--set", f"{k}={v}"]
        return self.spawn(args, d / "node.log"), d

    def wait(self, proc: subprocess.Popen, timeout: float, log: Path) -> int:
        end = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < end:
            self.track_daemons()
            time.sleep(0.5)
        assert proc.poll() is not None, f"process did not finish in {timeout} s:\n{log.read_text()[-3000:]}"
        return proc.returncode

    def close(self) -> None:
        self.track_daemons()
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def read_report(d: Path) -> dict:
    return json.loads((d / "report.json").read_text())


@pytest.fixture
def harness(tmp_path: Path):
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()
        time.sleep(0.5)
        alive = [p.pid for p in h.daemons if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"p2pd daemons outlived the test: {alive}"


@pytest.fixture
def no_daemon_left():
    """Every p2pd a test starts in this process (swarms, identity probes, publishers) is gone
    when it ends (waits up to 5 s for them to exit)."""
    yield
    end = time.monotonic() + 5
    left: list[psutil.Process] = []
    while time.monotonic() < end:
        left = [c for c in psutil.Process().children(recursive=True)
                if c.name() == "p2pd" and c.status() != psutil.STATUS_ZOMBIE]
        if not left:
            return
        time.sleep(0.1)
    pytest.fail(f"p2pd daemons outlived the test: {[c.pid for c in left]}")


@contextlib.asynccontextmanager
async def swarms(n: int, memberships: list | None = None, identities: list | None = None) -> AsyncIterator[list]:
    """``n`` in-process transports (one p2pd each) on 127.0.0.1, each joining the first; the
    i-th with ``memberships[i]`` and ``identities[i]`` (None: public swarm, new key). Every
    one is shut down on exit, its p2pd with it."""
    from p2pdiloco.net.transport import Swarm  # noqa: PLC0415  (imports hivemind)

    started: list[Swarm] = []
    try:
        for i in range(n):
            peers = await started[0].visible_maddrs() if started else []
            started.append(await Swarm.start(initial_peers=peers, membership=(memberships or [None] * n)[i],
                                             identity=(identities or [None] * n)[i]))
        yield started
    finally:
        await asyncio.gather(*(s.shutdown() for s in started), return_exceptions=True)
