"""A bootstrap and real node processes on 127.0.0.1 train together (issue: main job)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from node.alone import NEVER_MERGED_EXIT
from p2pdiloco.core.fragments import assign_parts
from p2pdiloco.core.merge import contribution_weight
from p2pdiloco.core.periods import round_fraction, span_fraction
from p2pdiloco.core.robust import robust_merge

from tests.conftest import TINY, read_report, wait_for

pytestmark = pytest.mark.integration


def status(d: Path) -> dict | None:
    try:
        return json.loads((d / "status.json").read_text())
    except (OSError, ValueError):
        return None


def _traces(d: Path) -> dict[str, dict]:
    return {t["round_id"]: t for t in (torch.load(p, weights_only=False) for p in sorted((d / "trace").glob("*.pt")))}


@pytest.mark.timeout(300)
def test_three_nodes_merge_like_one_process(harness):
    maddr = harness.bootstrap()
    nodes = [harness.node(maddr, f"n{i}", {**TINY, "data.num_shards": "3", "data.shard_index": str(i)},
                          "--duration", "14", "--set", f"trace_dir={harness.tmp / f'n{i}' / 'trace'}")
             for i in range(3)]
    for proc, d in nodes:
        assert harness.wait(proc, 240, d / "node.log") == 0, (d / "node.log").read_text()[-3000:]
    reports = [read_report(d) for _, d in nodes]
    # I1: every node ends at the same global state (all fragments, same versions and digests).
    assert len({r["global_digest"] for r in reports}) == 1, [r["fragments"] for r in reports]
    assert all(v > 0 for v, _ in reports[0]["fragments"])
    assert all(r["end_loss"] < r["start_loss"] for r in reports)
    # gathering announcements travel as pushes between the nodes, never through the DHT
    assert all(r["gathering_pushes"].get("sent", 0) > 0 and r["gathering_pushes"].get("received", 0) > 0
               for r in reports), [r["gathering_pushes"] for r in reports]
    # ... and so do matchmaking declarations once a node knows the others (net.rounds.matchmaking): most
    # rounds, if not all, read and store nothing in the DHT for matchmaking
    assert all(r["dht_ops"].get("store:mm", 0) + r["dht_ops"].get("get:mm", 0) < r["rounds_committed"]
               and not any(k.endswith(":gathering") for k in r["dht_ops"]) for r in reports), \
        [(r["dht_ops"], r["rounds_committed"]) for r in reports]
    # records travel as pushes too; the DHT holds them for nodes that do not know us yet, stored
    # every few seconds (heads_records.STORE_EVERY_S), not at every commit
    assert all(r["record_pushes"].get("sent", 0) > 0 and r["record_pushes"].get("received", 0) > 0
               for r in reports), [r["record_pushes"] for r in reports]
    assert all(r["record_pushes"]["sent"] > 2 * r["dht_ops"]["store:heads"] for r in reports), \
        [(r["record_pushes"], r["dht_ops"]) for r in reports]  # two peers a push: more publishes than stores
    # small calls travel in sessions (net.transport.sessions): a few streams opened per peer for many calls
    assert all(0 < r["sessions"]["opened"] <= 3 * 3 < r["rpc_calls"] and r["sessions"]["serving"] <= 2 * 3
               for r in reports), [(r["sessions"], r["rpc_calls"]) for r in reports]

    traces = [_traces(d) for _, d in nodes]
    full = [rid for rid in traces[0] if all(rid in t for t in traces) and len(traces[0][rid]["members"]) == 3]
    assert full, "no round merged all three nodes"
    for rid in full:
        rounds = sorted((t[rid] for t in traces), key=lambda t: t["me"])
        assert [t["me"] for t in rounds] == list(rounds[0]["members"])
        weights = [contribution_weight(t["tokens"], t["steps"]) for t in rounds]
        # the node's default robust merge (trust.outliers = clip): weights capped at the lower
        # median, each reducer's own Δ the reference for the tensors it reduces (assign_parts)
        mask, expected = rounds[0]["embedding_mask"], {}
        parts = assign_parts([t.numel() for t in rounds[0]["delta"]], len(rounds), rounds[0]["shares"])
        for r, slots in enumerate(parts):
            if slots:
                trust = rounds[r]["trust"] or None  # reducer r's earned trust in each member (trust.reputation)
                out = robust_merge([[t["delta"][i] for i in slots] for t in rounds], weights,
                                   [mask[i] for i in slots], own=r, trust=trust)
                expected.update(zip(slots, out.merged))
        expected = [expected[i] for i in range(len(mask))]
        # every member applies the step for the same fraction of a period: from the anchor's ledger
        # and the round's signed counters (tokens, lower median position, span fraction for the first period)
        H = int(TINY["outer.sync_every"])
        first = span_fraction([(t["tokens"], t["steps"], t["span"]) for t in rounds], H)
        fraction, _ = round_fraction(rounds[0]["ledger"], sum(t["tokens"] for t in rounds),
                                     sorted(t["position"] for t in rounds)[(len(rounds) - 1) // 2], H, first)
        for t in rounds:  # the distributed merge equals the one-process merge, bit for bit
            assert all(torch.equal(a, b) for a, b in zip(t["merged"], expected))
            assert t["fraction"] == fraction
            assert t["digest"] == rounds[0]["digest"] and t["anchor_digest"] == rounds[0]["anchor_digest"]


@pytest.mark.timeout(180)
def test_lone_node_applies_its_own_outer_step(harness):
    maddr = harness.bootstrap()
    proc, d = harness.node(maddr, "solo", TINY, "--duration", "12", "--set", f"trace_dir={harness.tmp / 'trace'}")
    # given a peer to join (the bootstrap) and merged with nobody: it says so by its exit code (node.alone)
    assert harness.wait(proc, 150, d / "node.log") == NEVER_MERGED_EXIT, (d / "node.log").read_text()[-3000:]
    report = read_report(d)
    assert report["exit_code"] == NEVER_MERGED_EXIT
    assert report["rounds_committed"] >= 8 and report["rounds_alone"] == report["rounds_committed"]
    assert all(v >= 4 for v, _ in report["fragments"])
    assert report["end_loss"] < report["start_loss"]
    traces = [torch.load(p, weights_only=False) for p in sorted((harness.tmp / "trace").glob("*.pt"))]
    assert traces
    for t in traces:  # I5: a lone learner's merge is its own pseudo-gradient, not zeros
        assert t["members"] == (t["me"],)
        assert all(torch.equal(m, x) for m, x in zip(t["merged"], t["delta"]))
        first = span_fraction([(t["tokens"], t["steps"], t["span"])], int(TINY["outer.sync_every"]))
        fraction, _ = round_fraction(t["ledger"], t["tokens"], t["position"], int(TINY["outer.sync_every"]), first)
        assert t["fraction"] == fraction > 0
        assert any(x.abs().sum() > 0 for x in t["delta"])
        assert t["digest"] != t["anchor_digest"]


@pytest.mark.timeout(240)
def test_a_node_frozen_for_a_few_rounds_catches_up_from_the_rounds_it_missed(harness):
    """Three nodes with int4 on the wire and a quorum of 2 (no lone rounds, whose fp32 Δ would
    cost half a state); n2's process is stopped (SIGSTOP: its p2pd stays up, it answers
    nothing) while the others commit two more rounds each without it. Thawed, it computes the
    states it missed from their rounds' merged slices (net.state.deltas: about a sixteenth of a
    state's bytes a round, digest checked) rather than downloading them, and every node ends at
    the same global state."""
    maddr = harness.bootstrap()
    # H = 200: a version of a fragment every few seconds, so the freeze costs a few (net.state.deltas.MAX_STEPS: 8)
    # error feedback decayed (beta 0.9): a member's own choice, which leaves the merge every node applies alike
    settings = {**TINY, "data.num_shards": "3", "outer.wire_precision": "int4", "outer.min_quorum": "2",
                "outer.sync_every": "200", "outer.error_feedback_decay": "0.9"}
    nodes = [harness.node(maddr, f"n{i}", {**settings, "data.shard_index": str(i)}, "--duration", "24",
                          "--set", "settle=30") for i in range(3)]
    proc, d = nodes[2]
    wait_for(lambda: (status(d) or {}).get("rounds_with_peers", 0) >= 2, 120, "n2 merging with the others",
             tick=harness.track_daemons)
    outer = status(d)["outer"]  # what it runs, as `node status` shows it
    assert (outer["wire_precision"], outer["error_feedback_decay"], outer["sync_every"]) == ("int4", 0.9, 200)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        others = [(status(x) or {}).get("rounds_committed", 0) for _, x in nodes[:2]]
        wait_for(lambda: all((status(x) or {}).get("rounds_committed", 0) >= n + 2
                             for (_, x), n in zip(nodes[:2], others)), 60, "the others merging without n2")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    for p, x in nodes:
        assert harness.wait(p, 200, x / "node.log") == 0, (x / "node.log").read_text()[-3000:]
    reports = [read_report(x) for _, x in nodes]
    assert len({r["global_digest"] for r in reports}) == 1, [r["fragments"] for r in reports]
    assert reports[2]["delta_catchups"] >= 1, (reports[2]["catchups"], (d / "node.log").read_text()[-3000:])
