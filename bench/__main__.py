"""The benchmark runner: one command for every benchmark; each writes its Markdown table, JSON
and PNG to docs/benchmarks/ (docs/benchmarks/README.md says what each measures and its goal).

    python -m bench list                  # the benchmarks, one line each
    python -m bench run NAME [ARGS...]    # one benchmark (the same as python -m bench.NAME ARGS...)
    python -m bench run NAME --help       # its options
    python -m bench all                   # the four headline benchmarks, about 30 minutes on 2 cores
    python -m bench all --quick           # smoke runs of the four (a few minutes)

Run from the repository root: the benchmarks start nodes (``python -m node``) and workers
(``python -m bench.workers``) that find their packages there. The four of ``all``:
  bandwidth    bytes per token and held-out loss: DDP, sync DiLoCo, torchft, p2pdiloco
  stragglers   4 nodes, one slowed 4x: merged tokens/s against standalone
  overhead     a node's tokens/s in a 3-node swarm against training alone
  goodput      goodput under the same kill/restart schedule: p2pdiloco and torchft

Each benchmark ends every process it starts (nodes, p2pd, workers, lighthouse) and deletes
its network namespaces and cgroups on every exit path. A benchmark that fails is reported
and the others still run; the exit code is 1 if any failed, 2 for a bad command line.
"""

from __future__ import annotations

import ast
import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADLINE = ["bandwidth", "stragglers", "overhead", "goodput"]
# modules of the package that are no benchmark: shared code and the children benchmarks start
HELPERS = {"__init__", "__main__", "common", "internet", "workers", "stream_cost"}


def benchmarks() -> dict[str, str]:
    """Every benchmark module's name -> the first line of its docstring (read, not imported:
    listing needs none of their dependencies)."""
    out = {}
    for path in sorted(HERE.glob("*.py")):
        if path.stem not in HELPERS:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            out[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return out


def _term_with_parent() -> None:
    """In the child: SIGTERM (its cleanup path) when the runner dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(name: str, args: list[str]) -> int:
    """``python -m bench.NAME ARGS`` as a child; returns its exit code, 130 when interrupted
    (Ctrl+C or SIGTERM: the child gets SIGTERM, its cleanup path, and up to 120 s to end)."""
    proc = subprocess.Popen([sys.executable, "-m", f"bench.{name}", *args], preexec_fn=_term_with_parent)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print("bench: interrupted", file=sys.stderr)
        return 130


def run_all(extra: list[str]) -> int:
    """The headline benchmarks in turn; a failed one is reported and the others still run."""
    failed = []
    t0 = time.monotonic()
    for name in HEADLINE:
        print(f"bench: {name} {' '.join(extra)}", flush=True)
        code = run(name, extra)
        if code == 130:
            return code
        if code != 0:
            failed.append(f"{name} (exit {code})")
    print(f"bench: done in {(time.monotonic() - t0) / 60:.1f} min"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _stop)
    known = benchmarks()
    if argv[:1] == ["list"] and len(argv) == 1:
        width = max(map(len, known))
        for name, line in known.items():
            print(f"{name:<{width}}  {line}")
        return 0
    if argv[:1] == ["run"] and len(argv) >= 2:
        if argv[1] not in known:
            print(f"bench: no benchmark {argv[1]!r} (python -m bench list)", file=sys.stderr)
            return 2
        return run(argv[1], argv[2:])
    if argv[:1] == ["all"] and all(a == "--quick" for a in argv[1:]):
        return run_all(argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
