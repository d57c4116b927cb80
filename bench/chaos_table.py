"""Render the JSON of ``p2pdiloco chaos --json FILE`` as the Markdown tables of docs/chaos.md.

    python -m bench.chaos_table /tmp/bench1.json [more.json ...]
"""

from __future__ import annotations

import json
import sys


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def rows(data: dict) -> list[str]:
    out = []
    for r in data["results"]:
        f = r["failures"]
        rejoin = "-" if r["rejoin_median_s"] is None else f"{r['rejoin_median_s']:.1f} / {r['rejoin_max_s']:.1f}"
        if r["rejoins_missing"]:
            rejoin += f" ({r['rejoins_missing']} never)"
        loss = "-" if r["end_loss_mean"] is None else f"{r['start_loss']:.3f} → {r['end_loss_mean']:.3f}"
        digests = f"{'equal' if r['digests_agree'] else 'differ'} ({len(r['digests'])}/{r['nodes']})"
        load = r.get("load") or {}
        out.append(f"| {r['mode']} | {pct(r['goodput_merged'])} | {pct(r['goodput'])} | {pct(r['uptime'])} "
                   f"| {f['kill']} | {rejoin} | {loss} | {digests} | {r['standalone_tokens_per_s']:.0f} "
                   f"| {r['tokens_processed'] / 1e6:.2f}M / {r['tokens_merged'] / 1e6:.2f}M "
                   f"| {r['training_node_s']:.0f} / {r['nodes'] * r['duration_s']:.0f} "
                   f"| {load.get('ours_cores', 0):.2f} / {load.get('others_cores', 0):.2f} |")
    return out


def main(paths: list[str]) -> None:
    print("| mode | goodput merged/processed | goodput useful/allocated | uptime | kills | rejoin s median / max "
          "| held-out loss (nats/byte) | digests at end | tokens/s per node | tokens processed / merged "
          "| node-s training / allocated | cores: run / others |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            for line in rows(json.load(f)):
                print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
