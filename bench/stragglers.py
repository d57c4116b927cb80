"""Benchmark 2, stragglers: 4 nodes, one slowed 4x. Merged tokens per second of the whole
swarm against the sum of the nodes' standalone throughputs, for p2pdiloco, DDP and
synchronous DiLoCo.

    python -m bench.stragglers           # about 5 minutes on a 2-core machine
    python -m bench.stragglers --quick   # a smoke run (short windows)

The slowdown is real CPU starvation: once it trains, every process of a system is moved into
its own CPU-quota cgroup (CFS bandwidth control, ``cpu.cfs_quota_us``), ``--cap`` cores for
the normal nodes and ``--cap / --slow`` for the slow one; a p2pdiloco node's cgroup also holds
its p2pd. The
slow node trains the same model on the same batch size; it only gets a quarter of the CPU.
``--set KEY=VALUE`` changes a setting of every process of every system (a slower model:
DiLoCo's regime), ``--doc NAME`` the files' name.

Phases, back to back, all under the same caps: the learners alone (no network:
``bench/workers.py standalone``), then ``--repeats`` times the p2pdiloco swarm and the learners
alone again, then DDP, synchronous DiLoCo and the learners alone a last time. Each system is
measured against the mean of the standalone phases just before and after it (the machine is
shared: its speed drifts).
Each phase waits until every process trains, lets ``--warm`` seconds pass, then measures
over ``--window`` seconds from the processes' own status files.

Writes docs/benchmarks/stragglers.md, .json and .png.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench import common as c

GOAL = 0.05  # a 4x-slowed node may cost the swarm at most 5% of its merged-token rate


def swarm_label(k: int) -> str:
    return "p2pdiloco" if k == 1 else f"p2pdiloco {k}"


def standalone_label(k: int) -> str:
    return "standalone" if k == 1 else f"standalone {k}"


def caps_for(n: int, cap: float, slow: float) -> list[float]:
    return [cap] * (n - 1) + [cap / slow]


def phase(label: str, n: int, caps: list[float], start, warm: float, window: float, work: Path) -> list[dict]:
    """Start n processes (``start(procs, i, ns_prefix) -> (popen, status_path)``) in one
    namespace; once every one trains, move each (a node with its p2pd) into its CPU cap, so that
    start-up (imports, data) is not slowed down; measure their rates; end them all."""
    print(f"stragglers: {label} ...", flush=True)
    cgroups = [c.CpuCap(cap, f"{label[:8]}{i}") for i, cap in enumerate(caps)]
    try:
        with c.NetNS(label[:8]) as ns, c.processes() as procs:
            started = [start(procs, i, ns.prefix) for i in range(n)]
            c.wait_training([s for _, s in started], [p for p, _ in started], 240)
            for g, (proc, status) in zip(cgroups, started):
                st = c.status_of(status) or {}
                for pid in (proc.pid, st.get("p2pd_pid")):
                    g.add(pid)
            rates = c.window_rates([s for _, s in started], warm, window)
    finally:
        for g in cgroups:
            g.close()
    total = sum(r["merged_per_s"] for r in rates)
    print(f"stragglers: {label}: merged {total:.0f} tokens/s, processed "
          f"{sum(r['tokens_per_s'] for r in rates):.0f} tokens/s", flush=True)
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description="Benchmark 2: stragglers")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--cap", type=float, default=0.15, help="CPU cores per normal node (CFS quota)")
    p.add_argument("--slow", type=float, default=4.0, help="the last node gets cap / slow")
    p.add_argument("--H", type=int, default=100)
    p.add_argument("--precision", default="int4")
    p.add_argument("--warm", type=float, default=10.0)
    p.add_argument("--window", type=float, default=30.0, help="seconds measured per baseline phase")
    p.add_argument("--swarm-window", type=float, default=60.0, help="seconds measured for p2pdiloco")
    p.add_argument("--repeats", type=int, default=1, help="swarm phases, each between two standalone phases")
    c.add_set_option(p)
    p.add_argument("--doc", default="stragglers", help="name of the files written in docs/benchmarks")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    if not 0 < a.cap <= 64 or not a.slow >= 1 or a.nodes < 2 or not 1 <= a.repeats <= 20:
        p.error("need 0 < --cap <= 64 cores, --slow >= 1, --nodes >= 2 and 1 <= --repeats <= 20")
    if a.quick:
        a.warm, a.window, a.swarm_window = 5.0, 10.0, 15.0
    c.install_signal_handlers()
    c.cleanup_stale()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="p2pdiloco-bench-straggler-"))
    m, t0 = c.machine(), time.monotonic()
    n, caps = a.nodes, caps_for(a.nodes, a.cap, a.slow)
    base = c.settings(inner__total_steps=100_000)
    c.apply_overrides(p, base, a.overrides)
    life = 3600  # processes are ended after their window; this only bounds a forgotten one

    def standalone(folder: Path):
        def start(procs: c.Processes, i: int, prefix: list[str]):
            st = folder / f"rank{i}.status"
            pr = procs.start([*prefix, *c.worker_argv("standalone", i, n, base, folder / f"rank{i}.json",
                                                      duration=life, status=st)], folder / f"rank{i}.log")
            return pr, st
        return start

    def sync(mode: str, folder: Path):
        def start(procs: c.Processes, i: int, prefix: list[str]):
            st = folder / f"rank{i}.status"
            pr = procs.start([*prefix, *c.worker_argv(mode, i, n, base, folder / f"rank{i}.json", duration=life,
                                                      status=st, H=a.H if mode == "diloco" else None)],
                             folder / f"rank{i}.log")
            return pr, st
        return start

    swarm_values = {**base, **c.SWARM, "outer.sync_every": str(a.H), "outer.wire_precision": a.precision,
                    "eval_every": "100000"}
    def swarm(swarm_dir: Path):
        booted: dict = {}

        def start(procs: c.Processes, i: int, prefix: list[str]):
            # the bootstrap peer (uncapped, in the namespace) starts with node 0
            if "maddr" not in booted:
                swarm_dir.mkdir(parents=True, exist_ok=True)
                booted["maddr"] = procs.start_bootstrap(swarm_dir, tuple(prefix), timeout=90)
            d = swarm_dir / f"node{i}"
            d.mkdir(parents=True, exist_ok=True)
            argv = [c.PY, "-m", "node", "run", "--initial-peers", booted["maddr"], "--host", "127.0.0.1",
                    "--port", "0", "--name", f"node{i}", "--data-dir", str(d), "--status-file", str(d / "status.json"),
                    "--report-file", str(d / "report.json"), "--run-id", "straggler", "--no-progress",
                    "--duration", str(life), "--set", f"data.shard_index={i}", "--set", f"data.num_shards={n}",
                    *c.set_args(swarm_values)]
            return procs.start([*prefix, *argv], d / "node.log"), d / "status.json"
        return start

    results: dict[str, list[dict]] = {}
    # the swarm runs between two standalone phases each time (S P S P ... S): each swarm phase is
    # measured against the mean of the two around it, so a drift of the machine falls on both
    order = [("standalone", standalone(work / "alone1"), a.window)]
    for k in range(1, a.repeats + 1):
        order += [(swarm_label(k), swarm(work / f"p2pdiloco{k}"), a.swarm_window),
                  (standalone_label(k + 1), standalone(work / f"alone{k + 1}"), a.window)]
    order += [("DDP", sync("ddp", work / "ddp"), a.window),
              ("sync DiLoCo", sync("diloco", work / "diloco"), a.window),
              ("standalone again", standalone(work / "alone-last"), a.window)]
    for label, start, window in order:
        try:
            results[label] = phase(label, n, caps, start, a.warm, window, work)
        except RuntimeError as e:
            print(f"stragglers: {label} failed: {e}", flush=True)
    write(a, results, m, time.monotonic() - t0, work)
    sys.exit(0 if len(results) == len(order) else 1)


def write(a: argparse.Namespace, results: dict[str, list[dict]], m: dict, seconds: float, work: Path) -> None:
    defaults = {"nodes": 4, "cap": 0.15, "slow": 4.0, "H": 100, "precision": "int4", "warm": 10.0, "window": 30.0,
                "swarm_window": 60.0, "repeats": 1}
    changed = [f"--{k.replace('_', '-')} {getattr(a, k)}" for k, v in defaults.items()
               if getattr(a, k) != v and not a.quick]  # --quick sets the windows itself
    cmd = " ".join(["python -m bench.stragglers", *changed, *(f"--set {kv}" for kv in a.overrides),
                    *([f"--doc {a.doc}"] if a.doc != "stragglers" else []), *(["--quick"] if a.quick else [])])
    doc = c.Doc(a.doc, f"Benchmark 2: a {a.slow:g}x-slowed node", cmd)
    doc.intro = [
        f"{a.nodes} processes per system on the benchmark model (2 layers, 64 wide, batch 16 x 64 bytes"
        f"{'; with ' + ', '.join(a.overrides) if a.overrides else ''}). Once it "
        f"trains, every process runs in its own CPU-quota cgroup (CFS bandwidth control): {a.cap:g} "
        f"core{'' if a.cap == 1 else 's'} for " + ("node 0" if a.nodes == 2 else f"nodes 0 to {a.nodes - 2}")
        + f", {a.cap / a.slow:g} cores (1/{a.slow:g}) for node {a.nodes - 1}, the straggler. A p2pdiloco "
        "node's cgroup holds its Python process and its p2pd, so the swarm's own work counts against its quota. "
        f"The slow node trains the same model on the same batch size; it just gets 1/{a.slow:g} of the CPU time.",
        "",
        f"p2pdiloco: H = {a.H}, {a.precision} on the wire, 4 fragments, quorum 1, grace 1-3 s. Synchronous DiLoCo: "
        f"H = {a.H}, gloo all-reduce. DDP: gloo all-reduce of the gradients every step.",
        "",
        "Merged tokens per second: tokens that went into a committed merge (p2pdiloco: each node's "
        "`tokens_merged`, counted per fragment), summed over the nodes, over the measured window. For DDP and "
        "synchronous DiLoCo every trained token is merged (DiLoCo's at the next all-reduce), so their rate is the "
        "tokens trained per second (synchronous DiLoCo: the number of ranks times the straggler's rate, "
        "since every rank trains exactly H steps per all-reduce and the fast ones wait for it; their own counters move "
        "in bursts of H steps, too coarse for the window). Rates are least-squares slopes of the counters "
        f"read about every second over the window. Reference: the sum of the {a.nodes} learners' throughputs when each trains alone "
        "(no network) under the same caps, in the standalone phases just before and just after the system's phase "
        "(mean of the two). The phases run S P S P ... S (``--repeats`` swarm phases), then DDP, synchronous DiLoCo "
        "and a last standalone phase, so a drift of the machine's speed falls on a phase and its reference alike.",
    ]
    alone = [k for k in results if k.startswith("standalone")]
    if not alone:
        doc.text("The standalone phases failed; no reference.")
        doc.write(m, seconds, {"results": results, "workdir": str(work)})
        return
    keys = list(results)  # in the order the phases ran

    def per_node(labels: list[str]) -> list[float]:
        return [sum(results[k][i]["tokens_per_s"] for k in labels) / len(labels) for i in range(a.nodes)]

    def around(label: str) -> list[str]:  # the standalone phases just before and just after it
        i = keys.index(label)
        return [k for k in keys[:i] if k in alone][-1:] + [k for k in keys[i + 1:] if k in alone][:1]

    every = per_node(alone)
    fast = sorted(every[:-1])[len(every[:-1]) // 2]
    factor = fast / every[-1] if every[-1] > 0 else float("inf")
    rows = []
    summary = {}
    for label, rates in results.items():
        merged = sum(r["merged_per_s"] for r in rates)
        trained = sum(r["tokens_per_s"] for r in rates)
        if label in alone:
            rows.append([label, f"{trained:,.0f}", "", "", "", " / ".join(f"{r['tokens_per_s']:,.0f}" for r in rates), ""])
            continue
        if label == "sync DiLoCo":
            # every rank trains exactly H steps per all-reduce, so all run at the slowest rank's
            # pace; the others' counters move in bursts of H steps, too coarse for the window
            merged = trained = a.nodes * rates[-1]["tokens_per_s"]  # the straggler never waits
        ref = sum(per_node(around(label)))
        share = merged / ref
        summary[label] = {"merged_per_s": merged, "tokens_per_s": trained, "share": share, "reference": ref,
                          "reference_phases": around(label), "per_node": [r["tokens_per_s"] for r in rates]}
        rows.append([label, f"{trained:,.0f}", f"{merged:,.0f}", f"{ref:,.0f}", f"{100 * share:.1f}%",
                     " / ".join(f"{r['tokens_per_s']:,.0f}" for r in rates),
                     f"{100 * (1 - share):.1f}%" + (f" {c.verdict(1 - share < GOAL)}" if label.startswith("p2pdiloco")
                                                   else "")])
    doc.table(["system", "tokens trained / s", "tokens merged / s", "reference / s", "merged / reference",
               "per node trained / s (node 0 ... straggler)", "cost of the straggler"], rows,
              "Reference: the sum of the standalone throughputs in the standalone phases just before and just after "
              f"the system's phase (mean of the two); the straggler's standalone rate is 1/{factor:.2f} of a normal "
              "node's (each node's mean over every standalone phase; the fast nodes' median), the measured slowdown.")
    swarms = [summary[k] for k in summary if k.startswith("p2pdiloco")]
    lines = [f"Goal: the slowed node costs the swarm under {100 * GOAL:.0f}% of its merged-token rate, i.e. the swarm "
             f"merges at least {100 - 100 * GOAL:.0f}% of the sum of the nodes' standalone throughputs."]
    if swarms:
        share = sum(x["share"] for x in swarms) / len(swarms)
        trained = sum(x["tokens_per_s"] / x["reference"] for x in swarms) / len(swarms)
        merged = sum(x["merged_per_s"] / max(1e-9, x["tokens_per_s"]) for x in swarms) / len(swarms)
        each = ", ".join(f"{100 * x['share']:.1f}%" for x in swarms)
        spread = f" (mean of {len(swarms)} swarm phases: {each})" if len(swarms) > 1 else ""
        summary["p2pdiloco mean"] = {"share": share, "phases": len(swarms)}
        lines.append(f"Result: p2pdiloco merges {100 * share:.1f}% of the standalone sum{spread} (cost "
                     f"{100 * (1 - share):.1f}%): {c.verdict(1 - share < GOAL)}. Split: the nodes "
                     f"trained {100 * trained:.1f}% of the standalone sum (the rest is the "
                     "swarm's own CPU inside each node's quota, benchmark 3, plus load drift), and "
                     f"{100 * merged:.1f}% of what they trained was "
                     "merged in the window (merges in the window also carry tokens trained before it); no node "
                     "waits for the straggler.")
        slow = results["p2pdiloco"][-1] if "p2pdiloco" in results else None
        if slow and slow["merged_per_s"] <= 0 and slow["tokens_per_s"] > 0:
            lines.append(f"The straggler merged nothing in the window: at {slow['tokens_per_s']:,.0f} tokens/s its "
                         f"first fragment is due after about {a.H * c.TOKENS_PER_STEP / slow['tokens_per_s']:.0f} s "
                         f"(H = {a.H} steps), after the window; until then it follows the others' merges and keeps "
                         "its own progress on top (rebase), to contribute it later.")
    for k in ("DDP", "sync DiLoCo"):
        if k in summary:
            lines.append(f"{k} merges {100 * summary[k]['share']:.1f}% (every rank waits for the straggler at each "
                         f"{'step' if k == 'DDP' else 'all-reduce'}).")
    doc.text(" ".join(lines))
    doc.text(f"![stragglers]({a.doc}.png)")
    total_ref = sum(every)
    doc.write(m, seconds, {"results": results, "summary": summary, "reference_tokens_per_s": total_ref,
                           "measured_slowdown": factor, "workdir": str(work)})
    plot(summary, total_ref, c.DOCS / f"{a.doc}.png", a.nodes, a.slow)
    print(f"stragglers: wrote {c.DOCS / (a.doc + '.md')} ({seconds / 60:.1f} min)", flush=True)


def plot(summary: dict, total_ref: float, path: Path, nodes: int, slow: float) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = [k for k in ("p2pdiloco mean", "DDP", "sync DiLoCo") if k in summary]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    vals = [100 * summary[k]["share"] for k in labels]
    labels = ["p2pdiloco" if k == "p2pdiloco mean" else k for k in labels]
    bars = ax.bar(labels, vals, color=["tab:green", "black", "tab:blue"][:len(labels)])
    ax.axhline(100, color="#888", lw=1)
    ax.axhline(95, color="tab:red", ls="--", lw=1, label="goal: 95%")
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v + 1, f"{v:.0f}%", ha="center", fontsize=9)
    ax.set_ylabel("merged tokens/s, % of the sum of standalone rates")
    ax.set_title(f"{nodes} nodes, one slowed {slow:g}x (reference {total_ref:,.0f} tokens/s)")
    ax.set_ylim(0, 115)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: every process, namespace and cgroup is gone by now
        print(f"{Path(__file__).stem}: interrupted", file=sys.stderr)
        sys.exit(130)
