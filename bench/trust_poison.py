"""Robust merging under attack: 4 nodes, one (or two colluding) poisoning every round, against 4 honest nodes.

    python -m bench.trust_poison                         # clean, then scale, flip, nan, mix (about 30 min on 2 cores)
    python -m bench.trust_poison --attacks mix --steps 300
    python -m bench.trust_poison --attacks flip --attackers 2 --steps 300   # two colluders of four
    python -m bench.trust_poison --attacks flip leave --attackers 2 --steps 1500 --honest-first 300  # trusted first

Each run is a bootstrap peer and 4 node processes on 127.0.0.1 with the demo's settings
(p2pdiloco/presets.py DEMO; one data shard per node), every node stopping after ``--steps``
inner steps. Node i keeps the same identity (so the same peer ID and batch order) in every
run, so runs differ only in the attack and in timing (who merges with whom); ``--clean-runs``
repeats the clean run to show that spread. The attacker is stopped when the honest nodes are
done (its own model may have diverged). In an attacked run node 3 (nodes 2 and 3 with
``--attackers 2``) sends, properly signed, poisoned
pseudo-gradients (``python -m p2pdiloco.chaos.inject --poison KIND``): ``scale`` x1000 every round,
``flip`` x-1 every round, ``nan`` a NaN in every tensor every round, ``mix`` the three in turn;
``leave`` is no attack: the same nodes stop after ``--honest-first`` seconds, the run that loses
their compute as an attack shut out at once would (the best a defence can do). The result is the final held-out loss of the
global model (nats/byte, the same held-out bytes on every node), averaged over the three honest
nodes, against the clean run's, and the reducers' rejections, clipped and left-out tensors from
the honest nodes' reports.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench import common as c
from p2pdiloco.procs import Processes
from p2pdiloco.presets import DEMO as DEMO_SETTINGS
from p2pdiloco.trust.identity import Identity

NODES = 4


def run(work: Path, ids: Path, steps: int, poison: str, seed: int, extra: dict[str, str] | None = None,
        attackers: int = 1, honest_first: float = 0.0) -> dict:
    """One swarm run, the last ``attackers`` nodes poisoning (colluding: the same attack); returns
    the honest nodes' end losses and the rejections seen."""
    work.mkdir(parents=True, exist_ok=True)
    children = Processes(parent_death=signal.SIGTERM)
    py = sys.executable
    try:
        maddr = children.start_bootstrap(work)
        procs = []
        for i in range(NODES):
            d = work / f"node{i}"
            d.mkdir(exist_ok=True)
            settings = {**DEMO_SETTINGS, "data.num_shards": str(NODES), "data.shard_index": str(i), "seed": str(seed),
                        "settle": "20", "trust.identity": str(ids / f"node{i}.key"), **(extra or {})}
            # the attacker: the ordinary node with its outgoing pseudo-gradients poisoned (p2pdiloco.chaos.inject)
            attacker = bool(poison) and i >= NODES - attackers
            entry = ["-m", "p2pdiloco.chaos.inject", "--poison", poison, "--poison-after", str(honest_first), "--",
                     "node"] if attacker and poison != "leave" else ["-m", "node"]
            if attacker and poison == "leave":  # the reference: the same compute lost, without an attack
                entry += ["run", "--duration", str(honest_first)]
            else:
                entry += ["run"]
            argv = [py, *entry, "--initial-peers", maddr, "--host", "127.0.0.1", "--port", "0",
                    "--name", f"node{i}", "--data-dir", str(d), "--max-steps", str(steps),
                    "--report-file", str(d / "report.json"), "--run-id", "poison"]
            for k, v in settings.items():
                argv += ["--set", f"{k}={v}"]
            procs.append((children.start(argv, d / "node.log"), d))
        honest = [i for i in range(NODES) if not (poison and i >= NODES - attackers)]
        for i in honest:
            procs[i][0].wait()
        reports = {i: json.loads((d / "report.json").read_text()) for i, (_, d) in enumerate(procs)
                   if (d / "report.json").exists()}
        missing = [i for i in honest if i not in reports]
        if missing:
            raise RuntimeError(f"honest nodes {missing} wrote no report; see {work}")
        rejected: Counter[str] = Counter()
        for i in honest:  # the reports' counters (status JSON), not the logs' wording
            rejected.update(reports[i].get("rejected", {}))
            ar = reports[i].get("allreduce", {})
            rejected["clipped tensors"] += ar.get("clipped", 0)
            rejected["misaligned tensors"] += ar.get("misaligned", 0)
        return {"end_loss": statistics.mean(reports[i]["end_loss"] for i in honest),
                "start_loss": statistics.mean(reports[i]["start_loss"] for i in honest),
                "digests": sorted({reports[i]["global_digest"] for i in honest}),
                "rounds": statistics.mean(reports[i]["rounds_committed"] for i in honest),
                "rejected": {k: v for k, v in rejected.items() if v}}
    finally:
        children.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="inner steps per node (default 400)")
    parser.add_argument("--attacks", nargs="+", default=["scale", "flip", "nan", "mix"],
                        choices=["scale", "flip", "nan", "mix", "leave"],
                        help="leave: the attackers stop (gracefully) after --honest-first seconds instead, "
                             "the run that loses the same compute without an attack")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attackers", type=int, default=1, choices=[1, 2],
                        help="nodes that poison, colluding with the same attack (default 1 of 4)")
    parser.add_argument("--honest-first", type=float, default=0.0, metavar="S",
                        help="the attackers work honestly for S seconds first, earning trust (default 0: fresh)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs' logs here")
    parser.add_argument("--clean-runs", type=int, default=1, help="clean runs, to see the run-to-run spread (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a setting for every node of every run, e.g. --set trust.outlier_factor=4")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="trust-poison-"))
    extra = dict(item.split("=", 1) for item in args.set)
    c.install_signal_handlers()
    ids = work / "identities"
    for i in range(NODES):
        Identity.load_or_create(ids / f"node{i}.key")
    results = {}
    runs = [("clean" if i == 0 else f"clean{i + 1}", "") for i in range(args.clean_runs)] + [(a, a) for a in args.attacks]
    for name, attack in runs:
        t0 = time.monotonic()
        results[name] = res = run(work / name, ids, args.steps, attack, args.seed, extra,
                                  args.attackers if attack else 1, args.honest_first)
        res["seconds"] = round(time.monotonic() - t0)
        print(f"{name:>6}: held-out loss {res['start_loss']:.4f} -> {res['end_loss']:.4f} nats/byte, "
              f"{res['rounds']:.0f} rounds per honest node, rejected {res['rejected']}, {res['seconds']} s",
              flush=True)
    clean = results["clean"]["end_loss"]
    print(f"\n{NODES} nodes, demo settings{''.join(f', {k}={v}' for k, v in extra.items())}, {args.steps} inner steps "
          f"per node; the last {args.attackers} node(s) poison every round"
          f"{f' after {args.honest_first:.0f} s of honest work' if args.honest_first else ''}")
    left = results.get("leave", {}).get("end_loss")  # the same compute lost without an attack
    print("| run | final held-out loss (honest nodes) | vs clean |" + (" vs leave |" if left else "")
          + " rejected, clipped, left out by the honest reducers |")
    print("|---|---|---|" + ("---|" if left else "") + "---|")
    for name, res in results.items():
        print(f"| {name} | {res['end_loss']:.4f} | {100 * (res['end_loss'] / clean - 1):+.2f} % | "
              + (f"{100 * (res['end_loss'] / left - 1):+.2f} % | " if left else "")
              + f"{', '.join(f'{k} {v}' for k, v in sorted(res['rejected'].items())) or '-'} |")
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
