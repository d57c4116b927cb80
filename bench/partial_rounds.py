"""Partial rounds: an in-process replica of the swarm's outer-step math (no network).

L learners (the project's own ``Learner``, model and data, each on its own data shard) train
in lock-step; every H inner steps each one sends its pseudo-gradient of the model's one
fragment. How the swarm groups those contributions is the scenario:

* ``merged``: every period, all learners merge in one group (the reference);
* ``split``: one period in three, the learners merge one after the other, each alone
  (the first on the anchor, each next one after following the previous result with its
  progress rebased on top, as a node that follows a newer head does), the others all together;
* ``alone``: every period merges one learner at a time;
* ``flush``: ``merged``, then one learner takes one more inner step and merges it alone (the
  end-of-budget flush): the change of held-out loss that near-empty round causes.

After each period every learner follows the newest state (rebased), as the catch-up loop
does. Each scenario runs under two outer-step rules: ``full`` (every round is one DiLoCo
Nesterov step, the rule before partial rounds were weighted) and ``fraction`` (the round
applies the step for its fraction of a period: ``p2pdiloco.core.periods.round_fraction`` from
the fragment state's ledger and the round's tokens and schedule position, with
``span_fraction`` in the first period). The merge is ``merge_pseudo_gradients`` with the
token weights, the outer step ``nesterov_outer_step``: the code the nodes run.

``--straggler``: 2 learners merged as the nodes merge (``Replica.node_round``: the reducers'
``robust_merge``, each tensor by its reducer with its own Δ as the reference, then
``apply_round``), ``merged`` every period or with the second learner skipping every third
period (the first merges alone, the second follows with its progress rebased and brings two
periods of it to the next round), under the outer rules of ``--rules`` (OUTER_RULES: the
nodes' default, Delayed Nesterov's period carry, CGAD's age gate on each Δ).

Usage: python -m bench.partial_rounds [--learners 2 4] [--seeds 0 1 2] [--steps 2000]
       python -m bench.partial_rounds --straggler [--seeds 0 1 2] [--steps 1000] [--rules fraction ...]
Writes docs/benchmarks/partial_rounds.{md,json} (--straggler: partial_rounds_straggler.{md,json}).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.common import Doc, fmt, params, replica_main, verdict
from node.setup import Setup
from p2pdiloco.config import load_config
from p2pdiloco.core.fragments import assign_parts
from p2pdiloco.core.merge import age_gate, contribution_weight, merge_pseudo_gradients
from p2pdiloco.core.outer import FragmentState, apply_round, nesterov_outer_step, with_error_feedback
from p2pdiloco.core.periods import round_fraction, span_fraction
from p2pdiloco.core.robust import robust_merge
from p2pdiloco.data import evaluate
from p2pdiloco.net.codecs import wire

# A small model, so that 3 seeds x 2000 steps x 6 learners x 5 runs fit on one CPU core in
# about half an hour: 1 layer, 64 wide (70k parameters), 8 x 64 tokens per inner step.
MODEL = {"model.n_layer": "1", "model.n_embd": "64", "model.n_head": "2", "model.block_size": "64",
         "data.batch_size": "8", "data.max_bytes": "1000000", "data.eval_batches": "16", "threads": "1",
         "inner.lr": "3e-3", "outer.lr": "0.7", "outer.momentum": "0.9", "outer.fragments": "1"}
SCENARIOS = ("merged", "split", "alone")
RULES = ("full", "fraction")
# --straggler: the outer-step rules compared, as keyword arguments of core.outer.apply_round
# ("merge": "plain" merges with the token weights alone, merge_pseudo_gradients, not as the reducers do)
# ("age_gate": (alpha, cutoff): each Δ scaled by core.merge.age_gate(span - 1, alpha, cutoff) first)
OUTER_RULES: dict[str, dict[str, Any]] = {"fraction": {}, "plain-merge": {"merge": "plain"},
                                          "age-gate": {"age_gate": (0.5, 8)}, "period-carry": {"carry": "period"}}
SKIP_EVERY = 3  # --straggler: the last learner skips every third period's round


class Replica:
    """L learners on one fragment; ``step()`` runs one inner step on each."""

    def __init__(self, learners: int, seed: int, steps: int, sync_every: int, over: dict[str, str] | None = None,
                 codec: str = "fp32"):
        """``over``: settings over MODEL's (e.g. ``{"inner.lr": "6e-3"}``); ``codec``: the wire
        codec of ``node_round``'s contributions and merge (``net.codecs.wire``; ``fp32``: none)."""
        common = {**MODEL, "seed": str(seed), "data.num_shards": str(learners), "outer.sync_every": str(sync_every),
                  "inner.warmup_steps": str(steps // 20), "inner.total_steps": str(steps), **(over or {})}
        self.setups = [Setup.build(load_config(overrides={**common, "data.shard_index": str(i)}),
                                   f"l{i}", f"replica-{seed}-{i}") for i in range(learners)]
        self.H, self.out = sync_every, self.setups[0].cfg.outer
        self.mask = [s.is_embedding for s in self.setups[0].fragments[0].slots]
        self.fractions: list[float] = []
        self.codec, self.residual = codec, [None] * learners  # error feedback: what the codec left out (per learner)

    @property
    def global_state(self) -> FragmentState:
        return max((s.learner.global_states[0] for s in self.setups), key=lambda st: st.version)

    def step(self) -> None:
        for s in self.setups:
            s.learner.inner_step(*s.sampler.next())

    def _round(self, members: list[int], rule: str) -> None:
        """One round of ``members`` on the newest state; every member installs the result."""
        anchor = self.global_state
        for i in members:  # follow the newest state first, progress rebased (as _follow does)
            if self.setups[i].learner.global_states[0].digest != anchor.digest:
                self.setups[i].learner.install(anchor, rebase=True)
        learners = [self.setups[i].learner for i in members]
        deltas = [ln.pseudo_gradient(0) for ln in learners]
        counters = [(*ln.counters(0), ln.span(0)) for ln in learners]
        merged = merge_pseudo_gradients(deltas, [contribution_weight(t, s) for t, s, _ in counters], self.mask)
        f, ledger = 1.0, anchor.ledger
        if rule == "fraction":  # what the node does: node/rounds.py, Node._round
            position = sorted(ln.step for ln in learners)[(len(learners) - 1) // 2]  # lower median, as reducers state
            f, ledger = round_fraction(anchor.ledger, sum(t for t, _, _ in counters), position,
                                       self.H, span_fraction(counters, self.H))
        self.fractions.append(f)
        new = nesterov_outer_step(anchor, merged, self.out.lr, self.out.momentum, f, ledger)
        for ln in learners:
            ln.install(new)

    def node_round(self, members: list[int], rule: str = "fraction") -> None:
        """One round of ``members`` as the nodes run it: each follows the newest state first
        (progress rebased), the reducers' ``robust_merge`` (each tensor by its reducer,
        ``assign_parts``, with its own Δ as the reference; a lone member's Δ as it is, as
        ``AllReducer.run``), the counters as ``Reducer._counters`` states them, then
        ``apply_round`` (``rule``: its outer-step rule); every member installs the result."""
        anchor = self.global_state
        for i in members:
            if self.setups[i].learner.global_states[0].digest != anchor.digest:
                self.setups[i].learner.install(anchor, rebase=True)
        learners = [self.setups[i].learner for i in members]
        deltas = [ln.pseudo_gradient(0) for ln in learners]
        counters = [(*ln.counters(0), ln.span(0)) for ln in learners]
        slots = self.setups[0].fragments[0].slots
        shapes = [s.shape for s in slots]
        if self.codec != "fp32" and len(members) > 1:  # each Δ (+ its residual) as the wire carries it
            for k, i in enumerate(members):
                sent = with_error_feedback(deltas[k], self.residual[i])
                deltas[k] = wire.decode(wire.encode(sent, self.codec), shapes, self.codec)
                self.residual[i] = [a - b for a, b in zip(sent, deltas[k])]
        kwargs = dict(OUTER_RULES[rule])
        if (gate := kwargs.pop("age_gate", None)) is not None:
            deltas = [[t * age_gate(span - 1, *gate) for t in d] for d, (_, _, span) in zip(deltas, counters)]
        merged = dict(enumerate(deltas[0]))
        if kwargs.pop("merge", "robust") == "plain":
            merged = dict(enumerate(merge_pseudo_gradients(
                deltas, [contribution_weight(t, s) for t, s, _ in counters], self.mask)))
        elif len(members) > 1:
            weights = [contribution_weight(t, s) for t, s, _ in counters]
            for r, part in enumerate(assign_parts([s.numel for s in slots], len(members))):  # reducer r: own = r
                if part:
                    out = robust_merge([[d[i] for i in part] for d in deltas], weights, [self.mask[i] for i in part],
                                       own=r)
                    merged.update(zip(part, out.merged))
        if self.codec != "fp32" and len(members) > 1:  # and the merged fragment as the reducers answer it
            merged = dict(enumerate(wire.decode_merged(wire.encode_merged([merged[i] for i in range(len(slots))],
                                                                          self.codec), shapes, self.codec)))
        position = sorted(ln.step for ln in learners)[(len(learners) - 1) // 2]
        new, f = apply_round(anchor, [merged[i] for i in range(len(slots))], sum(t for t, _, _ in counters), position,
                             span_fraction(counters, self.H), self.H, self.out.lr, self.out.momentum,
                             **kwargs)
        self.fractions.append(f)
        for ln in learners:
            ln.install(new)

    def follow_newest(self) -> None:
        """The catch-up loop: every learner follows the newest state, its progress rebased."""
        newest = self.global_state
        for s in self.setups:
            if s.learner.global_states[0].digest != newest.digest:
                s.learner.install(newest, rebase=True)

    def sync(self, grouping: str, rule: str) -> None:
        everyone = list(range(len(self.setups)))
        if grouping == "together":
            self._round(everyone, rule)
        else:
            for i in everyone:
                self._round([i], rule)
        self.follow_newest()

    def heldout(self) -> float:
        s = self.setups[0]
        return evaluate(s.global_model([self.global_state]), s.heldout)


def run(learners: int, seed: int, steps: int, sync_every: int, scenario: str, rule: str) -> dict[str, Any]:
    rep = Replica(learners, seed, steps, sync_every)
    t0 = time.monotonic()
    for t in range(1, steps + 1):
        rep.step()
        if t % sync_every == 0:
            period = t // sync_every
            alone = scenario == "alone" or (scenario == "split" and period % 3 == 2)
            rep.sync("alone" if alone else "together", rule)
    out = {"learners": learners, "seed": seed, "scenario": scenario, "rule": rule, "heldout": rep.heldout(),
           "version": rep.global_state.version, "fractions": list(rep.fractions), "seconds": time.monotonic() - t0}
    if scenario == "merged":  # the end-of-budget flush: one more step by one learner, merged alone
        first = rep.setups[0].learner
        first.inner_step(*rep.setups[0].sampler.next())
        before = first.state_dict()
        for r in RULES:
            rep._round([0], r)
            out[f"flush_{r}"] = rep.heldout()
            first.load_state_dict(before)  # undo: the next rule flushes from the same state
    print(f"L={learners} seed={seed} {scenario:6s} {rule:8s} held-out {out['heldout']:.4f} "
          f"({out['seconds']:.0f} s)", flush=True)
    return out


def run_straggler(seed: int, steps: int, sync_every: int, scenario: str, rule: str,
                  momentum: float = float(MODEL["outer.momentum"])) -> dict[str, Any]:
    """2 learners as the nodes merge (``Replica.node_round``): ``merged`` (every period both
    together) or ``straggler`` (the second skips every SKIP_EVERY-th period: the first merges
    alone and the second follows it with its progress rebased, bringing two periods of
    progress to the next round)."""
    rep = Replica(2, seed, steps, sync_every, {"outer.momentum": f"{momentum:g}"})
    t0 = time.monotonic()
    for t in range(1, steps + 1):
        rep.step()
        if t % sync_every == 0:
            skip = scenario == "straggler" and (t // sync_every) % SKIP_EVERY == 0
            rep.node_round([0] if skip else [0, 1], rule)
            rep.follow_newest()
    out = {"learners": 2, "seed": seed, "scenario": scenario, "rule": rule, "heldout": rep.heldout(),
           "version": rep.global_state.version, "fractions": list(rep.fractions), "seconds": time.monotonic() - t0}
    print(f"seed={seed} {scenario:9s} {rule:12s} held-out {out['heldout']:.4f} ({out['seconds']:.0f} s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--sync-every", type=int, default=100)
    ap.add_argument("--straggler", action="store_true",
                    help="the straggler scenario instead (2 learners; docs/benchmarks/partial_rounds_straggler.md)")
    ap.add_argument("--rules", nargs="+", default=["fraction", "period-carry", "age-gate"], choices=list(OUTER_RULES),
                    help="--straggler: the outer-step rules to compare (the first is the nodes' own)")
    ap.add_argument("--doc", default="partial_rounds_straggler", help="--straggler: name of the files written")
    ap.add_argument("--outer-momentum", type=float, default=float(MODEL["outer.momentum"]),
                    help="--straggler: the outer momentum μ (outer lr stays MODEL's)")
    replica_main(ap, dispatch, make_runs,
                 lambda results, a, m, seconds: (report_straggler if a.straggler else report)(results, a, m, seconds))


def make_runs(a: argparse.Namespace) -> list[tuple]:
    """The runs' arguments for ``dispatch``. ``merged`` computes the same bits under every
    straggler rule (f = 1 and span = 1 in each of its rounds): run once, under the first."""
    if a.straggler:
        return [("straggler", seed, a.steps, a.sync_every, scenario, rule, a.outer_momentum)
                for rule in a.rules for seed in a.seeds
                for scenario in ("merged", "straggler") if scenario == "straggler" or rule == a.rules[0]]
    return [(L, seed, a.steps, a.sync_every, scenario, rule) for L in a.learners for seed in a.seeds
            for scenario, rule in [("merged", "full"), *((s, r) for s in ("split", "alone") for r in RULES)]]


def dispatch(kind: Any, *args: Any) -> dict[str, Any]:
    """The pool's one entry point: ``("straggler", ...)`` runs :func:`run_straggler`, else :func:`run`."""
    return run_straggler(*args) if kind == "straggler" else run(kind, *args)


def report(results: list[dict[str, Any]], a: argparse.Namespace, m: dict[str, Any], seconds: float) -> None:
    def pick(L: int, scenario: str, rule: str, key: str = "heldout") -> list[float]:
        return [r[key] for r in results if r["learners"] == L and r["scenario"] == scenario
                and (r["rule"] == rule or scenario == "merged")]

    def steps_per_period(L: int, scenario: str, rule: str) -> str:
        runs = [r for r in results if r["learners"] == L and r["scenario"] == scenario
                and (r["rule"] == rule or scenario == "merged")]
        return fmt(statistics.mean(sum(r["fractions"]) / (a.steps // a.sync_every) for r in runs), 2)

    doc = Doc("partial_rounds", "Partial rounds: one period, one step",
              "python -m bench.partial_rounds " + " ".join(
                  [f"--learners {' '.join(map(str, a.learners))}", f"--seeds {' '.join(map(str, a.seeds))}",
                   f"--steps {a.steps}", f"--sync-every {a.sync_every}"]))
    paragraphs = __doc__.split("\n\n")
    doc.intro = [paragraphs[1], "", paragraphs[2].replace("* ", "- "), "", paragraphs[3], "",
                 f"{a.steps} inner steps per learner, H = {a.sync_every}, outer lr 0.7, momentum 0.9, one fragment; "
                 f"seeds {a.seeds}; held-out loss of the final global state, nats per byte (mean over seeds, "
                 "then the relative change against `merged` of the same seeds)."]
    rows, checks = [], []
    for L in a.learners:
        base = statistics.mean(pick(L, "merged", "full"))
        rows.append([L, "merged", "either", fmt(base, 4), "", "", steps_per_period(L, "merged", "full")])
        for scenario, bound in (("split", 0.01), ("alone", 0.05)):
            for rule in RULES:
                vals = pick(L, scenario, rule)
                rel = statistics.mean(vals) / base - 1
                worst = max(v / b - 1 for v, b in zip(vals, pick(L, "merged", "full")))
                rows.append([L, scenario, rule, fmt(statistics.mean(vals), 4), f"{rel:+.2%}", f"{worst:+.2%}",
                             steps_per_period(L, scenario, rule)])
                if rule == "fraction":
                    checks.append((f"L={L} {scenario}: within {bound:.0%} of merged", rel <= bound))
        for rule in RULES:
            flush = [r[f"flush_{rule}"] / r["heldout"] - 1 for r in results
                     if r["learners"] == L and r["scenario"] == "merged"]
            rows.append([L, "flush", rule, "", f"{statistics.mean(flush):+.3%}", f"{max(flush, key=abs):+.3%}", ""])
            if rule == "fraction":
                checks.append((f"L={L} flush: |change| < 0.2%", max(abs(x) for x in flush) < 0.002))
    doc.table(["learners", "scenario", "rule", "held-out (mean)", "vs merged (mean)", "vs merged (worst seed)",
               "outer steps per period"],
              rows, "Held-out loss at the end (flush: change caused by the one near-empty round after the last)")
    doc.text("Targets (issue: partial rounds): " + "; ".join(f"{name}: {verdict(ok)}" for name, ok in checks) + ".")
    path = doc.write(m, seconds, {"results": results, "seconds": seconds})
    print(path.read_text())


def report_straggler(results: list[dict[str, Any]], a: argparse.Namespace, m: dict[str, Any],
                     seconds: float) -> None:
    rules = list(dict.fromkeys(r["rule"] for r in results))
    seeds = sorted({r["seed"] for r in results})

    def pick(scenario: str, rule: str) -> dict[int, dict[str, Any]]:
        return {r["seed"]: r for r in results if r["scenario"] == scenario and r["rule"] == rule}

    doc = Doc(a.doc, "Partial rounds: a straggler's progress merged a period late",
              f"python -m bench.partial_rounds --straggler --seeds {' '.join(map(str, seeds))} --steps {a.steps} "
              f"--sync-every {a.sync_every} --rules {' '.join(rules)}"
              + (f" --outer-momentum {a.outer_momentum:g}" if a.outer_momentum != float(MODEL["outer.momentum"]) else "")
              + (f" --doc {a.doc}" if a.doc != "partial_rounds_straggler" else ""))
    doc.intro = [run_straggler.__doc__.split("\n\n")[0].replace("\n    ", "\n"), "",
                 f"{a.steps} inner steps per learner ({a.steps // a.sync_every} periods), H = {a.sync_every}, "
                 f"outer lr {MODEL['outer.lr']}, momentum {a.outer_momentum:g}, one fragment, model "
                 f"{MODEL['model.n_layer']} layer x {MODEL['model.n_embd']} wide ("
                 f"{params({k: v for k, v in MODEL.items() if k.startswith('model.')}):,} parameters); seeds {seeds}; "
                 "held-out loss of the final global state, nats per byte."]
    rows, checks = [], []
    for rule in rules:
        base, lag = pick("merged", rule) or pick("merged", rules[0]), pick("straggler", rule)
        rel = [lag[s]["heldout"] / base[s]["heldout"] - 1 for s in seeds if s in base and s in lag]
        steps = statistics.mean(sum(r["fractions"]) / (a.steps // a.sync_every) for r in lag.values())
        rows.append([rule, fmt(statistics.mean(r["heldout"] for r in base.values()), 4),
                     fmt(statistics.mean(r["heldout"] for r in lag.values()), 4), ", ".join(f"{x:+.2%}" for x in rel),
                     f"{statistics.mean(rel):+.2%}", fmt(steps, 2)])
        checks.append((f"{rule}: every seed within 1.5% of merged", max(rel) <= 0.015))
    doc.table(["outer rule", "merged: held-out", "straggler: held-out",
               "straggler vs merged (per seed)", "(mean)", "straggler: outer steps per period"], rows,
              "Held-out loss at the end (mean over seeds; per seed: straggler against merged of the same seed and rule)")
    doc.text("Target (issue: stragglers and stale progress): "
             + "; ".join(f"{n}: {verdict(ok)}" for n, ok in checks) + ".")
    path = doc.write(m, seconds, {"results": results, "seconds": seconds})
    print(path.read_text())


if __name__ == "__main__":
    main()
