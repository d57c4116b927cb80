"""The real commands, in subprocesses, on malformed input: each must exit non-zero with exactly
one clear line on stderr (no traceback) and leave no p2pd daemon behind.

Every command runs in its own session, so a daemon it starts can be found by its session ID
even after the command (its parent) exited. The cases run concurrently (each costs a Python
start with torch), then each test checks one case.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_for

# A valid peer ID: base58 of the sha2-256 multihash of b"p2pdiloco-test" (hivemind's PeerID
# accepts it; test_wire_records checks it through check_peer_maddr).
PID = "QmV6bPa3xB8gg5YhjHnmHBCvVpymShB3aaPJmsvxWoq5LB"
TIMEOUT = 60  # seconds per command; a case that needs more is a bug
NODE = ["-m", "node", "run", "--host", "127.0.0.1", "--port", "0"]
CLI_NODE = ["-m", "p2pdiloco.cli", "node", "run", "--host", "127.0.0.1", "--port", "0"]
BOOT = ["-m", "bootstrap", "--host", "127.0.0.1", "--port", "0"]
NEW_SWARM = "to start a new swarm instead, run `p2pdiloco bootstrap`"


@dataclass
class Result:
    argv: list[str]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    daemons_seen: set[int] = field(default_factory=set)  # p2pd pids seen while it ran
    survivors: list[int] = field(default_factory=list)  # p2pd of its session still alive after it

    def describe(self) -> str:
        return (f"argv: {' '.join(self.argv)}\nexit: {self.returncode} after {self.seconds:.1f} s\n"
                f"stdout: {self.stdout[-2000:]}\nstderr: {self.stderr[-4000:]}")


def _alive_pid(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.Error:
        return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _session_daemons(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["name"]):
        try:
            if p.info["name"] == "p2pd" and os.getsid(p.pid) == sid and _alive(p):
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def run_command(args: list[str]) -> Result:
    """Run ``python ARGS`` in a new session; kill its whole group if it overruns TIMEOUT."""
    res = Result([sys.executable, *args])
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(res.argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        def note_daemons() -> None:
            try:
                res.daemons_seen |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)
                                     if c.name() == "p2pd"}
            except psutil.Error:
                pass

        with contextlib.suppress(AssertionError):  # overran: killed below
            wait_for(lambda: proc.poll() is not None, TIMEOUT, "the command", every=0.05, tick=note_daemons)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        res.seconds = time.monotonic() - t0
        res.returncode = None if res.seconds >= TIMEOUT else proc.returncode
        def daemons_gone() -> bool:  # a daemon that is exiting on its own gets a moment
            return not _session_daemons(proc.pid) and not any(_alive_pid(pid) for pid in res.daemons_seen)

        with contextlib.suppress(AssertionError):  # the survivors are reported below
            wait_for(daemons_gone, 1.0, "the command's daemons to exit", every=0.05)
        survivors = {p.pid: p for p in _session_daemons(proc.pid)}
        for pid in res.daemons_seen:
            try:
                p = psutil.Process(pid)
                if _alive(p):
                    survivors[pid] = p
            except psutil.Error:
                pass
        res.survivors = sorted(survivors)
        for p in survivors.values():  # ours, by pid: do not leak them into the next test
            try:
                p.kill()
            except psutil.Error:
                pass
        out.seek(0)
        err.seek(0)
        res.stdout = out.read().decode(errors="replace")
        res.stderr = err.read().decode(errors="replace")
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Runs:
    """Every case's result, with the inputs the assertions need."""

    results: dict[str, Result]
    tmp: Path  # holds not.toml and unknown.toml
    offline: str  # a valid multiaddr where nothing listens
    busy: int  # a port held by the test while the commands ran

    def __getitem__(self, case: str) -> Result:
        return self.results[case]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "not.toml").write_text("[outer\nlr = 0.5\n")
    (tmp / "unknown.toml").write_text("[outer]\nlr = 0.5\nlrr = 1\n")
    (tmp / "tiny").mkdir()
    (tmp / "tiny" / "notes.txt").write_text("forty bytes of text, far too few to train\n")
    offline = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{PID}"  # valid, but nothing listens there
    with socket.socket() as taken, socket.socket() as not_libp2p:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        not_libp2p.bind(("127.0.0.1", 0))
        not_libp2p.listen(16)  # accepts TCP but speaks no libp2p: the daemon itself gets to fail
        busy = taken.getsockname()[1]
        tcp_only = f"/ip4/127.0.0.1/tcp/{not_libp2p.getsockname()[1]}/p2p/{PID}"
        cases = {
            "wrong protocol": NODE + ["--initial-peers", f"/http/127.0.0.1/tcp/5000/p2p/{PID}"],
            "embedded space": NODE + ["--initial-peers", f"/ip4/127.0.0.1/tcp/5000 /p2p/{PID}"],
            "missing /p2p/": NODE + ["--initial-peers", "/ip4/127.0.0.1/tcp/5000"],
            "port 0": NODE + ["--initial-peers", f"/ip4/127.0.0.1/tcp/0/p2p/{PID}"],
            "bad peer id": NODE + ["--initial-peers", "/ip4/127.0.0.1/tcp/5000/p2p/notapeerid"],
            "bootstrap bad peer": BOOT + ["--initial-peers", "/ip4/127.0.0.1/tcp/5000"],
            "bootstrap bad swarm key": BOOT + ["--swarm-key", "not-a-key"],
            "set without =": CLI_NODE + ["--set", "outer.lr"],
            "set bad value": NODE + ["--set", "outer.lr=fast"],
            "not toml": NODE + ["--config", str(tmp / "not.toml")],
            "unknown key": NODE + ["--config", str(tmp / "unknown.toml")],
            "missing data": NODE + ["--data", str(tmp / "no-such-corpus")],
            "tiny data": NODE + ["--data", str(tmp / "tiny")],
            "memory limit": NODE + ["--memory-limit", "64"],
            "no apple gpu": NODE + ["--device", "mps"],
            "unwritable data dir": NODE + ["--data-dir", "/proc/no-such-process/node"],
            "node all offline": NODE + ["--initial-peers", offline],
            "bootstrap all offline": BOOT + ["--initial-peers", offline],
            "bootstrap port in use": ["-m", "bootstrap", "--host", "127.0.0.1", "--port", str(busy)],
            "node port in use": ["-m", "node", "run", "--host", "127.0.0.1", "--port", str(busy)],
            "node peer not libp2p": NODE + ["--initial-peers", tcp_only],
            "demo set without =": ["-m", "p2pdiloco.cli", "demo", "--set", "outer.sync_every"],
            "demo bad setting": ["-m", "p2pdiloco.cli", "demo", "--set", "outer.fragments=0"],
        }
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = {name: pool.submit(run_command, args) for name, args in cases.items()}
            done = {name: f.result() for name, f in futures.items()}
    yield Runs(done, tmp, offline, busy)


