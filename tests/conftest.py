"""Process harness for integration tests: real bootstrap and node processes on 127.0.0.1.

Every process starts in its own session; teardown terminates, then kills, each process
group, and fails the test if any p2pd daemon the test started is still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import psutil
import pytest

from p2pdiloco import presets
from p2pdiloco.procs import Proc, Processes
from p2pdiloco.status import Report, conforms, keys

POLL_S = 0.2  # seconds between two checks of a condition a test waits for
FAULTS_FILE = "faults.jsonl"  # a node started with Harness.node(inject=...) records its faults here


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` (minute-long real-process scenarios whose behaviour a shorter
    default test covers too, named in each docstring) run only when asked for: ``-m long`` or
    RUN_LONG_TESTS=1. The default suite stays under 15 minutes on a 2-core machine."""
    if os.environ.get("RUN_LONG_TESTS", "0") not in ("", "0") or "long" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a long real-process run: opt in with -m long or RUN_LONG_TESTS=1")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def private_config_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run owners that the tests' commands pin (``p2pdiloco.owners``) go to a folder of this
    test session, inherited by every process it starts, never to the user's ~/.config."""
    home = tmp_path_factory.mktemp("config")
    os.environ["XDG_CONFIG_HOME"] = str(home)
    return home


def default_sigint() -> None:
    """``preexec_fn`` of the processes tests start: SIGINT back to its default, as in a
    terminal's job. A test run started in the background by a shell without job control
    (``cmd &`` in a script) inherits SIGINT ignored, and so would every node, which then
    could not take the Ctrl+C that the signal tests send."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition: Callable[[], object], timeout: float, what: str | Callable[[], str], *,
             every: float = POLL_S, tick: Callable[[], object] | None = None):
    """Check ``condition()`` every ``every`` seconds until it returns something truthy, and
    return that; fail naming ``what`` (or the message it returns, built when it fails) after
    ``timeout`` seconds. ``tick`` runs before each check (``Harness.track_daemons``, an
    assertion that a process is still alive...)."""
    end = time.monotonic() + timeout
    while True:
        if tick is not None:
            tick()
        value = condition()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"{what if isinstance(what, str) else what()}: not within {timeout:g} s")
        time.sleep(every)


async def until(condition: Callable[[], object | Awaitable[object]], timeout: float,
                what: str | Callable[[], str], *, every: float = POLL_S) -> float:
    """The asyncio form of :func:`wait_for`: ``condition()`` may return a value or an awaitable;
    ``what`` may be a callable (a message built when it fails). Returns the seconds waited."""
    loop = asyncio.get_running_loop()  # its clock: virtual seconds on a loop with virtual time
    t0 = loop.time()
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return loop.time() - t0
        if loop.time() - t0 >= timeout:
            raise AssertionError(f"{what if isinstance(what, str) else what()}: not within {timeout:g} s")
        await asyncio.sleep(every)


def running(procs) -> list[int]:
    """PIDs of the ``psutil.Process`` objects given that still run (zombies excluded)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.Error:
            pass
    return alive


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


# A model small enough for several nodes on 2 cores (p2pdiloco.presets), 400 steps.
TINY = {**presets.TINY, "inner.total_steps": "400"}


class Harness:
    """The processes of one test (bootstrap peers, nodes), started and ended by the one
    supervisor (``p2pdiloco.procs.Processes``), and every p2pd seen under them (``daemons``:
    none may outlive the test)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.processes = Processes()  # SIGKILL to every child if the test process dies
        self.daemons: set[psutil.Process] = set()

    @property
    def procs(self) -> list[Proc]:
        return self.processes.procs

    def spawn(self, args: list[str], log: Path, *, session: bool = True, prefix: tuple[str, ...] = ()) -> Proc:
        """Start ``python args`` leading a new session (``session``), else only a new process
        group, as a shell starts a job (a session leader cannot move its p2pd out of its group:
        ``net.transport.process_group._spawn_group``). Either way the process group's ID is the PID.
        ``prefix``: a command that sets up and then execs python (the same PID), such as
        :func:`private_tmpfs`'s."""
        return self.processes.start([*prefix, sys.executable, *args], log, log.parent.name, session=session)

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
        def started() -> str | None:
            assert proc.poll() is None, (self.tmp / "bootstrap.log").read_text()
            text = path.read_text().strip() if path.exists() else ""
            return text.split()[0] if text else None

        return wait_for(started, 60, "the bootstrap peer's multiaddr", every=0.1)

    def node(self, maddr: str, name: str, settings: dict[str, str], *extra: str,
             session: bool = True, inject: tuple[str, ...] = (), prefix: tuple[str, ...] = ()) -> tuple[Proc, Path]:
        """A node process of run "test"; with ``inject`` (``--fault KIND@N``, ``--poison KIND``)
        started through ``p2pdiloco.chaos.inject``, which records the faults that fire in
        ``faults.jsonl`` of its data dir."""
        d = self.tmp / name
        d.mkdir()
        entry = ["-m", "p2pdiloco.chaos.inject", *inject, "--record", str(d / FAULTS_FILE), "--", "node"] \
            if inject else ["-m", "node"]
        args = [*entry, "run", "--initial-peers", maddr, "--host", "127.0.0.1", "--port", "0",
                "--name", name, "--data-dir", str(d), "--report-file", str(d / "report.json"),
                "--status-file", str(d / "status.json"), "--run-id", "test", *extra]
        for k, v in settings.items():
            args += ["--set", f"{k}={v}"]
        return self.spawn(args, d / "node.log", session=session, prefix=prefix), d

    def wait(self, proc: Proc | subprocess.Popen, timeout: float, log: Path) -> int:
        try:
            wait_for(lambda: proc.poll() is not None, timeout, "the process's exit", every=0.5,
                     tick=self.track_daemons)
        except AssertionError:
            raise AssertionError(f"process did not finish in {timeout} s:\n{log.read_text()[-3000:]}") from None
        return proc.returncode

    def close(self) -> None:
        self.track_daemons()
        self.processes.close(grace=15.0)


