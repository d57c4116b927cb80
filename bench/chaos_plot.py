"""Plot a chaos run: held-out loss and tokens merged over time, decoupled against synchronous.

    p2pdiloco chaos ... --mode both --workdir /tmp/bench2 --json /tmp/bench2.json
    python -m bench.chaos_plot /tmp/bench2.json docs/benchmarks/chaos.png

Reads each mode's ``timeline.jsonl`` (every status sample the harness read, in the run's
``workdir``) and the kill times from the JSON's schedule. Left: the mean over nodes of each
node's latest held-out loss (nats/byte; a node evaluates its own model every ``eval_every``
inner steps, so a slow synchronous node reports rarely). Right: tokens merged, summed over nodes
and incarnations (a restarted node's counters start at 0). Needs matplotlib (``pip install
-e '.[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def _series(timeline: Path) -> tuple[list[float], list[float], list[float], list[float]]:
    """(times, mean held-out loss) and (times, total merged tokens) from a timeline file."""
    rows = [json.loads(line) for line in timeline.read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if r.get("t") is not None), key=lambda r: r["t"])
    heldout: dict[str, float] = {}
    merged: dict[tuple[str, int], float] = {}
    tl, loss, tm, tokens = [], [], [], []
    for r in rows:
        merged[(r["node"], r.get("life", 0))] = float(r.get("merged") or 0.0)
        tm.append(r["t"])
        tokens.append(sum(merged.values()))
        if isinstance(r.get("heldout"), (int, float)) and r.get("state") not in ("starting", "stopped"):
            heldout[r["node"]] = float(r["heldout"])
            tl.append(r["t"])
            loss.append(sum(heldout.values()) / len(heldout))
    return tl, loss, tm, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="the --json file of a `p2pdiloco chaos` run")
    ap.add_argument("out", type=Path, help="PNG to write")
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chaos_plot: needs matplotlib (pip install -e '.[plot]')", file=sys.stderr)
        return 2
    try:
        data = json.loads(args.json.read_text())
        results = data["results"]
    except (OSError, ValueError, KeyError) as e:
        print(f"chaos_plot: cannot read {args.json}: {e}", file=sys.stderr)
        return 2
    kills = [float(t) for t in re.findall(r"kill:node\d+@([\d.]+)", str(data.get("schedule", "")))]
    fig, (ax_loss, ax_tok) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        timeline = Path(r["workdir"]) / "timeline.jsonl"
        if not timeline.exists():
            print(f"chaos_plot: {timeline} is missing (run with --workdir)", file=sys.stderr)
            return 2
        tl, loss, tm, tokens = _series(timeline)
        label = f"{r['mode']} (goodput {100 * r['goodput_merged']:.1f}% merged/processed)"
        ax_loss.plot(tl, loss, label=label)
        ax_tok.plot(tm, [t / 1e6 for t in tokens], label=r["mode"])
    for ax in (ax_loss, ax_tok):
        for k in kills:
            ax.axvline(k, color="grey", lw=0.6, ls=":")
        ax.axvline(0, color="black", lw=0.8)
        ax.set_xlabel("seconds from the start of the measured window (dotted: a kill)")
    ax_loss.set_ylabel("held-out loss, nats/byte (mean over nodes)")
    ax_tok.set_ylabel("tokens merged, millions (all nodes)")
    ax_loss.legend(fontsize=8)
    ax_tok.legend(fontsize=8)
    fig.suptitle(f"{results[0]['nodes']} nodes, {data.get('description', '')}", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
