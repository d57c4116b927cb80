"""CPU duty-cycle throttling of node processes (what ``cpulimit`` does), for pacing and slowdown.

A node throttled to share ``s`` runs ``s * period`` seconds of every ``period``: its Python
process (training thread and event loop) gets SIGCONT at the start of its window and SIGSTOP
at the end. Only the process itself is paused, not its libp2p daemon, so TCP connections
stay up and incoming data is buffered; an RPC to a paused node is answered at most
``(1 - s) * period`` seconds late. Windows of different nodes are staggered over the period
so that their CPU demand spreads out.

Why: on a machine with fewer cores than nodes, unthrottled nodes share the CPU, so a killed
node's CPU goes to the survivors and "tokens processed" barely drops: goodput measured against
a fixed per-node rate would hide the cost of the kill. Capping every node at a share whose sum
stays below the core count makes a node's throughput its own, as on separate machines. A
slowdown by ``x F`` divides the node's share by F: it really computes F times slower.
"""

from __future__ import annotations

import signal

from p2pdiloco.procs import Proc


class Throttle:
    """Duty cycles for a set of processes. Call :meth:`tick` often (every few ms); it returns
    the time of the next switch. A process that is frozen (``proc.stopped``) is left alone."""

    def __init__(self, period: float = 0.1):
        self.period = period
        self.shares: dict[int, tuple[Proc, float, float]] = {}  # pid -> (proc, share, phase)

    def set(self, proc: Proc, share: float, phase: float) -> None:
        """Run ``proc`` ``share`` (0 < share <= 1) of the time, its window starting at
        ``phase`` (fraction of the period). ``share >= 1`` removes the throttle."""
        if share >= 1:
            self.release(proc)
            return
        self.shares[proc.pid] = (proc, max(share, 0.01), phase % 1.0)

    def release(self, proc: Proc) -> None:
        """Stop throttling ``proc`` and let it run (unless it is frozen)."""
        self.shares.pop(proc.pid, None)
        if proc.paused and not proc.stopped:
            proc.signal_leader(signal.SIGCONT)
        proc.paused = False

    def release_all(self) -> None:
        for proc, _, _ in list(self.shares.values()):
            self.release(proc)

    def tick(self, now: float) -> float:
        """Switch every throttled process to its state at ``now``; the next switch time."""
        nxt = now + self.period
        for pid, (proc, share, phase) in list(self.shares.items()):
            if not proc.alive():
                del self.shares[pid]
                continue
            pos = (now / self.period - phase) % 1.0  # where in its cycle this process is
            on = pos < share
            if not proc.stopped and on == proc.paused:
                proc.signal_leader(signal.SIGCONT if on else signal.SIGSTOP)
                proc.paused = not on
            to_switch = (share - pos) if on else (1.0 - pos)
            nxt = min(nxt, now + max(to_switch, 1e-3) * self.period)
        return nxt
