"""Applying a schedule's actions to live nodes, and the end of a run.

kill: SIGKILL to the node's whole process group (the node and its p2pd), after a last read of
its status (its counters end there; tokens extrapolated to the kill). restart: the same
command on the same data dir (same identity, port and checkpoint), with a training budget
that ends with the run. freeze / thaw: SIGSTOP / SIGCONT to the whole group. slow / unslow:
the node's CPU duty cycle divided by the factor / restored (:mod:`p2pdiloco.chaos.throttle`).
Actions on a node in the wrong state (a kill of a node that is down...) do nothing.
"""

from __future__ import annotations

import signal
import statistics
import time
from typing import TYPE_CHECKING

from p2pdiloco.chaos.observe import TRAINING, close_incarnation
from p2pdiloco.status import Report, read_status
from p2pdiloco.chaos.schedule import Event

if TYPE_CHECKING:
    from p2pdiloco.chaos.harness import Run


def apply_event(run: Run, ev: Event) -> None:
    """Apply one scheduled action to the run's node ``ev.node`` (see the module docstring)."""
    tr = run.tracks[ev.node]
    cur, now = tr.current, time.monotonic()
    if ev.action == "kill":
        if not tr.up():
            run.failures["kill_skipped"] += 1
            return
        tr.poll(run.offset)
        close_incarnation(cur, now, extrapolate=tr.frozen_since is None)
        run.throttle.release(cur.proc)
        run.procs.kill(cur.proc)
        cur.exit_code = cur.proc.popen.returncode
        tr.thawed(now)
        run.failures["kill"] += 1
        run.say(f"t={now - run.t0:5.0f} s  killed {tr.name} (SIGKILL to its process group)")
    elif ev.action == "restart":
        if tr.up():
            return
        # train until about the end of the window; at least 10 s, even if start-up runs late
        budget = max(10.0, run.t1 - now - startup_guess(run))
        run.spawn(tr, restart=True, budget=budget)
        run.say(f"t={now - run.t0:5.0f} s  restarted {tr.name} on its data dir")
    elif ev.action == "freeze":
        if not tr.up() or tr.frozen_since is not None:
            return
        cur.proc.signal_group(signal.SIGSTOP)
        cur.proc.stopped, tr.frozen_since = True, now
        run.failures["freeze"] += 1
        run.say(f"t={now - run.t0:5.0f} s  froze {tr.name} (SIGSTOP)")
    elif ev.action == "thaw":
        if tr.frozen_since is None or not tr.up():
            return
        cur.proc.signal_group(signal.SIGCONT)
        cur.proc.stopped = cur.proc.paused = False
        tr.thawed(now)
        run.say(f"t={now - run.t0:5.0f} s  thawed {tr.name} (SIGCONT)")
    elif ev.action in ("slow", "unslow"):
        tr.slow_factor = ev.arg if ev.action == "slow" else 1.0
        tr.slowed = tr.slowed or ev.action == "slow"
        run.failures["slow"] += ev.action == "slow"
        run.apply_throttle(tr)
        run.say(f"t={now - run.t0:5.0f} s  {tr.name} " + (f"runs x{ev.arg:g} slower (CPU duty cycle)"
                                                         if ev.action == "slow" else "back to full speed"))


def startup_guess(run: Run) -> float:
    """Seconds from spawn to training: median over restarts so far, else over first starts."""
    lives = [l for tr in run.tracks for l in tr.lives if l.training_at is not None]
    later = [l.training_at - l.spawned for l in lives if l.restart] or [l.training_at - l.spawned for l in lives]
    return statistics.median(later) if later else 10.0

def finish_nodes(run: Run) -> None:
    """Thaw every node, wait until each has spent its budget, settled and exited (SIGTERM
    after ``stop_timeout``); read the reports."""
    for tr in run.tracks:
        if tr.up() and tr.frozen_since is not None:
            tr.current.proc.signal_group(signal.SIGCONT)
            tr.current.proc.stopped = tr.current.proc.paused = False
            tr.thawed(time.monotonic())
    run.stopping = True
    live = [tr for tr in run.tracks if tr.up()]
    end = time.monotonic() + run.cfg.stop_timeout
    while time.monotonic() < end and any(tr.current.proc.alive() for tr in live):
        run.step(time.monotonic() + 0.5)
        for tr in live:  # a node that left training no longer needs its CPU cap
            if tr.current.last is not None and tr.current.last.state not in TRAINING:
                run.throttle.release(tr.current.proc)
    run.throttle.release_all()
    late = [tr for tr in live if tr.current.proc.alive()]
    for tr in late:
        run.notes.append(f"{tr.name} had not exited {run.cfg.stop_timeout:.0f} s after the window; SIGTERM")
        run.procs.stop(tr.current.proc, 30.0)
    for tr in live:
        cur = tr.current
        tr.poll(run.offset)
        report = read_status(tr.report_path)
        if cur.proc.alive():
            run.procs.kill(cur.proc)
        cur.ended = cur.ended or time.monotonic()
        cur.exit_code = cur.proc.popen.returncode
        if isinstance(report, Report) and report.pid == cur.proc.pid:
            cur.report = report
            cur.end_tokens = float(report.tokens)
            cur.end_merged = float(report.tokens_merged)
        else:
            run.notes.append(f"{tr.name} wrote no report")
