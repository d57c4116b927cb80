"""The node's local sockets to its libp2p daemon: no other local user can open them
(docs/trust.md, threat table, "another local user drives the node's libp2p daemon").

A real p2pd started under umask 000; a child process running as ``nobody`` tries to connect
to every unix socket the node and its daemon listen on: each must be refused (EACCES)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import stat
import subprocess
from pathlib import Path

import psutil
import pytest

from p2pdiloco.net.transport.swarm import Swarm

pytestmark = pytest.mark.integration

NOBODY = 65534
PYTHON = Path("/usr/bin/python3")  # an interpreter outside /root, which nobody may not enter

CONNECT = """
import json, socket, sys
out = {}
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        out[path] = 0
    except OSError as e:
        out[path] = e.errno
    finally:
        s.close()
print(json.dumps(out))
"""


def listening_sockets(*pids: int) -> list[str]:
    """Paths of the unix sockets bound (listening) by the processes ``pids``."""
    paths = set()
    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind="unix"):
            if c.laddr and os.path.exists(c.laddr) and stat.S_ISSOCK(os.stat(c.laddr).st_mode):
                paths.add(c.laddr)
    return sorted(paths)


def connect_as_nobody(paths: list[str]) -> dict[str, int]:
    """{path: errno of connect(2), 0 when it connected} from a process running as ``nobody``."""
    done = subprocess.run([str(PYTHON), "-I", "-S", "-c", CONNECT, *paths], user=NOBODY, group=NOBODY,
                          extra_groups=[], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.asyncio
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="dropping to another user needs root")
@pytest.mark.skipif(not PYTHON.exists(), reason=f"no {PYTHON} for the unprivileged child")
async def test_daemon_sockets_refuse_other_users() -> None:
    umask = os.umask(0o000)  # the worst case: every file this process creates would be open to all
    try:
        swarm = await Swarm.start()
    finally:
        os.umask(umask)
    daemon = psutil.Process(swarm.daemon_pid)
    try:
        assert os.umask(umask) == umask  # the start gave the umask back
        paths = listening_sockets(os.getpid(), swarm.daemon_pid)
        # p2pd's control socket, and hivemind's client socket that p2pd delivers streams to
        assert len(paths) >= 2, paths
        assert {stat.S_IMODE(os.stat(p).st_mode) & 0o077 for p in paths} == {0}, \
            {p: oct(os.stat(p).st_mode) for p in paths}
        assert {os.stat(p).st_uid for p in paths} == {os.geteuid()}
        for path in paths:  # the sockets are live: their owner connects
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
        refused = await asyncio.to_thread(connect_as_nobody, paths)
        assert refused == {p: errno.EACCES for p in paths}
    finally:
        await swarm.shutdown()
    _, alive = psutil.wait_procs([daemon], timeout=30)
    assert alive == []
    assert [p for p in paths if os.path.exists(p)] == []  # removed on exit
