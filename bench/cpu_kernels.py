"""Invariant I1 on mixed CPUs: a real swarm whose nodes run different torch CPU kernel sets.

    python -m bench.cpu_kernels                  # 3 nodes, 180 s of training, twice (about 7 minutes)
    python -m bench.cpu_kernels --duration 60    # shorter

Node i runs with ``ATEN_CPU_CAPABILITY`` = the i-th of the kernel sets this CPU offers (default,
avx2, avx512 where /proc/cpuinfo lists avx2 / avx512f; cycled over the nodes), so one machine
stands in for CPUs of different generations. Demo settings (node/demo.py), a bootstrap peer and
the nodes on 127.0.0.1, ``settle`` 30 s after training. Per node: the capability torch used,
committed rounds, catch-ups, and re-syncs (``resyncs`` in the report: downloads of a fragment
at the version the node already held, because its digest lost a split brain, invariant I7);
and whether the final global digests are equal; then the same swarm with every node on one kernel
set, as the baseline. Goal (docs/benchmarks/README.md): equal digests, and no node
re-downloads a fragment it holds at the swarm's version more than once a minute.

Writes docs/benchmarks/cpu_kernels.md and .json.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import common as c

from p2pdiloco.procs import Processes
from p2pdiloco.presets import DEMO as DEMO_SETTINGS


def capabilities() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text()
    return ["default", *(["avx2"] if " avx2" in flags else []), *(["avx512"] if " avx512f" in flags else [])]


def run(work: Path, caps: list[str], duration: float, seed: int) -> list[dict]:
    """One swarm; returns each node's report (with the capability it ran under)."""
    work.mkdir(parents=True, exist_ok=True)
    children = Processes(parent_death=signal.SIGTERM)
    try:
        maddr = children.start_bootstrap(work)
        nodes = []
        for i, cap in enumerate(caps):
            d = work / f"node{i}"
            d.mkdir(exist_ok=True)
            settings = {**DEMO_SETTINGS, "data.num_shards": str(len(caps)), "data.shard_index": str(i),
                        "seed": str(seed), "settle": "30"}
            argv = ["env", f"ATEN_CPU_CAPABILITY={cap}", c.PY, "-m", "node", "run", "--initial-peers", maddr,
                    "--host", "127.0.0.1", "--port", "0", "--name", f"node{i}-{cap}", "--data-dir", str(d),
                    "--duration", str(duration), "--report-file", str(d / "report.json"), "--run-id", "kernels",
                    "--no-progress", *c.set_args(settings)]
            nodes.append((children.start(argv, d / "node.log"), d, cap))
        for proc, d, _ in nodes:
            proc.wait(timeout=duration + 300)
        reports = []
        for proc, d, cap in nodes:
            if proc.returncode != 0 or not (d / "report.json").exists():
                raise RuntimeError(f"node {d.name} ({cap}) exited {proc.returncode}; see {d / 'node.log'}")
            reports.append({**json.loads((d / "report.json").read_text()), "capability": cap})
        return reports
    finally:
        children.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of training per node (default 180)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the logs here")
    args = parser.parse_args()
    c.install_signal_handlers()
    offered = capabilities()
    caps = [offered[i % len(offered)] for i in range(args.nodes)]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cpu-kernels-"))
    m, t0 = c.machine(), time.monotonic()
    uniform = [offered[-1]] * args.nodes  # the baseline: every node on the kernel set torch picks here
    phases = {"mixed": run(work / "mixed", caps, args.duration, args.seed),
              "uniform": run(work / "uniform", uniform, args.duration, args.seed)}
    minutes = args.duration / 60
    rows, worst = [], 0.0
    for phase, reports in phases.items():
        for r in reports:
            per_min = r["resyncs"] / minutes
            if phase == "mixed":
                worst = max(worst, per_min)
            rows.append([phase, r["name"], r["capability"], r["rounds_committed"], r["catchups"], r["resyncs"],
                         f"{per_min:.2f}", r["global_digest"]])
    equal = all(len({r["global_digest"] for r in rs}) == 1 for rs in phases.values())
    doc = c.Doc("cpu_kernels", "Mixed CPU kernel sets in one swarm (invariant I1)",
                f"python -m bench.cpu_kernels --nodes {args.nodes} --duration {args.duration:g}",
                intro=[__doc__.split("\n\n")[2].replace("\n", " ")])
    doc.table(["run", "node", "ATEN_CPU_CAPABILITY", "rounds committed", "catch-ups", "re-syncs", "re-syncs per minute",
               "final global digest"], rows,
              f"{args.nodes} nodes, {args.duration:g} s of training each, the mixed run then the uniform "
              f"baseline (every node on {offered[-1]}); kernel sets this CPU offers: {', '.join(offered)}.")
    doc.text(f"Equal final digests in each run: {c.verdict(equal)}. At most one re-sync per node per minute in "
             f"the mixed run: {c.verdict(worst <= 1.0)} (worst {worst:.2f} per minute; the uniform baseline shows "
             "the re-syncs that two groups merging the same version cause without any kernel difference).")
    path = doc.write(m, time.monotonic() - t0, {"runs": phases, "capabilities": caps, "duration": args.duration})
    print(path.read_text())
    print(f"logs: {work}")
    return 0 if equal and worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
