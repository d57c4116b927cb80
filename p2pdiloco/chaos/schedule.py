"""Fault schedules for the chaos harness: scripted, seeded random, or from a simulator schedule.

Times are seconds after the measured run starts (``t0``: every node trains and the warm-up
is over). Nodes are numbered ``0 .. nodes-1`` and named ``node0``, ``node1`` ...

Scripted syntax (items separated by ``;``, spaces ignored, case-insensitive)::

    kill:node2@60              SIGKILL node2's process group at 60 s, restart it after the
                               default restart delay (same data dir, so same identity)
    kill:node2@60,restart@80   ... and restart it at 80 s
    kill:node2@60,restart@never  ... and leave it down
    freeze:node1@100-115       SIGSTOP node1's process group at 100 s, SIGCONT at 115 s
    slow:node3x4               node3 runs 4 times slower for the whole run (CPU duty cycle)
    slow:node3x4@100-200       ... only from 100 s to 200 s

A kill of a node that is down when it comes due does nothing (as in the simulator,
:mod:`p2pdiloco.sim.chaos`); so does a freeze of a node that is down or frozen.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from p2pdiloco.errors import ConfigError


@dataclass(frozen=True)
class Kill:
    node: int
    at: float
    restart_at: float | None  # None: stays down


@dataclass(frozen=True)
class Freeze:
    node: int
    start: float
    end: float


@dataclass(frozen=True)
class Slow:
    node: int
    factor: float  # >= 1: the node gets 1/factor of its CPU share
    start: float = 0.0
    end: float = math.inf


Fault = Kill | Freeze | Slow


@dataclass(frozen=True)
class Event:
    """One action the harness applies: kill, restart, freeze, thaw, slow (arg: factor), unslow."""

    at: float
    action: str
    node: int
    arg: float = 0.0


_ORDER = {"restart": 0, "thaw": 1, "unslow": 2, "kill": 3, "freeze": 4, "slow": 5}


@dataclass(frozen=True)
class Schedule:
    """A list of faults for ``nodes`` nodes; :meth:`events` gives them as timed actions."""

    nodes: int
    faults: tuple[Fault, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError("chaos: nodes must be >= 1")
        for f in self.faults:
            where = f"chaos: {_describe(f)}"
            if not 0 <= f.node < self.nodes:
                raise ConfigError(f"{where}: there is no node{f.node} (nodes are node0..node{self.nodes - 1})")
            if isinstance(f, Kill):
                if f.at < 0 or (f.restart_at is not None and f.restart_at <= f.at):
                    raise ConfigError(f"{where}: need 0 <= kill time < restart time")
            elif isinstance(f, Freeze):
                if not 0 <= f.start < f.end < math.inf:
                    raise ConfigError(f"{where}: need 0 <= start < end")
            elif not (f.factor >= 1 and 0 <= f.start < f.end):
                raise ConfigError(f"{where}: need a factor >= 1 and 0 <= start < end")

    def events(self) -> list[Event]:
        """Every action in time order (at equal times: restarts and thaws first)."""
        out: list[Event] = []
        for f in self.faults:
            if isinstance(f, Kill):
                out.append(Event(f.at, "kill", f.node))
                if f.restart_at is not None:
                    out.append(Event(f.restart_at, "restart", f.node))
            elif isinstance(f, Freeze):
                out += [Event(f.start, "freeze", f.node), Event(f.end, "thaw", f.node)]
            else:
                out.append(Event(f.start, "slow", f.node, f.factor))
                if math.isfinite(f.end):
                    out.append(Event(f.end, "unslow", f.node))
        return sorted(out, key=lambda e: (e.at, _ORDER[e.action], e.node))

    def counts(self) -> dict[str, int]:
        return {"kill": sum(isinstance(f, Kill) for f in self.faults),
                "freeze": sum(isinstance(f, Freeze) for f in self.faults),
                "slow": sum(isinstance(f, Slow) for f in self.faults)}

    def text(self) -> str:
        """The schedule in the scripted syntax (parses back to the same faults)."""
        return "; ".join(_describe(f) for f in self.faults)


def _t(x: float) -> str:
    return f"{x:g}"


def _describe(f: Fault) -> str:
    if isinstance(f, Kill):
        return f"kill:node{f.node}@{_t(f.at)},restart@{'never' if f.restart_at is None else _t(f.restart_at)}"
    if isinstance(f, Freeze):
        return f"freeze:node{f.node}@{_t(f.start)}-{_t(f.end)}"
    window = "" if f.start == 0 and math.isinf(f.end) else f"@{_t(f.start)}-{_t(f.end)}"
    return f"slow:node{f.node}x{_t(f.factor)}{window}"


_NUM = r"(\d+(?:\.\d*)?)"
_NODE = r"(?:node)?(\d+)"
_KILL = re.compile(rf"kill:{_NODE}@{_NUM}(?:,restart@(?:{_NUM}|(never)))?")
_FREEZE = re.compile(rf"freeze:{_NODE}@{_NUM}-{_NUM}")
_SLOW = re.compile(rf"slow:{_NODE}x{_NUM}(?:@{_NUM}-{_NUM})?")


def parse_script(text: str, nodes: int, restart_delay: float = 20.0) -> Schedule:
    """Parse the scripted syntax (module docstring). Raises :class:`ConfigError` with the
    offending item for anything malformed or out of range."""
    faults: list[Fault] = []
    for raw in text.split(";"):
        item = "".join(raw.split()).lower()
        if not item:
            continue
        if m := _KILL.fullmatch(item):
            at = float(m[2])
            restart = None if m[4] else float(m[3]) if m[3] else at + restart_delay
            faults.append(Kill(int(m[1]), at, restart))
        elif m := _FREEZE.fullmatch(item):
            faults.append(Freeze(int(m[1]), float(m[2]), float(m[3])))
        elif m := _SLOW.fullmatch(item):
            start, end = (float(m[3]), float(m[4])) if m[3] else (0.0, math.inf)
            faults.append(Slow(int(m[1]), float(m[2]), start, end))
        else:
            raise ConfigError(f"chaos: cannot parse {raw.strip()!r}; expected kill:nodeN@T[,restart@T|never], "
                              "freeze:nodeN@T1-T2 or slow:nodeNxF[@T1-T2]")
    return Schedule(nodes, tuple(faults), text)


def random_schedule(nodes: int, duration: float, seed: int, kill_every: float, restart_delay: float = 20.0,
                    freeze_every: float = 0.0, freeze_s: float = 15.0, jitter: float = 0.25,
                    extra: tuple[Fault, ...] = ()) -> Schedule:
    """A seeded random schedule: about one kill every ``kill_every`` seconds (kill k at
    ``k * kill_every`` plus a uniform jitter of ``± jitter * kill_every``) of a node picked
    at random among those up at that moment, restarted ``restart_delay`` later; freezes the
    same way with ``freeze_every`` / ``freeze_s`` (0: none). A fault is only injected while
    at least two nodes are up, so the swarm never loses its state. ``extra`` (for example
    :class:`Slow` faults) is appended unchanged. Same arguments, same schedule."""
    if kill_every < 0 or freeze_every < 0 or not 0 <= jitter < 0.5 or restart_delay < 0 or freeze_s <= 0:
        raise ConfigError("chaos: need kill_every, freeze_every, restart_delay >= 0, freeze_s > 0, jitter in [0, 0.5)")
    rng = random.Random(seed)
    draws: list[tuple[float, str]] = []
    for every, kind in ((kill_every, "kill"), (freeze_every, "freeze")):
        if every > 0:
            draws += [(k * every + rng.uniform(-jitter, jitter) * every, kind)
                      for k in range(1, int(duration / every) + 1)]
    busy_until = [0.0] * nodes  # a node is down or frozen until then
    faults: list[Fault] = []
    for at, kind in sorted(draws):
        up = [n for n in range(nodes) if busy_until[n] <= at]
        if at >= duration or len(up) < 2:
            continue
        node = rng.choice(up)
        if kind == "kill":
            faults.append(Kill(node, round(at, 1), round(at + restart_delay, 1)))
            busy_until[node] = at + restart_delay
        else:
            faults.append(Freeze(node, round(at, 1), round(at + freeze_s, 1)))
            busy_until[node] = at + freeze_s
    parts = [f"kill about every {kill_every:g} s, restart after {restart_delay:g} s" if kill_every else "no kills",
             f"freeze about every {freeze_every:g} s for {freeze_s:g} s" if freeze_every else ""]
    desc = f"random seed {seed}: " + ", ".join(x for x in parts if x)
    return Schedule(nodes, (*faults, *extra), desc)


def round_robin_schedule(nodes: int, kill_interval: float, restart_delay: float, duration: float) -> Schedule:
    """The simulator's chaos schedule (:func:`p2pdiloco.sim.chaos.chaos_sessions`): kill k at
    ``k * kill_interval`` hits node ``(k - 1) mod nodes``; a kill of a node still down does
    nothing (left out here); kills at or after ``duration`` are not applied."""
    down_until = [0.0] * nodes
    faults: list[Fault] = []
    kills = int(duration // kill_interval) if math.isfinite(kill_interval) else 0
    for k in range(1, kills + 1):
        at, node = k * kill_interval, (k - 1) % nodes
        if at >= duration or at < down_until[node]:
            continue
        faults.append(Kill(node, at, at + restart_delay))
        down_until[node] = at + restart_delay
    return Schedule(nodes, tuple(faults), f"round robin: kill every {kill_interval:g} s, restart after {restart_delay:g} s")
