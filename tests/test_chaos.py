"""Chaos harness (p2pdiloco.chaos): schedules, metrics, throttling, and one short real run."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import psutil
import pytest

from p2pdiloco.chaos import ChaosConfig, Freeze, Kill, Slow, parse_script, random_schedule, round_robin_schedule, run
from p2pdiloco.chaos.cli import main as chaos_main
from p2pdiloco.chaos.metrics import uptime
from p2pdiloco.chaos.observe import Incarnation, NodeTrack, Sample, close_incarnation, is_rejoined
from p2pdiloco.presets import TINY
from p2pdiloco.chaos.throttle import Throttle
from p2pdiloco.errors import ConfigError
from p2pdiloco.sim.chaos import ChaosSchedule, chaos_sessions

# --- schedules --------------------------------------------------------------------------------


def test_scripted_schedule_example() -> None:
    s = parse_script("kill:node2@60,restart@80; freeze:node1@100-115; slow:node3x4", nodes=4)
    assert s.faults == (Kill(2, 60.0, 80.0), Freeze(1, 100.0, 115.0), Slow(3, 4.0, 0.0, math.inf))
    assert [(e.at, e.action, e.node, e.arg) for e in s.events()] == [
        (0.0, "slow", 3, 4.0), (60.0, "kill", 2, 0.0), (80.0, "restart", 2, 0.0),
        (100.0, "freeze", 1, 0.0), (115.0, "thaw", 1, 0.0)]
    assert s.counts() == {"kill": 1, "freeze": 1, "slow": 1}
    assert parse_script(s.text(), nodes=4).faults == s.faults  # the printed form parses back


def test_scripted_schedule_defaults_and_variants() -> None:
    s = parse_script(" KILL: 1 @ 30 ; kill:node0@40,restart@never; slow:2x2.5@10-20 ;", nodes=3, restart_delay=15)
    assert s.faults == (Kill(1, 30.0, 45.0), Kill(0, 40.0, None), Slow(2, 2.5, 10.0, 20.0))
    assert [(e.at, e.action) for e in s.events()] == [(10.0, "slow"), (20.0, "unslow"), (30.0, "kill"),
                                                     (40.0, "kill"), (45.0, "restart")]
    assert parse_script("", nodes=2).faults == ()


@pytest.mark.parametrize("text, message", [
    ("kill:node2", "cannot parse"),
    ("explode:node1@3", "cannot parse"),
    ("kill:node4@10", "there is no node4"),
    ("kill:node1@10,restart@5", "kill time < restart time"),
    ("freeze:node0@20-10", "start < end"),
    ("slow:node0x0.5", "factor >= 1"),
])
def test_scripted_schedule_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_script(text, nodes=4)


def test_random_schedule_hand_checked() -> None:
    # no jitter: kills at 30, 60, 90; restart after 20 s, so every node is back before the next kill
    s = random_schedule(nodes=2, duration=100, seed=1, kill_every=30, restart_delay=20, jitter=0)
    assert [(f.at, f.restart_at) for f in s.faults] == [(30, 50), (60, 80), (90, 110)]
    # down for 40 s: at 60 only one node is up, so that kill is left out (the swarm keeps a node)
    s = random_schedule(nodes=2, duration=100, seed=1, kill_every=30, restart_delay=40, jitter=0)
    assert [(f.at, f.restart_at) for f in s.faults] == [(30, 70), (90, 130)]


def test_random_schedule_is_seeded_and_respects_its_rules() -> None:
    kw = dict(nodes=5, duration=600, kill_every=60, restart_delay=20, freeze_every=90, freeze_s=15)
    a, b, c = random_schedule(seed=7, **kw), random_schedule(seed=7, **kw), random_schedule(seed=8, **kw)
    assert a == b and a.faults != c.faults
    kills = [f for f in a.faults if isinstance(f, Kill)]
    assert len(kills) == 10 and kills[-1].at == 598.0  # k = 1..10 at 60 k +- 15 s; the tenth drew 598 < 600
    assert sum(isinstance(f, Freeze) for f in a.faults) == 6  # 90 k +- 22.5 s for k = 1..6
    for k, f in enumerate(kills, start=1):
        assert abs(f.at - 60 * k) <= 15 and f.restart_at == pytest.approx(f.at + 20, abs=0.11)
    busy: dict[int, float] = {}
    for f in sorted(a.faults, key=lambda f: f.at if isinstance(f, Kill) else f.start):
        at, until = (f.at, f.restart_at) if isinstance(f, Kill) else (f.start, f.end)
        assert busy.get(f.node, 0.0) <= at  # never a fault on a node that is down or frozen
        busy[f.node] = until
        assert sum(1 for n in range(5) if busy.get(n, 0.0) <= at) >= 1


def test_round_robin_schedule_matches_the_simulator() -> None:
    sched = ChaosSchedule(nodes=4, kill_interval_s=30.0, restart_delay_s=10.0, duration_s=300.0,
                          tokens_per_s=200.0, round_s=5.0)
    ours = round_robin_schedule(4, 30.0, 10.0, 300.0)
    assert [(f.node, f.at) for f in ours.faults][:5] == [(0, 30.0), (1, 60.0), (2, 90.0), (3, 120.0), (0, 150.0)]
    sim = chaos_sessions(sched)
    kill_times = sorted(e for e in sim.end if math.isfinite(e) and e < 300.0)
    assert kill_times == [f.at for f in ours.faults]
    # a kill of a node still down does nothing: 2 nodes, kills every 10 s, 25 s down
    assert [(f.node, f.at) for f in round_robin_schedule(2, 10.0, 25.0, 60.0).faults] == [(0, 10.0), (1, 20.0),
                                                                                          (0, 50.0)]


# --- metrics helpers --------------------------------------------------------------------------

class FakeProc:
    def __init__(self, pid: int = 1) -> None:
        self.pid, self.stopped, self.paused, self.sent = pid, False, False, []

    def alive(self) -> bool:
        return True

    def signal_leader(self, sig: int) -> None:
        self.sent.append(sig)


def _sample(t: float, versions: tuple[int, ...], state: str = "training", tokens: float = 0.0,
            tps: float = 0.0) -> Sample:
    return Sample(t, state, tokens, 0.0, 0, 0, tps, versions, "")


def test_uptime_counts_bins_with_a_commit() -> None:
    assert uptime([0.5, 1.0, 7.0, 19.9], t0=0.0, t1=20.0, window=5.0) == 0.75  # bins 0, 1, 3 of 4
    assert uptime([], t0=0.0, t1=20.0, window=5.0) == 0.0
    assert uptime([25.0, -1.0], t0=0.0, t1=20.0, window=5.0) == 0.0  # outside the window


def test_kill_counters_extrapolate_tokens_to_the_kill() -> None:
    life = Incarnation(FakeProc(), spawned=0.0, restart=False, base_tokens=100.0)
    life.samples.append(_sample(10.0, (1,), tokens=1000.0, tps=50.0))
    close_incarnation(life, at=12.0, extrapolate=True)
    assert life.end_tokens == 1100.0 and life.processed() == 1000.0
    frozen = Incarnation(FakeProc(), spawned=0.0, restart=False)
    frozen.samples.append(_sample(10.0, (1,), tokens=1000.0, tps=50.0))
    close_incarnation(frozen, at=40.0, extrapolate=False)
    assert frozen.end_tokens == 1000.0


def test_rejoined_means_training_at_the_newest_versions() -> None:
    a, b = NodeTrack(0, Path("a")), NodeTrack(1, Path("b"))
    a.lives.append(Incarnation(FakeProc(1), 0.0, False, samples=[_sample(8.0, (5, 7)), _sample(10.0, (6, 7))]))
    b.lives.append(Incarnation(FakeProc(2), 0.0, True))
    tracks = [a, b]
    assert not is_rejoined(tracks, b, _sample(10.0, (5, 7), state="joining"), slack=2.0)
    assert not is_rejoined(tracks, b, _sample(10.0, (4, 7)), slack=2.0)
    assert is_rejoined(tracks, b, _sample(10.0, (5, 7)), slack=2.0)  # a had (5, 7) two seconds earlier
    assert not is_rejoined(tracks, b, _sample(12.0, (5, 7)), slack=2.0)  # by then a had v6 of fragment 0


def test_throttle_duty_cycle() -> None:
    th = Throttle(period=1.0)
    proc = FakeProc()
    th.set(proc, share=0.25, phase=0.5)
    assert th.tick(10.6) == pytest.approx(10.75) and proc.sent == [] and not proc.paused  # in its window
    assert th.tick(10.8) == pytest.approx(11.5) and proc.sent == [signal.SIGSTOP] and proc.paused
    proc.stopped = True  # frozen: the throttle leaves it alone
    th.tick(11.6)
    assert proc.sent == [signal.SIGSTOP]
    proc.stopped = False
    th.tick(11.6)
    assert proc.sent == [signal.SIGSTOP, signal.SIGCONT] and not proc.paused
    th.set(proc, share=0.25, phase=0.5)
    th.tick(12.0)
    th.release(proc)
    assert proc.sent[-1] == signal.SIGCONT and not proc.paused and not th.shares


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert chaos_main(["chaos", "--schedule", "kill:node7@3"]) == 2
    assert chaos_main(["chaos", "--set", "outer.sync_every=x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("p2pdiloco: chaos: kill:node7@3") and "no node7" in err[0]
    assert err[1].startswith("p2pdiloco: invalid configuration") and "outer.sync_every" in err[1]


# --- one real run -----------------------------------------------------------------------------

def _ours(workdir: Path) -> list[int]:
    """Processes whose command line names the run's folder (nodes) or that are p2pd of one."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(str(workdir) in part for part in (p.info["cmdline"] or [])):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


