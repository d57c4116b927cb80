"""Benchmark: volunteers on slow home links and behind NAT. Four p2pdiloco nodes on a
simulated internet (bench/internet.py): the merged tokens per second of the three on
50 Mbit/s links when the fourth is on 2 Mbit/s, or behind NAT (reached through the bootstrap
peer's relay), against the same with all four on 50 Mbit/s.

    python -m bench.home_links           # as root; 11 to 16 minutes on a 2-core machine
    python -m bench.home_links --quick   # a smoke run (short windows; about 3 to 7 minutes)

Each phase builds a fresh internet: the bootstrap peer on public host ``boot`` (not limited,
announced as relay.example), n1..n3 on public hosts (announced as n<i>.example: libp2p treats
203.0.113.x as unroutable) and a fourth node: *fast* n4 at 50 Mbit/s (the reference), *slow*
n4 at 2 Mbit/s, *relayed* h1 behind NAT at 50 Mbit/s, measured once its status says "relayed".
Rates are tbf limits on both directions of a host's link. Once all four train, each node and
its p2pd go into a CPU-quota cgroup of ``--cap`` cores (the phases get the same CPU on a shared
machine); then ``--warm`` s of warm-up and ``--window`` s measured from the nodes' status files
(least-squares slopes, as bench/stragglers.py). Needs root; exits 2 without.

Writes docs/benchmarks/home_links.md, .json and .png.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import common as c
from bench.internet import Internet, delete_namespaces, namespaces, unavailable
from p2pdiloco.model import ModelConfig
from p2pdiloco.status import Status

GOAL = 0.90  # the fast nodes keep at least 90% of their all-fast merged-token rate
RELAY, PORT = "relay.example", 4001
FAST = ("n1", "n2", "n3")
PHASES = ("fast", "slow", "relayed")
STALE = re.compile(r"hl(\d+)x\d+-[A-Za-z0-9]+")  # our namespaces: hl<pid>x<phase>-<host>


def cleanup_stale() -> None:
    """Delete namespaces left by a run of this benchmark whose process no longer exists."""
    dead = [ns for ns in namespaces() if (m := STALE.fullmatch(ns)) and not Path(f"/proc/{m[1]}").exists()]
    delete_namespaces(dead)


def start_boot(net: Internet, procs: c.Processes, work: Path) -> str:
    """The bootstrap peer (and relay) on ``boot``; returns its multiaddr under RELAY."""
    path = work / "bootstrap.txt"
    boot = procs.start([*net.exec_prefix("boot"), c.PY, "-m", "bootstrap", "--host", "0.0.0.0", "--port", "31337",
                        "--maddrs-file", str(path), "--announce", f"/dns4/{RELAY}/tcp/31337"], work / "bootstrap.log")
    return wait_for(lambda: next((m for m in (path.read_text().split() if path.exists() else []) if f"/{RELAY}/" in m),
                                 None), boot, 90, "the bootstrap peer's multiaddr")


def wait_for(get: Callable[[], Any], proc: c.Proc, timeout: float, what: str) -> Any:
    """Poll ``get()`` until it returns something truthy; RuntimeError when ``proc`` exits or on timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := get():
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"a process exited (code {proc.returncode}) while waiting for {what}")
        time.sleep(0.5)
    raise RuntimeError(f"no {what} within {timeout:.0f} s")