def private_tmpfs(mount: Path, size: str) -> tuple[str, ...] | None:
    """A command prefix that runs its command in a mount namespace of its own (``unshare -m``;
    with ``-r``, a user namespace too, when not root) where ``mount`` is a fresh tmpfs of
    ``size`` (``mount -o size=``: "8m"), a real filesystem that fills up; the command is
    exec'd, so its PID is the prefix's. Other processes see the files at
    ``/proc/PID/root/MOUNT`` while it runs. None when this machine cannot make one (no
    ``unshare``, user namespaces off)."""
    user = () if os.geteuid() == 0 else ("-r",)
    script = 'mkdir -p "$0" && mount -t tmpfs -o size="$1" tmpfs "$0" && shift && exec "$@"'
    prefix = ("unshare", *user, "-m", "sh", "-c", script, str(mount), size)
    made = [d for d in (mount, *mount.parents) if not d.exists()]  # by the probe's mkdir: removed after it
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    finally:
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
    return prefix if probe.returncode == 0 else None


def read_report(d: Path) -> Report:
    """A node's final report, held to its documented form (p2pdiloco.status.Report): every key,
    no other, each of its type."""
    report = json.loads((d / "report.json").read_text())
    schema = keys(Report)
    assert set(report) == set(schema), (set(schema) - set(report), set(report) - set(schema))
    assert all(conforms(report[k], t) for k, (t, _) in schema.items()), \
        {k: report[k] for k, (t, _) in schema.items() if not conforms(report[k], t)}
    return report


@pytest.fixture
def harness(tmp_path: Path):
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()
        try:  # each p2pd exits with its node (its parent's death is its signal)
            wait_for(lambda: not running(h.daemons), 5, "the test's p2pd daemons to exit")
        except AssertionError:
            left = running(h.daemons)
            for daemon in h.daemons:  # a daemon in a process group of its own: no killpg reached it
                with contextlib.suppress(psutil.Error):
                    daemon.kill()
            raise AssertionError(f"p2pd daemons outlived the test: {left}") from None


@pytest.fixture
def no_daemon_left():
    """Every p2pd a test starts in this process (swarms, identity probes, publishers) is gone
    when it ends (waits up to 5 s for them to exit)."""
    yield

    def daemons() -> list[int]:
        return running(c for c in psutil.Process().children(recursive=True) if _name(c) == "p2pd")

    try:
        wait_for(lambda: not daemons(), 5, "this process's p2pd daemons to exit", every=0.1)
    except AssertionError:
        pytest.fail(f"p2pd daemons outlived the test: {daemons()}")


@contextlib.asynccontextmanager
async def swarms(n: int, memberships: list | None = None, identities: list | None = None) -> AsyncIterator[list]:
    """``n`` in-process transports (one p2pd each) on 127.0.0.1, each joining the first; the
    i-th with ``memberships[i]`` and ``identities[i]`` (None: public swarm, new key). Every
    one is shut down on exit, its p2pd with it."""
    from p2pdiloco.net.transport.swarm import Swarm  # noqa: PLC0415  (imports hivemind)

    started: list[Swarm] = []
    try:
        for i in range(n):
            peers = await started[0].visible_maddrs() if started else []
            started.append(await Swarm.start(initial_peers=peers, membership=(memberships or [None] * n)[i],
                                             identity=(identities or [None] * n)[i]))
        yield started
    finally:
        await asyncio.gather(*(s.shutdown() for s in started), return_exceptions=True)