@pytest.mark.long
@pytest.mark.integration
@pytest.mark.timeout(240)
def test_real_run_kill_and_restart(tmp_path: Path) -> None:
    """3 tiny nodes, 45 s measured, node1 killed at 4 s and restarted at 7 s (same data dir).
    Long (opt-in): by default, the schedule and metrics tests above and test_churn's
    restarted node cover it."""
    t = time.monotonic()
    cfg = ChaosConfig(schedule=parse_script("kill:node1@4,restart@7", 3), duration=45.0,
                      settings={**TINY, "outer.sync_every": "100"}, workdir=tmp_path, warmup=8.0)
    r = run(cfg)
    assert not r.survivors and not _ours(tmp_path), "a node or p2pd outlived the harness"
    assert r.failures == {"kill": 1, "kill_skipped": 0, "freeze": 0, "slow": 0}
    assert r.exit_codes["node1#0"] == -signal.SIGKILL
    assert len(r.rejoin_s) == 1 and r.rejoins_missing == 0 and 0 < r.rejoin_s[0] < 45, (r.rejoin_s, r.notes)
    assert r.digests_agree and sorted(r.digests) == ["node0", "node1", "node2"], r.digests
    assert all(code == 0 for name, code in r.exit_codes.items() if name != "node1#0"), r.exit_codes
    assert r.standalone_tokens_per_s > 0 and r.tokens_processed > 0 and r.tokens_merged > 0
    assert 0 < r.goodput_merged <= 1.05 and 0 < r.goodput <= 1.05, (r.goodput_merged, r.goodput)
    assert 0 < r.uptime <= 1 and r.rounds_committed > 0
    assert r.start_loss is not None and all(v < r.start_loss for v in r.end_loss.values()), r.end_loss
    assert r.simulated_goodput is not None and 0 < r.simulated_goodput <= 1
    assert time.monotonic() - t < 200
