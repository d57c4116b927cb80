"""Shared pieces of the benchmark suite: the one model / data / token budget every system
trains, network namespaces that count the bytes crossing the sockets, CPU caps, child
processes that all end on every exit path, machine description and the output files.

Every benchmark runs its systems as real processes: each system inside its own network
namespace (``ip netns``) with only a loopback interface, so the namespace's ``lo`` counters
(``/proc/net/dev``) hold exactly the bytes that system's processes sent to each other
(payload plus TCP/IP headers; on loopback every byte sent is also received, so the transmit
counter alone is the traffic).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from node.control import ControlUnreachable, query
from p2pdiloco.procs import Proc, Processes, read_json
from p2pdiloco.status import Status, StatusError, parse_status, read_status

DOCS = ROOT / "docs" / "benchmarks"
PY = sys.executable

# The one model and data every system trains (byte-level GPT from p2pdiloco.model on
# p2pdiloco.data's default corpus, the Python standard library's source): 2 layers, 64 wide,
# 119k parameters, 16 x 64 = 1024 tokens per inner step. ``total_steps`` (the end of the
# cosine) is set per benchmark to its step budget.
MODEL = {"model.n_layer": "2", "model.n_embd": "64", "model.n_head": "4", "model.block_size": "64"}
TRAIN = {
    **MODEL,
    "seed": "0", "threads": "1",
    "inner.lr": "3e-3", "inner.warmup_steps": "50", "inner.total_steps": "1000",
    "data.batch_size": "16", "data.max_bytes": "2000000", "data.eval_batches": "16",
    "outer.lr": "0.7", "outer.momentum": "0.9",
}
# p2pdiloco's own knobs (the demo's, scaled to this model)
SWARM = {
    "outer.fragments": "4", "outer.overlap": "2", "outer.min_quorum": "1",
    "outer.grace_min": "1.0", "outer.grace_max": "3.0", "outer.quorum_timeout": "8",
    "outer.liveness_timeout": "8", "checkpoint_every": "0",
}
TOKENS_PER_STEP = 16 * 64


def params(model: dict[str, str]) -> int:
    """Parameters of the benchmark model with ``model``'s settings over :data:`MODEL`'s (119,424
    without); raises ValueError for settings the model does not take."""
    from p2pdiloco.model_config import ModelConfig  # noqa: PLC0415

    sizes = {}
    for k, v in {**MODEL, **model}.items():
        if not (v.isascii() and v.isdigit()):
            raise ValueError(f"{k}={v}: expected a positive whole number")
        sizes[k.split(".", 1)[1]] = int(v)
    return ModelConfig(**sizes).num_parameters


def settings(**over: Any) -> dict[str, str]:
    """TRAIN with ``section__field=value`` overrides (double underscore for the dot)."""
    out = dict(TRAIN)
    out.update({k.replace("__", "."): str(v) for k, v in over.items()})
    return out


def add_set_option(p: Any) -> None:
    """``--set KEY=VALUE`` (repeatable) on an argparse parser: a setting for every process."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting for every process of every phase (model.n_embd=128: a slower inner step)")


def apply_overrides(p: Any, values: dict[str, str], pairs: list[str]) -> None:
    """Put ``--set`` pairs into ``values``; a pair without ``=`` or key is a usage error (exit 2)."""
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            p.error(f"--set {kv!r}: expected KEY=VALUE")
        values[key] = value


def set_args(values: dict[str, str]) -> list[str]:
    out = []
    for k, v in values.items():
        out += ["--set", f"{k}={v}"]
    return out


# ---- machine ----------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    import psutil  # noqa: PLC0415
    import torch  # noqa: PLC0415

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torchft  # noqa: PLC0415, F401
        from importlib.metadata import version  # noqa: PLC0415

        tft = version("torchft")
    except Exception:  # noqa: BLE001
        tft = "not installed"
    from importlib.metadata import version  # noqa: PLC0415

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        head, dirty = "unknown", False
    return {
        "commit": head + (" (working tree with uncommitted changes)" if dirty else ""),
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
        "hivemind": version("hivemind"), "torchft": tft, "load_start": os.getloadavg(),
    }


def machine_line(m: dict[str, Any]) -> str:
    la = m.get("load_start", (0, 0, 0))
    end = m.get("load_end")
    load = f"1-min load average {la[0]:.1f} at the start" + (f", {end[0]:.1f} at the end" if end else "")
    return (f"commit {m.get('commit', 'unknown')}; {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, no GPU, Linux {m['kernel']}; Python "
            f"{m['python']}, torch {m['torch']}, hivemind {m['hivemind']}, torchft {m['torchft']}. The machine "
            f"was shared with other engineers' test runs while this ran ({load}), so absolute rates are noisy: "
            "every figure that compares systems is a ratio measured in the same run.")