def run_phase(k: int, label: str, a: argparse.Namespace, values: dict[str, str], work: Path) -> dict[str, Any]:
    fourth = "h1" if label == "relayed" else "n4"
    nodes = [*FAST, fourth]
    public = ["boot", *(h for h in nodes if h != "h1")]
    rates = {h: a.slow_mbit if (label, h) == ("slow", "n4") else a.fast_mbit for h in nodes}
    names = {RELAY: "boot", **{f"{h}.example": h for h in public[1:]}}
    life, d = 240 + a.relay_wait + a.warm + a.window + 60, work / label  # nodes end after the window; life bounds strays
    print(f"home_links: {label} ({fourth} at {rates[fourth]:g} Mbit/s{', NAT' if fourth == 'h1' else ''}) ...", flush=True)
    caps: list[c.CpuCap] = []
    out: dict[str, Any] = {"fourth": fourth, "link_mbit": rates[fourth], "nat": fourth == "h1"}
    try:
        caps.extend(c.CpuCap(a.cap, f"{label[:6]}{i}") for i in range(len(nodes) if a.cap > 0 else 0))
        with Internet(f"hl{os.getpid()}x{k}", homes=int(fourth == "h1"), public_hosts=public, rate_mbit=rates,
                      names=names) as net, c.processes() as procs:
            maddr = start_boot(net, procs, d)
            started, status = {}, {}
            for i, h in enumerate(nodes):
                status[h] = d / h / "status.json"
                argv = [c.PY, "-m", "node", "run", "--initial-peers", maddr, "--host", "0.0.0.0", "--port", str(PORT),
                        "--name", h, "--data-dir", str(d / h), "--status-file", str(status[h]),
                        "--report-file", str(d / h / "report.json"), "--run-id", "homelinks", "--no-progress",
                        "--threads", "1", "--duration", str(life), "--set", f"data.shard_index={i}",
                        *c.set_args(values)]
                if h != "h1":
                    argv += ["--set", f"swarm.announce=/dns4/{h}.example/tcp/{PORT}"]
                started[h] = procs.start([*net.exec_prefix(h), *argv], d / h / "node.log")
            c.wait_training(list(status.values()), list(started.values()), 240)
            for g, h in zip(caps, nodes):
                for pid in (started[h].pid, (c.status_of(status[h]) or {}).get("p2pd_pid")):
                    g.add(pid)
            if fourth == "h1":
                t0 = time.monotonic()
                wait_for(lambda: c.node_status(status["h1"]).reachability == "relayed", started["h1"],
                         a.relay_wait, "relay slot for h1 (status reachability 'relayed')")
                out["relayed_after_s"] = time.monotonic() - t0
                for g in caps[3:]:  # p2pd was restarted (forced private) for the slot: cap the new one too
                    g.add(c.node_status(status["h1"]).p2pd_pid)
            time.sleep(a.warm)
            before = {h: c.node_status(status[h]) for h in nodes}
            window = c.window_rates([status[h] for h in nodes], 0.0, a.window)
            after = {h: c.node_status(status[h]) for h in nodes}
    finally:
        for g in caps:
            g.close()

    def delta(h: str, figure: Callable[[Status], float]) -> float:
        return float(figure(after[h])) - float(figure(before[h]))

    out.update({
        "rates": dict(zip(nodes, window)),
        **{f"fast_{k}": sum(r[k] for r in window[:3]) for k in ("merged_per_s", "tokens_per_s")},
        "fast_rounds_with_peers": sum(delta(h, lambda s: s.rounds_with_peers) for h in FAST),
        "reachability": {h: after[h].reachability for h in nodes},
        "fourth_rounds_with_peers": delta(fourth, lambda s: s.rounds_with_peers),
        "fourth_rounds_total": after[fourth].rounds_with_peers,
        "fourth_mbit_in": 8e-6 * delta(fourth, lambda s: s.bytes_in) / max(1e-9, delta(fourth, lambda s: s.time)),
        "fourth_mbit_out": 8e-6 * delta(fourth, lambda s: s.bytes_out) / max(1e-9, delta(fourth, lambda s: s.time)),
        "bytes_relayed": {h: after[h].bytes_relayed for h in nodes},
        "bytes_relayed_window": {h: delta(h, lambda s: s.bytes_relayed) for h in nodes},
        "link_measured_mbit": {h: 8e-6 * float(after[h].link_bytes_per_s or 0) for h in nodes},
        # the fourth node's part of each reduction (bandwidth-aware shares) in its last rounds with peers
        "fourth_shares": [r.share for r in after[fourth].recent_rounds if r.committed and r.members > 1],
    })
    print(f"home_links: {label}: n1-n3 merged {out['fast_merged_per_s']:,.0f} tokens/s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="Benchmark: slow home links and NAT")
    p.add_argument("--fast-mbit", type=float, default=50.0)
    p.add_argument("--slow-mbit", type=float, default=2.0)
    p.add_argument("--H", type=int, default=24, help="outer.sync_every")
    p.add_argument("--precision", default="fp32", help="outer.wire_precision")
    p.add_argument("--cap", type=float, default=0.4, help="CPU cores per node with its p2pd (0: no cap)")
    p.add_argument("--warm", type=float, default=30.0)
    p.add_argument("--window", type=float, default=150.0, help="seconds measured per phase")
    p.add_argument("--relay-wait", type=float, default=300.0, help="seconds to wait for the NATed node's relay")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    if a.quick:
        a.warm, a.window = 5.0, 20.0
    if reason := unavailable():
        print(f"home_links: {reason}", file=sys.stderr)
        sys.exit(2)
    os.chdir(c.ROOT)  # the nodes run as `python -m node`
    c.install_signal_handlers()
    c.cleanup_stale()
    cleanup_stale()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="p2pdiloco-bench-homelinks-"))
    m, t0 = c.machine(), time.monotonic()
    values = {"seed": "0", "inner.total_steps": "100000", "data.num_shards": "4", "data.max_bytes": "2000000",
              "eval_every": "100000", "checkpoint_every": "0", "outer.sync_every": str(a.H),
              "outer.wire_precision": a.precision}
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for k, label in enumerate(a.phases):
        try:
            results[label] = run_phase(k, label, a, values, work)
        except RuntimeError as e:
            failed[label] = str(e)
            print(f"home_links: {label} failed: {e}", flush=True)
    write(a, results, failed, m, time.monotonic() - t0, work)
    sys.exit(0 if not failed else 1)


