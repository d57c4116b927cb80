"""Benchmark 1, bandwidth against quality: bytes sent per node per training token, and held-out
loss at an equal token budget, for DDP, synchronous DiLoCo, torchft's DiLoCo and p2pdiloco at
several H and wire precisions.

    python -m bench.bandwidth                   # about 11 minutes on a loaded 2-core machine
    python -m bench.bandwidth --seeds 0 1 2     # every system with three seeds (tables: means)
    python -m bench.bandwidth --quick           # a smoke run (tiny budget, few systems)

Every system trains the same model from the same seed on the same data shards for the same
number of inner steps per process (``--steps``; the cosine ends there) and seed (``--seeds``:
the model's initial weights and every process's data order), with ``--nodes``
processes, each system inside its own network namespace: the bytes are the namespace's
loopback transmit counter (every byte that crossed a socket between its processes, with
TCP/IP headers; for p2pdiloco it includes the bootstrap peer, the DHT and libp2p), divided
by the number of nodes and by the tokens each node trained. Held-out loss: the final
global model on the same held-out bytes (16 x 16 x 64 bytes of the standard library
source, identical for every system).

Writes docs/benchmarks/bandwidth.md, .json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import common as c
from p2pdiloco.config import TOPK2_RECIPE, WIRE_PRECISIONS
from p2pdiloco.status import Report, read_status

LIGHTHOUSE = str(Path(c.PY).parent / "torchft_lighthouse")
DDP_FACTOR = 500  # goal: at least this many times fewer bytes per token than DDP
LOSS_SLACK = 0.02  # goal: held-out loss within 2% of DDP
SYNC_SLACK = 0.01  # goal: p2pdiloco's held-out loss within 1% of synchronous DiLoCo at the same H


def run_baseline(mode: str, n: int, steps: int, H: int | None, work: Path, seed: int = 0, **over: str) -> dict:
    """DDP / synchronous DiLoCo / torchft DiLoCo: n worker processes in one namespace; ``over``:
    settings on top of the benchmark's (``inner__lr``: DDP's learning-rate grid; ``--set``'s)."""
    values = c.settings(inner__total_steps=steps, seed=seed, **over)
    work.mkdir(parents=True, exist_ok=True)
    with c.NetNS(mode) as ns, c.processes() as procs:
        before, t0 = ns.tx_bytes(), time.monotonic()
        extra: dict = {}
        if mode == "torchft":
            procs.start([*ns.prefix, LIGHTHOUSE, "--min_replicas", str(n), "--bind", "127.0.0.1:29510",
                         "--join_timeout_ms", "10000"], work / "lighthouse.log")
            extra = {"lighthouse": "http://127.0.0.1:29510", "min_replicas": n}
        workers = [procs.start([*ns.prefix, *c.worker_argv(mode, r, n, values, work / f"rank{r}.json", steps=steps,
                                                            H=H, **extra)], work / f"rank{r}.log")
                   for r in range(n)]
        c.wait_all(workers, 1800, mode)
        sent = ns.tx_bytes() - before
        seconds = time.monotonic() - t0
        results = [c.read_json(work / f"rank{r}.json") for r in range(n)]
        bad = [r for r, p in enumerate(workers) if p.returncode != 0 and results[r] is None]
        if bad:
            raise RuntimeError(f"{mode}: ranks {bad} failed; logs in {work}")
        # a rank that wrote its result (after its last step and evaluation) and then failed in
        # gloo's teardown ran to the end: kept, and said in the notes
        torn = [r for r, p in enumerate(workers) if p.returncode != 0]
    tokens = sum(r["tokens"] for r in results)
    return {"system": SYSTEMS[mode], "H": H or 1,
            "precision": "fp32", "nodes": n, "tokens": tokens, "bytes": sent, "payload": None,
            "bytes_per_token": sent / tokens, "loss": results[0]["end_loss"], "seconds": seconds,
            "isolated": ns.isolated, "seed": seed, "inner_lr": float(values["inner.lr"]),
            "outer_momentum": float(values["outer.momentum"]),
            "notes": (f"{results[0].get('commits', 0)} commits" if mode == "torchft" else "")
            + (f"ranks {torn} exited non-zero after writing their results" if torn else "")}


