"""Scale of the round protocol: matchmaking and all-reduce among 8 to 128 in-memory peers.

    python -m bench.scale                                  # N = 8, 16, 32, 64, 128; 60 rounds each (about 20 minutes)
    python -m bench.scale --sizes 8 16 --rounds 3 --out /tmp/scale   # a quick look

Each size runs on one ``MemoryNet`` (``p2pdiloco.net.transport.memory``): every peer a real ``Swarm`` (the
framing, limits, deadlines and signed DHT records of production) with its ``Matchmaker`` and
``AllReducer``, over links of 25 ms one way (50 ms round trip) and 20 Mbit/s. One round is one
outer round of one fragment at version v: every peer becomes ready at a random time within
``--spread`` seconds (learners drift apart), declares under the version's key with the grace
window of the demo (1 s, at most 3 s) and ``expected`` = N, and ends in a group, or "late" (a
group at its version closed without it: it would follow that group's state); each group then
all-reduces a fragment of 107k parameters, int4 on the wire. Rounds run one after the other.

Per size: versions forked (two or more groups at one version: a split brain, invariant I7),
peers late per round, members per group, round latency (ready to merged result, per member),
and per node and round: RPC streams opened for matchmaking (control) and for the all-reduce,
control bytes (every byte written, framing included, minus the all-reduce's payload) and DHT
reads and stores. Growth per node: the log-log slope of each per-node figure between the
smallest and the largest N (0: flat, 1: linear in N).

In it too: the leaders' gathering announcements, pushed to every other peer (``mm.gather``, as
a node pushes them to the learners of its records). Not in it: the node's background loops
(its record published every 5 s, the catch-up's records read every 2 s, status), state
downloads and training; they come when the node runs on this transport. A get costs nothing
here, whereas a Kademlia get visits up to 20 peers whose answers carry every record under the
key, so DHT traffic is counted, not timed, and its bytes are not in the control bytes: the
real-socket figures are in docs/benchmarks/control_plane.md. Virtual time (``looptime``:
the loop's clock jumps to the next timer whenever every peer waits), so a round's latency is
the links' latency and rate and the protocol's waits, not this machine's CPU: signing,
compressing and merging take no virtual time, and 128 peers in one process no longer make
deadlines fire by starving the loop (they did in real time: 3 s of loop lag at 128 peers).

Writes docs/benchmarks/scale.md, .json and .png (or into ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import statistics
import time
from pathlib import Path

import looptime
import torch

from bench import common as c
from p2pdiloco.core.fragments import Fragment, TensorSlot
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution, RoundResult
from p2pdiloco.net.rounds.matchmaking import GroupKey, Matchmaker
from p2pdiloco.net.transport.memory import Link, MemoryNet
from p2pdiloco.trust.identity import Identity

SHAPES = [(256, 128), (128, 384), (128, 128), (128, 64), (384,), (128,)]  # 107k parameters
FRAGMENT = Fragment(0, tuple(TensorSlot(f"t{i}", s, math.prod(s), i == 0) for i, s in enumerate(SHAPES)))
LINK = Link(latency=0.025, rate=20e6 / 8)
GRACE, GRACE_MAX, QUORUM_TIMEOUT = 1.0, 3.0, 10.0  # the demo's (node/demo.py)
PER_NODE = ("control_streams", "reduce_streams", "control_bytes", "dht_gets", "dht_stores")


async def one_size(n: int, rounds: int, spread: float, seed: int) -> dict:
    rng = random.Random(seed)
    net = MemoryNet(default=LINK, seed=seed)
    # seeded identities: one seed gives the same leaders, groups and figures (virtual time)
    sw = [await net.swarm(identity=Identity.from_seed(hashlib.sha256(f"scale/{seed}/{i}".encode()).digest()))
          for i in range(n)]
    mms = [Matchmaker(s, "scale", 1, num_fragments=1) for s in sw]
    reducers = [AllReducer(s, [FRAGMENT], "int4", QUORUM_TIMEOUT, sync_every=100, run_id="scale") for s in sw]
    for m, r in zip(mms, reducers):
        m.listed_in = r.expect  # as the node wires them, and every peer in the audience of the others' pushes
        m.gatherings.audience = lambda me=m.swarm.peer_id: [s.peer_id for s in sw if s.peer_id != me]
        await m.start()
        await r.start()
    pushers = [asyncio.create_task(m.gatherings.push_forever()) for m in mms]
    gen = torch.Generator().manual_seed(seed)
    deltas = [tuple(torch.randn(s, generator=gen) * 1e-2 for s in SHAPES) for _ in range(n)]
    loop = asyncio.get_running_loop()
    forked, late, sizes, latency, failed, fork_sizes = 0, [], [], [], 0, []
    t_start, real_start = loop.time(), time.perf_counter()
    try:
        for v in range(1, rounds + 1):
            key = GroupKey(0, v, f"{v:064x}")
            offsets = [rng.uniform(0, spread) for _ in range(n)]

            async def member(i: int) -> tuple[str, tuple | None, float | None]:
                await asyncio.sleep(offsets[i])
                t0 = loop.time()
                outcome, group = await mms[i].form_group(key, grace=GRACE, quorum_timeout=QUORUM_TIMEOUT,
                                                         expected=n, max_grace=GRACE_MAX)
                if outcome != "group":
                    return outcome, None, None
                try:
                    res = await reducers[i].run(group, Contribution(deltas[i], 1000, 100))
                except Exception:  # noqa: BLE001 - a failed round is counted, not fatal
                    return "failed", group.members, None
                return "group", group.members, loop.time() - t0 if isinstance(res, RoundResult) else None

            results = await asyncio.gather(*(member(i) for i in range(n)))
            groups = {m for o, m, _ in results if m is not None}
            forked += len(groups) > 1
            if len(groups) > 1:
                fork_sizes.append(sorted((len(g) for g in groups), reverse=True))
            late.append(sum(o == "late" for o, _, _ in results))
            failed += sum(o == "failed" for o, _, _ in results)
            sizes.extend(len(g) for g in groups)
            latency.extend(t for _, _, t in results if t is not None)
    finally:
        for task in pushers:
            task.cancel()
        await net.close()
    payload = sum(s.stats.bytes_out for s in sw)
    per = n * rounds
    reduce_streams = net.streams.get("ar.reduce", 0)
    return {
        "nodes": n, "rounds": rounds, "seconds": round(loop.time() - t_start, 1),
        "real_seconds": round(time.perf_counter() - real_start, 1),
        "versions_forked": forked, "fork_group_sizes": fork_sizes, "late_per_round": statistics.mean(late), "members_per_group": statistics.mean(sizes),
        "failed": failed,
        "latency_median_s": statistics.median(latency) if latency else None,
        "latency_p95_s": sorted(latency)[int(0.95 * (len(latency) - 1))] if latency else None,
        "control_streams": (sum(net.streams.values()) - reduce_streams) / per, "reduce_streams": reduce_streams / per,
        "control_bytes": (sum(net.bytes_sent.values()) - payload) / per,
        "dht_gets": sum(net.dht_gets.values()) / per, "dht_stores": sum(net.dht_stores.values()) / per,
        "streams_by_rpc": dict(net.streams),
    }


def growth(rows: list[dict], name: str) -> float | None:
    a, b = rows[0], rows[-1]
    if a[name] <= 0 or b[name] <= 0 or a["nodes"] == b["nodes"]:
        return None
    return math.log(b[name] / a[name]) / math.log(b["nodes"] / a["nodes"])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5))
    ns = [r["nodes"] for r in rows]
    for name, label in [("control_bytes", "control bytes / 100"), ("control_streams", "control RPC streams"),
                        ("dht_gets", "DHT reads"), ("dht_stores", "DHT stores")]:
        scale = 100 if name == "control_bytes" else 1
        ax.plot(ns, [r[name] / scale for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("peers (N)")
    ax.set_ylabel("per node and round")
    ax.set_title("Round protocol per node and round, in-memory peers (50 ms RTT, 20 Mbit/s)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(rows: list[dict], a: argparse.Namespace, m: dict, took: float) -> str:
    cmd = "python -m bench.scale" + (f" --sizes {' '.join(map(str, a.sizes))}" if a.sizes != DEFAULT_SIZES else "") \
        + (f" --rounds {a.rounds}" if a.rounds != 60 else "") + (f" --spread {a.spread:g}" if a.spread != 2.0 else "")
    out = ["# Scale of the round protocol (in-memory peers)", "", __doc__.split("\n\n", 2)[2].split("\n\nWrites")[0],
           "", f"Command: `{cmd}` (from the repository root, in the project's virtual environment; took "
           f"{took / 60:.1f} minutes).", "", f"Machine: {c.machine_line(m)}", "",
           "| N | versions forked | late per round | members per group | failed | latency median / p95 (s) "
           "| control streams | all-reduce streams | control bytes | DHT reads | DHT stores | virtual / real s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['nodes']} | {r['versions_forked']} of {r['rounds']} | {r['late_per_round']:.1f} | "
                   f"{r['members_per_group']:.1f} | {r['failed']} | {c.fmt(r['latency_median_s'], 2)} / "
                   f"{c.fmt(r['latency_p95_s'], 2)} | {r['control_streams']:.1f} | {r['reduce_streams']:.1f} | "
                   f"{r['control_bytes']:,.0f} | {r['dht_gets']:.1f} | {r['dht_stores']:.1f} | "
                   f"{r['seconds']:.0f} / {r['real_seconds']:.0f} |")
    out += ["", "Per node and round (control streams, all-reduce streams, control bytes, DHT reads and stores).",
            "Growth per node between the smallest and the largest N (log-log slope; sub-linear: < 1):", ""]
    for name in PER_NODE:
        g = growth(rows, name)
        out.append(f"- {name}: {'n/a' if g is None else f'{g:+.2f}'}")
    forks = [f"N = {r['nodes']}: " + ", ".join(" + ".join(map(str, g)) for g in r["fork_group_sizes"])
             for r in rows if r.get("fork_group_sizes")]
    if forks:
        out += ["", "Members of the groups of each forked version: " + "; ".join(forks) + "."]
    worst = max(r["versions_forked"] / r["rounds"] for r in rows)
    out += ["", f"Forks: at most {100 * worst:.0f}% of versions at any size (goal, docs/benchmarks/README.md: under 2%).", "",
            "![scale](scale.png)"]
    return "\n".join(out) + "\n"


DEFAULT_SIZES = [8, 16, 32, 64, 128]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--spread", type=float, default=2.0, help="seconds over which the peers of a round become ready")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=c.DOCS)
    a = p.parse_args()
    if any(n < 2 or n > 256 for n in a.sizes) or a.rounds < 1 or a.spread < 0:
        raise SystemExit("scale: sizes must be in 2..256, rounds >= 1, spread >= 0")
    m, t0, rows = c.machine(), time.monotonic(), []
    for n in sorted(a.sizes):
        print(f"scale: {n} peers ...", flush=True)
        with asyncio.Runner(loop_factory=lambda: looptime.new_event_loop(start=0.0)) as runner:  # virtual time
            rows.append(runner.run(one_size(n, a.rounds, a.spread, a.seed + n)))
        r = rows[-1]
        print(f"scale: {n} peers: {r['versions_forked']} of {a.rounds} versions forked, "
              f"{r['control_bytes']:,.0f} control bytes and {r['dht_gets']:.1f} DHT reads per node and round, "
              f"{r['seconds']} virtual s in {r['real_seconds']} s", flush=True)
    m["load_end"] = __import__("os").getloadavg()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "scale.json").write_text(json.dumps({"machine": m, "rows": rows}, indent=1))
    plot(rows, a.out / "scale.png")
    (a.out / "scale.md").write_text(report(rows, a, m, time.monotonic() - t0))
    print(f"scale: wrote {a.out / 'scale.md'} ({(time.monotonic() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    main()
