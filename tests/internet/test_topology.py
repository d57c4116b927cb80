"""Checks of the simulated internet itself: homes reach public hosts through their NAT
router, and nothing on the public side reaches into a home."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from bench.internet import Internet, namespaces, run_cmd, unavailable

_reason = unavailable()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

PORT = 40000

# serves forever: to every connection, the peer's address as this server sees it
SERVER = """\
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    conn, (peer, _) = srv.accept()
    conn.sendall(peer.encode()); conn.close()
"""

# connect (each try bounded by a socket timeout), retrying until a deadline; print what the
# server says and exit 0, or print the last error and exit 1
CLIENT = """\
import socket, sys, time
host, port, wait, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
end, pause = time.monotonic() + wait, 0.05  # a poll with a deadline, not a fixed wait
while True:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            print(s.recv(64).decode()); sys.exit(0)
    except OSError as e:
        if time.monotonic() >= end:
            print(f"{type(e).__name__}: {e}"); sys.exit(1)
        time.sleep(pause)
"""


def left(prefix: str) -> list[str]:
    """Namespaces of this machine that belong to ``prefix``."""
    return [ns for ns in namespaces() if ns.startswith(prefix + "-")]


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh prefix; its namespaces are removed after the test if the test left any."""
    p = "p2t" + uuid.uuid4().hex[:6]
    yield p
    for ns in left(p):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def serve(net: Internet, host: str, addr: str) -> subprocess.Popen[bytes]:
    """Start SERVER on ``addr``:PORT inside ``host``'s namespace."""
    return subprocess.Popen(net.exec_prefix(host) + [sys.executable, "-c", SERVER, addr, str(PORT)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def connect(net: Internet, host: str, addr: str, wait: float, timeout: float = 2.0) -> tuple[bool, str]:
    """From ``host``, connect to ``addr``:PORT: (connected, server's reply or the error)."""
    done = subprocess.run(net.exec_prefix(host) + [sys.executable, "-c", CLIENT, addr, str(PORT), str(wait),
                                                   str(timeout)], capture_output=True, text=True,
                          timeout=wait + timeout + 10)
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def test_home_reaches_public_host_through_nat(prefix: str) -> None:
    with Internet(prefix, homes=2, public_hosts=["boot", "pub"]) as net:
        assert (net.ip("boot"), net.ip("pub"), net.ip("h1")) == ("203.0.113.10", "203.0.113.11", "10.1.0.2")
        server = serve(net, "pub", net.ip("pub"))
        try:
            for home in ("h1", "h2"):
                ok, seen = connect(net, home, net.ip("pub"), wait=10)
                assert ok, f"{home} -> pub: {seen}"
                assert seen == net.public_ip(home), f"server saw {home} as {seen}, not its router's address"
            assert net.public_ip("h1") == "203.0.113.21"
        finally:
            server.kill()
            server.wait()
    assert left(prefix) == []


def test_nat_blocks_inbound(prefix: str) -> None:
    with Internet(prefix, homes=1, public_hosts=["pub"]) as net:
        server = serve(net, "h1", "0.0.0.0")
        try:
            ok, seen = connect(net, "r1", net.ip("h1"), wait=10)  # readiness, and the LAN side reaches it
            assert ok and seen == "10.1.0.1", seen
            # a public host with a route into the home too: the router's forward filter drops it
            run_cmd(["ip", "-n", net.ns("pub"), "route", "add", "10.1.0.0/24", "via", net.public_ip("h1")])
            for addr in (net.ip("h1"), net.public_ip("h1")):
                start = time.monotonic()
                ok, seen = connect(net, "pub", addr, wait=0)
                assert not ok, f"pub reached {addr}:{PORT} inside the home: {seen}"
                assert time.monotonic() - start < 8, f"pub -> {addr}: took {time.monotonic() - start:.1f} s"
        finally:
            server.kill()
            server.wait()
    assert left(prefix) == []