def one_line(res: Result, code: int | None = None) -> str:
    """The rules every case must follow; returns the single stderr line."""
    assert res.returncode is not None, f"timed out\n{res.describe()}"
    assert res.returncode != 0, res.describe()
    if code is not None:
        assert res.returncode == code, res.describe()
    assert "Traceback" not in res.stderr, res.describe()
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.describe()
    assert lines[0].startswith("p2pdiloco: "), res.describe()
    assert not res.survivors, f"p2pd outlived its command: {res.survivors}\n{res.describe()}"
    return lines[0]


ADDRESS_CASES = {
    "wrong protocol": "/http is not a host protocol; a multiaddr starts with one of /ip4, /ip6, /dns, /dns4, /dns6",
    "embedded space": "multiaddrs contain no spaces (use one flag or comma per address)",
    "missing /p2p/": "missing the /p2p/PEER_ID part (copy the whole address the bootstrap peer printed",
    "port 0": "port 0 cannot be dialed; give the real port",
    "bad peer id": "'notapeerid' after /p2p/ is not a valid peer ID",
}


@pytest.mark.parametrize("case", sorted(ADDRESS_CASES))
def test_malformed_initial_peer(results: Runs, case: str) -> None:
    line = one_line(results[case], code=2)
    assert line.startswith("p2pdiloco: invalid configuration: swarm.initial_peers: initial peer '/")
    assert ADDRESS_CASES[case] in line
    assert line.endswith("(from the command line)")
    assert not results[case].daemons_seen  # refused before any daemon started


def test_bootstrap_malformed_swarm_key(results: Runs) -> None:
    assert one_line(results["bootstrap bad swarm key"], code=2).startswith("p2pdiloco: --swarm-key 'not-a-key':")


def test_bootstrap_malformed_initial_peer(results: Runs) -> None:
    line = one_line(results["bootstrap bad peer"], code=2)
    assert line == ("p2pdiloco: initial peer '/ip4/127.0.0.1/tcp/5000': missing the /p2p/PEER_ID part (copy the "
                    "whole address the bootstrap peer printed, for example /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...)")


