"""The chaos harness: a bootstrap peer and N real node processes under a fault schedule.

Phases of one run: start (bootstrap, then every node with ``python -m node run``, each with
its own data dir, fixed port, status and report file, and a training budget of warm-up plus
duration), wait until every node trains, a fault-free warm-up, the measured window of
``duration`` seconds in which the schedule is applied (restarted nodes get the budget left),
then every node ends by its budget: it finishes its rounds, settles with the swarm and
writes its report (SIGTERM only to a node still running ``stop_timeout`` later; a node
stopped by a signal leaves without settling). Every process is ended on every exit path (own
process groups; :class:`~p2pdiloco.procs.Processes`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from p2pdiloco.chaos.faults import apply_event, finish_nodes
from p2pdiloco.chaos.load import LoadMonitor
from p2pdiloco.chaos.metrics import ChaosResult, commit_times, summarize, warmup_rate
from p2pdiloco.chaos.observe import TRAINING, Incarnation, NodeTrack, clock_offset, close_incarnation, is_rejoined
from p2pdiloco.procs import Processes
from p2pdiloco.chaos.replay import replay_goodput
from p2pdiloco.chaos.schedule import Event, Schedule
from p2pdiloco.chaos.throttle import Throttle

log = logging.getLogger(__name__)


class ChaosError(RuntimeError):
    """The run could not be carried out (a node did not start, the bootstrap peer died...)."""


@dataclass
class ChaosConfig:
    """One chaos run. ``settings``: ``--set`` values for every node; ``cpu_share``: the CPU
    duty cycle of each training node (None: ``0.7 x cores / nodes``, at most 1; 1: no
    throttling); ``standalone_tps``: per-node tokens/s for goodput (None: measured over
    this run, :mod:`p2pdiloco.chaos.metrics`)."""

    schedule: Schedule
    duration: float
    settings: dict[str, str]
    workdir: Path
    mode: str = "decoupled"  # or "synchronous"
    warmup: float = 20.0
    cpu_share: float | None = None
    throttle_period: float = 0.1
    standalone_tps: float | None = None
    rate_source: str = "given"  # how standalone_tps was obtained, for the report
    data: str | None = None
    uptime_window: float | None = None  # None: max(5 s, twice the warm-up's median gap between merges)
    rejoin_slack: float = 2.0
    start_timeout: float = 180.0
    stop_timeout: float = 150.0  # after the window: budget-end spread + finishing rounds + settle
    settle: float = 60.0  # the nodes' settle setting: serve until every peer is done and agrees
    poll_s: float = 0.5
    progress: Callable[[str], None] | None = None
    extra_notes: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return self.schedule.nodes

    def share(self) -> float:
        if self.cpu_share is not None:
            return min(1.0, self.cpu_share)
        return min(1.0, 0.7 * (os.cpu_count() or 1) / self.nodes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    def __init__(self, cfg: ChaosConfig):
        self.cfg = cfg
        self.work = cfg.workdir / cfg.mode
        self.work.mkdir(parents=True, exist_ok=True)
        self.procs = Processes()
        self.throttle = Throttle(cfg.throttle_period)
        self.offset = clock_offset()
        self.tracks = [NodeTrack(i, self.work / f"node{i}") for i in range(cfg.nodes)]
        self.ports = [_free_port() for _ in self.tracks]
        self.maddr = ""
        self.failures = {"kill": 0, "kill_skipped": 0, "freeze": 0, "slow": 0}
        self.notes: list[str] = list(cfg.extra_notes)
        self.next_poll = 0.0
        self.t0 = self.t1 = self.ready = 0.0
        self.stopping = False
        self.load = LoadMonitor(self.procs)
        self.timeline = open(self.work / "timeline.jsonl", "w")  # every status sample, for later analysis
        self.next_load = 0.0

    def say(self, msg: str) -> None:
        log.info("%s", msg)
        if self.cfg.progress is not None:
            self.cfg.progress(msg)

    # ---- processes ----------------------------------------------------------------------
    def start_bootstrap(self) -> None:
        path = self.work / "bootstrap.txt"
        path.unlink(missing_ok=True)
        boot = self.procs.start([sys.executable, "-m", "bootstrap", "--host", "127.0.0.1", "--port", "0",
                                 "--maddrs-file", str(path)], self.work / "bootstrap.log", "bootstrap")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if path.exists() and path.read_text().strip():
                self.maddr = path.read_text().split()[0]
                return
            if not boot.alive():
                raise ChaosError(f"the bootstrap peer exited with code {boot.popen.returncode} (log: {boot.log})")
            time.sleep(0.2)
        raise ChaosError("the bootstrap peer did not start within 60 s")

    def spawn(self, tr: NodeTrack, restart: bool, budget: float) -> None:
        """Start ``tr``'s node; it trains for ``budget`` seconds from when it starts training,
        then finishes its rounds and settles with the swarm (the end of a run by budget)."""
        tr.folder.mkdir(parents=True, exist_ok=True)
        tr.status_path.unlink(missing_ok=True)
        tr.report_path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "node", "run", "--initial-peers", self.maddr, "--host", "127.0.0.1",
                "--port", str(self.ports[tr.index]), "--name", tr.name, "--data-dir", str(tr.folder),
                "--status-file", str(tr.status_path), "--report-file", str(tr.report_path), "--run-id", "chaos",
                "--duration", f"{budget:.1f}", "--set", f"settle={self.cfg.settle}",
                "--set", f"data.shard_index={tr.index}", "--set", f"data.num_shards={self.cfg.nodes}"]
        if self.cfg.data:
            argv += ["--data", self.cfg.data]
        for k, v in self.cfg.settings.items():
            argv += ["--set", f"{k}={v}"]
        if self.cfg.mode == "synchronous":
            argv += ["--set", "outer.synchronous=true"]
        proc = self.procs.start(argv, tr.folder / "node.log", tr.name)
        tr.frozen_since = None
        tr.lives.append(Incarnation(proc, time.monotonic(), restart))

    def apply_throttle(self, tr: NodeTrack) -> None:
        cur = tr.current
        if cur is None or not tr.up() or cur.training_at is None:
            return
        share = self.cfg.share() / tr.slow_factor
        self.throttle.set(cur.proc, share, tr.index / self.cfg.nodes)

    # ---- observation --------------------------------------------------------------------
    def poll(self) -> None:
        for tr in self.tracks:
            cur = tr.current
            s = tr.poll(self.offset)
            if s is None or cur is None:
                continue
            self.timeline.write(json.dumps({**dataclasses.asdict(s), "t": round(s.t - self.t0, 2) if self.t0 else None,
                                            "node": tr.name, "life": len(tr.lives) - 1}) + "\n")
            if s.state in TRAINING and cur.proc.pid not in self.throttle.shares and tr.frozen_since is None:
                self.apply_throttle(tr)
            if cur.restart and cur.rejoined_at is None and is_rejoined(self.tracks, tr, s, self.cfg.rejoin_slack):
                cur.rejoined_at = s.t
                self.say(f"{tr.name} rejoined {s.t - cur.spawned:.1f} s after its restart")
        for tr in self.tracks:
            cur = tr.current
            if not self.stopping and cur is not None and cur.ended is None and not cur.proc.alive():
                close_incarnation(cur, time.monotonic(), extrapolate=False)
                cur.exit_code = cur.proc.popen.returncode
                self.notes.append(f"{tr.name} exited by itself with code {cur.exit_code} "
                                  f"at {time.monotonic() - self.t0:.0f} s (log: {cur.proc.log})")
                self.say(self.notes[-1])

    def step(self, until: float) -> None:
        """Run the throttle and the status polling until ``until`` (harness clock)."""
        while True:
            now = time.monotonic()
            if now >= until:
                return
            nxt = self.throttle.tick(now)
            if now >= self.next_poll:
                self.poll()
                self.next_poll = now + self.cfg.poll_s
            if now >= self.next_load and self.t0 and now >= self.t0:
                self.load.sample(now)
                self.next_load = now + 5.0
            time.sleep(max(0.0, min(nxt, self.next_poll, until) - time.monotonic()))

    # ---- phases -------------------------------------------------------------------------
    def wait_training(self) -> None:
        end = time.monotonic() + self.cfg.start_timeout
        while time.monotonic() < end:
            self.step(time.monotonic() + 0.5)
            for tr in self.tracks:
                if not tr.up():
                    raise ChaosError(f"{tr.name} exited during start-up; log: {tr.current.proc.log}")
            if all(tr.current.training_at is not None for tr in self.tracks):
                return
        raise ChaosError(f"not every node was training after {self.cfg.start_timeout:.0f} s")

    def apply(self, ev: Event) -> None:
        apply_event(self, ev)

    def finish(self) -> None:
        finish_nodes(self)

    def execute(self) -> ChaosResult:
        cfg = self.cfg
        self.start_bootstrap()
        budget = cfg.warmup + cfg.duration
        for tr in self.tracks:
            self.spawn(tr, restart=False, budget=budget)
        self.say(f"{cfg.mode}: {cfg.nodes} nodes starting (logs in {self.work})")
        self.wait_training()
        starts = [tr.current.training_at for tr in self.tracks]
        ready = self.ready = max(starts)
        # the nodes' budgets end around t1 (they started training at slightly different times)
        self.t1 = statistics.median(starts) + budget
        self.t0 = self.t1 - cfg.duration
        if self.t0 < ready + 3.0:
            self.t0 = ready + 3.0
            self.notes.append(f"start-up spread {ready - min(starts):.0f} s ate the warm-up; measured window shortened")
        self.say(f"{cfg.mode}: every node trains (start spread {ready - min(starts):.1f} s); warm-up until t0")
        self.step(self.t0)
        self.poll()
        for tr in self.tracks:
            cur = tr.current
            before = [x for x in cur.samples if x.t <= self.t0] or cur.samples[:1]
            if before:  # merged tokens pay off the warm-up's tokens first (metrics docstring)
                cur.base_tokens, cur.base_committed = before[-1].tokens, before[-1].committed
                cur.base_merged = max(before[-1].tokens, before[-1].merged)
        warm = warmup_rate(self.tracks, ready + 1.0, self.t0)
        self.say(f"{cfg.mode}: measured window starts; warm-up rate {warm:.0f} tokens/s per node")
        for ev in cfg.schedule.events():
            if self.t0 + ev.at >= self.t1:
                break
            self.step(self.t0 + ev.at)
            self.apply(ev)
        self.step(self.t1)
        self.load.sample(time.monotonic())
        self.say(f"{cfg.mode}: measured window over; waiting for the nodes to settle and exit")
        self.finish()
        return self.result(warm)

    def auto_window(self) -> float:
        commits = [t for t in commit_times(self.tracks) if self.ready <= t <= self.t0]
        gaps = [b - a for a, b in zip(commits, commits[1:], strict=False)]
        return round(max(5.0, 2 * statistics.median(gaps)), 1) if gaps else 10.0

    def result(self, warm: float) -> ChaosResult:
        self.procs.close()
        survivors = self.procs.survivors()
        if survivors:
            self.notes.append(f"processes still running after close: {survivors}")
        window = self.cfg.uptime_window or self.auto_window()
        res = summarize(self.cfg.mode, self.tracks, t0=self.t0, t1=self.t1, schedule=self.cfg.schedule.text(),
                        failures=self.failures, standalone_tps=self.cfg.standalone_tps,
                        rate_source=self.cfg.rate_source, warmup_tps=warm, window=window,
                        workdir=str(self.work), survivors=survivors, notes=self.notes)
        res.load = self.load.summary()
        res.cpu_share = round(self.cfg.share(), 3)
        if self.cfg.mode == "decoupled" and not self.failures["freeze"] and not self.failures["slow"]:
            res.simulated_goodput = replay_goodput(self.tracks, self.t0, self.t1, res.standalone_tokens_per_s,
                                                   self.cfg.settings)
        return res


def run(cfg: ChaosConfig) -> ChaosResult:
    """Carry out one chaos run; every process it started is gone when it returns or raises.

    Raises:
        ChaosError: the swarm could not be started (the message names the log to read).
    """
    r = Run(cfg)
    try:
        return r.execute()
    finally:
        r.throttle.release_all()
        r.procs.close()
        r.timeline.close()
