"""Run every benchmark in turn; each writes its Markdown table, JSON and PNG to docs/benchmarks/.

    python bench/run_all.py            # about 30 minutes on a 2-core machine
    python bench/run_all.py --quick    # smoke runs of all four (a few minutes)

Benchmarks (each is also one command of its own):
  1. python bench/bandwidth.py    bytes per token and held-out loss: DDP, sync DiLoCo, torchft, p2pdiloco
  2. python bench/stragglers.py   4 nodes, one slowed 4x: merged tokens/s against standalone
  3. python bench/overhead.py     a node's tokens/s in a 3-node swarm against training alone
  4. python bench/goodput.py      goodput under the same kill/restart schedule: p2pdiloco and torchft

Each benchmark ends every process it starts (nodes, p2pd, workers, lighthouse) and deletes
its network namespaces and cgroups on every exit path. A benchmark that fails is reported
and the others still run; the exit code is 1 if any failed.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["bandwidth.py", "stragglers.py", "overhead.py", "goodput.py"]


def _term_with_parent() -> None:
    """In the child: SIGTERM (its cleanup path) when run_all dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    extra = [a for a in sys.argv[1:] if a == "--quick"]
    if len(extra) != len(sys.argv[1:]):
        print(__doc__)
        return 2
    failed = []
    t0 = time.monotonic()
    for name in BENCHMARKS:
        print(f"run_all: {name} {' '.join(extra)}", flush=True)
        proc = subprocess.Popen([sys.executable, str(HERE / name), *extra], preexec_fn=_term_with_parent)
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # Ctrl+C or SIGTERM: the benchmark cleans up, then we stop
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            print("run_all: interrupted", file=sys.stderr)
            return 130
        if code != 0:
            failed.append(f"{name} (exit {code})")
    print(f"run_all: done in {(time.monotonic() - t0) / 60:.1f} min"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
