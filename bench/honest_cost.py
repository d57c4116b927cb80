"""What the trust rules cost an honest swarm: `p2pdiloco demo` at a baseline commit and at this
tree, alternated in one run (docs/benchmarks/honest_cost.md).

    python -m bench.honest_cost --baseline f8f2d5f --repeats 3 --duration 150 --doc honest_cost

Each repeat runs the demo (3 node processes and a bootstrap on 127.0.0.1, the demo's settings)
once from a clean checkout of the baseline commit (a git worktree, imported through
PYTHONPATH) and once from this tree, in alternating order, and reads the nodes' reports:
the global model's held-out loss at the end (nats/byte, the same held-out bytes on every node),
rounds committed with peers, and the tokens merged. The ratio of each figure, this tree over the
baseline, is taken per repeat (the two runs of one repeat are seconds apart on the same
machine) and summarised by its mean and range. The run names both commits and whether this
tree was clean.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def demo(tree: Path, work: Path, duration: float) -> dict:
    """One demo from ``tree``; per node report figures and the run's wall time."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "demo", "--quiet", "--duration", str(duration),
                           "--workdir", str(work)], cwd=tree, env=env, capture_output=True, text=True)
    reports = [json.loads((d / "report.json").read_text()) for d in sorted(work.glob("node*"))
               if (d / "report.json").exists()]
    return {"rc": done.returncode, "seconds": round(time.monotonic() - t0, 1),
            "end_loss": [r["end_loss"] for r in reports],
            "rounds_with_peers": [r["rounds_with_peers"] for r in reports],
            "tokens_merged": [r["tokens_merged"] for r in reports],
            "digests": sorted({r["global_digest"] for r in reports})}


def summary(runs: list[dict]) -> dict:
    """Per repeat: mean over nodes of each figure, and the ratio ours / baseline."""
    out = {}
    for key in ("end_loss", "rounds_with_peers", "tokens_merged"):
        ratios = [statistics.fmean(r["ours"][key]) / statistics.fmean(r["base"][key]) for r in runs]
        out[key] = {"ratios": [round(x, 4) for x in ratios], "mean": round(statistics.fmean(ratios), 4),
                    "min": round(min(ratios), 4), "max": round(max(ratios), 4)}
    return out


def report(result: dict) -> str:
    s, lines = result["summary"], []
    lines += [f"# What the trust rules cost an honest swarm ({result['ours']} against {result['baseline']})", "",
              f"Command: `{result['command']}`", "",
              f"Machine: {result['machine']}. This tree {'clean' if result['clean'] else 'WITH uncommitted changes'}.",
              f"Each repeat: `p2pdiloco demo --duration {result['duration']:g}` (3 nodes, the demo's settings) from the"
              f" baseline's checkout and from this tree, alternating which goes first.", "",
              "| repeat | first | held-out loss base / ours | rounds with peers (mean per node) base / ours |"
              " tokens merged base / ours | equal digests base / ours |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(result["runs"], 1):
        b, o = r["base"], r["ours"]
        lines.append(f"| {i} | {r['first']} | {statistics.fmean(b['end_loss']):.4f} / {statistics.fmean(o['end_loss']):.4f}"
                     f" | {statistics.fmean(b['rounds_with_peers']):.1f} / {statistics.fmean(o['rounds_with_peers']):.1f}"
                     f" | {statistics.fmean(b['tokens_merged']):,.0f} / {statistics.fmean(o['tokens_merged']):,.0f}"
                     f" | {len(b['digests']) == 1} / {len(o['digests']) == 1} |")
    lines += ["", "| figure | ours / baseline, mean | range over repeats |", "|---|---|---|"]
    for key, name in (("end_loss", "held-out loss"), ("rounds_with_peers", "rounds with peers"),
                      ("tokens_merged", "tokens merged")):
        lines.append(f"| {name} | {s[key]['mean']:.4f} | {s[key]['min']:.4f} to {s[key]['max']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the commit to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of training per demo")
    ap.add_argument("--doc", default=None, help="write docs/benchmarks/NAME.md and NAME.json")
    args = ap.parse_args()
    ours, clean = _git("rev-parse", "--short", "HEAD"), not _git("status", "--porcelain")
    with tempfile.TemporaryDirectory(prefix="honest-cost-") as tmp:
        base_tree = Path(tmp) / "baseline"
        _git("worktree", "add", "--detach", str(base_tree), args.baseline)
        try:
            runs = []
            for i in range(args.repeats):
                order = ("base", "ours") if i % 2 == 0 else ("ours", "base")
                run = {"first": order[0]}
                for which in order:
                    tree = base_tree if which == "base" else ROOT
                    run[which] = demo(tree, Path(tmp) / f"{which}{i}", args.duration)
                    print(which, i, json.dumps(run[which]), flush=True)
                runs.append(run)
        finally:
            _git("worktree", "remove", "--force", str(base_tree))
    result = {"baseline": _git("rev-parse", "--short", args.baseline), "ours": ours, "clean": clean,
              "duration": args.duration, "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs", "command": "python -m bench.honest_cost " + " ".join(sys.argv[1:]),
              "runs": runs, "summary": summary(runs)}
    text = report(result)
    print(text)
    if args.doc:
        out = ROOT / "docs" / "benchmarks"
        (out / f"{args.doc}.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / f"{args.doc}.md").write_text(text)
    return 0 if all(r["base"]["rc"] == 0 and r["ours"]["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