def write(a: argparse.Namespace, results: dict[str, dict[str, Any]], failed: dict[str, str], m: dict[str, Any],
          seconds: float, work: Path) -> None:
    cmd = "python -m bench.home_links" + (" --quick" if a.quick else "")
    doc = c.Doc("home_links", "Benchmark: volunteers on slow home links and behind NAT", cmd)
    params = ModelConfig().num_parameters or 0
    clean = "working tree" not in m["commit"]
    doc.intro = [
        "Four p2pdiloco nodes and a bootstrap peer (also the relay) on a simulated internet of network namespaces "
        "(bench/internet.py; link rates are tbf limits on both directions). Three phases, each on a fresh "
        f"internet: *fast*, n1 to n4 public on {a.fast_mbit:g} Mbit/s links; *slow*, n4 on {a.slow_mbit:g} Mbit/s; "
        f"*relayed*, the fourth node h1 behind NAT on {a.fast_mbit:g} Mbit/s, measured once its status says `relayed`.",
        "",
        f"Model: the default GPT (2 layers, 128 wide, context 128, {params / 1e3:.0f}k parameters, batch 16), H = {a.H}, "
        f"4 fragments, {a.precision} on the wire: a node's pseudo-gradient is {params * 4 / 1e6:.2f} MB at fp32 per "
        "H inner steps, and a member of a 4-member butterfly all-reduce sends and receives about 3/4 of it. Other "
        f"settings: the node's defaults. Each node with its p2pd runs under a CPU quota of {a.cap:g} cores once it "
        f"trains (1 torch thread); the bootstrap peer is not capped. Measured after {a.warm:g} s of warm-up, over "
        f"{a.window:g} s: n1 to n3's merged tokens/s (slopes of `tokens_merged`, summed, as bench/stragglers.py), "
        "the fourth node's rates, rounds with peers and payload traffic in the window and `bytes_relayed` (RPC bytes "
        "with peers reached only through a relay). Ratio: n1 to n3's merged tokens/s over the same in *fast*. "
        f"Commit {m['commit'].split()[0]}, working tree {'clean' if clean else 'NOT clean'}.",
    ]
    ref = results.get("fast", {}).get("fast_merged_per_s")
    rows, summary = [], {}
    for label in a.phases:
        if label in failed:
            rows.append([label] + ["failed"] + [""] * 9)
            continue
        r = results[label]
        ratio = r["fast_merged_per_s"] / ref if ref else None
        summary[label] = ratio
        f4 = r["rates"][r["fourth"]]
        goal = "" if label == "fast" or ratio is None else f" {c.verdict(ratio >= GOAL)}"
        rows.append([label, f"{r['fourth']}: {r['link_mbit']:g} Mbit/s{', NAT' if r['nat'] else ''}",
                     f"{r['fast_merged_per_s']:,.0f}", ("1.000" if label == "fast" else c.fmt(ratio)) + goal,
                     f"{f4['tokens_per_s']:,.0f} / {f4['merged_per_s']:,.0f}",
                     f"{r['fourth_rounds_with_peers']:.0f} ({r['fourth_rounds_total']})",
                     f"{r['fourth_mbit_in']:.2f} / {r['fourth_mbit_out']:.2f}",
                     f"{r['bytes_relayed'][r['fourth']] / 1e6:.2f} MB", r["reachability"][r["fourth"]],
                     f"{r['link_measured_mbit'][r['fourth']]:.1f}", _shares(r.get("fourth_shares") or [])])
    header = ["phase", "4th node", "n1-n3 merged tok/s", f"ratio (goal >= {GOAL:.2f})", "4th trained / merged tok/s",
              "4th rounds with peers in window (total)", "4th payload Mbit/s in / out", "4th bytes relayed",
              "4th reachability", "4th measured link Mbit/s", "4th share reduced (last rounds with peers)"]
    doc.table(header, rows)
    print("\n" + doc.sections[-1] + "\n", flush=True)
    lines = [f"Goal: with one node on {a.slow_mbit:g} Mbit/s, and with one node relayed, the fast nodes' merged "
             f"tokens/s within {100 * (1 - GOAL):.0f}% of the all-fast run."]
    for label in (k for k in ("slow", "relayed") if k in a.phases):
        ratio = summary.get(label)
        lines.append(f"*{label}*: " + (f"the phase failed ({failed[label]}): **not met**." if label in failed else
                                      "no ratio (the reference phase failed)." if ratio is None else
                                      f"ratio {ratio:.3f}: {c.verdict(ratio >= GOAL)}."))
    if "relayed" in results:
        lines.append(f"h1 was relayed {results['relayed'].get('relayed_after_s', 0):.0f} s after every node trained.")
    doc.text(" ".join(lines))
    doc.text(why(a, results))
    plotted = plot(a, results, c.DOCS / "home_links.png")
    doc.text("![home links](home_links.png)" if plotted else "No plot: matplotlib is not installed.")
    doc.write(m, seconds, {"settings": vars(a) | {"workdir": str(work)}, "results": results, "failed": failed,
                           "ratios": summary, "goal": GOAL})
    print(f"home_links: wrote {c.DOCS / 'home_links.md'} ({seconds / 60:.1f} min; logs in {work})", flush=True)