def run_p2p(n: int, steps: int, H: int, precision: str, work: Path, seed: int = 0, **over: str) -> dict:
    """``n`` real nodes and a bootstrap peer in one namespace; ``topk2`` runs at the outer
    settings it is measured with (``config.TOPK2_RECIPE``), every other wire at DiLoCo's;
    ``over``: ``--set``'s settings."""
    recipe = {f"outer__{k}": v for k, v in TOPK2_RECIPE.items()} if precision == "topk2" else {}
    values = {**c.settings(inner__total_steps=steps, outer__sync_every=H, outer__wire_precision=precision,
                           eval_every=10 * steps, seed=seed, **recipe, **over), **c.SWARM}
    work.mkdir(parents=True, exist_ok=True)
    with c.NetNS(f"p2p{H}{precision}") as ns, c.processes() as procs:
        before, t0 = ns.tx_bytes(), time.monotonic()
        nodes = c.start_swarm(procs, work, n, values, prefix=ns.prefix, max_steps=steps)
        steady = c.window_by_steps(ns, nodes, steps)
        c.wait_all([p for p, _ in nodes], 1800, f"p2pdiloco H={H} {precision}")
        sent = ns.tx_bytes() - before
        seconds = time.monotonic() - t0
        reports = [r for _, d in nodes if isinstance(r := read_status(d / "report.json"), Report)]
        if len(reports) < len(nodes) or any(p.returncode != 0 for p, _ in nodes):
            raise RuntimeError(f"p2pdiloco H={H} {precision}: a node failed; logs in {work}")
    tokens = sum(r.tokens for r in reports)
    digests = {r.global_digest for r in reports}
    rounds = sum(r.rounds_committed for r in reports)
    alone = sum(r.rounds_alone for r in reports)
    return {"system": "p2pdiloco", "H": H, "precision": precision, "nodes": n, "tokens": tokens, "bytes": sent,
            "payload": sum(r.bytes_out for r in reports), "bytes_per_token": sent / tokens,
            "loss": sum(r.end_loss for r in reports) / n, "seconds": seconds, "isolated": ns.isolated,
            "seed": seed, "steady": steady,
            **({"steady_bytes_per_token": steady["bytes"] / steady["tokens"],
                "steady_payload_per_token": steady["payload"] / steady["tokens"]} if steady else {}),
            "notes": f"{rounds} rounds ({alone} alone), {sum(r.catchups for r in reports)} catch-ups"
                     + ("" if len(digests) == 1 else f", {len(digests)} different final states")}


