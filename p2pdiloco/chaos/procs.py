"""Child processes of the chaos harness, each in its own process group.

A node is a Python process plus its libp2p daemon (p2pd), both in the node's process group,
so signalling the group hits both: SIGKILL kills the whole node, SIGSTOP freezes it. Every
child gets SIGKILL from the kernel when the harness dies (PR_SET_PDEATHSIG; a stopped
process would sit on a SIGTERM forever). :meth:`Processes.close` continues, terminates, then
kills every group, on every exit path of the harness.

PR_SET_PDEATHSIG fires when the *thread* that started the child ends, so children must be
started from one long-lived thread (the harness runs in the caller's thread throughout).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class Proc:
    """One child process group (the child is the group leader)."""

    def __init__(self, popen: subprocess.Popen, name: str, log: Path):
        self.popen, self.name, self.log = popen, name, log
        self.pid = popen.pid
        self.stopped = False  # the whole group is SIGSTOPped (a freeze)
        self.paused = False  # the leader alone is SIGSTOPped (duty-cycle throttling)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def signal_leader(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def group_members(self) -> list[psutil.Process]:
        """Processes still in this group (the leader, p2pd, anything they started)."""
        out = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == self.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (ProcessLookupError, psutil.Error, OSError):
                continue
        return out


class Processes:
    """Starts children in their own sessions and ends every one of them on :meth:`close`."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def start(self, argv: list[str], log: Path, name: str) -> Proc:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     preexec_fn=_die_with_parent)
        proc = Proc(popen, name, log)
        self.procs.append(proc)
        return proc

    def kill(self, proc: Proc, timeout: float = 10.0) -> None:
        """SIGKILL the whole group (also works on a stopped group) and reap the leader."""
        proc.signal_group(signal.SIGKILL)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        proc.stopped = proc.paused = False

    def stop(self, proc: Proc, timeout: float, on_wait=None) -> bool:
        """SIGCONT, then SIGTERM the group; wait up to ``timeout`` s (calling ``on_wait()``
        about every 0.5 s). Returns whether the leader exited by itself."""
        proc.signal_group(signal.SIGCONT)
        proc.stopped = proc.paused = False
        proc.signal_leader(signal.SIGTERM)
        end = time.monotonic() + timeout
        while proc.alive() and time.monotonic() < end:
            if on_wait is not None:
                on_wait()
            time.sleep(0.5)
        return not proc.alive()

    def close(self, grace: float = 15.0) -> None:
        """Continue every group, SIGTERM every leader, then SIGKILL every group (idempotent)."""
        live = [p for p in self.procs if p.alive() or p.group_members()]
        for p in live:
            p.signal_group(signal.SIGCONT)
            p.signal_leader(signal.SIGTERM)  # the node stops its own p2pd after settling
        end = time.monotonic() + grace
        for p in live:
            try:
                p.popen.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in live:
            p.signal_group(signal.SIGKILL)
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def survivors(self) -> list[int]:
        """PIDs of anything still running in a group we started (should be none after close)."""
        return [m.pid for p in self.procs for m in p.group_members()]
