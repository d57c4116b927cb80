"""Socket bytes of one RPC: two peers in a network namespace with only ``lo`` (run by
bench/control_plane.py, which makes the namespace), one calling the other's empty handler
``--calls`` times with an empty header, then with a 300-byte one, each in the caller's session
(``header_0``, ``header_300``) and on a stream of its own (``stream_header_0``, ...: a reply
limit over ``sessions.MAX_MESSAGE``; before sessions, every call); prints JSON: the loopback
bytes and packets per call (TCP/IP headers, TLS, yamux, stream negotiation and closing
included), after an idle window that measures (and subtracts) the daemons' own background."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from p2pdiloco.net.transport.swarm import Swarm

LO = Path("/sys/class/net/lo/statistics")


def counters() -> tuple[int, int]:
    return int((LO / "tx_bytes").read_text()), int((LO / "tx_packets").read_text())


async def main(calls: int, idle: float) -> dict:
    a = await Swarm.start()
    try:
        b = await Swarm.start(initial_peers=[(await a.visible_maddrs())[0]])
        try:
            async def empty(peer: str, header: dict, payload: bytes) -> tuple[dict, bytes]:
                return {}, b""
            await a.add_handler("t.empty", empty)
            await b.call(a.peer_id, "t.empty", {}, timeout=10)  # connected, protocol known
            (b0, _), t0 = counters(), time.monotonic()
            await asyncio.sleep(idle)  # a measurement window
            background = (counters()[0] - b0) / (time.monotonic() - t0)
            out = {"idle_bytes_per_s": background}
            for size, path in ((0, ""), (300, ""), (0, "stream_"), (300, "stream_")):
                header = {"x": bytes(size)} if size else {}
                # stream_: a reply limit over sessions.MAX_MESSAGE, so that the call takes a stream of its own
                max_reply = 2 << 20 if path else 64 << 10
                (b0, p0), t0 = counters(), time.monotonic()
                for _ in range(calls):
                    await b.call(a.peer_id, "t.empty", header, timeout=10, max_reply=max_reply)
                (b1, p1), dt = counters(), time.monotonic() - t0
                out[f"{path}header_{size}"] = {"bytes_per_call": (b1 - b0 - background * dt) / calls,
                                                "packets_per_call": (p1 - p0) / calls}
            return out
        finally:
            await b.shutdown()
    finally:
        await a.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window")
    a = ap.parse_args()
    print(json.dumps(asyncio.run(main(a.calls, a.idle))), flush=True)
