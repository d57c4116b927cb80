"""One tuning protocol for every system, in the in-process replica (``bench.partial_rounds``).

Every system trains the same model on the same data for the same tokens, and gets the same
number of trials over its own knobs on the tuning seeds; its best setting there (lowest mean
held-out loss) is then run on the reporting seeds, which no choice saw. Systems:

* ``ddp``: data parallelism as one learner whose inner step takes the L learners' batches
  at once (the gradient DDP averages over L workers is that of their concatenated batch);
  knob: the inner learning rate.
* ``diloco``: synchronous DiLoCo (arXiv 2311.08105): every H inner steps the L learners'
  pseudo-gradients are averaged (the plain mean, as ``bench/workers.py``'s all-reduce) and one
  Nesterov outer step applied (``nesterov_outer_step``); knobs: outer lr x outer momentum x
  inner lr.
* ``p2p-int4``: p2pdiloco's rounds as the nodes run them (``Replica.node_round``): each Δ plus
  its error-feedback residual through the ``int4`` wire codec, the reducers' robust merge
  (``assign_parts``, each its own Δ as the reference), the merged fragment through the codec
  and ``core.outer.apply_round``; knobs: as ``diloco``.

Held-out loss (nats per byte) of the final global state, on the same held-out batches for
every system (those of learner 0's setup of the L-learner runs).

Usage: python -m bench.tuning [--tune-seeds 10] [--seeds 1 2 3] [--steps 2000] [--sync-every 20]
Writes docs/benchmarks/tuning.{md,json}.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import json
import time
from typing import Any

import torch

from bench.common import DOCS, Doc, fmt, params, replica_main
from bench.partial_rounds import MODEL, Replica
from p2pdiloco.core.outer import nesterov_outer_step
from p2pdiloco.data import evaluate

LEARNERS = 2
# The grids: the same number of trials for every system, each over its own knobs.
GRIDS: dict[str, list[dict[str, float]]] = {
    "ddp": [{"inner_lr": lr} for lr in (1e-3, 1.5e-3, 2e-3, 3e-3, 4.5e-3, 6e-3, 9e-3, 1.2e-2)],
    **{system: [{"outer_lr": lr, "momentum": mu, "inner_lr": ilr}
                for lr, mu, ilr in itertools.product((0.7, 1.0), (0.5, 0.9), (3e-3, 6e-3))]
       for system in ("diloco", "p2p-int4")},
}


def run(system: str, seed: int, steps: int, sync_every: int, knobs: dict[str, float]) -> dict[str, Any]:
    """One trial: ``system`` with ``knobs`` (a GRIDS entry) for ``steps`` inner steps per learner."""
    torch.set_num_threads(1)
    over = {"inner.lr": f"{knobs['inner_lr']:g}"}
    if system != "ddp":
        over.update({"outer.lr": f"{knobs['outer_lr']:g}", "outer.momentum": f"{knobs['momentum']:g}"})
    t0 = time.monotonic()
    if system == "ddp":
        rep = Replica(1, seed, steps, sync_every, over)
        ln, sampler = rep.setups[0].learner, rep.setups[0].sampler
        for _ in range(steps):
            batches = [sampler.next() for _ in range(LEARNERS)]
            ln.inner_step(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        model = rep.setups[0].model
    else:
        rep = Replica(LEARNERS, seed, steps, sync_every, over, codec="int4" if system == "p2p-int4" else "fp32")
        for t in range(1, steps + 1):
            rep.step()
            if t % sync_every == 0:
                if system == "diloco":
                    deltas = [s.learner.pseudo_gradient(0) for s in rep.setups]
                    new = nesterov_outer_step(rep.global_state, [sum(ts) / len(ts) for ts in zip(*deltas)],
                                              rep.out.lr, rep.out.momentum)
                    for s in rep.setups:
                        s.learner.install(new)
                else:
                    rep.node_round(list(range(LEARNERS)))
        model = rep.setups[0].global_model([rep.global_state])
    ref = Replica(LEARNERS, seed, steps, sync_every).setups[0] if system == "ddp" else rep.setups[0]
    out = {"system": system, "seed": seed, **knobs, "heldout": evaluate(model, ref.heldout),
           "seconds": time.monotonic() - t0}
    print(f"{system:9s} seed={seed} {knobs} held-out {out['heldout']:.4f} ({out['seconds']:.0f} s)", flush=True)
    return out


def key(knobs: dict[str, Any]) -> tuple:
    return tuple(knobs.get(k) for k in ("outer_lr", "momentum", "inner_lr"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="+", default=list(GRIDS), choices=list(GRIDS))
    ap.add_argument("--tune-seeds", type=int, nargs="+", default=[10])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="reporting seeds")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--phase", choices=["tune", "report"], default="tune",
                    help="tune: the grids on the tuning seeds (writes tuning_grid.json); report: each system's "
                         "best setting from tuning_grid.json on the reporting seeds (writes tuning.{md,json})")
    replica_main(ap, run, make_runs, report)


def best(grid: list[dict[str, Any]], system: str) -> dict[str, float]:
    """The knobs of ``system``'s lowest mean held-out loss over the tuning seeds in ``grid``."""
    trials: dict[tuple, list[dict[str, Any]]] = {}
    for r in grid:
        if r["system"] == system:
            trials.setdefault(key(r), []).append(r)
    chosen = min(trials.values(), key=lambda rs: statistics.mean(r["heldout"] for r in rs))
    return {k: chosen[0][k] for k in GRIDS[system][0]}


