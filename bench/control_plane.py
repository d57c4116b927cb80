"""The control plane of real nodes: the socket bytes a node sends that are not pseudo-gradient
or state payload, per second and per committed round, at this commit against a baseline
commit, in the same run.

    python -m bench.control_plane                    # HEAD against --baseline, 4 nodes, 2 runs each
    python -m bench.control_plane --nodes 4 --duration 60 --repeats 2 --window 40 --baseline 74201dc

Each commit runs from its own clean clone of this repository checked out at that commit (its
processes start in the clone, with the clone first on PYTHONPATH), inside its own network
namespace with only ``lo``: a bootstrap peer and ``--nodes`` nodes (``python -m node run
--duration``), the bandwidth benchmark's model, data and swarm settings (4 fragments, grace
1-3 s), H = 100, int4 on the wire. Bytes: the namespace's ``lo`` transmit counter from the
bootstrap peer's start to the last node's exit (TCP/IP headers, TLS, yamux, the DHT and the
bootstrap peer included); *payload*: the nodes' RPC payload bytes (their reports'
``bytes_out``: slices, merged slices, state downloads; headers not counted); *control* =
bytes − payload. Per node per second (over the run's wall time) and per node per committed
round (all control bytes over the rounds: background, start-up and settling included), and in
the steady state: over a window that starts ``SETTLE_S`` (40 s) after every node trains and ends
20 s before the run's end (start-up and settling excluded), with and without the background (its rate
times the window, :func:`rounds_only`). Then the background: the same
nodes training without merging (H beyond the run), socket bytes per node per second over a
``--window`` that starts ``SETTLE_S`` after every node trains (start-up excluded). The runs alternate
between the commits (A B A B ...), so drifts in the machine's load fall on both. The nodes'
RPCs are counted by name (report key ``rpc_by_name``), and one RPC's socket bytes are measured
alone (bench/stream_cost.py), which together say where the per-round bytes go.

Writes docs/benchmarks/control_plane.md and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
import subprocess
import time
from pathlib import Path

from bench import common as c

GOAL_PER_S = 1000  # goal (docs/benchmarks/README.md): background control traffic at most 1 kB/s per node ...
GOAL_PER_ROUND = 5000  # ... and at most 5 kB per node per round
SETTLE_S = 40.0  # seconds after every node trains before a window starts: past the store of its new state
# (joining -> training), which waits for heads_records.RESTORE_S (30 s) after its first store, plus a publish period


def checkout(commit: str, work: Path) -> tuple[str, Path]:
    """A clean clone of this repository at ``commit``: (short commit, path)."""
    dst = work / f"src-{commit}"
    if not dst.exists():
        subprocess.run(["git", "clone", "-q", str(c.ROOT), str(dst)], check=True)
        subprocess.run(["git", "-C", str(dst), "checkout", "-q", commit], check=True)
    short = subprocess.run(["git", "-C", str(dst), "rev-parse", "--short", "HEAD"], check=True,
                           capture_output=True, text=True).stdout.strip()
    return short, dst


def run_once(src: Path, n: int, duration: float, work: Path, seed: int, sync_every: int = 100) -> dict:
    values = {**c.settings(inner__total_steps=100_000, outer__sync_every=sync_every, outer__wire_precision="int4",
                           eval_every=1_000_000, seed=seed), **c.SWARM}
    work.mkdir(parents=True, exist_ok=True)
    with c.NetNS(f"cp{seed}") as ns, c.processes() as procs:
        prefix = [*ns.prefix, "env", f"--chdir={src}", f"PYTHONPATH={src}"]
        before, t0 = ns.tx_bytes(), time.monotonic()
        nodes = c.start_swarm(procs, work, n, values, prefix=prefix, duration=duration)
        steady = steady_window(ns, nodes, duration - 20.0)
        c.wait_all([p for p, _ in nodes], duration + 300, "control plane")
        sent, seconds = ns.tx_bytes() - before, time.monotonic() - t0
        reports = [c.read_json(d / "report.json") for _, d in nodes]
        if any(r is None for r in reports) or any(p.returncode != 0 for p, _ in nodes):
            raise RuntimeError(f"a node failed; logs in {work}")
    payload = sum(r["bytes_out"] for r in reports)
    dht: Counter[str] = Counter()
    rpc: dict[str, list[int]] = {}
    for r in reports:
        dht.update(r.get("dht_ops", {}))  # a node's DHT reads and stores by record kind (absent before this benchmark)
        for name, (calls, header_bytes) in r.get("rpc_by_name", {}).items():  # absent before 2026-12-03
            rpc[name] = [a + b for a, b in zip(rpc.get(name, [0, 0]), (calls, header_bytes))]
    rounds = sum(r["rounds_committed"] for r in reports)
    return {"bytes": sent, "payload": payload, "seconds": seconds, "rounds": rounds,
            "tokens": sum(r["tokens"] for r in reports), "catchups": sum(r["catchups"] for r in reports),
            "control_per_node_s": (sent - payload) / n / seconds,
            "control_per_node_round": (sent - payload) / max(1, rounds), "payload_per_node_s": payload / n / seconds,
            "digests": len({r["global_digest"] for r in reports}), "dht_ops": dict(dht), "rpc_by_name": rpc,
            "steady": steady}


def steady_window(ns: c.NetNS, nodes: list, window: float, warm: float = SETTLE_S) -> dict:
    """The rounds' steady state: control bytes per node per round over ``window`` seconds that
    start ``warm`` seconds after every node trains and end before the first could stop (start-up
    and settling excluded), from the namespace's counter and the nodes' status files."""
    paths = [d / "status.json" for _, d in nodes]
    c.wait_training(paths, [p for p, _ in nodes], 180)
    time.sleep(warm)
    start, before, t0 = [c.read_json(q) for q in paths], ns.tx_bytes(), time.monotonic()
    time.sleep(max(10.0, window - warm))
    end, sent, seconds = [c.read_json(q) for q in paths], ns.tx_bytes() - before, time.monotonic() - t0
    rounds = sum(b["rounds_committed"] - a["rounds_committed"] for a, b in zip(start, end))
    payload = sum(b["bytes_out"] - a["bytes_out"] for a, b in zip(start, end))
    calls: Counter[str] = Counter()
    for a, b in zip(start, end):
        calls.update({k: v[0] - a.get("rpc_by_name", {}).get(k, [0])[0] for k, v in b.get("rpc_by_name", {}).items()})
    return {"seconds": seconds, "bytes": sent, "payload": payload, "rounds": rounds,
            "control_per_node_round": (sent - payload) / max(1, rounds),
            "control_per_node_s": (sent - payload) / len(nodes) / seconds,
            "rpc_per_round": {k: v / max(1, rounds) for k, v in calls.items() if v}}


def rounds_only(r: dict, nodes: int) -> float:
    """Control bytes per node per committed round in run ``r``'s steady state beyond its
    background: the same commit and seed's background rate (nodes training without rounds)
    times the steady window, taken off its control bytes. The background run's heartbeats are
    replaced by pushes of substantive changes while rounds run, so this slightly understates
    the cost of a round (by the heartbeats' share of the background, in its RPC table)."""
    s = r["steady"]
    background = r["background"]["background_per_node_s"] * nodes * s["seconds"]
    return (s["bytes"] - s["payload"] - background) / max(1, s["rounds"])


def background_once(src: Path, n: int, window: float, work: Path, seed: int, warm: float = SETTLE_S) -> dict:
    """Socket bytes per node per second of ``n`` nodes that train without merging (H far beyond
    the run): the background, measured over ``window`` seconds once every node trains and
    ``warm`` seconds more (start-up, the first DHT reads and stores, excluded), minus the RPC
    payload sent meanwhile (none: no round, no catch-up)."""
    values = {**c.settings(inner__total_steps=100_000, outer__sync_every=10_000_000, outer__wire_precision="int4",
                           eval_every=1_000_000, seed=seed), **c.SWARM}
    work.mkdir(parents=True, exist_ok=True)
    with c.NetNS(f"bg{seed}") as ns, c.processes() as procs:
        prefix = [*ns.prefix, "env", f"--chdir={src}", f"PYTHONPATH={src}"]
        nodes = c.start_swarm(procs, work, n, values, prefix=prefix, duration=window + warm + 300)
        paths = [d / "status.json" for _, d in nodes]
        c.wait_training(paths, [p for p, _ in nodes], 180)
        time.sleep(warm)
        start = [c.read_json(q) for q in paths]
        before, t0 = ns.tx_bytes(), time.monotonic()
        time.sleep(window)
        sent, seconds = ns.tx_bytes() - before, time.monotonic() - t0
        end = [c.read_json(q) for q in paths]
    payload = sum(b["bytes_out"] - a["bytes_out"] for a, b in zip(start, end))
    calls: Counter[str] = Counter()  # what the nodes did in the window: RPCs by name, DHT operations
    for a, b in zip(start, end):
        calls.update({f"rpc {k}": v[0] - a.get("rpc_by_name", {}).get(k, [0])[0] for k, v in b.get("rpc_by_name", {}).items()})
        calls.update({f"dht {k}": v - a.get("dht_ops", {}).get(k, 0) for k, v in b.get("dht_ops", {}).items()})
    return {"bytes": sent, "payload": payload, "seconds": seconds, "rounds": sum(b["rounds_committed"] for b in end),
            "background_per_node_s": (sent - payload) / n / seconds,
            "per_node_minute": {k: v / n / seconds * 60 for k, v in calls.items() if v}}


def stream_cost(src: Path) -> dict:
    """bench/stream_cost.py at ``src`` in a namespace of its own: socket bytes of one RPC."""
    with c.NetNS("sc") as ns:
        out = subprocess.run([*ns.prefix, "env", f"--chdir={src}", f"PYTHONPATH={src}", c.PY,
                              str(Path(__file__).resolve().parent / "stream_cost.py")],
                             check=True, capture_output=True, text=True, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description="control-plane bytes of real nodes, this commit against a baseline")
    p.add_argument("--baseline", default="74201dc", help="the commit to compare with (default: stop 27's main)")
    p.add_argument("--commit", default="HEAD")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--duration", type=float, default=60.0, help="seconds each node trains")
    p.add_argument("--repeats", type=int, default=2, help="runs per commit (seeds 0, 1, ...)")
    p.add_argument("--window", type=float, default=40.0, help="seconds of the background measurement")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    work, m, t0 = c.begin("control plane", a.workdir, "p2pdiloco-bench-cp-")
    commits = [checkout(x, work) for x in (a.baseline, a.commit)]
    cost = stream_cost(commits[-1][1])
    print(f"control plane: one RPC costs {cost['header_0']['bytes_per_call']:.0f} socket bytes", flush=True)
    runs: list[dict] = []
    for seed in range(a.repeats):
        for short, src in commits:
            print(f"control plane: {short} seed {seed} ...", flush=True)
            r = run_once(src, a.nodes, a.duration, work / f"{short}-{seed}", seed)
            b = background_once(src, a.nodes, a.window, work / f"{short}-{seed}-bg", seed)
            runs.append({"commit": short, "seed": seed, **r, "background": b})
            print(f"control plane: {short} seed {seed}: {r['control_per_node_s'] / 1e3:.1f} kB/s and "
                  f"{r['control_per_node_round'] / 1e3:.1f} kB/round of control per node; background "
                  f"{b['background_per_node_s'] / 1e3:.2f} kB/s per node", flush=True)
    write(a, runs, [s for s, _ in commits], m, time.monotonic() - t0, cost)


def write(a: argparse.Namespace, runs: list[dict], commits: list[str], m: dict, seconds: float, cost: dict) -> None:
    base, new = commits
    doc = c.Doc("control_plane", "Control plane of real nodes", f"python -m bench.control_plane --baseline {a.baseline} "
                f"--nodes {a.nodes} --duration {a.duration:g} --repeats {a.repeats} --window {a.window:g}", intro=[__doc__.split("\n\n")[2]])
    doc.table(["commit", "seed", "wall s", "rounds", "catch-ups", "socket MB", "payload MB", "payload kB/s/node",
               "control kB/s/node", "control kB/round/node", "final states"],
              [[r["commit"], r["seed"], f"{r['seconds']:.0f}", r["rounds"], r["catchups"], f"{r['bytes'] / 1e6:.2f}",
                f"{r['payload'] / 1e6:.2f}", f"{r['payload_per_node_s'] / 1e3:.2f}",
                f"{r['control_per_node_s'] / 1e3:.2f}", f"{r['control_per_node_round'] / 1e3:.1f}", r["digests"]]
               for r in runs], caption=f"Every run ({a.nodes} nodes, {a.duration:g} s of training each):")
    mean = {k: {x: statistics.mean(r[x] for r in runs if r["commit"] == k)
                for x in ("control_per_node_s", "control_per_node_round")} for k in commits}
    for k in commits:
        mean[k]["background"] = statistics.mean(r["background"]["background_per_node_s"] for r in runs
                                                if r["commit"] == k)
        mean[k]["steady"] = statistics.mean(r["steady"]["control_per_node_round"] for r in runs if r["commit"] == k)
        mean[k]["rounds_only"] = statistics.mean(rounds_only(r, a.nodes) for r in runs if r["commit"] == k)
    doc.table(["commit", "seed", "window s", "rounds", "socket MB", "payload MB", "control kB/s/node",
               "control kB/round/node"],
              [[r["commit"], r["seed"], f"{r['steady']['seconds']:.0f}", r["steady"]["rounds"],
                f"{r['steady']['bytes'] / 1e6:.2f}", f"{r['steady']['payload'] / 1e6:.2f}",
                f"{r['steady']['control_per_node_s'] / 1e3:.2f}", f"{r['steady']['control_per_node_round'] / 1e3:.1f}"]
               for r in runs], caption="The same runs' steady state (start-up and settling excluded):")
    doc.table(["commit", "seed", "window s", "socket kB", "payload kB", "rounds", "background B/s/node"],
              [[r["commit"], r["seed"], f"{r['background']['seconds']:.0f}", f"{r['background']['bytes'] / 1e3:.1f}",
                f"{r['background']['payload'] / 1e3:.1f}", r["background"]["rounds"],
                f"{r['background']['background_per_node_s']:,.0f}"] for r in runs],
              caption=f"Background: the same {a.nodes} nodes training without merging (H = 10^7), socket bytes over "
                      f"a {a.window:g} s window that starts {SETTLE_S:g} s after every node trains:")
    doc.table(["figure", base, new, f"{new} / {base}", "goal"],
              [["background bytes per node per second (no rounds)", f"{mean[base]['background']:,.0f}",
                f"{mean[new]['background']:,.0f}", f"{mean[new]['background'] / mean[base]['background']:.2f}",
                f"<= {GOAL_PER_S:,}: {c.verdict(mean[new]['background'] <= GOAL_PER_S)}"],
               ["control bytes per node per second", f"{mean[base]['control_per_node_s']:,.0f}",
                f"{mean[new]['control_per_node_s']:,.0f}",
                f"{mean[new]['control_per_node_s'] / mean[base]['control_per_node_s']:.2f}",
                "(background and rounds)"],
               ["control bytes per node per round", f"{mean[base]['control_per_node_round']:,.0f}",
                f"{mean[new]['control_per_node_round']:,.0f}",
                f"{mean[new]['control_per_node_round'] / mean[base]['control_per_node_round']:.2f}",
                f"<= {GOAL_PER_ROUND:,}: {c.verdict(mean[new]['control_per_node_round'] <= GOAL_PER_ROUND)}"],
               ["control bytes per node per round, steady state", f"{mean[base]['steady']:,.0f}",
                f"{mean[new]['steady']:,.0f}", f"{mean[new]['steady'] / mean[base]['steady']:.2f}",
                "(background included)"],
               ["control bytes per node per round beyond the background, steady state",
                f"{mean[base]['rounds_only']:,.0f}", f"{mean[new]['rounds_only']:,.0f}",
                f"{mean[new]['rounds_only'] / mean[base]['rounds_only']:.2f}",
                f"<= {GOAL_PER_ROUND:,}: {c.verdict(mean[new]['rounds_only'] <= GOAL_PER_ROUND)}"]],
              caption="Means over the seeds (the per-second figure holds every control byte, so it bounds "
                      "the background from above; the per-round ones hold the background too, except the "
                      "last, which takes the same commit and seed's background rate times the window off the "
                      "steady state's control bytes: the goal's model (docs/benchmarks/README.md), background per second plus a cost "
                      "per round):")
    for k in commits:
        bg: Counter[str] = Counter()
        for r in runs:
            if r["commit"] == k:
                bg.update(r["background"].get("per_node_minute", {}))  # absent before 2026-12-03
        if bg:
            seeds = sum(r["commit"] == k for r in runs)
            doc.table(["RPC or DHT operation", "per node per minute"],
                      [[op, f"{n / seeds:.1f}"] for op, n in sorted(bg.items(), key=lambda kv: -kv[1])],
                      caption=f"{k}: what the nodes did in the background window (status keys rpc_by_name and "
                              "dht_ops, differences over the window):")
    for k in commits:
        rpc: dict[str, list[float]] = {}
        for r in runs:
            if r["commit"] == k:
                for name, (calls, header_bytes) in r.get("rpc_by_name", {}).items():
                    got = rpc.setdefault(name, [0.0, 0.0, 0])
                    got[0] += calls / max(1, r["rounds"])
                    got[1] += header_bytes
                    got[2] += calls
        if rpc:
            seeds = sum(r["commit"] == k for r in runs)
            steady: Counter[str] = Counter()
            for r in runs:
                if r["commit"] == k:
                    steady.update(r["steady"]["rpc_per_round"])
            doc.table(["RPC", "calls per node per committed round", "in the steady state", "header bytes per call"],
                      [[name, f"{v[0] / seeds:.2f}", f"{steady[name] / seeds:.2f}", f"{v[1] / max(1, v[2]):.0f}"]
                       for name, v in sorted(rpc.items(), key=lambda kv: -kv[1][0])],
                      caption=f"{k}: the nodes' RPCs by name (report key rpc_by_name; each call one libp2p "
                              "stream before WIRE_VERSION 10, a message each way in a session since, for calls up "
                              "to 64 KiB: see the last table):")
        ops = Counter()
        for r in runs:
            if r["commit"] == k:
                ops.update({op: n / max(1, r["rounds"]) for op, n in r["dht_ops"].items()})
        if ops:
            seeds = sum(r["commit"] == k for r in runs)
            doc.table(["DHT operation (record kind)", "per node per committed round"],
                      [[op, f"{n / seeds:.2f}"] for op, n in sorted(ops.items(), key=lambda kv: -kv[1])],
                      caption=f"{k}: the nodes' DHT reads and stores per committed round (report key dht_ops; "
                              "each one a Kademlia traversal of the DHT, whose answers carry every record "
                              "under the key):")
    doc.table(["call", "request header", "socket bytes per call", "packets per call"],
              [[where, f"{size} B", f"{cost[f'{key}header_{size}']['bytes_per_call']:.0f}",
                f"{cost[f'{key}header_{size}']['packets_per_call']:.1f}"]
               for key, where in (("", "in a session"), ("stream_", "stream of its own")) for size in (0, 300)
               if f"{key}header_{size}" in cost],
              caption=f"One RPC of {new} on loopback (bench/stream_cost.py: 200 calls of an empty handler, the "
                      "daemons' idle traffic subtracted), with TLS, yamux and TCP/IP headers: in the caller's "
                      "session (request and reply on a stream already open), and on a stream of its own (opening "
                      "the stream, its protocol negotiation, request, reply and closing):")
    path = doc.write(m, seconds, {"stream_cost": cost, "runs": runs, "commits": commits, "nodes": a.nodes, "duration": a.duration})
    print(f"control plane: wrote {path}", flush=True)


if __name__ == "__main__":
    main()