def _shares(shares: list[float]) -> str:
    """The fourth node's reduction shares, e.g. "0.00 x4, 0.25 x1" (equal shares in a group of 4: 0.25)."""
    if not shares:
        return "-"
    counts: dict[str, int] = {}
    for x in shares:
        counts[f"{x:.2f}"] = counts.get(f"{x:.2f}", 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))


def why(a: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    """The ratio as the fast nodes' training rate (CPU) times their share of it merged (network)."""
    ref = results.get("fast")
    if not ref:
        return "Why: no reference phase, no explanation."
    share = {k: r["fast_merged_per_s"] / max(1e-9, r["fast_tokens_per_s"]) for k, r in results.items()}
    out = [f"Why: a ratio is the product of the fast nodes' training rate (tokens trained/s, their CPU; on this "
           "shared machine it drifts by a few percent between phases for reasons that have nothing to do with the "
           f"network) and the share of what they trained that was merged in the window (*fast*: "
           f"{ref['fast_tokens_per_s']:,.0f} tokens/s trained, {100 * share['fast']:.0f}% merged, "
           f"{ref['fast_rounds_with_peers']:.0f} rounds with peers)."]
    for k in ("slow", "relayed"):
        r = results.get(k)
        if not r:
            continue
        link = r["link_mbit"]
        out.append(f"*{k}*: training rate x{r['fast_tokens_per_s'] / max(1e-9, ref['fast_tokens_per_s']):.3f}, merged "
                   f"share x{share[k] / max(1e-9, share['fast']):.3f}, {r['fast_rounds_with_peers']:.0f} rounds with "
                   f"peers. {r['fourth']}'s payload used {r['fourth_mbit_in']:.2f} Mbit/s in and "
                   f"{r['fourth_mbit_out']:.2f} out of its {link:g} Mbit/s link "
                   f"({100 * max(r['fourth_mbit_in'], r['fourth_mbit_out']) / link:.0f}%, without TCP and libp2p "
                   f"overhead), in {r['fourth_rounds_with_peers']:.0f} rounds with peers"
                   + ("." if not r["nat"] else f"; {r['bytes_relayed_window'][r['fourth']] / 1e6:.2f} MB of it went "
                      "through the relay" + (" (h1 dials n1 to n3 itself, out through its NAT, and they answer on those "
                      "connections: the relay slot is held but carries nothing; this phase tests NAT, not relaying)."
                      if not r["bytes_relayed"][r["fourth"]] else ".")))
    return " ".join(out)


def plot(a: argparse.Namespace, results: dict[str, dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = [k for k in PHASES if k in results]
    vals = [results[k]["fast_merged_per_s"] for k in labels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar_label(ax.bar(labels, vals, color=["tab:green", "tab:orange", "tab:blue"][:len(labels)]), fmt="{:,.0f}")
    if "fast" in results:
        ax.axhline(GOAL * results["fast"]["fast_merged_per_s"], color="tab:red", ls="--", lw=1,
                   label=f"goal: {100 * GOAL:.0f}% of fast")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_ylabel("n1-n3 merged tokens/s")
    ax.margins(y=0.12)
    ax.set_title(f"3 nodes on {a.fast_mbit:g} Mbit/s; the 4th: {a.fast_mbit:g}, {a.slow_mbit:g} Mbit/s, NAT")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: every process and namespace is gone by now
        print(f"{Path(__file__).stem}: interrupted", file=sys.stderr)
        sys.exit(130)
