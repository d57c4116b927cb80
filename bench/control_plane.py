"""The control plane of real nodes: the socket bytes a node sends that are not pseudo-gradient
or state payload, per second and per committed round, at this commit against a baseline
commit, in the same run.

    python bench/control_plane.py                    # HEAD against --baseline, 4 nodes, 2 runs each
    python bench/control_plane.py --nodes 4 --duration 60 --repeats 2 --baseline 364f230

Each commit runs from its own clean clone of this repository checked out at that commit (its
processes start in the clone, with the clone first on PYTHONPATH), inside its own network
namespace with only ``lo``: a bootstrap peer and ``--nodes`` nodes (``python -m node run
--duration``), the bandwidth benchmark's model, data and swarm settings (4 fragments, grace
1-3 s), H = 100, int4 on the wire. Bytes: the namespace's ``lo`` transmit counter from the
bootstrap peer's start to the last node's exit (TCP/IP headers, TLS, yamux, the DHT and the
bootstrap peer included); *payload*: the nodes' RPC payload bytes (their reports'
``bytes_out``: slices, merged slices, state downloads; headers not counted); *control* =
bytes − payload. Per node per second (over the run's wall time) and per node per committed
round (all control bytes over the rounds: background included). The runs alternate between
the commits (A B A B ...), so drifts in the machine's load fall on both.

Writes docs/benchmarks/control_plane.md and .json.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as c  # noqa: E402

GOAL_PER_S = 1000  # issue 13: background control traffic at most 1 kB/s per node ...
GOAL_PER_ROUND = 5000  # ... and at most 5 kB per node per round


def checkout(commit: str, work: Path) -> tuple[str, Path]:
    """A clean clone of this repository at ``commit``: (short commit, path)."""
    dst = work / f"src-{commit}"
    if not dst.exists():
        subprocess.run(["git", "clone", "-q", str(c.ROOT), str(dst)], check=True)
        subprocess.run(["git", "-C", str(dst), "checkout", "-q", commit], check=True)
    short = subprocess.run(["git", "-C", str(dst), "rev-parse", "--short", "HEAD"], check=True,
                           capture_output=True, text=True).stdout.strip()
    return short, dst


def run_once(src: Path, n: int, duration: float, work: Path, seed: int) -> dict:
    values = {**c.settings(inner__total_steps=100_000, outer__sync_every=100, outer__wire_precision="int4",
                           eval_every=1_000_000, seed=seed), **c.SWARM}
    work.mkdir(parents=True, exist_ok=True)
    with c.NetNS(f"cp{seed}") as ns, c.processes() as procs:
        prefix = [*ns.prefix, "env", f"--chdir={src}", f"PYTHONPATH={src}"]
        before, t0 = ns.tx_bytes(), time.monotonic()
        nodes = c.start_swarm(procs, work, n, values, prefix=prefix, duration=duration)
        c.wait_all([p for p, _ in nodes], duration + 300, "control plane")
        sent, seconds = ns.tx_bytes() - before, time.monotonic() - t0
        reports = [c.read_json(d / "report.json") for _, d in nodes]
        if any(r is None for r in reports) or any(p.returncode != 0 for p, _ in nodes):
            raise RuntimeError(f"a node failed; logs in {work}")
    payload = sum(r["bytes_out"] for r in reports)
    dht: Counter[str] = Counter()
    for r in reports:
        dht.update(r.get("dht_ops", {}))  # a node's DHT reads and stores by record kind (absent before this benchmark)
    rounds = sum(r["rounds_committed"] for r in reports)
    return {"bytes": sent, "payload": payload, "seconds": seconds, "rounds": rounds,
            "tokens": sum(r["tokens"] for r in reports), "catchups": sum(r["catchups"] for r in reports),
            "control_per_node_s": (sent - payload) / n / seconds,
            "control_per_node_round": (sent - payload) / max(1, rounds), "payload_per_node_s": payload / n / seconds,
            "digests": len({r["global_digest"] for r in reports}), "dht_ops": dict(dht)}


def main() -> None:
    p = argparse.ArgumentParser(description="control-plane bytes of real nodes, this commit against a baseline")
    p.add_argument("--baseline", default="364f230", help="the commit to compare with (default: stop 25's main)")
    p.add_argument("--commit", default="HEAD")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--duration", type=float, default=60.0, help="seconds each node trains")
    p.add_argument("--repeats", type=int, default=2, help="runs per commit (seeds 0, 1, ...)")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    c.install_signal_handlers()
    c.cleanup_stale()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="p2pdiloco-bench-cp-"))
    m, t0 = c.machine(), time.monotonic()
    if not c.netns_available():
        raise SystemExit("control plane: needs network namespaces (ip netns) to count socket bytes")
    commits = [checkout(x, work) for x in (a.baseline, a.commit)]
    runs: list[dict] = []
    for seed in range(a.repeats):
        for short, src in commits:
            print(f"control plane: {short} seed {seed} ...", flush=True)
            r = run_once(src, a.nodes, a.duration, work / f"{short}-{seed}", seed)
            runs.append({"commit": short, "seed": seed, **r})
            print(f"control plane: {short} seed {seed}: {r['control_per_node_s'] / 1e3:.1f} kB/s and "
                  f"{r['control_per_node_round'] / 1e3:.1f} kB/round of control per node", flush=True)
    write(a, runs, [s for s, _ in commits], m, time.monotonic() - t0)


def write(a: argparse.Namespace, runs: list[dict], commits: list[str], m: dict, seconds: float) -> None:
    base, new = commits
    doc = c.Doc("control_plane", "Control plane of real nodes", f"python bench/control_plane.py --baseline {a.baseline} "
                f"--nodes {a.nodes} --duration {a.duration:g} --repeats {a.repeats}", intro=[__doc__.split("\n\n")[2]])
    doc.table(["commit", "seed", "wall s", "rounds", "catch-ups", "socket MB", "payload MB", "payload kB/s/node",
               "control kB/s/node", "control kB/round/node", "final states"],
              [[r["commit"], r["seed"], f"{r['seconds']:.0f}", r["rounds"], r["catchups"], f"{r['bytes'] / 1e6:.2f}",
                f"{r['payload'] / 1e6:.2f}", f"{r['payload_per_node_s'] / 1e3:.2f}",
                f"{r['control_per_node_s'] / 1e3:.2f}", f"{r['control_per_node_round'] / 1e3:.1f}", r["digests"]]
               for r in runs], caption=f"Every run ({a.nodes} nodes, {a.duration:g} s of training each):")
    mean = {k: {x: statistics.mean(r[x] for r in runs if r["commit"] == k)
                for x in ("control_per_node_s", "control_per_node_round")} for k in commits}
    doc.table(["figure", base, new, f"{new} / {base}", "goal"],
              [["control bytes per node per second", f"{mean[base]['control_per_node_s']:,.0f}",
                f"{mean[new]['control_per_node_s']:,.0f}",
                f"{mean[new]['control_per_node_s'] / mean[base]['control_per_node_s']:.2f}",
                f"<= {GOAL_PER_S:,} (background): {c.verdict(mean[new]['control_per_node_s'] <= GOAL_PER_S)}"],
               ["control bytes per node per round", f"{mean[base]['control_per_node_round']:,.0f}",
                f"{mean[new]['control_per_node_round']:,.0f}",
                f"{mean[new]['control_per_node_round'] / mean[base]['control_per_node_round']:.2f}",
                f"<= {GOAL_PER_ROUND:,}: {c.verdict(mean[new]['control_per_node_round'] <= GOAL_PER_ROUND)}"]],
              caption="Means over the seeds (the per-second figure holds every control byte, so it bounds "
                      "the background from above; the per-round one holds the background too):")
    for k in commits:
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
    path = doc.write(m, seconds, {"runs": runs, "commits": commits, "nodes": a.nodes, "duration": a.duration})
    print(f"control plane: wrote {path}", flush=True)


if __name__ == "__main__":
    main()
