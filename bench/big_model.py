"""A transformers Llama-style model of 100M+ parameters through the full protocol, with its memory measured.

    python -m bench.big_model                         # 101M parameters, about 16 minutes
    python -m bench.big_model --n-layer 2 --n-embd 256 --duration 90 --join-at 30   # a smoke run

Two nodes start training ``p2pdiloco.models.hf:llama`` (transformers' ``LlamaForCausalLM``,
random initialisation from the run seed; default 8 layers, 1024 wide, 16 heads, byte vocabulary,
101.3M parameters, context 64, 2 sequences per inner step) with real node processes and a
bootstrap peer on 127.0.0.1, writing local checkpoints; a third node joins midway and downloads
every fragment's state before it trains. Each node's resident memory is sampled every
``--sample-every`` seconds (psutil) and its own peak read from its report (``hardware.peak_rss_mib``: VmHWM); both
are compared with the estimate the node showed at start (``hardware.memory_estimate``,
p2pdiloco.footprint). Goals (docs/benchmarks/README.md, "Real models"): held-out loss falls
on every node, equal final global digests, the newcomer downloads the full state, peak resident
memory within 1.5x of the estimate and under 8 x the model's fp32 bytes + 1 GiB on every node.

Writes docs/benchmarks/big_model.md and .json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench import common as c
from bench import own_model as om

FACTORY = "p2pdiloco.models.hf:llama"
MIB = 2**20
NAMES = om.NAMES


def settings(args: argparse.Namespace) -> dict[str, str]:
    return {
        "model.factory": FACTORY, "model.n_layer": str(args.n_layer), "model.n_embd": str(args.n_embd),
        "model.n_head": str(args.n_head), "model.block_size": str(args.block), "seed": "0", "threads": "1",
        "inner.lr": "1e-3", "inner.warmup_steps": "10", "inner.total_steps": "400",
        "outer.fragments": str(args.fragments), "outer.sync_every": str(args.sync_every), "outer.overlap": "2",
        "outer.min_quorum": "1", "outer.grace_min": "1.0", "outer.grace_max": "10.0", "outer.quorum_timeout": "20",
        "outer.liveness_timeout": "60", "outer.lr": "0.7", "outer.momentum": "0.9",
        "data.batch_size": str(args.batch), "data.max_bytes": "2000000", "data.eval_batches": "4",
        "data.num_shards": "3", "eval_every": str(args.eval_every), "checkpoint_every": str(args.checkpoint_every),
        "settle": str(args.settle),
    }


class RssSampler:
    """Resident memory of each node process (and its p2pd child) every ``every`` seconds, in
    a thread: the peak per process, MiB."""

    def __init__(self, every: float) -> None:
        self.every, self.pids = every, {}
        self.peak: dict[str, float] = {}
        self.p2pd_peak: dict[str, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples += 1
            for name, pid in list(self.pids.items()):
                try:
                    proc = psutil.Process(pid)
                    rss = proc.memory_info().rss / MIB
                    daemons = sum(ch.memory_info().rss for ch in proc.children(recursive=True)) / MIB
                except psutil.Error:
                    continue
                self.peak[name] = max(self.peak.get(name, 0.0), rss)
                self.p2pd_peak[name] = max(self.p2pd_peak.get(name, 0.0), daemons)


def run(args: argparse.Namespace, values: dict[str, str], frags: list[dict], work: Path) -> dict:
    """The swarm: node0 and node1, then the newcomer, sampled; their reports and journals' figures."""
    dirs = [work / n for n in NAMES]
    sampler = RssSampler(args.sample_every)
    with c.processes() as procs:
        maddr = procs.start_bootstrap(work, timeout=90)
        first = []
        for i in range(2):
            dirs[i].mkdir(exist_ok=True)
            first.append(procs.start(om.node_argv(maddr, NAMES[i], dirs[i], i, args.duration, values, "big-model"),
                                     dirs[i] / "node.log"))
            sampler.watch(NAMES[i], first[-1].pid)
        sampler.start()
        try:
            c.wait_training([d / "status.json" for d in dirs[:2]], first, 600)
            trained = time.monotonic()
            time.sleep(args.join_at)
            dirs[2].mkdir(exist_ok=True)
            rest = max(60.0, args.duration - (time.monotonic() - trained) - args.startup)
            joined_at = time.time()
            late = procs.start(om.node_argv(maddr, NAMES[2], dirs[2], 2, rest, values, "big-model"),
                               dirs[2] / "node.log")
            sampler.watch(NAMES[2], late.pid)
            c.wait_all([*first, late], args.duration + 1200, "the nodes")
        finally:
            sampler.stop()
        for name, d, p in zip(NAMES, dirs, [*first, late]):
            if p.returncode != 0 or not (d / "report.json").exists():
                raise RuntimeError(f"{name} exited {p.returncode}; see {d / 'node.log'}")
    return {"reports": {n: c.read_json(d / "report.json") for n, d in zip(NAMES, dirs)}, "newcomer_started": joined_at,
            "rss_sampled_peak_mib": sampler.peak, "p2pd_sampled_peak_mib": sampler.p2pd_peak,
            "rss_samples": sampler.samples, **om.journals(work, joined_at, frags)}


