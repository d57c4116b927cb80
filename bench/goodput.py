"""Benchmark 4, goodput under failures: p2pdiloco (through the chaos harness,
p2pdiloco.chaos) against torchft's DiLoCo under the same kill/restart schedule.

    python -m bench.goodput            # about 6 minutes on a 2-core machine
    python -m bench.goodput --quick    # a smoke run

Both systems get: the same nodes (``--nodes`` processes, the benchmark model and data), the
same fault schedule (p2pdiloco.chaos.schedule.round_robin_schedule: kill node ``k mod N``
every ``--kill-every`` seconds with SIGKILL to its whole process group, restart it
``--restart-delay`` seconds later on the same rank), the same CPU duty cycle per node (the
harness's throttle: ``0.7 x cores / nodes`` of a core, so a killed node's CPU does not
speed the survivors up), the same warm-up and measured window, and the same denominator:

    goodput = merged tokens in the window / (nodes x standalone tokens/s x window)

where the standalone rate is measured first, with the lone learners (``bench/workers.py
standalone``) under the same throttle, and handed to both. Merged tokens: p2pdiloco counts
each node's contributions to committed merges (``tokens_merged``); torchft counts the
tokens of every sync whose ``should_commit`` succeeded on that replica (a failed sync
restores the last global parameters: that progress is lost). As in the harness, tokens
trained before the window must be merged first (an incarnation's baseline is
max(tokens, merged) at the window's start).

torchft setup: one lighthouse (``torchft_lighthouse --min_replicas 1 --join_timeout_ms
10000``), one replica group of one process per node, ProcessGroupGloo, ``Manager(
min_replica_size=1, use_async_quorum=False, timeout 10 s)``, ``DiLoCo(sync_every=H)``,
outer SGD Nesterov lr 0.7 momentum 0.9; a restarted replica heals from a live one
(torchft's HTTP checkpoint transport), which also restores its inner step.

Writes docs/benchmarks/goodput.md, .json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import common as c

LIGHTHOUSE = str(Path(c.PY).parent / "torchft_lighthouse")


class Life:
    """One process lifetime of a torchft replica, and what its status file said."""

    def __init__(self, proc, spawned: float, status: Path):
        self.proc, self.spawned, self.status = proc, spawned, status
        self.samples: list[tuple[float, float, float]] = []  # (harness time, tokens, merged)
        self.ended: float | None = None
        self.training = False

    def poll(self, offset: float) -> None:
        if self.ended is not None:
            return
        s = c.read_json(self.status)
        if not s or s.get("pid") != self.proc.pid:
            return
        t = s["t"] - offset
        if not self.samples or t > self.samples[-1][0]:
            self.samples.append((t, float(s["tokens"]), float(s["merged"])))
            self.training = self.training or s["tokens"] > 0

    def at(self, t: float) -> tuple[float, float] | None:
        before = [x for x in self.samples if x[0] <= t]
        return (before[-1][1], before[-1][2]) if before else None

    def merged_in(self, t0: float, t1: float) -> tuple[float, float]:
        """(merged, trained) tokens of this life counted in [t0, t1]."""
        end = self.at(min(t1, self.ended if self.ended is not None else t1))
        if end is None:
            return 0.0, 0.0
        start = self.at(t0) if self.spawned < t0 else None
        base_tokens = start[0] if start else 0.0
        base_merged = max(start) if start else 0.0
        return max(0.0, end[1] - base_merged), max(0.0, end[0] - base_tokens)


def throttled_standalone(n: int, share: float, warm: float, window: float, work: Path, values: dict) -> float:
    """Median tokens/s of n lone learners under the harness's duty-cycle throttle."""
    from p2pdiloco.procs import Processes  # noqa: PLC0415
    from p2pdiloco.chaos.throttle import Throttle  # noqa: PLC0415

    procs, throttle = Processes(), Throttle(0.1)
    try:
        started = []
        for i in range(n):
            st = work / f"rank{i}.status"
            pr = procs.start(c.worker_argv("standalone", i, n, values, work / f"rank{i}.json", duration=3600,
                                           status=st), work / f"rank{i}.log", f"alone{i}")
            throttle.set(pr, share, i / n)
            started.append(st)
        end = time.monotonic() + 180
        while time.monotonic() < end and not all((c.status_of(s) or {}).get("tokens", 0) > 0 for s in started):
            nxt = throttle.tick(time.monotonic())
            time.sleep(max(0.0, min(nxt, time.monotonic() + 0.25) - time.monotonic()))
        s0 = None
        t_warm = time.monotonic() + warm
        t_end = t_warm + window
        while time.monotonic() < t_end:
            now = time.monotonic()
            if s0 is None and now >= t_warm:
                s0 = [c.status_of(s) for s in started]
            nxt = throttle.tick(now)
            time.sleep(max(0.0, min(nxt, t_end) - time.monotonic()))
        s1 = [c.status_of(s) for s in started]
        rates = [(b["tokens"] - a["tokens"]) / max(1e-6, b["t"] - a["t"]) for a, b in zip(s0, s1)]
        return statistics.median(rates)
    finally:
        throttle.release_all()
        procs.close()