def plot(rows: list[dict], ddp: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5.2))
    ax.axhspan(0, ddp["loss"] * (1 + LOSS_SLACK), color="#e8f4e8", zorder=0)
    ax.axvline(ddp["bytes_per_token"] / DDP_FACTOR, color="#888", ls="--", lw=1)
    ax.text(ddp["bytes_per_token"] / DDP_FACTOR, ddp["loss"] * (1 + LOSS_SLACK), " DDP/500\n within 2%\n of DDP",
            fontsize=7, va="top", color="#555")
    styles = {"DDP": ("s", "black"), "sync DiLoCo": ("^", "tab:blue"), "torchft DiLoCo": ("v", "tab:orange")}
    colors = {"fp32": "tab:red", "fp16": "tab:purple", "int8": "tab:green", "int4": "tab:brown", "topk2": "tab:olive"}
    for sysname, (marker, color) in styles.items():
        pts = sorted((r for r in rows if r["system"] == sysname), key=lambda r: r["bytes_per_token"])
        if pts:
            ax.plot([r["bytes_per_token"] for r in pts], [r["loss"] for r in pts], marker=marker, color=color,
                    label=sysname, ls="-" if len(pts) > 1 else "none")
            for r in pts:
                if sysname != "DDP":
                    ax.annotate(f"H={r['H']}", (r["bytes_per_token"], r["loss"]), fontsize=7,
                                xytext=(4, -9 if sysname == "sync DiLoCo" else -18), textcoords="offset points",
                                color=color)
    for prec, color in colors.items():
        pts = sorted((r for r in rows if r["system"] == "p2pdiloco" and r["precision"] == prec),
                     key=lambda r: r["bytes_per_token"])
        if pts:
            ax.plot([r["bytes_per_token"] for r in pts], [r["loss"] for r in pts], marker="o", color=color,
                    label=f"p2pdiloco {prec}", ls="-" if len(pts) > 1 else "none")
            for r in pts:
                label = f"H={r['H']}" if prec == "int4" else prec
                ax.annotate(label, (r["bytes_per_token"], r["loss"]), fontsize=7, xytext=(4, 3),
                            textcoords="offset points", color=color)
    ax.set_xscale("log")
    lo = min(r["loss"] for r in rows)
    ax.set_ylim(lo * 0.97, max(r["loss"] for r in rows) * 1.03)
    ax.set_xlabel("bytes sent per node per training token (socket bytes, log scale)")
    ax.set_ylabel("held-out loss at equal tokens (nats/byte)")
    ax.set_title("Bandwidth against quality (lower left is better)")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description="Benchmark 1: bandwidth against quality")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=500, help="inner steps per node (the token budget)")
    p.add_argument("--H", type=int, nargs="+", default=[25, 100, 250], help="H values (int4 and sync DiLoCo)")
    p.add_argument("--precision-H", type=int, default=100, help="H at which every wire precision is run")
    p.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8", "int4"], choices=WIRE_PRECISIONS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds; every system runs once per seed")
    p.add_argument("--no-torchft", action="store_true", help="leave torchft out (else: run at the first seed only)")
    p.add_argument("--quick", action="store_true", help="smoke run: 60 steps, H 30, int4 and fp32")
    p.add_argument("--ddp-lr", type=float, nargs="+", default=None,
                   help="DDP's inner learning rates to try at the first seed; the other seeds run DDP at the best "
                        f"(default: the benchmark's {c.TRAIN['inner.lr']} only)")
    p.add_argument("--momenta", type=float, nargs="+", default=None,
                   help="outer momenta of synchronous DiLoCo to try at the first seed, at every H (reported as a "
                        f"grid; synchronous DiLoCo and p2pdiloco's dense wires run at {c.TRAIN['outer.momentum']})")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS),
                   help="the systems to run (the others' rows may come from --rows-from)")
    p.add_argument("--rows-from", type=Path, default=None, metavar="JSON",
                   help="an earlier run's JSON file: its rows of the systems not run now go into the tables, each "
                        "with the commit it ran on")
    p.add_argument("--report-from", type=Path, default=None, metavar="JSON",
                   help="write the report again from a run's JSON file (run with the same flags), running nothing")
    p.add_argument("--doc", default="bandwidth", help="name of the files written in docs/benchmarks")
    p.add_argument("--workdir", type=Path, default=None)
    c.add_set_option(p)
    a = p.parse_args()
    a.model = {}  # --set: the model's size only (its context and batch, hence tokens per step, stay)
    c.apply_overrides(p, a.model, a.overrides)
    if set(a.model) - set(SIZES):
        p.error(f"--set: only {', '.join(SIZES)} (the model's size), not {', '.join(sorted(set(a.model) - set(SIZES)))}")
    try:
        a.params = c.params(a.model)
    except ValueError as e:
        p.error(f"--set: {e}")
    if a.quick:
        a.steps, a.H, a.precision_H, a.precisions = 60, [30], 30, ["fp32", "int4"]
    earlier = read_run(p, a, a.rows_from, "--rows-from") if a.rows_from else None
    if a.report_from:
        done = read_run(p, a, a.report_from, "--report-from")
        if "seconds" not in done:
            p.error(f"--report-from {a.report_from}: the run's duration is not in it")
        write(a, done["rows"], done.get("grid", []), done["machine"], done["seconds"],
              all(r.get("isolated", True) for r in done["rows"]), Path(done["workdir"]), [])
        return
    c.install_signal_handlers()
    c.cleanup_stale()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="p2pdiloco-bench-bw-"))
    m, t0 = c.machine(), time.monotonic()
    isolated = c.netns_available()
    rows: list[dict] = []
    grid: list[dict] = []  # DDP's learning rates and synchronous DiLoCo's momenta tried at the first seed
    failed: list[str] = []
    if earlier:  # the systems not run now, as that run measured them
        keep = [SYSTEMS[k] for k in SYSTEMS if k not in a.systems]
        for into, key in ((rows, "rows"), (grid, "grid")):
            into += [dict(r, commit=r.get("commit", earlier["machine"]["commit"]))
                     for r in earlier.get(key, []) if r["system"] in keep]

    def go(label: str, fn, *args, into: list[dict] = rows, **kw) -> None:
        print(f"bandwidth: {label} ...", flush=True)
        try:
            r = fn(*args, **a.model, **kw)  # every system on --set's model
        except RuntimeError as e:
            print(f"bandwidth: {label} failed: {e}", flush=True)
            failed.append(f"{label}: {e}")
            return
        into.append(dict(r, commit=m["commit"]))
        print(f"bandwidth: {label}: {r['bytes_per_token']:.3f} B/token, loss {r['loss']:.4f}, "
              f"{r['seconds']:.0f} s", flush=True)

    if any(a.steps % H for H in {*a.H, a.precision_H}):
        raise SystemExit("bandwidth: every H must divide --steps (the synchronous baselines sync on the last step)")
    runs = [(a.precision_H, prec) for prec in a.precisions]
    runs += [(H, "int4") for H in a.H if (H, "int4") not in runs]
    ddp_lr = float(c.TRAIN["inner.lr"])
    for seed in a.seeds:
        sw = work / f"seed{seed}"
        if "ddp" in a.systems and seed == a.seeds[0] and a.ddp_lr:
            for lr in a.ddp_lr:
                go(f"DDP lr {lr:g} seed {seed}", run_baseline, "ddp", a.nodes, a.steps, None, sw / f"ddp-lr{lr:g}",
                   seed, into=grid, inner__lr=f"{lr:g}")
            tried = [r for r in grid if r["system"] == "DDP"]
            if tried:
                ddp_lr = min(tried, key=lambda r: r["loss"])["inner_lr"]
                rows.append(next(r for r in tried if r["inner_lr"] == ddp_lr))
                print(f"bandwidth: DDP runs at lr {ddp_lr:g} (lowest held-out loss at seed {seed})", flush=True)
        elif "ddp" in a.systems:
            go(f"DDP seed {seed}", run_baseline, "ddp", a.nodes, a.steps, None, sw / "ddp", seed,
               inner__lr=f"{ddp_lr:g}")
        for H in a.H if "diloco" in a.systems else []:
            go(f"sync DiLoCo H={H} seed {seed}", run_baseline, "diloco", a.nodes, a.steps, H, sw / f"diloco{H}", seed)
            for mu in (a.momenta or []) if seed == a.seeds[0] else []:
                if f"{mu:g}" != c.TRAIN["outer.momentum"]:
                    go(f"sync DiLoCo H={H} momentum {mu:g} seed {seed}", run_baseline, "diloco", a.nodes, a.steps,
                       H, sw / f"diloco{H}-m{mu:g}", seed, into=grid, outer__momentum=f"{mu:g}")
        if "torchft" in a.systems and not a.no_torchft and seed == a.seeds[0]:
            try:
                import torchft  # noqa: F401, PLC0415
            except ImportError as e:
                print(f"bandwidth: torchft not importable ({e}); skipped", flush=True)
            else:
                H = a.precision_H
                go(f"torchft DiLoCo H={H} seed {seed}", run_baseline, "torchft", a.nodes, a.steps, H, sw / "torchft",
                   seed)
        for H, prec in runs if "p2p" in a.systems else []:
            go(f"p2pdiloco H={H} {prec} seed {seed}", run_p2p, a.nodes, a.steps, H, prec, sw / f"p2p-{H}-{prec}", seed)
    seconds = time.monotonic() - t0
    write(a, rows, grid, m, seconds, isolated, work, failed)
    sys.exit(1 if failed else 0)


