"""Regenerate docs/simulator.md's reproduced table, its timing section and docs/simulator-goodput.png.

    python -m bench.simulate_table               # table, timings and plot (about 10 s)
    python -m bench.simulate_table --calibrate   # also rerun the one-time grid search (minutes)

The doc's generated parts sit between ``<!-- BEGIN name -->`` and ``<!-- END name -->``
markers; everything else in the doc is left as it is. Needs matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from p2pdiloco.sim.cli import format_table
from p2pdiloco.sim.datacenter import CALIBRATED, DatacenterParams, simulate
from p2pdiloco.sim.paper import PAPER_TABLE, SIZES, calibrate, reproduce_table

DOC = ROOT / "docs" / "simulator.md"
PLOT = ROOT / "docs" / "simulator-goodput.png"
DAY = 86400.0
log = logging.getLogger("bench.simulate_table")


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{DOC}: no <!-- BEGIN {name} --> ... <!-- END {name} --> block")
    return pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text)


def timing_block() -> str:
    rows = []
    for system, m in (("dp", 1), ("elastic", 1), ("diloco", 8), ("diloco", 16)):
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = simulate(DatacenterParams(2_400_000, system, m, horizon_s=30 * DAY, seed=0))
            best.append(time.perf_counter() - t0)
        rows.append(f"| {system} M={m} | {r.failures} | {min(best):.2f} s | {100 * r.goodput:.1f}% |")
    cmd = [sys.executable, "-m", "p2pdiloco.sim", "datacenter", "--chips", "2400000", "--learners", "8",
           "--days", "30", "--seed", "0"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    cli_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    reproduce_table(horizon_s=30 * DAY)
    table_s = time.perf_counter() - t0
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    machine = (f"{os.cpu_count()} cores ({cpu}), "
               f"Python {platform.python_version()}, numpy {np.__version__}")
    return "\n".join([
        f"Machine: {machine}.",
        "",
        "| 2.4M chips, 30 days | chip failures | simulation time (best of 3) | goodput |",
        "|---|---|---|---|",
        *rows,
        "",
        f"`python -m p2pdiloco.sim datacenter --chips 2400000 --learners 8 --days 30 --seed 0` (all three "
        f"systems, including interpreter start-up): {cli_s:.1f} s wall. The whole table (30 cells, 30 days each): "
        f"{table_s:.1f} s.",
    ])


def plot(fit: object) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for i, (row, paper) in enumerate(PAPER_TABLE.items()):
        color = f"C{i}"
        ax.plot(SIZES, fit.cells[row], "-", color=color, label=f"{row} (simulated)")
        ax.plot(SIZES, paper, "o", color=color, mfc="none")
    ax.plot([], [], "ko", mfc="none", label="paper (Table 1)")
    ax.set_xscale("log")
    ax.set_xticks(SIZES, ["150k", "300k", "600k", "1.2M", "2.4M"])
    ax.minorticks_off()
    ax.set_xlabel("chips (one failure per chip-year)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(f"Simulated goodput vs Decoupled DiLoCo paper (largest difference {fit.max_error:.1f} points)",
                 fontsize=10)
    ax.legend(fontsize=7.5, loc="lower left")
    fig.tight_layout()
    fig.savefig(PLOT)
    log.info("wrote %s", PLOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="rerun the grid search first and print its result")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    logging.getLogger("p2pdiloco.sim.paper").setLevel(logging.INFO if args.calibrate else logging.WARNING)
    if args.calibrate:
        best = calibrate(detect=(2.0, 2.5, 3.0, 3.5, 4.0), reconfig=np.arange(20.0, 26.01, 0.5),
                         repair=np.arange(50.0, 75.01, 1.0), readmit=range(150, 331, 30))
        log.info("best on 7 days: %s, largest difference %.2f points (CALIBRATED is %s)",
                 best.timing, best.max_error, CALIBRATED)
    fit = reproduce_table(CALIBRATED, horizon_s=30 * DAY, seed=0)
    seeds = [reproduce_table(CALIBRATED, horizon_s=30 * DAY, seed=s).max_error for s in range(1, 4)]
    text = DOC.read_text()
    table = format_table(fit, markdown=True).rsplit("\n\n", 1)[0]
    note = (f"Each cell: simulated (paper), percent. Largest difference {fit.max_error:.2f} points (seed 0); "
            "seeds 1, 2, 3: " + ", ".join(f"{e:.2f}" for e in seeds) + ".")
    text = replace_block(text, "table", table + "\n\n" + note)
    text = replace_block(text, "timing", timing_block())
    DOC.write_text(text)
    log.info("updated %s", DOC)
    plot(fit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
