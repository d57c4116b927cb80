"""A transport peer for tests/test_clock.py, run as ``python -m tests.skewed_peer`` in its own
process, whose clock a test shifts with libfaketime (LD_PRELOAD; p2pd, a static Go binary,
keeps the true time).

It joins through ``--peer``, then until ``--stop`` exists (at most ``--seconds``): stores
``{"t": swarm time}`` under ``--key`` (its own peer ID as subkey, ``--ttl`` seconds) and reads
the key back. It writes one JSON line to ``--out`` after joining and after every read:
``{"peer_id", "clock": Swarm.clock.status(), "local": its Unix time, "seen": [subkeys]}``;
on a refused start, ``{"error": exception class, "offset_s": ...}`` and exit code 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from p2pdiloco.errors import ClockSkewError, P2PDilocoError
from p2pdiloco.net.transport.swarm import Swarm


def _write(out: Path, line: dict) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")


PUBLISH_EVERY_S = 0.3  # seconds between two of this peer's records (and reads)


async def main(args: argparse.Namespace) -> int:
    out, stop = Path(args.out), Path(args.stop)
    try:
        swarm = await Swarm.start(initial_peers=[args.peer])
    except ClockSkewError as e:
        _write(out, {"error": type(e).__name__, "offset_s": e.offset_s})
        return 3
    except P2PDilocoError as e:
        _write(out, {"error": type(e).__name__, "message": str(e)})
        return 1
    try:
        end = time.monotonic() + args.seconds
        seen: list[str] = []
        while not stop.exists() and time.monotonic() < end:
            _write(out, {"peer_id": swarm.peer_id, "clock": swarm.clock.status(), "local": time.time(), "seen": seen})
            await swarm.store(args.key, swarm.peer_id, {"t": swarm.clock.now()}, args.ttl)
            seen = sorted(await swarm.get(args.key))
            await asyncio.sleep(PUBLISH_EVERY_S)
        return 0
    finally:
        await swarm.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--key", default="clock-test")
    parser.add_argument("--ttl", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=90.0)
    sys.exit(asyncio.run(main(parser.parse_args())))
