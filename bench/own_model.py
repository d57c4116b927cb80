"""Your own model through the full protocol: a 20-50M-parameter model from a factory (not the built-in GPT).

    python -m bench.own_model                    # 2 nodes for 240 s, a third joins after 100 s (about 7 minutes)
    python -m bench.own_model --duration 120 --join-at 50

Two nodes start training ``model.factory`` (default ``p2pdiloco.models.torch_lm:decoder_lm``,
plain-torch pre-LayerNorm decoder, 7 layers, 512 wide, 22.4M parameters, context 128, 2
sequences per inner step) with real node processes, a bootstrap peer, on 127.0.0.1; a third node
joins midway and must download every fragment's full state (Θ and the outer momentum) before it
trains. Reported: the fragments' sizes, per node the rounds merged with peers, catch-ups, RPC
bytes sent and received, the held-out loss at its first evaluation and of the final global
model, and the final global digest; the newcomer's download (its journal's ``follow`` events
before its first round, and ``joined``). Goals (docs/operating.md, "Your own model"):
multi-megabyte fragments merged, the newcomer downloads the full state, held-out loss falls
on every node, equal final global digests.

Writes docs/benchmarks/own_model.md and .json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import common as c

from node.journal import FILE as JOURNAL, read_journal

FACTORY = "p2pdiloco.models.torch_lm:decoder_lm"
MB = 1e6


def settings(args: argparse.Namespace) -> dict[str, str]:
    return {
        "model.factory": args.factory, "model.n_layer": str(args.n_layer), "model.n_embd": str(args.n_embd),
        "model.n_head": "8", "model.block_size": str(args.block), "seed": str(args.seed), "threads": "1",
        "inner.lr": "1e-3", "inner.warmup_steps": "20", "inner.total_steps": "400",
        "outer.fragments": str(args.fragments), "outer.sync_every": str(args.sync_every), "outer.overlap": "2",
        "outer.min_quorum": "1", "outer.grace_min": "1.0", "outer.grace_max": "5.0", "outer.quorum_timeout": "10",
        "outer.liveness_timeout": "20", "outer.lr": "0.7", "outer.momentum": "0.9",
        "data.batch_size": str(args.batch), "data.max_bytes": "2000000", "data.eval_batches": "8",
        "data.num_shards": "3", "eval_every": "40", "checkpoint_every": "0", "settle": "60",
    }


def fragment_sizes(values: dict[str, str]) -> tuple[int, list[dict]]:
    """The model's parameter count and, per fragment, its tensors, parameters, and bytes on the
    wire: a pseudo-gradient (fp32) and a full state (Θ and momentum, fp32)."""
    from p2pdiloco.config import load_config  # noqa: PLC0415
    from p2pdiloco.core.fragments import balanced_fragments  # noqa: PLC0415
    from p2pdiloco.model import build_model  # noqa: PLC0415
    from p2pdiloco.net.codecs import wire  # noqa: PLC0415

    cfg = load_config(env={}, overrides=values)
    model = build_model(cfg.model, cfg.seed)
    frags = balanced_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], cfg.outer.fragments,
                               model.embedding_names())
    rows = []
    for f in frags:
        shapes = [s.shape for s in f.slots]
        rows.append({"fragment": f.index, "tensors": len(f.slots), "parameters": sum(s.numel for s in f.slots),
                     "delta_bytes": wire.wire_nbytes(shapes, cfg.outer.wire_precision),
                     "state_bytes": wire.wire_nbytes(shapes + shapes, "fp32")})
    return sum(p.numel() for p in model.parameters()), rows


def node_argv(maddr: str, name: str, d: Path, shard: int, duration: float, values: dict[str, str],
              run_id: str = "own-model") -> list[str]:
    return [c.PY, "-m", "node", "run", "--initial-peers", maddr, "--host", "127.0.0.1", "--port", "0",
            "--name", name, "--data-dir", str(d), "--status-file", str(d / "status.json"),
            "--report-file", str(d / "report.json"), "--run-id", run_id, "--no-progress",
            "--duration", f"{duration:g}", *c.set_args({**values, "data.shard_index": str(shard)})]


def newcomer_download(d: Path, started: float, frags: list[dict]) -> dict:
    """What the newcomer's journal says about its join: the fragments it installed before its
    first round (the first of each is its download at joining; version, seconds after its
    start), the bytes those downloads hold, and ``joined``."""
    events = read_journal(d / JOURNAL)
    first_round = next((e["t"] for e in events if e["event"] == "round"), float("inf"))
    follows = [e for e in events if e["event"] == "follow" and e["t"] <= first_round]
    first: dict[int, dict] = {}
    for e in follows:
        first.setdefault(e["fragment"], e)
    joined = next((e for e in events if e["event"] == "joined"), None)
    return {"fragments": sorted(first), "versions": [first[p]["version"] for p in sorted(first)],
            "more_before_first_round": len(follows) - len(first),
            "bytes": sum(frags[p]["state_bytes"] for p in first),
            "first_s": round(min(e["t"] for e in first.values()) - started, 1) if first else None,
            "last_s": round(max(e["t"] for e in first.values()) - started, 1) if first else None,
            "joined_step": joined["step"] if joined else None,
            "joined_s": round(joined["t"] - started, 1) if joined else None,
            "download_failed": sum(e["event"] == "download_failed" for e in events)}


def members(d: Path) -> dict[str, int]:
    """{members: committed rounds} of a node's journal."""
    out: dict[str, int] = {}
    for e in read_journal(d / JOURNAL):
        if e["event"] == "round" and e["committed"]:
            out[str(e["members"])] = out.get(str(e["members"]), 0) + 1
    return dict(sorted(out.items()))