def memory_rows(data: dict) -> tuple[list[dict], bool]:
    """Per node: the estimate shown at start, the peak resident memory (the larger of the
    sampled one and the node's own peak (VmHWM)), their ratio and the 8x-fp32 + 1 GiB bound."""
    bound = 8 * 4 * data["parameters"] / MIB + 1024
    rows, ok = [], True
    for n in NAMES:
        hw = data["reports"][n]["hardware"]
        est = hw["memory_estimate"]["total_mib"]
        peak = max(data["rss_sampled_peak_mib"].get(n, 0.0), hw.get("peak_rss_mib") or 0.0)
        ratio = peak / est
        met = 1 / 1.5 <= ratio <= 1.5 and peak < bound
        ok &= met
        sampled = round(data["rss_sampled_peak_mib"].get(n, 0.0))
        rows.append({"node": n, "estimate_mib": est, "sampled_peak_mib": sampled,
                     "own_peak_mib": hw.get("peak_rss_mib"), "peak_mib": round(peak), "ratio": round(ratio, 3),
                     "bound_mib": round(bound), "p2pd_peak_mib": round(data["p2pd_sampled_peak_mib"].get(n, 0.0)),
                     "parts": hw["memory_estimate"], "met": met})
    return rows, ok


def write(args: dict, m: dict, seconds: float, data: dict) -> tuple[Path, bool]:
    """docs/benchmarks/big_model.md and .json from one run's figures; whether every goal was met."""
    frags, reports, download = data["fragments"], [data["reports"][n] for n in NAMES], data["newcomer"]
    mem, mem_ok = memory_rows(data)
    data["memory"] = mem
    equal = len({r["global_digest"] for r in reports}) == 1
    falls = all(r["end_loss"] < r["start_loss"] for r in reports)
    full = download["fragments"] == list(range(len(frags)))
    checkpoints = [r["checkpoint"] for r in reports]
    doc = c.Doc("big_model", "A 100M+ parameter transformers model through the full protocol, memory measured",
                f"flock /tmp/p2p.lock python -m bench.big_model --duration {args['duration']:g} --join-at "
                f"{args['join_at']:g} --n-layer {args['n_layer']} --n-embd {args['n_embd']}",
                intro=[" ".join(__doc__.split("\n\n")[2].split())])
    doc.text(f"Model: `{FACTORY}`, {data['parameters'] / 1e6:.1f}M parameters (n_layer {args['n_layer']}, n_embd "
             f"{args['n_embd']}, n_head {args['n_head']}, vocab 256 bytes, block {args['block']}); {args['fragments']} "
             f"fragments of {min(f['parameters'] for f in frags) / 1e6:.1f}M to "
             f"{max(f['parameters'] for f in frags) / 1e6:.1f}M "
             f"parameters, H = {args['sync_every']}, {args['batch']} x {args['block']} tokens per inner step, wire "
             f"precision fp32, one torch thread per node, checkpoint_every {args['checkpoint_every']:g} s.")
    doc.table(["node", "inner steps", "held-out loss, first evaluation", "held-out loss, final global model",
               "rounds committed", "rounds with peers", "catch-ups", "checkpoints", "checkpoint stall, last / max (s)",
               "final global digest"],
              [[n, r.get("step", "n/a"), c.fmt(r["start_loss"]), c.fmt(r["end_loss"]), r["rounds_committed"],
                r["rounds_with_peers"], r["catchups"], r["checkpoint"]["count"],
                f"{r['checkpoint']['last_s']} / {r['checkpoint']['max_s']}", r["global_digest"]]
               for n, r in zip(NAMES, reports)],
              f"node0 and node1 train {args['duration']:g} s; the newcomer starts {args['join_at']:g} s after they "
              "began training. Loss in nats per byte (bytes are the tokens). A checkpoint serializes the live "
              "tensors in the training thread between two steps (no copy: it adds no memory); training waits for "
              "the write, at most 5% of the time (node/training.py, CHECKPOINT_COST).")
    doc.table(["node", "estimate shown at start (MiB)", "peak RSS, sampled (MiB)", "peak RSS, its own (MiB)",
               "peak / estimate", "8 x fp32 + 1 GiB (MiB)", "p2pd peak (MiB)", "met"],
              [[r["node"], r["estimate_mib"], r["sampled_peak_mib"], r["own_peak_mib"], f"{r['ratio']:.2f}",
                r["bound_mib"], r["p2pd_peak_mib"], c.verdict(r["met"])] for r in mem],
              f"Resident memory of each node's Python process, sampled every {args['sample_every']:g} s "
              f"({data['rss_samples']} samples) and its own peak (``VmHWM``, p2pdiloco.footprint.peak_rss_mib); the p2pd daemon is a process "
              "of its own, shown apart. The estimate's parts (MiB) on node0: " + ", ".join(
                  f"{k.removesuffix('_mib')} {v}" for k, v in mem[0]["parts"].items() if k != "parameters") + ".")
    doc.text(f"The newcomer's download at joining (its journal): fragments {download['fragments']} at versions "
             f"{download['versions']}, {download['bytes'] / 1e6:.0f} MB of state (Θ and momentum), the first "
             f"installed {download['first_s']} s and the last {download['last_s']} s after its process started; "
             f"{download['download_failed']} failed download attempt(s).")
    doc.text(f"Held-out loss falls on every node: {c.verdict(falls)}. Equal final global digests: {c.verdict(equal)}. "
             f"The newcomer downloaded the full state: {c.verdict(full)}. Checkpoints written on every node: "
             f"{c.verdict(all(ck['count'] > 0 for ck in checkpoints))}. Peak memory within 1.5x of the estimate and "
             f"under 8 x fp32 + 1 GiB on every node: {c.verdict(mem_ok)}.")
    path = doc.write(m, seconds, {"args": args, "seconds": seconds, **data})
    return path, equal and falls and full and mem_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=660.0, help="seconds of training of the first two nodes")
    parser.add_argument("--join-at", type=float, default=200.0,
                        help="seconds after the first two train when the third starts (it trains until they stop)")
    parser.add_argument("--startup", type=float, default=60.0,
                        help="seconds the newcomer is expected to take from its start to training (its download)")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--fragments", type=int, default=16)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=120.0)
    parser.add_argument("--sample-every", type=float, default=0.5, help="seconds between RSS samples")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the logs here")
    args = parser.parse_args()
    c.install_signal_handlers()
    values = settings(args)
    params, frags = om.fragment_sizes(values)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="big-model-"))
    work.mkdir(parents=True, exist_ok=True)
    m, t0 = c.machine(), time.monotonic()
    data = {"settings": values, "parameters": params, "fragments": frags, **run(args, values, frags, work)}
    kept = {k: v for k, v in vars(args).items() if k != "workdir"}
    path, ok = write(kept, m, time.monotonic() - t0, data)
    print(path.read_text())
    print(f"logs: {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