def read_run(p: argparse.ArgumentParser, a: argparse.Namespace, path: Path, flag: str) -> dict:
    """An earlier run's JSON file, checked against this run's flags: the same number of nodes
    and of steps, and every seed of this run in it (else a usage error, exit 2)."""
    try:
        run = json.loads(path.read_text())
        if not (isinstance(run.get("rows"), list) and all("system" in r for r in run["rows"])
                and isinstance(run["machine"]["commit"], str)):
            raise ValueError("no rows or no commit")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        p.error(f"{flag} {path}: not the JSON file of an earlier run of this benchmark ({e})")
    base = [r for r in run["rows"] if r["system"] != SYSTEMS["p2p"]]
    steps = {r["tokens"] // (r["nodes"] * c.TOKENS_PER_STEP) for r in base}
    if {r["nodes"] for r in run["rows"]} != {a.nodes} or (base and steps != {a.steps}):
        p.error(f"{flag} {path}: that run had {sorted({r['nodes'] for r in run['rows']})} nodes and "
                f"{sorted(steps)} steps, this one --nodes {a.nodes} --steps {a.steps}")
    if run.get("model", {}) != a.model:
        p.error(f"{flag} {path}: that run's model settings were {run.get('model', {})}, this one's {a.model}")
    missing = sorted(set(a.seeds) - {r.get("seed", 0) for r in run["rows"]})
    if missing:
        p.error(f"{flag} {path}: that run has no seed {missing[0]}")
    run["rows"] = [r for r in run["rows"] if r.get("seed", 0) in a.seeds]
    return run


def mean_rows(runs: list[dict]) -> list[dict]:
    """One row per (system, H, wire): the mean over its seeds of tokens, bytes, payload, bytes
    per token, loss and seconds; ``seeds`` lists them; notes: the first seed's."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["system"], r["H"], r["precision"]), []).append(r)
    out = []
    for rs in groups.values():
        row = dict(rs[0], seeds=[r.get("seed", 0) for r in rs])
        for k in ("tokens", "bytes", "bytes_per_token", "loss", "seconds"):
            row[k] = statistics.mean(r[k] for r in rs)
        if rs[0]["payload"] is not None:
            row["payload"] = statistics.mean(r["payload"] for r in rs)
        for k in ("steady_bytes_per_token", "steady_payload_per_token"):  # None unless every seed has a window
            row[k] = statistics.mean(r[k] for r in rs) if all(k in r for r in rs) else None
        out.append(row)
    return out


SYSTEMS = {"ddp": "DDP", "diloco": "sync DiLoCo", "torchft": "torchft DiLoCo", "p2p": "p2pdiloco"}
REGIME_GOAL = {(200, "int4"): 1000, (200, "topk2"): 4000}  # fewer bytes than DDP, at loss within REGIME_SLACK
REGIME_SLACK = 0.02  # of synchronous DiLoCo at the same H (goal: docs/benchmarks/README.md)


def pair(runs: list[dict], r0: dict, system: str, H: int | None) -> list[tuple[int, float]]:
    """(seed, relative held-out loss change) of ``r0``'s runs against ``system``'s at ``H`` and the same seed."""
    out = []
    for mine in runs:
        if (mine["system"], mine["H"], mine["precision"]) != (r0["system"], r0["H"], r0["precision"]):
            continue
        other = next((r for r in runs if r["system"] == system and (H is None or r["H"] == H)
                      and r.get("seed", 0) == mine.get("seed", 0)), None)
        if other:
            out.append((mine.get("seed", 0), mine["loss"] / other["loss"] - 1))
    return out


def regime_tables(runs: list[dict], rows: list[dict], grid: list[dict], ddp: dict,
                  a: argparse.Namespace) -> list[str]:
    """The tuning grid, DiLoCo's cost against DDP (the method's) and p2pdiloco's bytes against
    DDP with its loss against synchronous DiLoCo (ours), each as a Markdown table."""
    out = []
    first = a.seeds[0]
    lines = [f"| system | H | setting | held-out loss (seed {first}) | used |", "|---|---|---|---|---|"]
    for r in sorted((r for r in grid if r["system"] == "DDP"), key=lambda r: r["inner_lr"]):
        used = r["inner_lr"] == ddp["inner_lr"]
        lines.append(f"| DDP | 1 | inner lr {r['inner_lr']:g} | {r['loss']:.4f} | {'**yes**' if used else ''} |")
    for H in sorted({r["H"] for r in grid if r["system"] == "sync DiLoCo"}):
        tried = [r for r in [*runs, *grid] if r["system"] == "sync DiLoCo" and r["H"] == H
                 and r.get("seed", 0) == first]
        for r in sorted(tried, key=lambda r: r["outer_momentum"]):
            used = f"{r['outer_momentum']:g}" == c.TRAIN["outer.momentum"]
            lines.append(f"| sync DiLoCo | {H} | outer momentum {r['outer_momentum']:g} | {r['loss']:.4f} | "
                         f"{'**yes**' if used else ''} |")
    if len(lines) > 2:
        out.append(f"Tuning grid, at seed {first} (DDP: the learning rate with the lowest held-out loss runs every "
                   f"seed; synchronous DiLoCo and p2pdiloco's dense wires run at outer momentum "
                   f"{c.TRAIN['outer.momentum']}, as the nodes do by default):\n\n" + "\n".join(lines))
    lines = ["| H | per seed | mean |", "|---|---|---|"]
    for r0 in (r for r in rows if r["system"] == "sync DiLoCo"):
        pairs = pair(runs, r0, "DDP", None)
        if pairs:
            lines.append(f"| {r0['H']} | " + ", ".join(f"{d:+.2%} (seed {s})" for s, d in pairs)
                         + f" | {statistics.mean(d for _, d in pairs):+.2%} |")
    if len(lines) > 2:
        out.append(f"The method's cost: synchronous DiLoCo's held-out loss against DDP's (inner lr "
                   f"{ddp['inner_lr']:g}) at the same seed and tokens:\n\n" + "\n".join(lines))
    n = ddp["nodes"]
    ddp_payload = 8 * (n - 1) / n * a.params / c.TOKENS_PER_STEP  # fp32 ring all-reduce of every gradient
    lines = ["| H | wire | bytes / node / token, whole run: socket, payload | steady state: socket, payload | "
             "DDP / ours, steady: socket, payload | vs sync DiLoCo: mean (worst seed) | goal | |",
             "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["system"] == "p2pdiloco" and r["payload"]):
        pairs = pair(runs, r, "sync DiLoCo", r["H"])
        if not pairs:
            continue
        mean, worst = statistics.mean(d for _, d in pairs), max(d for _, d in pairs)
        sock, pay = r.get("steady_bytes_per_token"), r.get("steady_payload_per_token")
        windows = [x["steady"] for x in runs if x.get("steady")
                   and (x["system"], x["H"], x["precision"]) == (r["system"], r["H"], r["precision"])]
        steady = (f"{fmt_b(sock)}, {fmt_b(pay)} ({statistics.mean(w['rounds'] for w in windows) / n:.0f} rounds a "
                  f"node in {statistics.mean(w['seconds'] for w in windows):.0f} s)" if sock else "no window")
        ratios = f"{ddp['bytes_per_token'] / sock:,.0f}x, {ddp_payload / pay:,.0f}x" if sock else ""
        want = REGIME_GOAL.get((r["H"], r["precision"]))
        goal = (f">= {want:,}x, at most +{REGIME_SLACK:.0%}" if want else f"at most +{REGIME_SLACK:.0%}")
        ok = mean <= REGIME_SLACK and (want is None or (pay is not None and ddp_payload / pay >= want))
        socket_too = want is None or (sock is not None and ddp["bytes_per_token"] / sock >= want)
        lines.append(f"| {r['H']} | {r['precision']} | {fmt_b(r['bytes_per_token'])}, "
                     f"{fmt_b(r['payload'] / r['tokens'])} | {steady} | {ratios} | {mean:+.2%} ({worst:+.2%}) | "
                     f"{goal} | {c.verdict(ok)}" + ("" if not ok or socket_too else " on payload; not on socket "
                                                    "bytes") + " |")
    if len(lines) > 2:
        out.append(f"Our cost and our bytes (the goals of docs/benchmarks/README.md): p2pdiloco's held-out loss against synchronous DiLoCo at the "
                   "same H, seed and tokens, and its bytes against DDP's at equal tokens (means over seeds). Socket "
                   "bytes are the namespace's (the DHT, libp2p and TCP/IP headers included); payload is what the "
                   "nodes' RPCs carried (pseudo-gradient slices, merged slices, rounds and states for catch-ups). "
                   "Whole run: from start to exit. Steady state: from the moment every node has trained "
                   f"{c.STEADY[0]:.0%} of its steps to the moment the first has trained {c.STEADY[1]:.0%} (start-up, "
                   "the first states and the end-of-budget flush left out). DDP: its socket figure "
                   f"({fmt_b(ddp['bytes_per_token'])} per token), and for payload its fp32 ring all-reduce of every "
                   f"gradient, 8 (N - 1) / N x {a.params:,} bytes per step ({fmt_b(ddp_payload)} per token at "
                   f"N = {n}):\n\n" + "\n".join(lines))
    return out


def versus_sync(runs: list[dict]) -> list[list]:
    """p2pdiloco's held-out loss against synchronous DiLoCo at the same H and seed (the same
    tokens): per seed, mean and worst relative change; the goal is within SYNC_SLACK
    (docs/benchmarks/README.md)."""
    rows = []
    for r0 in mean_rows([r for r in runs if r["system"] == "p2pdiloco"]):
        pairs = pair(runs, r0, "sync DiLoCo", r0["H"])
        if pairs:
            mean = statistics.mean(d for _, d in pairs)
            rows.append([r0["H"], r0["precision"], ", ".join(f"{d:+.2%} (seed {s})" for s, d in pairs),
                         f"{mean:+.2%}", f"{max(d for _, d in pairs):+.2%}", c.verdict(mean <= SYNC_SLACK)])
    return rows


def write(a: argparse.Namespace, runs: list[dict], grid: list[dict], m: dict, seconds: float, isolated: bool,
          work: Path, failed: list[str]) -> None:
    rows = mean_rows(runs)
    ddp = next((r for r in rows if r["system"] == "DDP"), None)
    cmd = "python -m bench.bandwidth" + (" --quick" if a.quick else "") + "".join(
        f" {flag} {value}" for flag, value, default in (
            ("--nodes", a.nodes, 2), ("--steps", a.steps, 500),
            ("--H", " ".join(map(str, a.H)), "25 100 250"), ("--precision-H", a.precision_H, 100),
            ("--precisions", " ".join(a.precisions), "fp32 fp16 int8 int4"),
            ("--seeds", " ".join(map(str, a.seeds)), "0"),
            ("--ddp-lr", " ".join(f"{x:g}" for x in a.ddp_lr or []), ""),
            ("--momenta", " ".join(f"{x:g}" for x in a.momenta or []), ""),
            ("--systems", " ".join(a.systems), " ".join(SYSTEMS)), ("--rows-from", a.rows_from, None),
            ("--doc", a.doc, "bandwidth"))  # --quick sets the steps, H and wires itself; every other flag is kept
        if str(value) != str(default) and not (a.quick and flag in ("--steps", "--H", "--precision-H", "--precisions"))) + (
        " --no-torchft" if a.no_torchft else "") + "".join(f" --set {k}={v}" for k, v in a.model.items())
    doc = c.Doc(a.doc, "Benchmark 1: bandwidth against quality", cmd)
    doc.intro = [
        f"{a.nodes} nodes (processes) per system, {a.steps} inner steps each of {c.TOKENS_PER_STEP} tokens "
        f"(batch 16 x 64 bytes), so {a.steps * c.TOKENS_PER_STEP * a.nodes / 1e6:.2f}M training tokens per system; "
        f"the same byte-level GPT ({describe(a)}), AdamW (lr 3e-3, DDP at the best of its grid "
        "when one is given below; 50 warmup steps, "
        "cosine to the last step, weight decay 0.1, clip 1.0), data shard i of the standard library's source on "
        "process i, and the same held-out bytes for everyone. DiLoCo variants: outer Nesterov lr 0.7, "
        "momentum 0.9 (p2pdiloco's `topk2`: the settings it is measured with, " + ", ".join(
            f"outer {k.replace('_', ' ')} {v:g}" for k, v in TOPK2_RECIPE.items()) + "). "
        "p2pdiloco: 4 fragments, overlap 2, quorum 1, grace 1-3 s, real node processes "
        "(`python -m node run --max-steps ...`) with a bootstrap peer.",
        "",
        "Bytes: " + ("each system ran in its own network namespace (`ip netns`) with only `lo`; the figure is the "
                     "namespace's `lo` transmit counter over the whole run (start-up, training, final agreement), "
                     "TCP/IP headers included, divided by nodes and by tokens per node. For p2pdiloco that also "
                     "counts the bootstrap peer, the DHT (heartbeat records, matchmaking) and libp2p's own "
                     "traffic. *payload* is what the nodes' RPCs carried (pseudo-gradient slices, merged slices, "
                     "state downloads), from the nodes' own counters."
                     if isolated else
                     "`ip netns` was NOT available: the figure is the host's `lo` counter, which also counts any "
                     "other traffic on this machine's loopback during the run (an overestimate)."),
        "",
        "Held-out loss: the final global model of each system (DDP: the model; synchronous and torchft "
        "DiLoCo: the global parameters after the last outer step, which falls on the last inner step; "
        "p2pdiloco: each node's global state Θ at the end, mean over nodes), in nats per byte.",
    ]
    if ddp is None:
        doc.text("DDP did not run, so no ratio can be given.")
        doc.write(m, seconds, {"rows": runs, "model": a.model, "workdir": str(work)})
        return
    limit_b = ddp["bytes_per_token"] / DDP_FACTOR
    limit_l = ddp["loss"] * (1 + LOSS_SLACK)
    table = []
    for r in rows:
        less = ddp["bytes_per_token"] / r["bytes_per_token"]
        dl = r["loss"] / ddp["loss"] - 1
        ok = r["system"] == "p2pdiloco" and less >= DDP_FACTOR and dl <= LOSS_SLACK
        table.append([r["system"], r["H"], r["precision"], f"{r['tokens'] / 1e6:.3f}M", f"{r['bytes'] / 1e6:.2f}",
                      "" if r["payload"] is None else f"{r['payload'] / 1e6:.2f}",
                      fmt_b(r["bytes_per_token"]), f"{less:,.0f}x", f"{r['loss']:.4f}", f"{100 * dl:+.1f}%",
                      f"{r['seconds']:.0f}", ("**both goals met** " if ok else "") + r["notes"]
                      + (f" (on {r['commit']})" if r.get("commit", m["commit"]) != m["commit"] else "")])
    doc.table(["system", "H", "wire", "tokens", "socket MB", "payload MB", "bytes / node / token",
               "fewer bytes than DDP", "held-out loss", "vs DDP", "wall s", "notes"], table,
              f"All runs (mean over seeds {a.seeds}; notes: the first seed's"
              + (", torchft at the first only" if len(a.seeds) > 1 and SYSTEMS["torchft"] in {r["system"] for r in rows}
                 else "") + "):")
    doc.sections.extend(regime_tables(runs, rows, grid, ddp, a))
    vs_rows = versus_sync(runs)
    if vs_rows:
        doc.table(["H", "wire", "per seed", "mean", "worst seed", f"at most +{SYNC_SLACK:.0%} (mean; goal)"],
                  vs_rows,
                  "p2pdiloco against synchronous DiLoCo at the same H, seed and tokens (held-out loss, relative "
                  "change; our cost, apart from the method's):")
    p2p = [r for r in rows if r["system"] == "p2pdiloco"]
    meet = [r for r in p2p if r["bytes_per_token"] <= limit_b and r["loss"] <= limit_l]
    best_b = [r for r in p2p if r["bytes_per_token"] <= limit_b]
    best_l = [r for r in p2p if r["loss"] <= limit_l]
    goal = (f"The first goal of docs/benchmarks/README.md (whole runs, socket bytes): at least {DDP_FACTOR}x fewer bytes per token than DDP "
            f"({fmt_b(limit_b)} bytes or fewer) with held-out loss within {100 * LOSS_SLACK:.0f}% of DDP's "
            f"({limit_l:.4f} or lower).")
    if meet:
        best = min(meet, key=lambda r: r["loss"])
        lines = [goal, "", f"Result: {c.verdict(True)} by p2pdiloco H={best['H']} {best['precision']}: "
                 f"{ddp['bytes_per_token'] / best['bytes_per_token']:,.0f}x fewer bytes, loss "
                 f"{100 * (best['loss'] / ddp['loss'] - 1):+.1f}% against DDP."]
    else:
        lines = [goal, "", f"Result: {c.verdict(False)}: no p2pdiloco run meets both."]
        if best_b:
            r = min(best_b, key=lambda r: r["loss"])
            lines.append(f"Among runs at least {DDP_FACTOR}x below DDP, the best loss is H={r['H']} {r['precision']} "
                         f"at {100 * (r['loss'] / ddp['loss'] - 1):+.1f}%.")
        if best_l:
            r = min(best_l, key=lambda r: r["bytes_per_token"])
            lines.append(f"Among runs within {100 * LOSS_SLACK:.0f}% of DDP's loss, the fewest bytes are H={r['H']} "
                         f"{r['precision']} at {ddp['bytes_per_token'] / r['bytes_per_token']:,.0f}x below DDP.")
        r = max(p2p, key=lambda r: ddp["bytes_per_token"] / r["bytes_per_token"], default=None)
        if r:
            lines.append(f"Largest reduction: H={r['H']} {r['precision']}, "
                         f"{ddp['bytes_per_token'] / r['bytes_per_token']:,.0f}x, loss "
                         f"{100 * (r['loss'] / ddp['loss'] - 1):+.1f}%.")
    doc.text("\n".join(lines))
    doc.text(*why(rows, ddp, a))
    if failed:
        doc.text("Runs that failed (left out above): " + "; ".join(failed))
    doc.text(f"![bandwidth against quality]({a.doc}.png)")
    doc.write(m, seconds, {"rows": runs, "grid": grid, "model": a.model, "params": a.params, "workdir": str(work),
                           "ddp_factor": DDP_FACTOR,
                           "loss_slack": LOSS_SLACK, "sync_slack": SYNC_SLACK, "seeds": a.seeds, "seconds": seconds})
    plot(rows, ddp, c.DOCS / f"{a.doc}.png")
    print(f"bandwidth: wrote {c.DOCS / a.doc}.md and {a.doc}.png ({seconds / 60:.1f} min)", flush=True)


FRAGMENTS = 4
SIZES = ("model.n_layer", "model.n_embd", "model.n_head")  # what --set may change


def describe(a: argparse.Namespace) -> str:
    m = {k: a.model.get(k, c.MODEL[k]) for k in SIZES}
    return f"{m['model.n_layer']} layers, {m['model.n_embd']} wide, {a.params / 1e3:.0f}k parameters"


def why(rows: list[dict], ddp: dict, a: argparse.Namespace) -> list[str]:
    """Generated reading of the table: what limits quality and what the bytes are."""
    out = ["Reading the numbers:"]
    H = a.precision_H
    sync = next((r for r in rows if r["system"] == "sync DiLoCo" and r["H"] == H), None)
    tft = next((r for r in rows if r["system"] == "torchft DiLoCo"), None)
    if sync:
        out.append(f"- Quality. Synchronous DiLoCo at H = {H} (the same inner and outer optimizer, every rank merging "
                   f"every time, no swarm) is {100 * (sync['loss'] / ddp['loss'] - 1):+.1f}% against DDP"
                   + (f", and torchft's DiLoCo gives {tft['loss']:.4f} against its {sync['loss']:.4f}"
                      if tft else "")
                   + f". With {a.steps} inner steps ({a.steps // H} outer steps at H = {H}) on a "
                   + f"{a.params / 1e3:.0f}k-parameter "
                   + ("model, DiLoCo-style training itself is more than 2% behind DDP at equal tokens, so no H that "
                      "saves bandwidth can meet the 2% bound here; the gap narrows with longer runs and larger "
                      "models (DiLoCo, arXiv 2311.08105). " if sync["loss"] > ddp["loss"] * (1 + LOSS_SLACK) else
                      "model, DiLoCo-style training is within 2% of DDP at equal tokens. ")
                   + "p2pdiloco's own extra loss against synchronous DiLoCo at the same H "
                   "comes from merges with fewer members (a node that is not ready within the grace window is "
                   "left out: the 'alone' rounds) and from the inner steps after each fragment's last merge, "
                   "which the final global state does not contain.")
    p2p = [r for r in rows if r["system"] == "p2pdiloco" and r["payload"]]
    if p2p:
        ctl = [(r["bytes"] - r["payload"]) / (r["nodes"] * r["seconds"]) for r in p2p]
        share = [r["payload"] / r["bytes"] for r in p2p]
        extra = [(r["bytes"] - r["payload"]) / r["tokens"] for r in p2p]
        out.append(f"- Bytes. The nodes' own RPC payload is {span(share, 100, '.0f')}% of "
                   "p2pdiloco's socket bytes. The rest is libp2p framing (TLS, yamux and TCP/IP headers on every "
                   "message), start-up (the DHT, joins, the first state) and the control plane (matchmaking, "
                   "heartbeats, DHT records; control_plane.md measures it per round and per second): "
                   f"{span(ctl, 1e-3, '.1f')} kB/s per node over the runs, "
                   f"{span(extra, 1, '.2f')} bytes per training token (DDP/"
                   f"{ddp['bytes_per_token'] / max(extra):,.0f} to DDP/{ddp['bytes_per_token'] / min(extra):,.0f}).")
        rest = [f"H={r['H']} {r['precision']}: {catchups(r)}" for r in p2p]
        out.append("- Catch-ups. A node that missed a fragment's round follows it from the round's merged slices "
                   "(catchups.md) or, further behind, downloads the fragment's fp32 state (Θ and the momentum b, "
                   f"{8 * a.params / FRAGMENTS / 1e3:.0f} kB): " + "; ".join(rest) + " per run (first seed; "
                   "both count in the payload).")
    return ["\n".join(out)]


def span(xs: list[float], scale: float, f: str) -> str:
    """``lo-hi`` of ``xs`` times ``scale`` in format ``f``; one number when they print alike."""
    lo, hi = format(min(xs) * scale, f), format(max(xs) * scale, f)
    return lo if lo == hi else f"{lo}-{hi}"


def catchups(r: dict) -> int:
    try:
        return int(r["notes"].split(" catch-ups")[0].rsplit(" ", 1)[-1])
    except (ValueError, IndexError):
        return 0


def fmt_b(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:,.0f}"


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: every process, namespace and cgroup is gone by now
        print(f"{Path(__file__).stem}: interrupted", file=sys.stderr)
        sys.exit(130)
