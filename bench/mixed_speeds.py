"""Mixed speeds: what the robust merge's norm bound costs honest learners of different speeds,
in an in-process replica of the swarm's outer-step math (no network; ``bench.partial_rounds``).

L learners, the first half fast and the second half ``--ratio`` times slower: a fast learner
takes an inner step every tick, a slow one every ``ratio``-th. Whenever the fast learners have
H inner steps of progress since their last install, all L merge in one group, as in a swarm
where a fast learner's gathering pulls the slow ones in early (the schedule's early pull,
``core.fragments.StaggeredSchedule.due``): the slow ones bring H / ratio steps. The merge is
the reducers' ``core.robust.robust_merge`` with the token weights, then the fractional outer
step (``round_fraction``), as ``Node._round`` does; a slow learner's place in the learning-rate
schedule is kept at the swarm's (``Node._keep_schedule``). Merge rules:

* ``off``: no norm bound (``trust.outliers = off``): the plain token-weighted merge, the reference;
* ``clip``: the default, ``trust.outliers = clip`` with ``outlier_factor`` 1.25, as the
  reducers run it: each tensor merged by its reducer (``assign_parts``) with its own Δ as the
  reference (docs/trust.md §5): weights capped at the median and a tensor whose norm is over
  1.25 × the median norm scaled down to that bound (each median between the lower and the
  upper one, picked by the reducer's own), each other member weighed by its alignment with the
  reducer's Δ. With two members the reducer's own weight and norm set the bounds, so the
  faster learner's honest Δ is cut in the tensors the slower one reduces.

Reported: held-out loss of the final global state (nats per byte), and the share of
(member, tensor) pairs the bound clipped, all of them honest.

Usage: python -m bench.mixed_speeds [--learners 2 4] [--seeds 0 1 2] [--steps 2000] [--ratio 2]
Writes docs/benchmarks/mixed_speeds.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.common import Doc, fmt, replica_main
from bench.partial_rounds import Replica

from p2pdiloco.core.fragments import assign_parts
from p2pdiloco.core.merge import contribution_weight
from p2pdiloco.core.outer import nesterov_outer_step
from p2pdiloco.core.periods import round_fraction, span_fraction
from p2pdiloco.core.robust import robust_merge

RULES = ("off", "clip")


class MixedReplica(Replica):
    """A ``Replica`` whose learners ``fast`` step every tick and the others every ``ratio``-th."""

    def __init__(self, learners: int, seed: int, steps: int, sync_every: int, ratio: int):
        super().__init__(learners, seed, steps, sync_every)
        self.fast, self.ratio = learners // 2, ratio
        self.clipped = self.pairs = 0

    def tick(self, t: int) -> None:
        for i, s in enumerate(self.setups):
            if i < self.fast or t % self.ratio == 0:
                s.learner.inner_step(*s.sampler.next())

    def merge_round(self, rule: str) -> None:
        """All learners merge on the newest state, each installs the result (``Node._round``)."""
        anchor = self.global_state
        learners = [s.learner for s in self.setups]
        deltas = [ln.pseudo_gradient(0) for ln in learners]
        counters = [(*ln.counters(0), ln.span(0)) for ln in learners]
        weights = [contribution_weight(t, s) for t, s, _ in counters]
        merged: dict[int, torch.Tensor] = {}
        slots = self.setups[0].fragments[0].slots
        for r, part in enumerate(assign_parts([s.numel for s in slots], len(learners))):  # reducer r: own = r
            if part:
                out = robust_merge([[d[i] for i in part] for d in deltas], weights, [self.mask[i] for i in part],
                                   policy=rule, own=r)
                merged.update(zip(part, out.merged))
                self.clipped += len(out.clipped)
        self.pairs += len(deltas) * len(self.mask)
        position = sorted(ln.step for ln in learners)[(len(learners) - 1) // 2]
        f, ledger = round_fraction(anchor.ledger, sum(t for t, _, _ in counters), position, self.H,
                                   span_fraction(counters, self.H))
        new = nesterov_outer_step(anchor, [merged[i] for i in range(len(slots))], self.out.lr, self.out.momentum, f, ledger)
        for ln in learners:  # and the schedule's place at least the swarm's (Node._keep_schedule)
            ln.install(new)
            ln.step = max(ln.step, new.ledger.period_start)


def run(learners: int, seed: int, steps: int, sync_every: int, ratio: int, rule: str) -> dict[str, Any]:
    rep = MixedReplica(learners, seed, steps, sync_every, ratio)
    t0 = time.monotonic()
    for t in range(1, steps + 1):
        rep.tick(t)
        if t % sync_every == 0:
            rep.merge_round(rule)
    out = {"learners": learners, "seed": seed, "rule": rule, "ratio": ratio, "heldout": rep.heldout(),
           "clipped": rep.clipped, "pairs": rep.pairs, "seconds": time.monotonic() - t0}
    print(f"L={learners} seed={seed} {rule:8s} held-out {out['heldout']:.4f} clipped {rep.clipped}/{rep.pairs} "
          f"({out['seconds']:.0f} s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=2000, help="inner steps of a fast learner")
    ap.add_argument("--sync-every", type=int, default=100)
    ap.add_argument("--ratio", type=int, default=2, help="a slow learner takes one step per RATIO ticks")
    replica_main(ap, run, lambda a: [(L, seed, a.steps, a.sync_every, a.ratio, rule) for L in a.learners
                                     for seed in a.seeds for rule in RULES], report)


def report(results: list[dict[str, Any]], a: argparse.Namespace, m: dict[str, Any], seconds: float) -> None:
    doc = Doc("mixed_speeds", "Mixed speeds: what the norm bound costs honest learners of different speeds",
              "python -m bench.mixed_speeds " + " ".join(
                  [f"--learners {' '.join(map(str, a.learners))}", f"--seeds {' '.join(map(str, a.seeds))}",
                   f"--steps {a.steps}", f"--sync-every {a.sync_every}", f"--ratio {a.ratio}"]))
    paragraphs = __doc__.split("\n\n")
    doc.intro = [paragraphs[1], "", paragraphs[2].replace("* ", "- "), "", paragraphs[3], "",
                 f"{a.steps} inner steps per fast learner ({a.steps // a.ratio} per slow one), H = {a.sync_every}, "
                 f"outer lr 0.7, momentum 0.9, one fragment; seeds {a.seeds}; mean over seeds, and the relative "
                 "change against `off` of the same seeds."]
    rows = []
    for L in a.learners:
        base = {r["seed"]: r["heldout"] for r in results if r["learners"] == L and r["rule"] == "off"}
        for rule in RULES:
            rs = [r for r in results if r["learners"] == L and r["rule"] == rule]
            rel = [r["heldout"] / base[r["seed"]] - 1 for r in rs]
            rows.append([L, rule, fmt(statistics.mean(r["heldout"] for r in rs), 4),
                         f"{statistics.mean(rel):+.2%}" if rule != "off" else "",
                         f"{max(rel):+.2%}" if rule != "off" else "",
                         f"{sum(r['clipped'] for r in rs) / sum(r['pairs'] for r in rs):.1%}"])
    doc.table(["learners", "merge rule", "held-out (mean)", "vs off (mean)", "vs off (worst seed)",
               "(member, tensor) pairs clipped"], rows, "Held-out loss at the end, and honest tensors clipped")
    path = doc.write(m, seconds, {"results": results, "seconds": seconds})
    print(path.read_text())


if __name__ == "__main__":
    main()
