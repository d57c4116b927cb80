"""The background control traffic of real nodes at several swarm sizes: socket bytes per node
per second of ``--nodes`` nodes that train without merging (H beyond the run), at this commit
against a baseline commit, in the same run.

    python -m bench.background_scale --baseline 207bb3c --nodes 4 16

Each size and commit runs ``bench/control_plane.py``'s background measurement (a clean clone
at the commit, its own network namespace with only ``lo``, a bootstrap peer and the nodes,
socket bytes over ``--window`` seconds that start ``SETTLE_S`` (40 s) after every node trains), commits
alternating at each size. Every node trains on this machine's cores, so at 16 nodes each gets a
fraction of a core: the figure is bytes, which do not depend on the training speed without
rounds, but the start-up takes longer. What the nodes did in the window is counted from their
status files (RPCs by name, DHT operations).

Writes docs/benchmarks/background_scale.md and .json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import common as c
from bench.control_plane import GOAL_PER_S, background_once, checkout


def main() -> None:
    p = argparse.ArgumentParser(description="background control bytes of real nodes at several swarm sizes")
    p.add_argument("--baseline", required=True, help="the commit to compare with")
    p.add_argument("--commit", default="HEAD")
    p.add_argument("--nodes", type=int, nargs="+", default=[4, 16])
    p.add_argument("--window", type=float, default=60.0, help="seconds of the measurement")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    work, m, t0 = c.begin("background scale", a.workdir, "p2pdiloco-bench-bg-")
    commits = [checkout(x, work) for x in (a.baseline, a.commit)]
    runs = []
    for n in a.nodes:
        for short, src in commits:
            print(f"background scale: {short}, {n} nodes ...", flush=True)
            b = background_once(src, n, a.window, work / f"{short}-{n}", seed=0)
            runs.append({"commit": short, "nodes": n, **b})
            print(f"background scale: {short}, {n} nodes: {b['background_per_node_s']:,.0f} B/s per node", flush=True)
    base, new = (s for s, _ in commits)
    doc = c.Doc("background_scale", "Background control traffic at several swarm sizes",
                f"python -m bench.background_scale --baseline {a.baseline} --nodes {' '.join(map(str, a.nodes))} "
                f"--window {a.window:g}", intro=[__doc__.split("\n\n")[2]])
    rate = {(r["commit"], r["nodes"]): r["background_per_node_s"] for r in runs}
    doc.table(["nodes", f"{base} B/s/node", f"{new} B/s/node", f"{new} / {base}", "goal"],
              [[n, f"{rate[base, n]:,.0f}", f"{rate[new, n]:,.0f}", f"{rate[new, n] / rate[base, n]:.2f}",
                f"<= {GOAL_PER_S:,}: {c.verdict(rate[new, n] <= GOAL_PER_S)}"] for n in a.nodes],
              caption=f"Background socket bytes per node per second (one run each, {a.window:g} s window):")
    for r in runs:
        doc.table(["RPC or DHT operation", "per node per minute"],
                  [[op, f"{v:.1f}"] for op, v in sorted(r["per_node_minute"].items(), key=lambda kv: -kv[1])],
                  caption=f"{r['commit']}, {r['nodes']} nodes: what the nodes did in the window (status keys "
                          "rpc_by_name and dht_ops):")
    path = doc.write(m, time.monotonic() - t0, {"runs": runs, "commits": [base, new], "window": a.window})
    print(f"background scale: wrote {path}", flush=True)


if __name__ == "__main__":
    main()