def grid_file() -> dict[str, Any]:
    """What ``--phase tune`` wrote: docs/benchmarks/tuning_grid.json."""
    return json.loads((DOCS / "tuning_grid.json").read_text())


def make_runs(a: argparse.Namespace) -> list[tuple]:
    if a.phase == "tune":
        return [(s, seed, a.steps, a.sync_every, k) for s in a.systems for seed in a.tune_seeds for k in GRIDS[s]]
    grid = grid_file()["results"]
    return [(s, seed, a.steps, a.sync_every, best(grid, s)) for s in a.systems for seed in a.seeds]


def report(results: list[dict[str, Any]], a: argparse.Namespace, m: dict[str, Any], seconds: float) -> None:
    setup = {"learners": LEARNERS, "steps": a.steps, "sync_every": a.sync_every, "outer_steps": a.steps // a.sync_every,
             "model": {"parameters": params({k: v for k, v in MODEL.items() if k.startswith("model.")}),
                       "layers": int(MODEL["model.n_layer"]), "width": int(MODEL["model.n_embd"]),
                       "batch": f"{MODEL['data.batch_size']} x {MODEL['model.block_size']} tokens per learner step"}}
    if a.phase == "tune":
        (DOCS / "tuning_grid.json").write_text(json.dumps({"machine": m, "seconds": seconds, "setup": setup,
                                                            "tune_seeds": a.tune_seeds, "results": results}, indent=1))
        for s in a.systems:
            print(f"{s}: best {best(results, s)}", flush=True)
        return
    grid = grid_file()
    cmd = (f"python -m bench.tuning --phase tune --tune-seeds {' '.join(map(str, grid['tune_seeds']))} "
           f"--steps {a.steps} --sync-every {a.sync_every}; python -m bench.tuning --phase report "
           f"--seeds {' '.join(map(str, a.seeds))} --steps {a.steps} --sync-every {a.sync_every}")
    doc = Doc("tuning", "One tuning protocol for every system (in-process replica)", cmd)
    paragraphs = __doc__.split("\n\n")
    doc.intro = [paragraphs[1], "", paragraphs[2].replace("* ", "- "), "", paragraphs[3], "",
                 f"{LEARNERS} learners (DDP: one learner taking both batches), model {MODEL['model.n_layer']} layer x "
                 f"{MODEL['model.n_embd']} wide ({setup['model']['parameters']:,} parameters), {a.steps} inner steps per "
                 f"learner, H = "
                 f"{a.sync_every} ({a.steps // a.sync_every} outer steps of the one fragment), inner warm-up "
                 f"{a.steps // 20} steps then cosine; tuning seeds {grid['tune_seeds']} ({len(GRIDS['ddp'])} trials "
                 f"per system), reporting seeds {a.seeds}. Tuning took {grid['seconds'] / 60:.1f} minutes on "
                 f"commit {grid['machine'].get('commit', '?')}."]
    rows = []
    for s in a.systems:
        for k in GRIDS[s]:
            vals = [r["heldout"] for r in grid["results"] if r["system"] == s and key(r) == key(k)]
            rows.append([s, *(f"{k[x]:g}" if x in k else "" for x in ("outer_lr", "momentum", "inner_lr")),
                         fmt(statistics.mean(vals), 4), "**chosen**" if key(k) == key(best(grid["results"], s)) else ""])
    doc.table(["system", "outer lr", "outer momentum", "inner lr", "held-out (tuning seeds)", ""], rows,
              "The grid, on the tuning seeds (not reported below)")
    edges = []
    for s in a.systems:
        chosen = best(grid["results"], s)
        at = [k for k, v in chosen.items() if len({g[k] for g in GRIDS[s]}) > 1
              and v in (min(g[k] for g in GRIDS[s]), max(g[k] for g in GRIDS[s]))]
        if at:
            edges.append(f"{s} ({', '.join(at)})")
    if edges:
        doc.text("Chosen at the edge of its grid, so a wider grid may find a better setting: " + "; ".join(edges) + ".")
    by = {s: [r for r in results if r["system"] == s] for s in a.systems}
    ddp = {r["seed"]: r["heldout"] for r in by.get("ddp", [])}
    dil = {r["seed"]: r["heldout"] for r in by.get("diloco", [])}
    rows = []
    for s in a.systems:
        rs = by[s]
        vals = [r["heldout"] for r in rs]

        def rel(ref: dict[int, float]) -> str:
            xs = [r["heldout"] / ref[r["seed"]] - 1 for r in rs if r["seed"] in ref]
            return f"{statistics.mean(xs):+.2%} ({', '.join(f'{x:+.2%}' for x in xs)})" if xs else ""

        rows.append([s, ", ".join(f"{k} {v:g}" for k, v in best(grid["results"], s).items()),
                     fmt(statistics.mean(vals), 4), fmt(statistics.stdev(vals), 4) if len(vals) > 1 else "",
                     rel(ddp) if s != "ddp" else "", rel(dil) if s == "p2p-int4" else ""])
    doc.table(["system", "chosen setting", "held-out (mean)", "sd", "vs DDP (mean; per seed)",
               "vs sync DiLoCo (mean; per seed)"], rows, f"Each system at its chosen setting, reporting seeds {a.seeds}")
    path = doc.write(m, seconds, {"setup": setup, "grid": grid["results"], "tune_seeds": grid["tune_seeds"],
                                  "seeds": a.seeds, "results": results, "seconds": seconds})
    print(path.read_text())


if __name__ == "__main__":
    main()