# ---- network namespaces -----------------------------------------------------------------

def _lo_counters(text: str) -> tuple[int, int]:
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            f = rest.split()
            return int(f[0]), int(f[8])  # rx bytes, tx bytes
    raise RuntimeError("no lo interface in /proc/net/dev")


def netns_available() -> bool:
    name = f"p2pbench-probe-{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return True


class NetNS:
    """A network namespace with only ``lo`` (up). ``prefix`` runs a command inside it;
    ``tx_bytes()`` reads its loopback transmit counter. Without ``ip netns`` (no root), the
    fallback runs in the host namespace and counts the host's ``lo`` (other traffic on this
    machine then leaks into the figure; the table says so)."""

    counter = 0

    def __init__(self, tag: str):
        NetNS.counter += 1
        self.name = f"p2pbench-{os.getpid()}-{NetNS.counter}-{tag}"[:60]
        self.isolated = False

    def __enter__(self) -> NetNS:
        try:
            subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True, timeout=10)
            subprocess.run(["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"], check=True,
                           capture_output=True, timeout=10)
            self.isolated = True
        except (OSError, subprocess.SubprocessError):
            self.close()
            self.isolated = False
        return self

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name] if self.isolated else []

    def tx_bytes(self) -> int:
        if not self.isolated:
            return _lo_counters(Path("/proc/net/dev").read_text())[1]
        out = subprocess.run(["ip", "netns", "exec", self.name, "cat", "/proc/net/dev"], check=True,
                             capture_output=True, text=True, timeout=10).stdout
        return _lo_counters(out)[1]

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)

    def __exit__(self, *exc: object) -> None:
        if self.isolated:
            self.close()


# ---- CPU caps -------------------------------------------------------------------------------

def _cpu_cgroup_root() -> tuple[Path, str] | None:
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, "v1"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text():
        return v2, "v2"
    return None


