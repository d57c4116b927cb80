"""Cost of signed updates per outer round at the demo's settings (docs/trust.md).

    python -m bench.trust_overhead                 # 3 nodes, the demo model, 8 rounds per fragment
    python -m bench.trust_overhead --demo 90       # also run `p2pdiloco demo` 90 s for its real round times
    python -m bench.trust_overhead --rounds 4 --json

Three swarms (one p2pd each) in this process on 127.0.0.1 run real rounds of the demo's
model (p2pdiloco/presets.py DEMO: about 0.8M parameters in 4 fragments): matchmaking
through the DHT with the demo's grace settings, then the signed, robust all-reduce with
pseudo-gradients of the real tensor shapes. Measured on every node, per round:

* crypto: CPU seconds spent hashing (sha256 of every slice and merged slice sent or
  received), signing and verifying Ed25519 signatures (``AllReducer.stats.sign_seconds +
  verify_seconds``), plus signing and validating the round's DHT records
  (``SignedRecords.seconds``: matchmaking declarations, heads records);
* round: wall time from declaring readiness to holding the merged pseudo-gradient;
* all-reduce: wall time of ``AllReducer.run`` alone.

The three nodes share this process's CPU, so the per-node crypto is the total divided by 3.
These in-process rounds close as soon as all three nodes joined, so they are far shorter than
the demo's; ``--demo SECONDS`` also runs the real demo (3 node processes training) and reads
its round times from the nodes' logs ("round fP vV: N members, S s") to compare against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from p2pdiloco.presets import DEMO as DEMO_SETTINGS
from p2pdiloco.config import load_config
from p2pdiloco.core.fragments import balanced_fragments
from p2pdiloco.model import build_model
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution
from p2pdiloco.net.rounds.matchmaking import GroupKey, Matchmaker
from p2pdiloco.net.transport.swarm import Swarm

NODES = 3


def _crypto(swarms, reducers) -> tuple[float, float, int]:
    """(all-reduce crypto seconds, DHT record crypto seconds, records signed or validated), summed over nodes."""
    return (sum(r.stats.sign_seconds + r.stats.verify_seconds for r in reducers),
            sum(s.records.seconds for s in swarms), sum(s.records.signed + s.records.validated for s in swarms))


async def measure(rounds_per_fragment: int) -> dict:
    cfg = load_config(env={}, overrides=DEMO_SETTINGS)
    out = cfg.outer
    model = build_model(cfg.model, cfg.seed)
    fragments = balanced_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], out.fragments,
                                   model.embedding_names())
    params = sum(p.numel() for p in model.parameters())
    tokens_per_round = out.sync_every * cfg.data.batch_size * cfg.model.block_size
    swarms: list[Swarm] = []
    try:
        for _ in range(NODES):
            peers = await swarms[0].visible_maddrs() if swarms else []
            swarms.append(await Swarm.start(initial_peers=peers))
        mms = [Matchmaker(s, "bench/run", out.min_quorum) for s in swarms]
        reducers = [AllReducer(s, fragments, out.wire_precision, out.liveness_timeout, sync_every=out.sync_every,
                               run_id="bench/run",
                               outliers=cfg.trust.outliers, outlier_factor=cfg.trust.outlier_factor) for s in swarms]
        for m, r in zip(mms, reducers):
            m.listed_in = r.expect  # as the node wires them
        for service in (*mms, *reducers):
            await service.start()
        rows, skipped = [], 0
        gen = torch.Generator().manual_seed(0)
        for version in range(rounds_per_fragment):
            for frag in fragments:
                key = GroupKey(frag.index, version, f"{frag.index:02d}{version:062d}")
                contribs = [Contribution(tuple(torch.randn(s.shape, generator=gen) * 1e-3 for s in frag.slots),
                                         tokens_per_round, out.sync_every) for _ in swarms]
                crypto0 = _crypto(swarms, reducers)
                t0 = time.perf_counter()

                async def one(i: int):
                    outcome, group = await mms[i].form_group(key, grace=out.grace_min, quorum_timeout=out.quorum_timeout,
                                                             expected=NODES)
                    if outcome != "group":  # matchmaking split the nodes (seldom, under load): not counted
                        return None
                    t1 = time.perf_counter()
                    await reducers[i].run(group, contribs[i])
                    return time.perf_counter() - t1, len(group.members)

                done = await asyncio.gather(*(one(i) for i in range(NODES)))
                if any(d is None or d[1] != NODES for d in done):
                    skipped += 1
                    continue
                allreduce = [d[0] for d in done]
                crypto1 = _crypto(swarms, reducers)
                ar, rec, n = ((b - a) / NODES for a, b in zip(crypto0, crypto1))
                rows.append({"fragment": frag.index, "round_s": time.perf_counter() - t0, "allreduce_s": max(allreduce),
                             "crypto_s": ar + rec, "ar_crypto_s": ar, "record_crypto_s": rec, "records": n})
        rejected = sum(sum(r.stats.rejected.values()) for r in reducers)
        assert rejected == 0, f"honest rounds had rejections: {[r.stats.rejected for r in reducers]}"
    finally:
        await asyncio.gather(*(s.shutdown() for s in swarms), return_exceptions=True)
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("round_s", "allreduce_s", "crypto_s", "ar_crypto_s", "record_crypto_s", "records")}
    return {
        "params": params, "fragments": len(fragments), "nodes": NODES, "rounds": len(rows), "skipped": skipped,
        "wire_precision": out.wire_precision, "bytes_per_fragment": 4 * params // len(fragments),
        "median_round_s": med["round_s"], "median_allreduce_s": med["allreduce_s"],
        "median_crypto_ms_per_node": 1e3 * med["crypto_s"],
        "median_allreduce_crypto_ms_per_node": 1e3 * med["ar_crypto_s"],
        "median_record_crypto_ms_per_node": 1e3 * med["record_crypto_s"],
        "median_records_per_node": med["records"],
        "max_crypto_ms_per_node": 1e3 * max(r["crypto_s"] for r in rows),
        "crypto_share_of_round": med["crypto_s"] / med["round_s"],
        "crypto_share_of_allreduce": med["crypto_s"] / med["allreduce_s"],
        "machine": f"{platform.machine()}, {platform.python_version()}, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
    }


def demo_round_times(seconds: float) -> list[float]:
    """Run ``p2pdiloco demo`` for ``seconds`` and return every committed round's duration."""
    with tempfile.TemporaryDirectory(prefix="trust-bench-") as work:
        subprocess.run([sys.executable, "-c", "import sys; from p2pdiloco.cli import main; sys.exit(main())", "demo",
                        "--duration", str(seconds), "--quiet", "--workdir", work], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        pattern = re.compile(r"round f\d+ v\d+: (\d+) members, ([0-9.]+) s")
        return [float(m.group(2)) for log in Path(work).glob("node*/node.log")
                for m in pattern.finditer(log.read_text())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds per fragment (default 8)")
    parser.add_argument("--demo", type=float, default=0, metavar="SECONDS",
                        help="also run the real demo this long and compare with its round times")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    res = asyncio.run(measure(args.rounds))
    if args.demo:
        times = demo_round_times(args.demo)
        res.update(demo_rounds=len(times), demo_median_round_s=statistics.median(times),
                   crypto_share_of_demo_round=res["median_crypto_ms_per_node"] / 1e3 / statistics.median(times))
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{res['params'] / 1e6:.2f}M parameters, {res['fragments']} fragments, {res['nodes']} nodes, "
          f"{res['rounds']} rounds of all {NODES} nodes, {res['skipped']} smaller groups not counted ({res['machine']})")
    print(f"  round (matchmaking + all-reduce), median: {res['median_round_s'] * 1e3:8.1f} ms")
    print(f"  all-reduce alone, median:                 {res['median_allreduce_s'] * 1e3:8.1f} ms")
    print(f"  signing + verification per node, median: {res['median_crypto_ms_per_node']:8.2f} ms "
          f"(max {res['max_crypto_ms_per_node']:.2f} ms)")
    print(f"    of which all-reduce slices and statements: {res['median_allreduce_crypto_ms_per_node']:.2f} ms; "
          f"DHT records: {res['median_record_crypto_ms_per_node']:.2f} ms "
          f"({res['median_records_per_node']:.0f} signed or validated)")
    print(f"  share of the round: {100 * res['crypto_share_of_round']:.2f} %; "
          f"of the all-reduce alone: {100 * res['crypto_share_of_allreduce']:.2f} %")
    if args.demo:
        print(f"  the demo ({args.demo:.0f} s, 3 node processes): {res['demo_rounds']} committed rounds, median "
              f"{res['demo_median_round_s']:.2f} s; signing + verification: "
              f"{100 * res['crypto_share_of_demo_round']:.3f} % of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