def run_torchft(n: int, schedule, share: float, H: int, duration: float, warmup: float, tps: float, work: Path,
                values: dict) -> dict:
    from p2pdiloco.procs import Processes  # noqa: PLC0415
    from p2pdiloco.chaos.throttle import Throttle  # noqa: PLC0415

    procs, throttle = Processes(), Throttle(0.1)
    offset = time.time() - time.monotonic()
    port = c.free_port()
    lives: list[list[Life]] = [[] for _ in range(n)]
    failures = {"kill": 0, "kill_skipped": 0}
    notes: list[str] = []
    try:
        procs.start([LIGHTHOUSE, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "10000"],
                     work / "lighthouse.log", "lighthouse")

        def spawn(i: int, budget: float) -> None:
            st = work / f"rank{i}.status"
            st.unlink(missing_ok=True)
            k = len(lives[i])
            pr = procs.start(c.worker_argv("torchft", i, n, values, work / f"rank{i}-{k}.json", duration=budget,
                                           status=st, H=H, lighthouse=f"http://127.0.0.1:{port}", min_replicas=1,
                                           ft_timeout=10, ft_quorum_timeout=60),
                             work / f"rank{i}-{k}.log", f"replica{i}")
            lives[i].append(Life(pr, time.monotonic(), st))

        def up(i: int) -> bool:
            return bool(lives[i]) and lives[i][-1].ended is None and lives[i][-1].proc.alive()

        def step(until: float) -> None:
            while True:
                now = time.monotonic()
                if now >= until:
                    return
                for i in range(n):
                    if not up(i):
                        continue
                    life = lives[i][-1]
                    life.poll(offset)
                    if life.training and life.proc.pid not in throttle.shares:
                        throttle.set(life.proc, share, i / n)
                nxt = throttle.tick(now)
                time.sleep(max(0.0, min(nxt, now + 0.25, until) - time.monotonic()))

        budget = 3600.0
        for i in range(n):
            spawn(i, budget)
        end = time.monotonic() + 240
        while not all(lives[i][-1].training for i in range(n)):
            if time.monotonic() > end or any(not lives[i][-1].proc.alive() for i in range(n)):
                raise RuntimeError(f"torchft replicas did not all start training (logs in {work})")
            step(time.monotonic() + 0.5)
        t0 = time.monotonic() + warmup
        t1 = t0 + duration
        step(t0)
        for ev in schedule.events():
            if t0 + ev.at >= t1:
                break
            step(t0 + ev.at)
            if ev.action == "kill":
                if not up(ev.node):
                    failures["kill_skipped"] += 1
                    continue
                life = lives[ev.node][-1]
                life.poll(offset)
                throttle.release(life.proc)
                procs.kill(life.proc)
                life.ended = time.monotonic()
                failures["kill"] += 1
            elif ev.action == "restart" and not up(ev.node):
                spawn(ev.node, budget)
        step(t1)
        for i in range(n):
            if up(i):
                lives[i][-1].poll(offset)
                lives[i][-1].ended = t1
        merged = trained = 0.0
        for per in lives:
            for life in per:
                m, t = life.merged_in(t0, t1)
                merged, trained = merged + m, trained + t
        restarts = sum(len(per) - 1 for per in lives)
        return {"goodput": merged / (n * tps * duration), "goodput_merged": merged / trained if trained else 0.0,
                "tokens_merged": merged, "tokens_processed": trained, "failures": failures, "restarts": restarts,
                "notes": notes}
    finally:
        throttle.release_all()
        procs.close()