NAMES = ["node0", "node1", "newcomer"]


def run(args: argparse.Namespace, values: dict[str, str], frags: list[dict], work: Path) -> dict:
    """The swarm: node0 and node1, then the newcomer; their reports and journals' figures."""
    dirs = [work / n for n in NAMES]
    with c.processes() as procs:
        maddr = procs.start_bootstrap(work, timeout=90)
        first = []
        for i in range(2):
            dirs[i].mkdir(exist_ok=True)
            first.append(procs.start(node_argv(maddr, NAMES[i], dirs[i], i, args.duration, values),
                                     dirs[i] / "node.log"))
        c.wait_training([d / "status.json" for d in dirs[:2]], first, 300)
        trained = time.monotonic()
        time.sleep(args.join_at)
        dirs[2].mkdir(exist_ok=True)
        # its --duration counts from when it starts training (after its download): end with the others
        rest = max(30.0, args.duration - (time.monotonic() - trained) - args.startup)
        joined_at = time.time()
        late = procs.start(node_argv(maddr, NAMES[2], dirs[2], 2, rest, values), dirs[2] / "node.log")
        c.wait_all([*first, late], args.duration + 900, "the nodes")
        for name, d, p in zip(NAMES, dirs, [*first, late]):
            if p.returncode != 0 or not (d / "report.json").exists():
                raise RuntimeError(f"{name} exited {p.returncode}; see {d / 'node.log'}")
    return {"reports": {n: c.read_json(d / "report.json") for n, d in zip(NAMES, dirs)}, "newcomer_started": joined_at,
            **journals(work, joined_at, frags)}


def journals(work: Path, joined_at: float, frags: list[dict]) -> dict:
    return {"newcomer": newcomer_download(work / NAMES[2], joined_at, frags),
            "members": {n: members(work / n) for n in NAMES}}


