"""Wire codecs in DiLoCo's regime: an in-process replica of the swarm's round math (no network).

L learners (the project's own ``Learner``, model and data, each on its own data shard, data
order fixed by the seed) train in lock-step; every H inner steps all of them merge one
fragment (the whole model) in one group, as synchronous DiLoCo does. Each contribution goes
through the wire codec the nodes use, with error feedback (the node's Δ plus its last
quantisation residual, ``RoundResult.residual``); the reducer merges the decoded slices with
``robust_merge`` (the node's default: norm clip, factor 2) and answers with the codec's merged
slice (``wire.encode_merged``); every learner applies ``nesterov_outer_step`` to what it
decodes. ``fp32`` is synchronous DiLoCo itself; the other codecs are measured against it at
the same H, tokens and seed.

Bytes are the encoded lengths, exact: per learner and outer round, a contribution up and a
merged fragment down, each (L - 1) / L of it crossing the network in the all-reduce (a member
keeps the slice it reduces itself). DDP's bytes: a ring all-reduce of fp32 gradients every
inner step, 2 (L - 1) / L x 4 bytes per parameter. Both count payload only (no headers, no
control plane: docs/benchmarks/control_plane.md measures that on real sockets). The ratio
DDP / codec at equal tokens is then 8 P H / (up + down), independent of L.

Each configuration is ``codec[/k]@outer-momentum[,lr=X][,ef=B]``: outer lr X (0.7 unless
given) and error-feedback decay B (a member sends Δ + B·e, ``core.outer.with_error_feedback``;
1 unless given). SparseLoCo runs without outer momentum, its decayed error-feedback buffer
taking that part (arXiv 2508.15706, section 3); ``topk2/k`` keeps k entries of a 4,096-element
chunk instead of the codec's ``net.codecs.sparse.TOPK`` (224; 64 before wire version 13, 128 before
14). The default grid is fp32 and int4 at DiLoCo's momentum 0.9 and topk2 at the recipe the
nodes document (momentum 0, lr 2, B = 0.65: docs/architecture.md). Every codec is compared
with ``fp32@0.9`` of the same H and seed.

Usage: python -m bench.codecs [--learners 4] [--seeds 1 2 3] [--steps 4000] [--sync-every 100 200]
       [--configs fp32@0.9 int4@0.9 topk2@0,lr=2,ef=0.65] [--jobs 2] [--doc codecs]
Writes docs/benchmarks/codecs.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.common import Doc, fmt, replica_main, verdict
from bench.partial_rounds import MODEL
from node.setup import Setup
from p2pdiloco.config import TOPK2_RECIPE, OuterConfig, load_config
from p2pdiloco.core.merge import contribution_weight
from p2pdiloco.core.outer import nesterov_outer_step, with_error_feedback
from p2pdiloco.core.robust import robust_merge
from p2pdiloco.data import evaluate
from p2pdiloco.net.codecs import sparse, wire


DEFAULT_TOPK = sparse.TOPK
RECIPE = "topk2@{momentum:g},lr={lr:g},ef={error_feedback_decay:g}".format(**TOPK2_RECIPE)  # topk2@0,lr=2,ef=0.65


def parse_config(config: str) -> tuple[str, float, int | None, float, float]:
    """``codec[/k]@momentum[,lr=X][,ef=B]`` -> (codec, momentum, k, lr, ef): ``k``, for ``topk2``,
    the entries kept of a 4096-element chunk (``net.codecs.sparse.TOPK``, 224, by default); ``lr`` the outer
    learning rate (0.7); ``ef`` the error-feedback decay beta (1: the residual is carried whole;
    SparseLoCo's e <- beta e + delta, arXiv 2508.15706, section 3).

    Raises:
        ValueError: a malformed configuration, an unknown codec or option, or a value out of range.
    """
    head, *options = config.split(",")
    codec, momentum = head.split("@")
    name, _, k = codec.partition("/")
    opts = {"lr": 0.7, "ef": 1.0}
    for option in options:
        key, _, value = option.partition("=")
        if key not in opts:
            raise ValueError(f"unknown option {key!r} in {config!r} (lr=, ef=)")
        opts[key] = float(value)
    mom, topk = float(momentum), int(k) if k else None
    # the nodes' own checks of these settings (config.OuterConfig raises Invalid, a ValueError)
    OuterConfig(wire_precision=name, momentum=mom, lr=opts["lr"], error_feedback_decay=opts["ef"])
    if k and (name != "topk2" or not 1 <= topk <= sparse.SPARSE_CHUNK):
        raise ValueError(f"/k is topk2's entries of a {sparse.SPARSE_CHUNK}-element chunk, 1..{sparse.SPARSE_CHUNK}")
    return name, mom, topk, opts["lr"], opts["ef"]


def checked(config: str) -> str:
    """argparse type of ``--configs``: the configuration as given, once it parses."""
    try:
        parse_config(config)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{config!r}: {e}") from None
    return config


def run(learners: int, seed: int, steps: int, sync_every: int, codec: str, momentum: float,
        topk: int | None = None, lr: float = 0.7, ef: float = 1.0) -> dict[str, Any]:
    # a density scan: the codec's k for this run (the process runs one configuration at a time)
    sparse.TOPK = topk or DEFAULT_TOPK
    common = {**MODEL, "seed": str(seed), "data.num_shards": str(learners), "outer.sync_every": str(sync_every),
              "outer.momentum": str(momentum), "outer.lr": str(lr), "inner.warmup_steps": str(steps // 20),
              "inner.total_steps": str(steps)}
    setups = [Setup.build(load_config(overrides={**common, "data.shard_index": str(i)}), f"l{i}",
                          f"codecs-{seed}-{i}") for i in range(learners)]
    out_cfg = setups[0].cfg.outer
    slots = setups[0].fragments[0].slots
    mask, shapes = [s.is_embedding for s in slots], [s.shape for s in slots]
    params = sum(s.numel for s in slots)
    residual: list[list[torch.Tensor] | None] = [None] * learners
    up = down = rounds = 0
    t0 = time.monotonic()
    for t in range(1, steps + 1):
        for s in setups:
            s.learner.inner_step(*s.sampler.next())
        if t % sync_every:
            continue
        anchor = setups[0].learner.global_states[0]
        decoded, weights = [], []
        for i, s in enumerate(setups):
            delta = with_error_feedback([d.detach().clone() for d in s.learner.pseudo_gradient(0)], residual[i], ef)
            data = wire.encode(delta, codec)
            got = wire.decode(data, shapes, codec)
            residual[i] = None if codec == "fp32" else [d - g for d, g in zip(delta, got)]
            decoded.append(got)
            weights.append(contribution_weight(*s.learner.counters(0)))
            up += len(data)
        merged = robust_merge(decoded, weights, mask, policy="clip").merged
        body = wire.encode_merged(merged, codec)
        down += len(body) * learners
        rounds += 1
        new = nesterov_outer_step(anchor, wire.decode_merged(body, shapes, codec), out_cfg.lr, out_cfg.momentum)
        for s in setups:
            s.learner.install(new)
    s = setups[0]
    heldout = evaluate(s.global_model([s.learner.global_states[0]]), s.heldout)
    per_round = (up + down) / (rounds * learners)  # bytes per learner per round (up + down, whole fragment)
    out = {"learners": learners, "seed": seed, "sync_every": sync_every, "codec": codec, "momentum": momentum,
           "lr": lr, "ef": ef,
           "topk": sparse.TOPK if codec == "topk2" else None,
           "heldout": heldout, "params": params, "rounds": rounds, "up_bytes": up / (rounds * learners),
           "down_bytes": down / (rounds * learners), "ddp_ratio": 8 * params * sync_every / per_round,
           "seconds": time.monotonic() - t0}
    print(f"L={learners} H={sync_every} {codec:5s}/{sparse.TOPK} m={momentum} lr={lr} ef={ef} seed={seed} held-out {heldout:.4f} "
          f"up {out['up_bytes']:.0f} B down {out['down_bytes']:.0f} B x{out['ddp_ratio']:.0f} "
          f"({out['seconds']:.0f} s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--sync-every", type=int, nargs="+", default=[100, 200])
    ap.add_argument("--configs", nargs="+", default=["fp32@0.9", "int4@0.9", RECIPE], type=checked,
                    help="codec[/k]@outer-momentum[,lr=X][,ef=B] (k: topk2's entries kept of a 4096-element "
                         f"chunk, {DEFAULT_TOPK} by default; X the outer lr, 0.7; B the error-feedback decay, 1); "
                         "fp32@0.9 is the reference")
    ap.add_argument("--doc", default="codecs", help="name of the files written in docs/benchmarks (a scan: another)")
    replica_main(ap, run, lambda a: [(a.learners, seed, a.steps, H, *parse_config(c))
                                     for H in a.sync_every for c in a.configs for seed in a.seeds], report)


def report(results: list[dict[str, Any]], a: argparse.Namespace, m: dict[str, Any], seconds: float) -> None:
    doc = Doc(a.doc, "Wire codecs in DiLoCo's regime: bytes against DDP, loss against synchronous DiLoCo",
              "python -m bench.codecs " + " ".join(
                  [f"--learners {a.learners}", f"--seeds {' '.join(map(str, a.seeds))}", f"--steps {a.steps}",
                   f"--sync-every {' '.join(map(str, a.sync_every))}", f"--configs {' '.join(a.configs)}"]
                  + ([f"--doc {a.doc}"] if a.doc != "codecs" else [])))
    paragraphs = __doc__.split("\n\n")
    doc.intro = [paragraphs[1], "", paragraphs[2], "", paragraphs[3], "",
                 f"{a.learners} learners, {a.steps} inner steps each ({a.steps * 8 * 64:,} tokens per learner), "
                 f"one fragment; seeds {a.seeds}; held-out loss of the final global state in "
                 "nats per byte (mean over seeds; the change against fp32 is the mean of the per-seed changes)."]
    rows, checks = [], []
    for H in a.sync_every:
        base = {r["seed"]: r["heldout"] for r in results
                if (r["sync_every"], r["momentum"], r["codec"], r.get("lr", 0.7)) == (H, 0.9, "fp32", 0.7)}
        for config in a.configs:
            codec, mom, k, lr, ef = parse_config(config)
            k = k or (DEFAULT_TOPK if codec == "topk2" else None)
            rs = [r for r in results if (r["sync_every"], r["momentum"], r["codec"], r.get("topk", k), r.get("lr", 0.7),
                                         r.get("ef", 1.0)) == (H, mom, codec, k, lr, ef)]
            if not rs:
                continue
            reference = (codec, mom, lr) == ("fp32", 0.9, 0.7)
            rel = [r["heldout"] / base[r["seed"]] - 1 for r in rs if r["seed"] in base]
            ratio = statistics.mean(r["ddp_ratio"] for r in rs)
            rows.append([H, mom, lr, ef, codec if k is None else f"{codec} ({k / 4096:.2%})", fmt(statistics.mean(r["heldout"] for r in rs), 4),
                         "" if reference or not rel else f"{statistics.mean(rel):+.2%}",
                         "" if reference or not rel else f"{max(rel):+.2%}",
                         f"{statistics.mean(r['up_bytes'] for r in rs):,.0f}",
                         f"{statistics.mean(r['down_bytes'] for r in rs):,.0f}", f"{ratio:,.0f}x"])
            goal = {"int4": 1000, "topk2": 4000}.get(codec)
            if goal and H == 200 and rel:
                checks.append((f"H={H} {config}: >= {goal}x fewer payload bytes than DDP with held-out loss "
                               f"within 2% of synchronous DiLoCo", ratio >= goal and statistics.mean(rel) <= 0.02))
    doc.table(["H", "outer momentum", "outer lr", "error-feedback decay", "codec", "held-out (mean)", "vs fp32 (mean)", "vs fp32 (worst seed)",
               "up B / learner / round", "down B / learner / round", "DDP bytes / ours"], rows,
              "Held-out loss at the end and payload bytes at equal tokens")
    doc.text("Targets (docs/benchmarks/README.md, payload only): " + "; ".join(f"{n}: {verdict(ok)}" for n, ok in checks) + ".")
    path = doc.write(m, seconds, {"results": results, "seconds": seconds})
    print(path.read_text())


if __name__ == "__main__":
    main()
