"""Catch-up bytes of real nodes: what a node that fell a few rounds behind downloads to catch
up, at this commit (catch-ups from the rounds missed, ``net.state.deltas``) against a baseline commit
(every catch-up a state download), in the same run.

    python -m bench.catchups --baseline 7193932 --repeats 2

Each commit runs from its own clean clone checked out at that commit, inside its own network
namespace: a bootstrap peer and three nodes (``python -m node run --duration``) with the
bandwidth benchmark's model, data and swarm settings (4 fragments, grace 1-3 s), H = 100,
``--precision`` on the wire. Once node2 merges with the others, its process is stopped
(SIGSTOP; its p2pd stays up) for ``--freeze`` seconds while the two others merge without it,
then continued; it catches up on every fragment. From node2's journal (``events.jsonl``), per
follow: the versions it jumped and the payload bytes of its download (the event's ``bytes``;
the baseline has no such field, and its downloads are the fragment's state, Θ and momentum in
fp32, whose bytes the benchmark computes from the model). The runs alternate between the
commits, so drifts in the machine's load fall on both.

Writes docs/benchmarks/catchups.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path

from bench import common as c
from bench.control_plane import checkout


def state_bytes(values: dict[str, str]) -> list[int]:
    """Each fragment's state bytes (Θ and momentum, fp32) for these settings."""
    from node.setup import Setup  # noqa: PLC0415
    from p2pdiloco.config import load_config  # noqa: PLC0415

    s = Setup.build(load_config(overrides={**values, "data.max_bytes": "50000"}), "bench", "QmBench")
    return [8 * sum(t.numel for t in f.slots) for f in s.fragments]


def run_once(src: Path, work: Path, seed: int, freeze: float, precision: str, duration: float) -> dict:
    values = {**c.settings(inner__total_steps=100_000, outer__sync_every=100, outer__wire_precision=precision,
                           eval_every=1_000_000, seed=seed), **c.SWARM}
    sizes = state_bytes(values)
    work.mkdir(parents=True, exist_ok=True)
    with c.NetNS(f"cu{seed}") as ns, c.processes() as procs:
        prefix = [*ns.prefix, "env", f"--chdir={src}", f"PYTHONPATH={src}"]
        nodes = c.start_swarm(procs, work, 3, values, prefix=prefix, duration=duration)
        d2 = nodes[2][1]
        deadline = time.monotonic() + 180
        while (c.read_json(d2 / "status.json") or {}).get("rounds_with_peers", 0) < 4:
            if time.monotonic() > deadline or any(p.poll() is not None for p, _ in nodes):
                raise RuntimeError(f"node2 did not merge with the others; logs in {work}")
            time.sleep(0.5)
        pid = c.read_json(d2 / "status.json")["pid"]  # the node's own process (its p2pd stays up)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(freeze)
        finally:
            os.kill(pid, signal.SIGCONT)
        thawed_at = time.time()
        c.wait_all([p for p, _ in nodes], duration + 300, "catch-ups")
        reports = [c.read_json(d / "report.json") for _, d in nodes]
        if any(r is None for r in reports) or any(p.returncode != 0 for p, _ in nodes):
            raise RuntimeError(f"a node failed; logs in {work}")
    follows = [e for e in _journal(d2) if e.get("event") == "follow" and e["t"] >= thawed_at - 1]
    rows = [{"fragment": e["fragment"], "behind": e["version"] - e["from_version"], "rounds": e.get("rounds", 0),
             "bytes": e.get("bytes", sizes[e["fragment"]]), "state_bytes": sizes[e["fragment"]]} for e in follows]
    return {"follows": rows, "digests": len({r["global_digest"] for r in reports}),
            "delta_catchups": reports[2].get("delta_catchups"), "catchups": reports[2]["catchups"]}


def _journal(d: Path) -> list[dict]:
    out = []
    for line in (d / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="catch-up bytes of a node that fell behind, this commit against a baseline")
    p.add_argument("--baseline", default="7193932", help="the commit to compare with (default: before net.state.deltas)")
    p.add_argument("--commit", default="HEAD")
    p.add_argument("--repeats", type=int, default=2, help="runs per commit (seeds 0, 1, ...)")
    p.add_argument("--freeze", type=float, default=8.0, help="seconds node2 is stopped")
    p.add_argument("--precision", default="int4", help="outer.wire_precision of the run")
    p.add_argument("--duration", type=float, default=60.0, help="seconds each node trains")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    work, m, t0 = c.begin("catch-ups", a.workdir, "p2pdiloco-bench-cu-")
    commits = [checkout(x, work) for x in (a.baseline, a.commit)]
    runs = []
    for seed in range(a.repeats):
        for short, src in commits:
            print(f"catch-ups: {short} seed {seed} ...", flush=True)
            r = run_once(src, work / f"{short}-{seed}", seed, a.freeze, a.precision, a.duration)
            runs.append({"commit": short, "seed": seed, **r})
            print(f"catch-ups: {short} seed {seed}: {len(r['follows'])} follows, "
                  f"{sum(f['bytes'] for f in r['follows']) / 1e3:.1f} kB", flush=True)
    write(a, runs, [s for s, _ in commits], m, time.monotonic() - t0)


def write(a: argparse.Namespace, runs: list[dict], commits: list[str], m: dict, seconds: float) -> None:
    doc = c.Doc("catchups", "Catch-up bytes of a node that fell behind",
                f"python -m bench.catchups --baseline {a.baseline} --repeats {a.repeats} --freeze {a.freeze:g} "
                f"--precision {a.precision} --duration {a.duration:g}", intro=[__doc__.split("\n\n")[2]])
    doc.table(["commit", "seed", "follows", "versions behind (mean)", "from rounds", "kB downloaded",
               "kB of the states", "bytes / state bytes", "final states"],
              [[r["commit"], r["seed"], len(r["follows"]),
                f"{statistics.mean(f['behind'] for f in r['follows']):.1f}" if r["follows"] else "-",
                sum(f["rounds"] > 0 for f in r["follows"]), f"{sum(f['bytes'] for f in r['follows']) / 1e3:.1f}",
                f"{sum(f['state_bytes'] for f in r['follows']) / 1e3:.1f}",
                f"{sum(f['bytes'] for f in r['follows']) / max(1, sum(f['state_bytes'] for f in r['follows'])):.3f}",
                r["digests"]] for r in runs],
              caption=f"node2's follows after it was continued ({a.freeze:g} s stopped), every run:")
    ratio = {k: sum(f["bytes"] for r in runs if r["commit"] == k for f in r["follows"])
             / max(1, sum(f["state_bytes"] for r in runs if r["commit"] == k for f in r["follows"])) for k in commits}
    doc.table(["commit", "catch-up bytes / state bytes (all runs)"], [[k, f"{ratio[k]:.3f}"] for k in commits],
              caption="Per commit, the bytes node2 downloaded to catch up over what the same follows cost as "
                      "state downloads:")
    path = doc.write(m, seconds, {"runs": runs, "commits": commits})
    print(f"catch-ups: wrote {path}", flush=True)


if __name__ == "__main__":
    main()