def test_set_without_equals(results: Runs) -> None:
    line = one_line(results["set without ="], code=2)
    assert line == "p2pdiloco: --set 'outer.lr': expected SECTION.FIELD=VALUE, for example --set outer.sync_every=50"


def test_the_demo_checks_its_settings_before_anything_starts(results: Runs) -> None:
    """A fresh user's finding: the demo ignored a --set without = and ran 4 minutes, and a bad
    value failed only in each node after the swarm had started."""
    line = one_line(results["demo set without ="], code=2)
    assert line == ("p2pdiloco: --set 'outer.sync_every': expected SECTION.FIELD=VALUE, for example "
                    "--set outer.sync_every=50")
    line = one_line(results["demo bad setting"], code=2)
    assert line == "p2pdiloco: invalid configuration: outer.fragments: must be in 1..1024 (from the command line)"
    assert not results["demo set without ="].daemons_seen and not results["demo bad setting"].daemons_seen


def test_set_with_a_bad_value(results: Runs) -> None:
    line = one_line(results["set bad value"], code=2)
    assert line == "p2pdiloco: invalid configuration: outer.lr: expected a number, got 'fast' (from the command line)"


def test_config_that_is_not_toml(results: Runs) -> None:
    line = one_line(results["not toml"], code=2)
    path = results.tmp / "not.toml"
    assert line.startswith(f"p2pdiloco: config file {path} is not valid TOML: ")
    assert "line 1" in line


def test_config_with_an_unknown_key(results: Runs) -> None:
    line = one_line(results["unknown key"], code=2)
    path = results.tmp / "unknown.toml"
    assert line.startswith("p2pdiloco: invalid configuration: outer.lrr: unknown setting; known: error_feedback_decay, fragments, ")
    assert line.endswith(f"(in {path})")


def test_data_path_that_does_not_exist(results: Runs) -> None:
    line = one_line(results["missing data"], code=2)
    path = results.tmp / "no-such-corpus"
    assert line == f"p2pdiloco: invalid configuration: data.path: '{path}' does not exist (from the command line)"


def test_data_too_small_for_one_sequence_is_refused_before_any_daemon(results: Runs) -> None:
    res = results["tiny data"]
    line = one_line(res, code=2)
    assert line.startswith("p2pdiloco: ") and "data: this node's training text has 42 bytes, fewer than one " \
        "sequence (model.block_size + 1 = " in line, line
    assert not res.daemons_seen  # refused before any daemon started


@pytest.mark.parametrize("case", ["memory limit", "no apple gpu", "unwritable data dir"])
def test_hardware_and_data_dir_that_cannot_work_are_refused_before_any_daemon(results: Runs, case: str) -> None:
    res = results[case]
    line = one_line(res, code=2)
    assert line.startswith({"memory limit": "p2pdiloco: memory_limit: training this 0.",
                            "no apple gpu": "p2pdiloco: device 'mps': no Apple GPU",
                            "unwritable data dir": "p2pdiloco: data_dir: cannot create /proc/no-such-process/node"}[case])
    assert not res.daemons_seen


@pytest.mark.parametrize("case", ["node all offline", "bootstrap all offline"])
def test_all_initial_peers_offline(results: Runs, case: str) -> None:
    res = results[case]
    line = one_line(res, code=1)
    assert line == (f"p2pdiloco: none of the initial peers is reachable ({results.offline}: Connection refused); "
                    f"check the addresses, or {NEW_SWARM} and pass the multiaddr it prints to --initial-peers")
    assert res.seconds < 30, res.describe()


@pytest.mark.parametrize("case", ["bootstrap port in use", "node port in use"])
def test_port_in_use(results: Runs, case: str) -> None:
    line = one_line(results[case], code=1)
    port = results.busy
    assert line == (f"p2pdiloco: port {port} on 127.0.0.1 is already in use (another bootstrap peer or node?); "
                    "choose another --port, or --port 0 for any free port")


def test_peer_that_speaks_no_libp2p(results: Runs) -> None:
    """The preflight passes (the port accepts TCP), so the daemon starts, fails to bootstrap
    and must not survive the command."""
    res = results["node peer not libp2p"]
    line = one_line(res, code=1)
    assert res.daemons_seen, f"expected a daemon to start\n{res.describe()}"
    assert "initial peers" in line or "bootstrap peers" in line, line


def test_peer_that_speaks_no_libp2p_says_how_to_start_a_swarm(results: Runs) -> None:
    line = one_line(results["node peer not libp2p"], code=1)
    assert "p2pdiloco bootstrap" in line, line
