"""Poisoned merges on real pseudo-gradients: what one poisoner or two colluders of a group of 4
can do to ``core.robust.robust_merge`` (docs/trust.md §5).

The project's byte-level GPT (``p2pdiloco.model``, default config: 2 layers, 128 wide) is
trained ``--pre`` AdamW steps by one learner (DiLoCo inner defaults, ``core.learner``), then 4
learners start from that Θ and take ``--steps`` inner steps each on their own data shard
(``p2pdiloco.data``, the standard library's source), and their pseudo-gradients Δ (per
fragment, ``outer.fragments`` = 4) are merged the way a reducer merges its part: per fragment,
``robust_merge(..., own=r)`` with r an honest member (every honest member in turn; the worst
figure is reported), then all fragments concatenated into one vector. Attacks (poisoners are
members 2 and 3, the reducer never):

* ``steer_random``: member 3 sends, per tensor, 1.7 x the honest members' median norm along a
  random unit vector; reported: cosine of the merged Δ with the poisoner's Δ (goal <= 0.3);
* ``steer_negative``: the same along minus the honest members' mean Δ;
* ``flip2`` / ``flip2_tokens``: members 2 and 3 send −2 x their own Δ (and claim twice their
  tokens); reported: progress along the honest direction <merged, h> / ‖h‖², h the plain
  merge (``merge_pseudo_gradients``) of members 0 and 1 (goal >= 0.8);
* ``scale1000``: member 3 sends 1000 x its Δ; reported: ‖merged‖ over the same rule's merge with
  its honest Δ (goal <= 1.1);
* ``tokens1000``: member 3 claims 1000 x its tokens; reported: its merge weight over the
  lower median weight (goal <= 1);
* ``honest``: no attack; reported: cosine with, and norm over, the plain paper merge.

Usage: python -m bench.merge_attacks [--pre 300] [--steps 24] [--seed 0]
Prints one line per figure and the JSON of all of them.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Callable, Sequence

import torch

from p2pdiloco.core import InnerConfig, Learner, balanced_fragments
from p2pdiloco.core.merge import contribution_weight, merge_pseudo_gradients
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.core.robust import robust_merge
from p2pdiloco.data import BatchSampler, default_corpus_files, load_corpus
from p2pdiloco.model import ModelConfig, build_model

MEMBERS, FRAGMENTS, BATCH = 4, 4, 16
PoisonedRound = tuple[list[list[list[torch.Tensor]]], list[float]]  # per member, per fragment, per slot; weights


class Round:
    """4 learners' pseudo-gradients from one Θ: ``deltas[m][p][i]`` fp32 (member m, fragment p,
    slot i), ``tokens`` and ``steps`` per member, the ``fragments``' embedding masks."""

    def __init__(self, pre: int, steps: int, seed: int = 0, max_bytes: int = 400_000) -> None:
        cfg = ModelConfig()
        model = build_model(cfg, seed)
        self.fragments = balanced_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], FRAGMENTS,
                                            model.embedding_names())
        files = default_corpus_files()
        base = Learner(model, self.fragments, InnerConfig())
        shards = [load_corpus(files, k, MEMBERS + 1, max_bytes=max_bytes).train for k in range(MEMBERS + 1)]
        sampler = BatchSampler(shards[MEMBERS], BATCH, cfg.block_size, seed)
        for _ in range(pre):
            base.inner_step(*sampler.next())
        named = dict(model.named_parameters())
        for p, f in enumerate(self.fragments):  # the pre-trained weights are the round's Θ
            theta = [named[s.name].detach().clone() for s in f.slots]
            base.global_states[p] = FragmentState.create(p, 0, theta, [torch.zeros_like(t) for t in theta])
        self.deltas, self.tokens, self.steps = [], [], []
        for m in range(MEMBERS):
            learner = copy.deepcopy(base)
            s = BatchSampler(shards[m], BATCH, cfg.block_size, seed * 100 + m)
            for _ in range(steps):
                learner.inner_step(*s.next())
            self.deltas.append([learner.pseudo_gradient(p) for p in range(FRAGMENTS)])
            tokens, n = learner.counters(0)
            self.tokens.append(tokens)
            self.steps.append(n)
        self.masks = [f.embedding_mask for f in self.fragments]

    def weights(self, token_factor: Sequence[float] = (1, 1, 1, 1)) -> list[float]:
        return [contribution_weight(int(t * k), s) for t, s, k in zip(self.tokens, self.steps, token_factor)]

    def map(self, fn: Callable[[int, int, int, torch.Tensor], torch.Tensor]) -> list[list[list[torch.Tensor]]]:
        """deltas with slot (m, p, i) replaced by fn(m, p, i, Δ)."""
        return [[[fn(m, p, i, d) for i, d in enumerate(frag)] for p, frag in enumerate(member)]
                for m, member in enumerate(self.deltas)]