def main() -> None:
    p = argparse.ArgumentParser(description="Benchmark 4: goodput under failures against torchft")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--duration", type=float, default=75.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--kill-every", type=float, default=25.0)
    p.add_argument("--restart-delay", type=float, default=12.0)
    p.add_argument("--H", type=int, default=100)
    p.add_argument("--precision", default="int4")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    if a.quick:
        a.duration, a.warmup, a.kill_every, a.restart_delay = 30.0, 8.0, 12.0, 6.0
    c.install_signal_handlers()
    c.cleanup_stale()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="p2pdiloco-bench-goodput-"))
    m, t_start = c.machine(), time.monotonic()
    n = a.nodes
    share = min(1.0, 0.7 * (os.cpu_count() or 1) / n)
    base = c.settings(inner__total_steps=100_000)
    res: dict = {"share": share}
    try:
        from p2pdiloco.chaos import ChaosConfig, round_robin_schedule, run  # noqa: PLC0415
    except ImportError as e:
        res["error"] = f"the chaos harness (p2pdiloco.chaos) is not importable: {e}"
        write(a, res, m, time.monotonic() - t_start, work)
        sys.exit(1)
    schedule = round_robin_schedule(n, a.kill_every, a.restart_delay, a.duration)
    res["schedule"] = schedule.text()
    print(f"goodput: schedule {schedule.text()}", flush=True)
    print("goodput: standalone rate under the throttle ...", flush=True)
    tps = throttled_standalone(n, share, 10.0 if not a.quick else 5.0, 30.0 if not a.quick else 10.0,
                               work / "alone", base)
    res["standalone_tps"] = tps
    print(f"goodput: standalone {tps:.0f} tokens/s per node at {share:.2f} of a core", flush=True)
    print("goodput: p2pdiloco under the chaos harness ...", flush=True)
    try:
        settings = {**base, **c.SWARM, "outer.sync_every": str(a.H), "outer.wire_precision": a.precision,
                    "eval_every": "100000"}
        r = run(ChaosConfig(schedule=schedule, duration=a.duration, settings=settings, workdir=work / "p2p",
                            mode="decoupled", warmup=a.warmup, cpu_share=share, standalone_tps=tps, settle=20.0,
                            progress=lambda s: print(f"goodput:   {s}", flush=True)))
        res["p2pdiloco"] = {"goodput": r.goodput, "goodput_merged": r.goodput_merged, "tokens_merged": r.tokens_merged,
                            "tokens_processed": r.tokens_processed, "failures": r.failures,
                            "digests_agree": r.digests_agree, "end_loss": r.end_loss_mean,
                            "rejoin_median_s": r.rejoin_median_s, "survivors": r.survivors, "notes": r.notes}
        print(f"goodput: p2pdiloco {100 * r.goodput:.1f}%", flush=True)
    except Exception as e:  # noqa: BLE001  (report what failed, keep the other system)
        res["p2pdiloco"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(f"goodput: p2pdiloco failed: {e}", flush=True)
    print("goodput: torchft DiLoCo under the same schedule ...", flush=True)
    try:
        import torchft  # noqa: F401, PLC0415

        (work / "torchft").mkdir(parents=True, exist_ok=True)
        res["torchft"] = run_torchft(n, schedule, share, a.H, a.duration, a.warmup, tps, work / "torchft", base)
        print(f"goodput: torchft {100 * res['torchft']['goodput']:.1f}%", flush=True)
    except Exception as e:  # noqa: BLE001
        res["torchft"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(f"goodput: torchft failed: {e}", flush=True)
    write(a, res, m, time.monotonic() - t_start, work)
    sys.exit(1 if any("error" in res.get(k, {}) for k in ("p2pdiloco", "torchft")) else 0)


def write(a: argparse.Namespace, res: dict, m: dict, seconds: float, work: Path) -> None:
    cmd = "python -m bench.goodput" + (" --quick" if a.quick else "")
    doc = c.Doc("goodput", "Benchmark 4: goodput under failures, p2pdiloco against torchft", cmd)
    doc.intro = [
        f"{a.nodes} nodes of the benchmark model, H = {a.H} for both systems (p2pdiloco: {a.precision} on the wire, "
        "4 fragments, quorum 1; torchft: one fragment, fp32). Faults: the chaos harness's round-robin schedule "
        f"(a SIGKILL of one node's whole process group every {a.kill_every:g} s, restart {a.restart_delay:g} s "
        f"later), applied identically to both, over a {a.duration:g} s measured window after {a.warmup:g} s of "
        f"fault-free warm-up. Every node runs at {res.get('share', 0):.2f} of a core (the harness's duty-cycle "
        "throttle, same for both), so a killed node's CPU does not speed up the survivors.",
        "",
        "goodput = merged tokens in the window / (nodes x standalone tokens/s x window), with the same measured "
        "standalone rate for both (the lone learners under the same throttle). *merged / trained*: the share of "
        "the tokens trained in the window that ended up in a committed merge.",
    ]
    if "error" in res:
        doc.text(f"Not run: {res['error']}. Once the harness lands, run `{cmd}`.")
        doc.write(m, seconds, res)
        return
    doc.text(f"Schedule: `{res['schedule']}`; standalone rate {res.get('standalone_tps', 0):,.0f} tokens/s per node.")
    rows = []
    for name in ("p2pdiloco", "torchft"):
        r = res.get(name, {})
        if "error" in r:
            rows.append([name, "failed", "", "", "", r["error"][:200]])
            continue
        extra = []
        if name == "p2pdiloco":
            extra.append(f"final states agree: {r.get('digests_agree')}")
            if r.get("rejoin_median_s") is not None:
                extra.append(f"median rejoin {r['rejoin_median_s']:.1f} s")
            if r.get("end_loss"):
                extra.append(f"held-out loss {r['end_loss']:.3f}")
        else:
            extra.append(f"{r.get('restarts', 0)} restarts healed")
        rows.append([name, f"{100 * r['goodput']:.1f}%", f"{100 * r['goodput_merged']:.1f}%",
                     f"{r['tokens_merged']:,.0f}", f"{r['failures'].get('kill', 0)}", "; ".join(extra)])
    doc.table(["system", "goodput", "merged / trained", "tokens merged", "kills", "notes"], rows)
    ok = all("goodput" in res.get(k, {}) for k in ("p2pdiloco", "torchft"))
    if ok:
        p, t = res["p2pdiloco"]["goodput"], res["torchft"]["goodput"]
        doc.text(f"Goal: goodput against torchft under the same faults. Result: p2pdiloco {100 * p:.1f}%, torchft "
                 f"{100 * t:.1f}% ({p / t:.2f}x)." if t > 0 else f"Result: p2pdiloco {100 * p:.1f}%, torchft 0%.")
        doc.text(
            "Reading: both systems lose the progress a node had not yet merged when it is killed, and a restarted "
            "node first has to start (imports, data), join and catch up. torchft's DiLoCo syncs the whole model "
            f"every H = {a.H} steps and the replicas of one quorum step together: a killed replica's last up to H "
            "steps are lost, a restarted one contributes only at its first sync, H steps after it trains again, "
            "and a sync whose all-reduce fails is discarded on every member (its parameters are restored). "
            "p2pdiloco merges one of its 4 fragments about every H/4 steps, so a kill loses less unmerged work; "
            "a failed round keeps the progress for the next one; nobody waits for a dead node beyond the grace "
            "window and liveness timeout; a restarted node downloads the newest states from its peers. The "
            "window is short for this machine's pace (about 20 s per torchft sync here), so the figures are "
            "coarse; both systems saw the same kills at the same times.")
        plot(res, c.DOCS / "goodput.png")
        doc.text("![goodput](goodput.png)")
    doc.write(m, seconds, {**res, "workdir": str(work)})
    print(f"goodput: wrote {c.DOCS / 'goodput.md'} ({seconds / 60:.1f} min)", flush=True)


def plot(res: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = ["p2pdiloco", "torchft"]
    vals = [100 * res[k]["goodput"] for k in names]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    bars = ax.bar(["p2pdiloco", "torchft DiLoCo"], vals, color=["tab:green", "tab:orange"])
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v + 1, f"{v:.0f}%", ha="center", fontsize=9)
    ax.set_ylabel("goodput (% of nodes x standalone rate)")
    ax.set_title("Same kill/restart schedule")
    ax.set_ylim(0, max(100, max(vals) + 10))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: every process, namespace and cgroup is gone by now
        print(f"{Path(__file__).stem}: interrupted", file=sys.stderr)
        sys.exit(130)
