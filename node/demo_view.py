"""Terminal rendering of the demo: a live table per node and the final table (rich)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from p2pdiloco.procs import Proc
from p2pdiloco.status import Report, Snapshot, Status, read_status

from node.formatting import fmt_num

console = Console(width=None if sys.stdout.isatty() else 150)  # a log file gets the whole table


class Clock:
    """The demo's elapsed time and an estimate of the time left (seconds).

    Each node trains for ``duration`` seconds (``--duration``) from when it starts training, or
    until ``max_steps`` inner steps (``--max-steps``, 0: none); the estimate runs from the first
    status that shows a node past "starting" and "joining", and with ``max_steps`` takes the
    earlier of the two ends at the slowest node's step rate. None until a node trains."""

    def __init__(self, duration: float, max_steps: int = 0) -> None:
        self.duration, self.max_steps = duration, max_steps
        self.t0 = time.monotonic()
        self.trained_at: float | None = None  # time.monotonic() a node was first seen training

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self, statuses: list[Snapshot | None]) -> float | None:
        """Seconds left; ``statuses``: each node's status, None before its first."""
        now = time.monotonic()
        if self.trained_at is None and any(s is not None and s.state not in ("starting", "joining") for s in statuses):
            self.trained_at = now
        if self.trained_at is None:
            return None
        left = max(0.0, self.duration - (now - self.trained_at))
        steps = [s.step if isinstance(s, Status) else 0 for s in statuses]
        if self.max_steps and steps and min(steps) > 0 and now > self.trained_at:
            left = min(left, max(0.0, (self.max_steps - min(steps)) * (now - self.trained_at) / min(steps)))
        return left

    def text(self, statuses: list[Snapshot | None]) -> str:
        left = self.left(statuses)
        return f"{self.elapsed():.0f} s elapsed, " + ("starting" if left is None else f"about {left:.0f} s left")


def _statuses(nodes: list[tuple[Proc, Path]]) -> list[Snapshot | None]:
    return [read_status(d / "status.json") for _, d in nodes]


def _state(proc: Proc, s: Snapshot | None) -> str:
    """The node's state, or how its process exited (a stopped node's state stands)."""
    state = "starting" if s is None else s.state
    return state if proc.poll() is None or state == "stopped" else f"exit {proc.returncode}"


def _live_table(nodes: list[tuple[Proc, Path]], clock: Clock) -> Table:
    t = Table(title=f"p2pdiloco demo: {clock.text(_statuses(nodes))}")
    for col in ("node", "state", "step", "tok/s", "loss", "held-out", "rounds", "last round", "versions"):
        t.add_column(col)
    for proc, d in nodes:
        s = read_status(d / "status.json")
        if not isinstance(s, Status):
            t.add_row(d.name, _state(proc, s), "0", "-", "-", "-", "0", "-", "")
            continue
        last = s.last_round
        last_txt = f"f{last.fragment} v{last.version} x{last.members}" if last and last.committed else "-"
        t.add_row(d.name, _state(proc, s), str(s.step), fmt_num(s.tokens_per_s, ".0f"), fmt_num(s.loss),
                  fmt_num(s.heldout_loss), str(s.rounds_committed), last_txt, " ".join(str(v) for v, _ in s.fragments))
    return t


PLAIN_EVERY_S = 10.0  # seconds between two progress lines when stdout is not a terminal


def _plain_line(nodes: list[tuple[Proc, Path]], clock: Clock) -> str:
    """One progress line for a log file: per node its state, inner step, loss, rounds."""
    parts = []
    for proc, d in nodes:
        s = read_status(d / "status.json")
        run = s if isinstance(s, Status) else Status(name=d.name, state="starting")  # zeros before it trains
        parts.append(f"{d.name} {_state(proc, s)} step {run.step} loss {fmt_num(run.loss)} "
                     f"held-out {fmt_num(run.heldout_loss)} rounds {run.rounds_committed}")
    return f"[{clock.text(_statuses(nodes))}] " + " | ".join(parts)