def flat(per_fragment: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """One fp64 vector of a member's (or a merge's) tensors, fragment by fragment."""
    return torch.cat([t.reshape(-1).to(torch.float64) for frag in per_fragment for t in frag])


def merge(rnd: Round, deltas, weights: Sequence[float], own: int | None, **kw) -> torch.Tensor:
    """The reducer ``own``'s robust merge of every fragment, concatenated (fp64 vector)."""
    return flat([robust_merge([d[p] for d in deltas], weights, rnd.masks[p], own=own, **kw).merged
                 for p in range(FRAGMENTS)])


def plain(rnd: Round, deltas, weights: Sequence[float]) -> torch.Tensor:
    """The paper's token-weighted merge of ``deltas`` (arXiv 2604.21428), concatenated."""
    return flat([merge_pseudo_gradients([d[p] for d in deltas], weights, rnd.masks[p]) for p in range(FRAGMENTS)])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def attacks(rnd: Round, seed: int = 0) -> dict[str, PoisonedRound]:
    """The poisoned inputs of each attack (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    honest = (0, 1, 2)

    def median_norm(p: int, i: int) -> float:
        return sorted(float(rnd.deltas[m][p][i].norm()) for m in honest)[1]

    def steer(direction: Callable[[int, int, torch.Tensor], torch.Tensor]):
        def fn(m, p, i, d):
            if m != 3:
                return d
            u = direction(p, i, d)
            return u * (1.7 * median_norm(p, i) / float(u.norm()))
        return fn

    w = rnd.weights()
    mean = lambda p, i, d: -sum(rnd.deltas[m][p][i] for m in honest)  # noqa: E731
    rand = lambda p, i, d: torch.randn(d.shape, generator=g)  # noqa: E731
    flip = lambda m, p, i, d: d * -2.0 if m >= 2 else d  # noqa: E731
    return {
        "steer_random": (rnd.map(steer(rand)), w),
        "steer_negative": (rnd.map(steer(mean)), w),
        "flip2": (rnd.map(flip), w),
        "flip2_tokens": (rnd.map(flip), rnd.weights((1, 1, 2, 2))),
        "scale1000": (rnd.map(lambda m, p, i, d: d * 1000.0 if m == 3 else d), w),
    }


def measure(rnd: Round, reducers: Sequence[int | None] = (0, 1, 2), **kw) -> dict[str, float]:
    """Every figure of the module docstring, the worst over the honest ``reducers`` (own index;
    None for the median fallback; the colluders 2 and 3 are left out of the ``flip2`` figures)."""
    w = rnd.weights()
    poisoned = attacks(rnd)
    honest_plain = plain(rnd, rnd.deltas, w)
    h2 = plain(rnd, rnd.deltas[:2], w[:2])
    out: dict[str, list[float]] = {k: [] for k in ("steer_random", "steer_negative", "flip2", "flip2_tokens",
                                                   "scale1000", "tokens1000", "honest_cosine", "honest_norm")}
    for r in reducers:
        clean = merge(rnd, rnd.deltas, w, r, **kw)
        out["honest_cosine"].append(cosine(clean, honest_plain))
        out["honest_norm"].append(float(clean.norm() / honest_plain.norm()))
        for k in ("steer_random", "steer_negative"):
            ds, ws = poisoned[k]
            out[k].append(cosine(merge(rnd, ds, ws, r, **kw), flat(ds[3])))
        for k in ("flip2", "flip2_tokens"):
            if r in (2, 3):  # a colluder: its own part is its own to poison (docs/trust.md §5)
                continue
            ds, ws = poisoned[k]
            out[k].append(float(merge(rnd, ds, ws, r, **kw) @ h2 / (h2 @ h2)))
        ds, ws = poisoned["scale1000"]
        out["scale1000"].append(float(merge(rnd, ds, ws, r, **kw).norm() / clean.norm()))
        claimed = rnd.weights((1, 1, 1, 1000))
        used = robust_merge([d[0] for d in rnd.deltas], claimed, rnd.masks[0], own=r, **kw).weights
        out["tokens1000"].append(used[3] / sorted(claimed)[1])
    worst = {"steer_random": max, "steer_negative": max, "flip2": min, "flip2_tokens": min, "scale1000": max,
             "tokens1000": max, "honest_cosine": min, "honest_norm": lambda xs: max(xs, key=lambda x: abs(x - 1))}
    return {k: worst[k](v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pre", type=int, default=300, help="inner steps of one learner before the round")
    ap.add_argument("--steps", type=int, default=24, help="inner steps of each of the 4 learners (H)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    rnd = Round(a.pre, a.steps, a.seed)
    pair = [math.nan]
    for f in rnd.fragments:
        for i, s in enumerate(f.slots):
            ds = [rnd.deltas[m][f.index][i].reshape(-1) for m in range(MEMBERS)]
            pair += [cosine(ds[x].double(), ds[y].double()) for x in range(MEMBERS) for y in range(x)]
    pair = [c for c in pair if not math.isnan(c)]
    results = {"own reference (reducers 0, 1, 2)": measure(rnd, (0, 1, 2)),
               "median fallback (own=None)": measure(rnd, (None,)),
               "policy off": measure(rnd, (0,), policy="off")}
    print(f"honest pairwise cosine per tensor: min {min(pair):.2f} median {sorted(pair)[len(pair) // 2]:.2f} "
          f"max {max(pair):.2f}")
    for name, figs in results.items():
        print(name + ": " + ", ".join(f"{k} {v:.3f}" for k, v in figs.items()))
    print(json.dumps({"pre": a.pre, "steps": a.steps, "seed": a.seed, "seconds": round(time.monotonic() - t0, 1),
                      "pairwise_cosine": [min(pair), max(pair)], "results": results}))


if __name__ == "__main__":
    main()
