"""Benchmark 3, overhead: one node's training throughput inside a 3-node p2pdiloco swarm
against the same learner training alone.

    python -m bench.overhead            # about 4 minutes on a 2-core machine
    python -m bench.overhead --quick    # a smoke run

Fair comparison on a shared 2-core machine: both phases run the same number of training
processes (3), and the primary figure is normalised by CPU time: tokens trained per CPU-second
of the node, where a swarm node's CPU is its Python process (training thread, event loop,
DHT, merges) plus its p2pd, and the lone learner's is its own process
(``bench/workers.py standalone``: the same model, optimizer and data, no network). So the
figure is what the swarm costs the node in compute, whatever else the machine runs. Tokens
per wall-clock second are reported too; they move with the machine's load (three processes
share two cores with other jobs). Phases: alone, swarm, alone again (the reference is the mean
of the two lone phases). A fourth phase, the same swarm without outer rounds (H = 10^7), splits
the swarm's CPU, measured directly per node (process less training thread, plus p2pd), into a
cost per second and a cost per committed round.

Writes docs/benchmarks/overhead.md and .json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import common as c

GOAL = 0.03
CPU_GOAL = 0.01  # goal: swarm CPU at most 0.01 cores per node (docs/benchmarks/README.md)
BACKGROUND_H = 10_000_000  # inner steps per outer round in the phase without rounds: none come


def _cpu(pids: list[int | None]) -> float:
    total = 0.0
    for pid in pids:
        if not pid:
            continue
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def _threads(pid: int | None) -> dict[int, float]:
    """{thread ID: CPU seconds} of a process (empty when it is gone)."""
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()} if pid else {}
    except psutil.Error:
        return {}


def _rounds(path: Path) -> int:
    return c.node_status(path).rounds_committed


def measure(paths: list[Path], warm: float, window: float) -> list[dict]:
    """Per process: tokens/s and tokens per CPU-second over ``window`` s after ``warm`` s.
    For a node also its swarm's CPU, measured directly: the process's CPU less its training
    thread's (the busiest thread over the window: inner steps, pseudo-gradients and installs
    of merged states run there, ``node/training.py``), plus its p2pd's; and the outer rounds
    it committed in the window."""
    time.sleep(warm)
    s0 = [c.status_of(p) for p in paths]
    cpu0 = [(_cpu([s["pid"]]), _cpu([s.get("p2pd_pid")])) for s in s0]
    th0, r0 = [_threads(s["pid"]) for s in s0], [_rounds(p) for p in paths]
    time.sleep(window)
    s1 = [c.status_of(p) for p in paths]
    cpu1 = [(_cpu([s["pid"]]), _cpu([s.get("p2pd_pid")])) for s in s1]
    th1, r1 = [_threads(s["pid"]) for s in s1], [_rounds(p) for p in paths]
    out = []
    for a, b, x, y, t0, t1, n0, n1 in zip(s0, s1, cpu0, cpu1, th0, th1, r0, r1):
        tokens, dt = b["tokens"] - a["tokens"], max(1e-6, b["t"] - a["t"])
        cpu = (y[0] - x[0]) + (y[1] - x[1])
        training = max((v - t0.get(k, 0.0) for k, v in t1.items()), default=0.0)
        out.append({"tokens_per_s": tokens / dt, "tokens_per_cpu_s": tokens / max(1e-6, cpu),
                    "cpu_cores": cpu / dt, "p2pd_cores": (y[1] - x[1]) / dt,
                    "training_cores": training / dt, "swarm_cores": (cpu - training) / dt,
                    "rounds_per_s": (n1 - n0) / dt})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="Benchmark 3: swarm overhead")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--H", type=int, default=100)
    p.add_argument("--precision", default="int4")
    p.add_argument("--warm", type=float, default=10.0)
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--settle", type=float, default=30.0,
                   help="seconds more before the background window: the deferred DHT store of the training state")
    c.add_set_option(p)
    p.add_argument("--doc", default="overhead", help="name of the files written in docs/benchmarks")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    if a.quick:
        a.warm, a.window = 5.0, 10.0
    c.install_signal_handlers()
    c.cleanup_stale()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="p2pdiloco-bench-overhead-"))
    m, t0 = c.machine(), time.monotonic()
    n = a.nodes
    base = c.settings(inner__total_steps=100_000)
    c.apply_overrides(p, base, a.overrides)
    results: dict[str, list[dict]] = {}

    def alone(label: str) -> None:
        print(f"overhead: {label} ...", flush=True)
        folder = work / label.replace(" ", "-")
        with c.processes() as procs:
            started = [(procs.start(c.worker_argv("standalone", i, n, base, folder / f"rank{i}.json", duration=3600,
                                                  status=folder / f"rank{i}.status"), folder / f"rank{i}.log"),
                        folder / f"rank{i}.status") for i in range(n)]
            c.wait_training([s for _, s in started], [p for p, _ in started], 180)
            results[label] = measure([s for _, s in started], a.warm, a.window)

    def swarm() -> None:
        print("overhead: p2pdiloco swarm ...", flush=True)
        values = {**base, **c.SWARM, "outer.sync_every": str(a.H), "outer.wire_precision": a.precision,
                  "eval_every": "100000"}
        with c.NetNS("overhead") as ns, c.processes() as procs:
            nodes = c.start_swarm(procs, work / "swarm", n, values, prefix=ns.prefix, duration=3600)
            paths = [d / "status.json" for _, d in nodes]
            c.wait_training(paths, [p for p, _ in nodes], 240)
            results["swarm"] = measure(paths, a.warm, a.window)
            final = [c.node_status(pth) for pth in paths]
            results["swarm_rounds"] = [{"rounds_committed": f.rounds_committed, "rounds_alone": f.rounds_alone}
                                       for f in final]

    def background() -> None:
        print("overhead: p2pdiloco swarm without rounds ...", flush=True)
        values = {**base, **c.SWARM, "outer.sync_every": str(BACKGROUND_H), "outer.wire_precision": a.precision,
                  "eval_every": "100000"}
        with c.NetNS("overhead-bg") as ns, c.processes() as procs:
            nodes = c.start_swarm(procs, work / "background", n, values, prefix=ns.prefix, duration=3600)
            paths = [d / "status.json" for _, d in nodes]
            c.wait_training(paths, [p for p, _ in nodes], 240)
            results["background"] = measure(paths, a.warm + a.settle, a.window)

    for step in (lambda: alone("alone"), swarm, background, lambda: alone("alone again")):
        try:
            step()
        except RuntimeError as e:
            print(f"overhead: failed: {e}", flush=True)
    write(a, results, m, time.monotonic() - t0, work, int(base["data.batch_size"]) * int(base["model.block_size"]))
    sys.exit(0 if all(k in results for k in ("alone", "swarm", "alone again")) else 1)


def write(a: argparse.Namespace, results: dict, m: dict, seconds: float, work: Path, tokens_per_step: int) -> None:
    cmd = " ".join(["python -m bench.overhead", *(f"--set {kv}" for kv in a.overrides),
                    *([f"--window {a.window:g}"] if a.window != 30.0 and not a.quick else []),
                    *([f"--doc {a.doc}"] if a.doc != "overhead" else []), *(["--quick"] if a.quick else [])])
    doc = c.Doc(a.doc, "Benchmark 3: swarm overhead on one node", cmd)
    doc.intro = [
        f"{a.nodes} p2pdiloco nodes (H = {a.H}, {a.precision} on the wire, 4 fragments, quorum 1) on the benchmark "
        f"model{' with ' + ', '.join(a.overrides) if a.overrides else ''}, against {a.nodes} lone learners (`bench/workers.py standalone`: the same model, AdamW, batch "
        "and data, no network), so the machine runs the same number of training processes in both phases. "
        "Primary figure: tokens trained per CPU-second, where a node's CPU time is its Python process plus its "
        "p2pd (so every cycle spent on the DHT, matchmaking, encoding and merging counts against it) and the "
        "lone learner's is its own process. Secondary: tokens per wall-clock second, which also move with the "
        "load other jobs put on the shared cores. Measured window: "
        f"{a.window:g} s after {a.warm:g} s of warm-up, per phase; the reference is the mean of the lone phase "
        "before and after the swarm.",
    ]
    ref = [results[k] for k in ("alone", "alone again") if k in results]
    sw = results.get("swarm")
    if not ref or not sw:
        doc.text("A phase failed; no comparison.")
        doc.write(m, seconds, {"results": results, "workdir": str(work)})
        return
    ref_cpu = statistics.fmean(r["tokens_per_cpu_s"] for ph in ref for r in ph)
    ref_wall = statistics.fmean(r["tokens_per_s"] for ph in ref for r in ph)
    rows = []
    for label in ("alone", "swarm", "alone again"):
        if label not in results:
            continue
        ph = results[label]
        cpu = statistics.fmean(r["tokens_per_cpu_s"] for r in ph)
        wall = statistics.fmean(r["tokens_per_s"] for r in ph)
        rows.append([label, " / ".join(f"{r['tokens_per_cpu_s']:,.0f}" for r in ph), f"{cpu:,.0f}",
                     f"{100 * (1 - cpu / ref_cpu):+.1f}%" if label == "swarm" else "",
                     " / ".join(f"{r['tokens_per_s']:,.0f}" for r in ph), f"{wall:,.0f}",
                     f"{100 * (1 - wall / ref_wall):+.1f}%" if label == "swarm" else "",
                     " / ".join(f"{r['cpu_cores']:.3f}" for r in ph),
                     " / ".join(f"{r.get('p2pd_cores', 0):.3f}" for r in ph) if label == "swarm" else ""])
    doc.table(["phase", "tokens per CPU-s, per process", "mean", "overhead (CPU)", "tokens per wall s, per process",
               "mean", "overhead (wall)", "cores used, per process", "of which p2pd"], rows)
    cpu_sw = statistics.fmean(r["tokens_per_cpu_s"] for r in sw)
    wall_sw = statistics.fmean(r["tokens_per_s"] for r in sw)
    over_cpu, over_wall = 1 - cpu_sw / ref_cpu, 1 - wall_sw / ref_wall
    extra = statistics.fmean(r["cpu_cores"] - r["tokens_per_s"] / ref_cpu for r in sw)
    p2pd = statistics.fmean(r.get("p2pd_cores", 0.0) for r in sw)
    doc.text(f"From the tokens: a swarm node used {extra:.3f} cores more than a lone learner needs for its tokens "
             f"(its p2pd {p2pd:.3f}). That counts the swarm's own CPU (below, measured directly) and also a "
             "training thread that trains fewer tokens per CPU-second beside an event loop and a daemon (shared "
             "caches and interpreter lock on 2 cores), and the outer rounds' work in that thread.")
    cpu_rows, split = [], cpu_split(results, tokens_per_step)
    for label, key in (("swarm (rounds)", "swarm"), ("swarm without rounds", "background")):
        if key in results:
            ph = results[key]
            cpu_rows.append([label, " / ".join(f"{r['swarm_cores']:.4f}" for r in ph),
                             f"{statistics.fmean(r['swarm_cores'] for r in ph):.4f}",
                             " / ".join(f"{r['p2pd_cores']:.4f}" for r in ph),
                             " / ".join(f"{r['training_cores']:.3f}" for r in ph),
                             " / ".join(f"{r['rounds_per_s']:.2f}" for r in ph)])
    doc.text("The swarm's CPU measured directly, per node: the node process's CPU less its training "
             "thread's (inner steps, pseudo-gradients, installs of merged states), plus its p2pd's. The "
             "phase without rounds is the same swarm with H = 10^7 (nodes train, push heartbeats, refresh "
             "their view and status; no outer round comes), measured after the deferred DHT store of the "
             "training state; what rounds add is its difference from the swarm phase, per committed round.")
    doc.table(["phase", "swarm cores, per node", "mean", "of which p2pd", "training thread cores",
               "outer rounds per s"], cpu_rows)
    if split and split["ms_per_round"] is not None:
        bg, per_round, rate = split["background_cores"], split["ms_per_round"], split["rounds_per_s"]
        doc.text(f"So a node's swarm costs {bg:.4f} cores without rounds plus {per_round:.1f} ms of CPU per outer "
                 f"round it commits. This benchmark's model takes {1000 * split['step_s']:.0f} ms an inner step, so with "
                 f"H = {a.H} and 4 fragments a node commits {rate:.2f} rounds a second and its swarm takes "
                 f"{split['swarm_cores']:.4f} cores: {c.verdict(split['swarm_cores'] <= CPU_GOAL)} against the goal's "
                 f"{CPU_GOAL} cores. The same swarm with a model of 1 s an inner step (DiLoCo's regime: a round every "
                 f"{a.H / 4:.0f} s) would take {bg + per_round / 1000 * 4 / a.H:.4f} cores "
                 f"({c.verdict(bg + per_round / 1000 * 4 / a.H <= CPU_GOAL)}).")
    doc.text(f"Goal: the swarm costs a node under {100 * GOAL:.0f}% of its standalone tokens/s. Result, per "
             f"CPU-second: {100 * over_cpu:.1f}% {c.verdict(over_cpu < GOAL)}; per wall-clock second: "
             f"{100 * over_wall:.1f}% (noisier: it also moves with the other jobs on the machine).")
    doc.text(f"![overhead]({a.doc}.png)")
    doc.write(m, seconds, {"results": results, "overhead_cpu": over_cpu, "overhead_wall": over_wall,
                           "cpu_split": split, "workdir": str(work)})
    plot(results, c.DOCS / f"{a.doc}.png")
    print(f"overhead: wrote {c.DOCS / (a.doc + '.md')} ({seconds / 60:.1f} min): CPU {100 * over_cpu:.1f}%, "
          f"wall {100 * over_wall:.1f}%", flush=True)


def cpu_split(results: dict, tokens_per_step: int) -> dict | None:
    """The swarm's CPU per node as a cost per second without rounds plus a cost per committed
    outer round (means over nodes); None without both swarm phases."""
    sw, bg = results.get("swarm"), results.get("background")
    if not sw or not bg:
        return None
    swarm, background = statistics.fmean(r["swarm_cores"] for r in sw), statistics.fmean(r["swarm_cores"] for r in bg)
    rate = statistics.fmean(r["rounds_per_s"] for r in sw)
    tokens = statistics.fmean(r["tokens_per_s"] for r in sw)
    return {"swarm_cores": swarm, "background_cores": background, "rounds_per_s": rate,
            "ms_per_round": 1000 * (swarm - background) / rate if rate > 0 else None,
            "step_s": tokens_per_step / tokens if tokens > 0 else None}


def plot(results: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    phases = [k for k in ("alone", "swarm", "alone again") if k in results]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, key, title in ((axes[0], "tokens_per_cpu_s", "tokens per CPU-second (primary)"),
                           (axes[1], "tokens_per_s", "tokens per wall-clock second")):
        vals = [statistics.fmean(r[key] for r in results[k]) for k in phases]
        bars = ax.bar(phases, vals, color=["tab:gray" if k != "swarm" else "tab:green" for k in phases])
        ref = statistics.fmean(v for k, v in zip(phases, vals) if k != "swarm")
        ax.axhline(ref * 0.97, color="tab:red", ls="--", lw=1, label="goal: within 3% of alone")
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("One node's training throughput: in a 3-node swarm vs alone (mean per process)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: every process, namespace and cgroup is gone by now
        print(f"{Path(__file__).stem}: interrupted", file=sys.stderr)
        sys.exit(130)
