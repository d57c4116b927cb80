"""The one process supervisor: every child process the demo, the chaos harness, the benchmarks
and the tests start, each leading its own process group, and all of them ended on every exit path.

A node is a Python process plus its libp2p daemon (p2pd), both in the node's process group,
so signalling the group hits both: SIGKILL kills the whole node, SIGSTOP freezes it. A
graceful stop sends SIGTERM to the leader only (the node stops its own p2pd after its rounds
and settle), then SIGKILL to the group after a grace period. Every child gets a signal from the
kernel when the supervisor dies (PR_SET_PDEATHSIG: SIGKILL for the chaos harness, SIGTERM for
the demo, so that nodes leave gracefully). :meth:`Processes.close` continues, terminates, then
kills every group, and :meth:`Processes.survivors` lists anything left.

PR_SET_PDEATHSIG fires when the *thread* that started the child ends, so children must be
started from one long-lived thread (the supervisors here run in their caller's thread).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

PR_SET_PDEATHSIG = 1


def _on_parent_death(sig: int):
    def preexec() -> None:  # in the child, before exec
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a supervisor started by `cmd &` passes SIGINT ignored
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        except OSError:
            pass
    return preexec


class Proc:
    """One child process group (the child is the group leader)."""

    def __init__(self, popen: subprocess.Popen, name: str, log: Path):
        self.popen, self.name, self.log = popen, name, log
        self.pid = popen.pid
        self.stopped = False  # the whole group is SIGSTOPped (a freeze)
        self.paused = False  # the leader alone is SIGSTOPped (duty-cycle throttling)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        return self.popen.wait(timeout)

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

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
    """Starts children, each leading its own process group, and ends every one of them on
    :meth:`close`.

    Args:
        parent_death: the signal each child gets when this process dies (SIGKILL: the chaos
            harness and tests; SIGTERM: the demo and benchmarks, whose nodes then leave gracefully).
    """

    def __init__(self, parent_death: int = signal.SIGKILL) -> None:
        self.procs: list[Proc] = []
        self.parent_death = parent_death

    def start(self, argv: list[str], log: Path, name: str = "", *, session: bool = True,
              cwd: Path | None = None) -> Proc:
        """Start ``argv`` with stdout and stderr appended to ``log``. ``session``: the child leads
        a new session; else only a new process group, as a shell starts a job (a session leader
        cannot move its p2pd out of its group: ``net.transport.daemon``). Either way the group's ID is the PID."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=session, process_group=None if session else 0,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=cwd,
                                     preexec_fn=_on_parent_death(self.parent_death))
        return self.adopt(popen, name or Path(argv[0]).name, log)

    def adopt(self, popen: subprocess.Popen, name: str, log: Path) -> Proc:
        """Supervise a child started elsewhere (leading its own process group: ``start_new_session``),
        for example under another environment; it is ended with the others."""
        proc = Proc(popen, name, log)
        self.procs.append(proc)
        return proc

    def start_bootstrap(self, work: Path, prefix: tuple[str, ...] = (), timeout: float = 60) -> str:
        """Start a bootstrap peer on 127.0.0.1 (``prefix``: a command to run it under, such as a
        network namespace's; log and address file in ``work``); returns its multiaddr.

        Raises:
            RuntimeError: it exits, or writes no address within ``timeout`` seconds."""
        path = work / "bootstrap.txt"
        for old in (path, work / "bootstrap.log"):  # a reused folder: never a previous run's address or log
            old.unlink(missing_ok=True)
        boot = self.start([*prefix, sys.executable, "-m", "bootstrap", "--host", "127.0.0.1", "--port", "0",
                           "--maddrs-file", str(path)], work / "bootstrap.log", "bootstrap")
        return wait_for_file(path, boot, timeout)

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
        end = time.monotonic() + 5  # the rest of each group (p2pd) dies a moment after its SIGKILL
        while self.survivors() and time.monotonic() < end:
            time.sleep(0.05)

    def survivors(self) -> list[int]:
        """PIDs of anything still running in a group we started (should be none after close)."""
        return [m.pid for p in self.procs for m in p.group_members()]


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None if it is missing, torn or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def wait_for_file(path: Path, proc: Proc, timeout: float, every: float = 0.2) -> str:
    """The first word of ``path`` once ``proc`` has written it (a bootstrap peer's multiaddr).

    Raises:
        RuntimeError: ``proc`` exits first, or nothing is written within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return text.split()[0]
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with code {proc.returncode} (log: {proc.log})")
        time.sleep(every)
    raise RuntimeError(f"{proc.name} wrote nothing to {path} within {timeout:g} s (log: {proc.log})")