def live_view(nodes: list[tuple[Proc, Path]], quiet: bool = False, clock: Clock | None = None) -> None:
    """Refresh the live table, titled with ``clock``'s elapsed and remaining time, until every
    node process has exited; when stdout is not a terminal (a file, a pipe), print a plain
    progress line every ``PLAIN_EVERY_S`` instead."""
    clock = clock or Clock(0.0)
    if quiet:
        while any(p.poll() is None for p, _ in nodes):
            time.sleep(0.5)
        return
    if not console.is_terminal:
        last = time.monotonic()
        print(_plain_line(nodes, clock), flush=True)
        while any(p.poll() is None for p, _ in nodes):
            time.sleep(0.5)
            if time.monotonic() - last >= PLAIN_EVERY_S:
                last = time.monotonic()
                print(_plain_line(nodes, clock), flush=True)
        print(_plain_line(nodes, clock), "", sep="\n", flush=True)
        return
    with Live(_live_table(nodes, clock), console=console, refresh_per_second=2) as live:
        while any(p.poll() is None for p, _ in nodes):
            time.sleep(1.0)
            live.update(_live_table(nodes, clock))
        live.update(_live_table(nodes, clock))


def digest_lines(reports: list[Report | None]) -> str:
    """The nodes' global digests (16 hex, ``node.committed.global_digest``), one node a line,
    whole at 80 columns: what the README tells the reader to compare. Where they differ, each
    node's fragments follow on a line of their own as version:digest (12 hex, ``FragmentState.short``)."""
    done = [r for r in reports if r]
    lines = ["global digests (equal iff the nodes hold the same model):"]
    lines += [f"  {r.name:<10} {r.global_digest}" for r in done]
    if len({r.global_digest for r in done}) > 1:
        lines += [f"  {r.name:<10} " + " ".join(f"{v}:{d[:12]}" for v, d in r.fragments) for r in done]
    return "\n".join(lines)


def final_table(reports: list[Report | None], codes: list[int | None],
                reasons: list[str] | None = None) -> bool:
    """Print the final table; True when every node finished, the held-out loss fell, nodes at
    equal fragment versions hold equal digests (invariant I1) and, with several nodes, each
    merged with another at least once. ``reasons``: per node, the last line of its log, shown
    under the table for the nodes that failed."""
    t = Table(title="p2pdiloco demo: result")
    for col in ("node", "held-out", "bits/byte", "tokens", "rounds", "catch-ups", "versions"):
        t.add_column(col)
    by_version: dict[tuple[int, int], set[str]] = {}
    ok = True
    for i, (r, code) in enumerate(zip(reports, codes)):
        if r is None or code != 0:
            t.add_row(f"node{i}", f"failed (exit {code})", *["-"] * 5)
            ok = False
            continue
        frags = r.fragments
        for p, (v, dig) in enumerate(frags):
            by_version.setdefault((p, v), set()).add(dig)
        t.add_row(r.name, f"{fmt_num(r.start_loss)} -> {fmt_num(r.end_loss)}", fmt_num(r.end_bits_per_byte),
                  f"{r.tokens:,}", str(r.rounds_committed), str(r.catchups), " ".join(str(v) for v, _ in frags))
    console.print(t)
    console.print(digest_lines(reports))
    for i, (r, code) in enumerate(zip(reports, codes)):
        if (r is None or code != 0) and reasons and reasons[i]:
            console.print(Text(f"node{i} failed (exit {code}): {reasons[i]}", style="red"))
    split = {k: v for k, v in by_version.items() if len(v) > 1}
    done = [r for r in reports if r]
    solo = [r.name for r in done if not r.rounds_with_peers]
    if len(reports) > 1 and solo:
        console.print(Text(f"never merged with another node: {', '.join(solo)}", style="red"))
        ok = False
    if split:
        console.print(f"[red]I1 violated: equal versions with different digests: {split}")
        ok = False
    elif done:
        digests = {r.global_digest for r in done}
        console.print(f"I1: nodes at equal versions hold equal digests; "
                      f"{'all nodes end at the same global state' if len(digests) == 1 else 'nodes end at different versions'}")
    if done:
        start = sum(r.start_loss for r in done) / len(done)
        end = sum(r.end_loss for r in done) / len(done)
        console.print(f"held-out loss {start:.3f} -> {end:.3f} nats/byte ({100 * (1 - end / start):.1f}% lower)")
        if not end < start:
            console.print(Text("the held-out loss did not fall", style="red"))
            ok = False
    return ok