class CpuCap:
    """A CPU-quota cgroup (CFS bandwidth: ``cores`` CPU-seconds per second for the whole
    group: the node, its threads and its p2pd). ``add`` moves a running process into it."""

    counter = 0

    def __init__(self, cores: float, tag: str):
        root = _cpu_cgroup_root()
        if root is None:
            raise RuntimeError("no writable CPU cgroup controller (/sys/fs/cgroup/cpu or cgroup v2 'cpu')")
        CpuCap.counter += 1
        self.root, self.kind = root
        self.path = self.root / f"p2pbench-{os.getpid()}-{CpuCap.counter}-{tag}"
        self.path.mkdir()
        period = 100_000
        quota = max(1000, int(cores * period))
        if self.kind == "v1":
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {period}")
        self.cores = cores

    def add(self, pid: int | None) -> None:
        """Move a running process (all its threads; children it starts later follow) into the cap."""
        if pid:
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # it has exited

    def close(self) -> None:
        try:
            left = [p for p in (self.path / "cgroup.procs").read_text().split() if p]
            for pid in left:  # should not happen: the children are gone; move them out
                try:
                    (self.root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            self.path.rmdir()
        except OSError:
            pass


def cleanup_stale() -> None:
    """Remove namespaces and cgroups left by a benchmark process that no longer exists
    (only ours: names start with p2pbench-PID-)."""
    def dead(name: str) -> bool:
        parts = name.split("-")
        return len(parts) > 1 and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists()

    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith("p2pbench-") and dead(name):
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        pass
    root = _cpu_cgroup_root()
    if root:
        for d in root[0].glob("p2pbench-*"):
            if dead(d.name):
                try:
                    d.rmdir()
                except OSError:
                    pass


# ---- processes --------------------------------------------------------------------------

@contextmanager
def processes():
    """Children (nodes get SIGTERM if the benchmark dies) that are all ended (TERM, then KILL)
    when the block exits, however it exits; anything left of them is killed and reported."""
    procs = Processes(parent_death=signal.SIGTERM)
    try:
        yield procs
    finally:
        procs.close(grace=10.0)
        left = procs.survivors()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if left:
            print(f"bench: killed {len(left)} leftover processes: {left}", file=sys.stderr)


def begin(what: str, workdir: Path | None, prefix: str) -> tuple[Path, dict[str, Any], float]:
    """Start of a benchmark that counts socket bytes in network namespaces: signal handlers,
    leftovers of earlier runs removed, namespaces required (else exits with one line);
    returns (work directory: ``workdir`` or a new temporary one, :func:`machine`, start time)."""
    install_signal_handlers()
    cleanup_stale()
    if not netns_available():
        raise SystemExit(f"{what}: needs network namespaces (ip netns) to count socket bytes")
    return workdir or Path(tempfile.mkdtemp(prefix=prefix)), machine(), time.monotonic()


def install_signal_handlers() -> None:
    """SIGTERM ends a benchmark through its cleanup paths (as Ctrl+C does)."""
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def wait_all(procs: list[Proc], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what} did not finish within {timeout:.0f} s") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- systems ------------------------------------------------------------------------------

def start_swarm(procs: Processes, work: Path, n: int, values: dict[str, str], *, run_id: str = "bench",
                prefix: list[str] | None = None, node_prefix: list[list[str]] | None = None,
                max_steps: int = 0, duration: float = 0.0, names: list[str] | None = None,
                shards: int | None = None) -> list[tuple[Proc, Path]]:
    """A bootstrap peer and ``n`` p2pdiloco nodes (``python -m node run``), as node/demo.py
    starts them; ``prefix`` (a namespace) wraps every process, ``node_prefix[i]`` (a CPU cap)
    wraps node i."""
    prefix = prefix or []
    maddr = procs.start_bootstrap(work, tuple(prefix), timeout=90)
    nodes = []
    for i in range(n):
        name = names[i] if names else f"node{i}"
        d = work / name
        d.mkdir(parents=True, exist_ok=True)
        argv = [PY, "-m", "node", "run", "--initial-peers", maddr, "--host", "127.0.0.1", "--port", "0",
                "--name", name, "--data-dir", str(d), "--status-file", str(d / "status.json"),
                "--report-file", str(d / "report.json"), "--run-id", run_id, "--no-progress",
                "--set", f"data.shard_index={i}", "--set", f"data.num_shards={shards or n}"]
        if max_steps:
            argv += ["--max-steps", str(max_steps)]
        if duration:
            argv += ["--duration", str(duration)]
        argv += set_args(values)
        wrap = [*prefix, *(node_prefix[i] if node_prefix else [])]
        nodes.append((procs.start([*wrap, *argv], d / "node.log"), d))
    return nodes


STEADY = (0.15, 0.85)  # the steady window: from every node past this share of its steps to the first past that


def window_by_steps(ns: NetNS, nodes: list, steps: int, timeout: float = 1800.0) -> dict | None:
    """Socket bytes, payload, tokens and rounds between the moment every node has trained
    ``STEADY[0]`` of its ``steps`` and the moment the first has trained ``STEADY[1]``: start-up
    (joins, first states) and the end-of-budget flush left out. The nodes' figures are fresh
    snapshots from their control sockets, read right after the namespace's counter. None when
    a node stops answering before the window closes (the run's own checks then say why)."""
    socks = [str(d / "control.sock") for _, d in nodes]

    def snapshot() -> tuple[int, float, list[Status]] | None:
        sent, t = ns.tx_bytes(), time.monotonic()
        try:
            snaps = [parse_status(query(q, timeout=10)) for q in socks]
        except (ControlUnreachable, StatusError):
            return None
        return sent, t, [x if isinstance(x, Status) else Status(name=x.name, state=x.state) for x in snaps]

    def wait(done) -> tuple[int, float, list[Status]] | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            snap = snapshot()
            if snap and done([x.step for x in snap[2]]):
                return snap
            if any(p.poll() is not None for p, _ in nodes):
                return None
            time.sleep(0.5)
        return None

    a = wait(lambda st: min(st) >= STEADY[0] * steps)
    b = a and wait(lambda st: max(st) >= STEADY[1] * steps)
    if not b:
        return None
    pairs = list(zip(a[2], b[2]))
    return {"bytes": b[0] - a[0], "seconds": b[1] - a[1], "tokens": sum(y.tokens - x.tokens for x, y in pairs),
            "payload": sum(y.bytes_out - x.bytes_out for x, y in pairs),
            "rounds": sum(y.rounds_committed - x.rounds_committed for x, y in pairs)}


def worker_argv(mode: str, rank: int, world: int, values: dict[str, str], out: Path, **kw: Any) -> list[str]:
    """``python -m bench.workers``: DDP, synchronous DiLoCo, torchft DiLoCo or a standalone trainer
    (run from the repository root, as every benchmark is: the child finds ``bench`` there)."""
    argv = [PY, "-m", "bench.workers", mode, "--rank", str(rank), "--world", str(world), "--out", str(out),
            "--settings", json.dumps(values)]
    for k, v in kw.items():
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


# ---- output -------------------------------------------------------------------------------

@dataclass
class Doc:
    """One benchmark's Markdown file: title, what it measures, the command, the machine, tables."""

    name: str
    title: str
    command: str
    intro: list[str] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)

    def table(self, header: list[str], rows: list[list[Any]], caption: str = "") -> None:
        lines = ([caption, ""] if caption else []) + ["| " + " | ".join(header) + " |",
                                                       "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        self.sections.append("\n".join(lines))

    def text(self, *paragraphs: str) -> None:
        self.sections.extend(paragraphs)

    def write(self, m: dict[str, Any], seconds: float, data: dict[str, Any]) -> Path:
        DOCS.mkdir(parents=True, exist_ok=True)
        m = {**m, "load_end": m.get("load_end") or os.getloadavg()}
        body = [f"# {self.title}", "", *self.intro, "",
                f"Command: `{self.command}` (from the repository root, in the project's virtual environment; "
                f"took {seconds / 60:.1f} minutes).", "",
                f"Machine: {machine_line(m)}", "", *[s + "\n" for s in self.sections]]
        path = DOCS / f"{self.name}.md"
        path.write_text("\n".join(body).rstrip() + "\n")
        (DOCS / f"{self.name}.json").write_text(json.dumps({"machine": m, **data}, indent=1, default=str) + "\n")
        return path


def replica_main(ap: Any, run: Any, make_runs: Any, report: Any) -> None:
    """``main`` of the in-process replica benchmarks (``bench.partial_rounds``, ``mixed_speeds``,
    ``codecs``): adds ``--jobs``, ``--no-write`` and ``--report-from`` to the argparse parser
    ``ap``, runs ``run(*args)`` for every tuple of ``make_runs(args)`` in a process pool, then
    ``report(results, args, machine, seconds)``."""
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (one core each)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--report-from", metavar="JSON", help="rewrite the report from an earlier run's JSON file")
    a = ap.parse_args()
    if a.report_from:
        data = json.loads(Path(a.report_from).read_text())
        report(data["results"], a, data["machine"], data["seconds"])
        return
    m, t0 = machine(), time.monotonic()
    with ProcessPoolExecutor(a.jobs) as pool:
        results = list(pool.map(run, *zip(*make_runs(a))))
    if not a.no_write:
        report(results, a, m, time.monotonic() - t0)


def fmt(x: float | None, nd: int = 3) -> str:
    if x is None:
        return "n/a"
    return f"{x:.{nd}f}"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


# ---- throughput sampling ------------------------------------------------------------------

def status_of(path: Path) -> dict[str, Any] | None:
    """A node's status.json or a worker's status file, as (time, tokens, merged) figures."""
    node = read_status(path)
    if isinstance(node, Status):  # a p2pdiloco node (p2pdiloco.status)
        return {"t": node.time, "tokens": node.tokens, "merged": node.tokens_merged, "state": node.state,
                "pid": node.pid, "p2pd_pid": node.p2pd_pid}
    s = read_json(path)
    if not s or "t" not in s:  # missing, or a node still starting
        return None
    return {"t": s["t"], "tokens": s["tokens"], "merged": s["merged"], "state": "training", "pid": s.get("pid"),
            "cpu_s": s.get("cpu_s")}


def node_status(path: Path) -> Status:
    """A node's status file (p2pdiloco.status) as a Status: zeros while it is missing or the
    node is still starting."""
    node = read_status(path)
    return node if isinstance(node, Status) else Status(name=path.parent.name, state="starting")


def wait_training(paths: list[Path], procs: list[Proc], timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = [status_of(p) for p in paths]
        if all(s is not None and s["state"] in ("training", "alone") and s["tokens"] > 0 for s in st):
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{len(dead)} process(es) exited during start-up (first: {dead[0].args[-1]!r})")
        time.sleep(0.5)
    raise RuntimeError(f"not every process was training after {timeout:.0f} s")


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) points (0.0 with fewer than two distinct times)."""
    if len(points) < 2:
        return 0.0
    mt = sum(t for t, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / var if var > 0 else 0.0


def window_rates(paths: list[Path], warm: float, window: float) -> list[dict[str, float]]:
    """After ``warm`` seconds, each process's tokens/s and merged tokens/s over ``window``
    seconds: least-squares slopes of its counters, read about every second from its own status
    file (with the status's own timestamps), so that merges, which move the merged counter in
    steps, do not make the figure depend on where the window starts."""
    time.sleep(warm)
    series: list[dict[float, tuple[float, float]]] = [{} for _ in paths]
    end = time.monotonic() + window
    while time.monotonic() < end:
        for ser, p in zip(series, paths):
            s = status_of(p)
            if s is not None:
                ser[s["t"]] = (s["tokens"], s["merged"])
        time.sleep(0.5)
    out = []
    for ser in series:
        pts = sorted(ser.items())
        out.append({"tokens_per_s": slope([(t, v[0]) for t, v in pts]),
                    "merged_per_s": slope([(t, v[1]) for t, v in pts]),
                    "seconds": pts[-1][0] - pts[0][0] if pts else 0.0, "samples": len(pts)})
    return out
