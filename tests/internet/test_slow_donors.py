"""A newcomer whose only donors sit on a slow link (512 kbit/s each way, tbf in network
namespaces: tests/internet/topology.py): its state downloads take the time that link needs and
succeed, instead of failing at a deadline made for a fast link and striking both donors
(docs/operating.md, "Faults of the machine"). Real nodes and p2pd; assertions on status JSON and
the journal. Not in the default suite (``python -m pytest -q tests/internet``)."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest

from node.journal import FILE as JOURNAL_FILE
from node.journal import read_journal
from p2pdiloco.status import read_status
from tests.conftest import TINY, wait_for
from tests.internet.topology import Internet, unavailable

pytestmark = pytest.mark.usefixtures("no_daemon_left")

REASON = unavailable(nat=False)
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)

DONOR_MBIT = 0.512


def _status(d: Path) -> dict:
    return read_status(d / "status.json") or {}


def _start(harness, net: Internet, host: str, args: list[str]) -> Path:
    """``python -m args`` on ``host``, with its data dir, status and report files and log in
    ``harness.tmp/host``; returns that folder."""
    d = harness.tmp / host
    d.mkdir()
    harness.processes.start([*net.exec_prefix(host), sys.executable, "-m", *args], d / "node.log", host,
                            cwd=Path(__file__).resolve().parents[2])
    return d


def _node(harness, net: Internet, host: str, maddr: str, settings: dict[str, str]) -> Path:
    # libp2p counts documentation addresses (203.0.113.0/24) as unroutable: hosts announce names
    args = ["node", "run", "--initial-peers", maddr, "--host", net.ip(host), "--port", "4001", "--name", host,
            "--set", f"swarm.announce=/dns4/{host}.example/tcp/4001",
            "--data-dir", str(harness.tmp / host), "--status-file", str(harness.tmp / host / "status.json"),
            "--run-id", "slow", "--duration", "600", *(a for k, v in settings.items() for a in ("--set", f"{k}={v}"))]
    return _start(harness, net, host, args)


def _state_bytes(settings: dict[str, str]) -> list[int]:
    """Bytes on the wire of each fragment's state (Θ and momentum, fp32) for ``settings``."""
    from p2pdiloco.config import load_config  # noqa: PLC0415
    from p2pdiloco.net.codecs import wire  # noqa: PLC0415
    from node.setup import Setup  # noqa: PLC0415

    setup = Setup.build(load_config(overrides=settings), "probe", "QmProbe")
    return [wire.wire_nbytes([s.shape for s in f.slots] * 2, "fp32") for f in setup.fragments]


@pytest.mark.timeout(600)
def test_a_newcomer_catches_up_from_donors_on_a_slow_link(harness):
    """Two donors, each on a 512 kbit/s link, train and hold states past v0; a newcomer on a
    fast link joins. Each fragment's state arrives within the time the donors' link needs for all of them plus
    30 s of the newcomer starting to join; no donor is struck for it (``ignored`` empty) and
    the newcomer's journal holds no failed download."""
    # a wider model than TINY: a fragment's state (about 0.6 MB) needs 10 s at 512 kbit/s, the
    # first deadline (3 s + size / 256 KiB/s) about 5.5 s; rounds get the time that link needs
    settings = {**TINY, "model.n_embd": "96", "outer.liveness_timeout": "30", "outer.quorum_timeout": "30",
                "swarm.reachability": "public", "settle": "0"}
    sizes = _state_bytes(settings)
    with Internet("p2s" + uuid.uuid4().hex[:5], homes=0, public_hosts=("boot", "d1", "d2", "new"),
                  rate_mbit={"d1": DONOR_MBIT, "d2": DONOR_MBIT},
                  names={f"{h}.example": h for h in ("boot", "d1", "d2", "new")}) as net:
        boot = _start(harness, net, "boot", ["bootstrap", "--host", net.ip("boot"), "--port", "31337",
                                             "--announce", "/dns4/boot.example/tcp/31337",
                                             "--maddrs-file", str(harness.tmp / "boot" / "maddrs.txt")])
        maddr = wait_for(lambda: next((m for m in ((boot / "maddrs.txt").read_text().split() if (boot / "maddrs.txt")
                                                   .exists() else []) if "/boot.example/" in m), None),
                         60, "the bootstrap peer's multiaddr")
        donors = [_node(harness, net, h, maddr, settings) for h in ("d1", "d2")]

        def alive() -> None:
            harness.track_daemons()
            for proc in harness.procs:
                assert proc.poll() is None, proc.log.read_text()[-3000:]

        wait_for(lambda: all(_status(d).get("rounds_committed", 0) >= 4 for d in donors), 240,
                 "the donors' rounds", tick=alive)
        d = _node(harness, net, "new", maddr, settings)
        wait_for(lambda: _status(d).get("state") == "joining", 120, "the newcomer joining", tick=alive, every=0.1)
        t0 = time.monotonic()
        need = sum(sizes) / (DONOR_MBIT * 1e6 / 8)  # seconds the donors' link needs for every fragment's state
        wait_for(lambda: _status(d).get("catchups", 0) >= len(sizes), need + 30,
                 lambda: f"the newcomer's downloads:\n{(d / 'node.log').read_text()[-3000:]}", tick=alive)
        took = time.monotonic() - t0
        st = _status(d)
        assert st["ignored"] == {}, st["ignored"]
        events = read_journal(d / JOURNAL_FILE)
        assert not [e for e in events if e["event"] == "download_failed"], events
        assert {e["fragment"] for e in events if e["event"] == "follow"} == set(range(len(sizes)))
        print(f"state bytes {sizes}, link needs {need:.1f} s, caught up in {took:.1f} s")