def write(args: dict, m: dict, seconds: float, data: dict) -> tuple[Path, bool]:
    """docs/benchmarks/own_model.md and .json from one run's figures; whether every goal was met."""
    frags, reports, download = data["fragments"], [data["reports"][n] for n in NAMES], data["newcomer"]
    rows = []
    for name, r in zip(NAMES, reports):
        rows.append([name, r.get("step", "n/a"), c.fmt(r["start_loss"]), c.fmt(r["end_loss"]), r["rounds_committed"],
                     r["rounds_with_peers"], r["rounds_late"], r["catchups"], f"{r['bytes_out'] / MB:.0f}",
                     f"{r['bytes_in'] / MB:.0f}", r["global_digest"]])
    equal = len({r["global_digest"] for r in reports}) == 1
    falls = all(r["end_loss"] < r["start_loss"] for r in reports)
    merged = all(r["rounds_with_peers"] > 0 for r in reports) and min(f["delta_bytes"] for f in frags) > MB
    full = download["fragments"] == list(range(len(frags)))
    doc = c.Doc("own_model", "Your own model through the full protocol",
                f"python -m bench.own_model --duration {args['duration']:g} --join-at {args['join_at']:g}",
                intro=[" ".join(__doc__.split("\n\n")[2].split())])
    doc.table(["fragment", "tensors", "parameters", "pseudo-gradient on the wire (MB)", "full state (MB)"],
              [[f["fragment"], f["tensors"], f"{f['parameters'] / 1e6:.2f}M", f"{f['delta_bytes'] / MB:.1f}",
                f"{f['state_bytes'] / MB:.1f}"] for f in frags],
              f"Model: `{args['factory']}`, {data['parameters'] / 1e6:.1f}M parameters (n_layer {args['n_layer']}, "
              f"n_embd {args['n_embd']}, block {args['block']}), {args['fragments']} fragments, H = "
              f"{args['sync_every']}, {args['batch']} x {args['block']} tokens per inner step, wire precision fp32.")
    doc.table(["node", "inner steps", "held-out loss, first evaluation", "held-out loss, final global model",
               "rounds committed", "rounds with peers", "rounds late", "catch-ups", "MB sent", "MB received",
               "final global digest"],
              rows, f"node0 and node1 train {args['duration']:g} s; the newcomer starts {args['join_at']:g} s after "
              "they began training and trains until about when they stop. Loss in nats per byte (the newcomer's "
              "first evaluation is of the state it downloaded); bytes are the nodes' RPC payloads (swarm.stats); "
              "a late round is one whose group the swarm had already moved past (the node then catches up).")
    doc.text(f"The newcomer's download at joining (its journal): fragments {download['fragments']} at versions "
             f"{download['versions']}, {download['bytes'] / MB:.0f} MB of state (Θ and momentum), the first "
             f"installed {download['first_s']} s and the last {download['last_s']} s after its process started "
             f"(model build and swarm join included); it took the swarm's inner step {download['joined_step']} "
             f"({download['joined_s']} s); {download['more_before_first_round']} more catch-up(s) before its first "
             f"round; {download['download_failed']} failed download attempt(s).",
             "Committed rounds by number of members (journals): " + "; ".join(
                 f"{n} " + ", ".join(f"{k} with {size} member(s)" for size, k in data["members"][n].items())
                 for n in NAMES) + ".")
    doc.text(f"Multi-megabyte fragments merged with peers on every node: {c.verdict(merged)}. The newcomer "
             f"downloaded the full state: {c.verdict(full)}. Held-out loss falls on every node: {c.verdict(falls)}. "
             f"Equal final global digests: {c.verdict(equal)}.")
    path = doc.write(m, seconds, {"args": args, "seconds": seconds, **data})
    return path, equal and falls and merged and full


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of training of the first two nodes")
    parser.add_argument("--join-at", type=float, default=100.0,
                        help="seconds after the first two train when the third starts (it trains until they stop)")
    parser.add_argument("--startup", type=float, default=40.0,
                        help="seconds the newcomer is expected to take from its start to training (its download)")
    parser.add_argument("--factory", default=FACTORY)
    parser.add_argument("--n-layer", type=int, default=7)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the logs here")
    parser.add_argument("--rewrite", action="store_true",
                        help="no run: write the Markdown again from docs/benchmarks/own_model.json (and the "
                             "journals in --workdir, when given)")
    args = parser.parse_args()
    if args.rewrite:
        saved = json.loads((c.DOCS / "own_model.json").read_text())
        m, kept, seconds = saved.pop("machine"), saved.pop("args"), saved.pop("seconds")
        if args.workdir:
            saved.update(journals(args.workdir, saved["newcomer_started"], saved["fragments"]))
        path, ok = write(kept, m, seconds, saved)
        print(path.read_text())
        return 0 if ok else 1
    c.install_signal_handlers()
    values = settings(args)
    params, frags = fragment_sizes(values)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="own-model-"))
    work.mkdir(parents=True, exist_ok=True)
    m, t0 = c.machine(), time.monotonic()
    data = {"settings": values, "parameters": params, "fragments": frags, **run(args, values, frags, work)}
    kept = {k: v for k, v in vars(args).items() if k not in ("workdir", "rewrite")}
    path, ok = write(kept, m, time.monotonic() - t0, data)
    print(path.read_text())
    print(f"logs: {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
