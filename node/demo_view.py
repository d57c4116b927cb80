"""Terminal rendering of the demo: a live table per node and the final table (rich)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from p2pdiloco.procs import Proc
from p2pdiloco.status import read_status

console = Console(width=None if sys.stdout.isatty() else 150)  # a log file gets the whole table


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def _live_table(nodes: list[tuple[Proc, Path]]) -> Table:
    t = Table(title="p2pdiloco demo: live")
    for col in ("node", "state", "inner step", "tokens/s", "loss", "held-out", "rounds", "last round", "versions"):
        t.add_column(col)
    for proc, d in nodes:
        s = read_status(d / "status.json") or {}
        last = s.get("last_round") or {}
        last_txt = f"f{last['fragment']} v{last['version']} x{last['members']}" if last.get("committed") else "-"
        state = s.get("state", "starting") if proc.poll() is None or s.get("state") == "stopped" else f"exit {proc.returncode}"
        t.add_row(d.name, state, str(s.get("step", 0)), _fmt(s.get("tokens_per_s"), ".0f"), _fmt(s.get("loss")),
                  _fmt(s.get("heldout_loss")), str(s.get("rounds_committed", 0)), last_txt,
                  " ".join(str(v) for v, _ in s.get("fragments", [])))
    return t


PLAIN_EVERY_S = 10.0  # seconds between two progress lines when stdout is not a terminal


def _plain_line(nodes: list[tuple[Proc, Path]], elapsed: float) -> str:
    """One progress line for a log file: per node its state, inner step, loss, rounds."""
    parts = []
    for proc, d in nodes:
        s = read_status(d / "status.json") or {}
        state = s.get("state", "starting") if proc.poll() is None or s.get("state") == "stopped" else f"exit {proc.returncode}"
        parts.append(f"{d.name} {state} step {s.get('step', 0)} loss {_fmt(s.get('loss'))} "
                     f"held-out {_fmt(s.get('heldout_loss'))} rounds {s.get('rounds_committed', 0)}")
    return f"[{elapsed:5.0f} s] " + " | ".join(parts)


def live_view(nodes: list[tuple[Proc, Path]], quiet: bool = False) -> None:
    """Refresh the live table until every node process has exited; when stdout is not a
    terminal (a file, a pipe), print a plain progress line every ``PLAIN_EVERY_S`` instead."""
    if quiet:
        while any(p.poll() is None for p, _ in nodes):
            time.sleep(0.5)
        return
    if not console.is_terminal:
        t0 = last = time.monotonic()
        print(_plain_line(nodes, 0.0), flush=True)
        while any(p.poll() is None for p, _ in nodes):
            time.sleep(0.5)
            if time.monotonic() - last >= PLAIN_EVERY_S:
                last = time.monotonic()
                print(_plain_line(nodes, last - t0), flush=True)
        print(_plain_line(nodes, time.monotonic() - t0), "", sep="\n", flush=True)
        return
    with Live(_live_table(nodes), console=console, refresh_per_second=2) as live:
        while any(p.poll() is None for p, _ in nodes):
            time.sleep(1.0)
            live.update(_live_table(nodes))
        live.update(_live_table(nodes))


def final_table(reports: list[dict[str, Any] | None], codes: list[int | None],
                reasons: list[str] | None = None) -> bool:
    """Print the final table; True when every node finished, the held-out loss fell, nodes at
    equal fragment versions hold equal digests (invariant I1) and, with several nodes, each
    merged with another at least once. ``reasons``: per node, the last line of its log, shown
    under the table for the nodes that failed."""
    t = Table(title="p2pdiloco demo: result")
    for col in ("node", "held-out start", "held-out end", "bits/byte", "tokens", "rounds", "catch-ups",
                "fragments (version:digest)", "global digest"):
        t.add_column(col)
    by_version: dict[tuple[int, int], set[str]] = {}
    ok = True
    for i, (r, code) in enumerate(zip(reports, codes)):
        if r is None or code != 0:
            t.add_row(f"node{i}", f"failed (exit {code})", *["-"] * 7)
            ok = False
            continue
        frags = r["fragments"]
        for p, (v, dig) in enumerate(frags):
            by_version.setdefault((p, v), set()).add(dig)
        t.add_row(r["name"], _fmt(r["start_loss"]), _fmt(r["end_loss"]), _fmt(r["end_bits_per_byte"]),
                  f"{r['tokens']:,}", str(r["rounds_committed"]), str(r["catchups"]),
                  " ".join(f"{v}:{d[:6]}" for v, d in frags), r["global_digest"])
    console.print(t)
    for i, (r, code) in enumerate(zip(reports, codes)):
        if (r is None or code != 0) and reasons and reasons[i]:
            console.print(Text(f"node{i} failed (exit {code}): {reasons[i]}", style="red"))
    split = {k: v for k, v in by_version.items() if len(v) > 1}
    done = [r for r in reports if r]
    solo = [r["name"] for r in done if not r.get("rounds_with_peers")]
    if len(reports) > 1 and solo:
        console.print(Text(f"never merged with another node: {', '.join(solo)}", style="red"))
        ok = False
    if split:
        console.print(f"[red]I1 violated: equal versions with different digests: {split}")
        ok = False
    elif done:
        digests = {r["global_digest"] for r in done}
        console.print(f"I1: nodes at equal versions hold equal digests; "
                      f"{'all nodes end at the same global state' if len(digests) == 1 else 'nodes end at different versions'}")
    if done:
        start = sum(r["start_loss"] for r in done) / len(done)
        end = sum(r["end_loss"] for r in done) / len(done)
        console.print(f"held-out loss {start:.3f} -> {end:.3f} nats/byte ({100 * (1 - end / start):.1f}% lower)")
        if not end < start:
            console.print(Text("the held-out loss did not fall", style="red"))
            ok = False
    return ok
