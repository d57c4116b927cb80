"""CPU used on the machine by the harness's own processes and by everything else.

Other processes (other users' jobs, tests) compete with the nodes for the cores and make a
node's throughput drop by itself; the run reports how many cores they used on average so a
result can be read against it.
"""

from __future__ import annotations

import psutil

from p2pdiloco.procs import Processes


class LoadMonitor:
    """Call :meth:`sample` every few seconds; :meth:`summary` gives mean cores busy in total
    and in our process groups (CPU seconds of processes that ended between two samples are
    missed, so ``ours`` is a slight underestimate and ``others`` a slight overestimate)."""

    def __init__(self, procs: Processes):
        self.procs = procs
        self.cpu: dict[int, float] = {}  # pid -> cpu seconds at the last sample
        self.t_last: float | None = None
        self.busy_last = 0.0
        self.total = self.ours = self.seconds = 0.0

    def _busy(self) -> float:
        t = psutil.cpu_times()
        return t.user + t.system + t.nice + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + \
            getattr(t, "steal", 0.0)

    def sample(self, now: float) -> None:
        busy = self._busy()
        cpu: dict[int, float] = {}
        for p in self.procs.procs:
            for m in p.group_members():
                try:
                    c = m.cpu_times()
                    cpu[m.pid] = c.user + c.system
                except psutil.Error:
                    continue
        try:
            me = psutil.Process().cpu_times()
            cpu[-1] = me.user + me.system
        except psutil.Error:
            pass
        if self.t_last is not None and now > self.t_last:
            self.seconds += now - self.t_last
            self.total += busy - self.busy_last
            # a process first seen now started since the last sample: all its CPU time is new
            self.ours += sum(v - self.cpu.get(pid, 0.0) for pid, v in cpu.items() if pid != -1 or pid in self.cpu)
        self.t_last, self.busy_last, self.cpu = now, busy, cpu

    def summary(self) -> dict[str, float]:
        if not self.seconds:
            return {}
        total, ours = self.total / self.seconds, self.ours / self.seconds
        return {"cores": psutil.cpu_count() or 0, "busy_cores": round(total, 2), "ours_cores": round(ours, 2),
                "others_cores": round(max(0.0, total - ours), 2)}
