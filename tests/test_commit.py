"""A merged round's commit (``Node._commit``) against states installed while it was in flight.

The race (issue found by reading ``node/runtime.py``): a catch-up that finishes during a round
installs a state with the anchor's digest as another object; the old guard compared identity
(``committed[p] is anchor``), so the merged result was dropped with no log, count or round
record, and the node contributed progress its group had already merged. The guard compares
digests now; a state that really moved on supersedes the result, which is recorded and
counted. A real ``Node`` (TINY model) on one in-memory peer; no round is run, the commit is
called as ``Node._round`` calls it once the all-reduce returned.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import TINY, until

from node.runtime import Node
from node.setup import Setup
from p2pdiloco.config import load_config
from p2pdiloco.core.outer import FragmentState, nesterov_outer_step
from p2pdiloco.core.periods import round_fraction
from p2pdiloco.net.rounds.allreduce import Contribution, RoundResult
from p2pdiloco.net.state.heads import Head
from p2pdiloco.net.rounds.matchmaking import Group, GroupKey
from p2pdiloco.net.transport.memory import MemoryNet
from p2pdiloco.net.records.parse import HeadsRecord

P = 1  # the fragment the round is for


async def node_and_round(net: MemoryNet) -> tuple[Node, FragmentState, Group, RoundResult, Contribution]:
    cfg = load_config(env={}, overrides=TINY)
    swarm = await net.swarm()
    node = Node(await asyncio.to_thread(Setup.build, cfg, "n0", swarm.peer_id), swarm)
    anchor = node.committed[P]
    g = torch.Generator().manual_seed(0)
    delta = [1e-3 * torch.randn(t.shape, generator=g) for t in anchor.theta]
    other = (await net.swarm()).peer_id
    group = Group("r1", GroupKey(P, anchor.version, anchor.digest), tuple(sorted((swarm.peer_id, other))), 0.1,
                  swarm.peer_id)
    sync_every = cfg.outer.sync_every
    merged = RoundResult(delta, 2 * 8 * 64 * sync_every, sync_every, 1.0, group.members)
    return node, anchor, group, merged, Contribution(delta, 8 * 64 * sync_every, sync_every)


@pytest.mark.asyncio
async def test_a_round_commits_over_an_equal_state_installed_meanwhile():
    net = MemoryNet()
    try:
        node, anchor, group, merged, contrib = await node_and_round(net)
        # a catch-up finished during the round: the swarm's state, equal to our anchor, another object
        async with node.committed.lock(P):
            node.committed.install(P, FragmentState.create(P, anchor.version, anchor.theta, anchor.momentum,
                                                           anchor.ledger), "")
        assert node.committed[P] is not anchor and node.committed[P].digest == anchor.digest

        new = await node._commit(P, anchor, group, merged, contrib, t0=0.0)

        fraction, ledger = round_fraction(anchor.ledger, merged.tokens, merged.position, node.cfg.outer.sync_every,
                                          merged.first)
        expected = nesterov_outer_step(anchor, merged.delta, node.cfg.outer.lr, node.cfg.outer.momentum, fraction,
                                       ledger)
        assert new is node.committed[P] and (new.version, new.digest) == (anchor.version + 1, expected.digest)
        assert (node.stats.rounds_committed, node.stats.rounds_failed, node.committed.superseded) == (1, 0, 0)
        assert node.committed.round_ids()[P] == "r1"
        assert node.stats.recent[-1].committed and node.stats.recent[-1].digest == new.short()
    finally:
        await net.close()


@pytest.mark.asyncio
async def test_a_round_is_superseded_by_another_state_installed_meanwhile_and_says_so():
    net = MemoryNet()
    try:
        node, anchor, group, merged, contrib = await node_and_round(net)
        moved = FragmentState.create(P, anchor.version + 1, [t + 0.01 for t in anchor.theta], anchor.momentum,
                                     anchor.ledger)
        node.committed.install(P, moved, "r0")

        assert await node._commit(P, anchor, group, merged, contrib, t0=0.0) is None

        assert node.committed[P] is moved  # the newer state stays
        assert (node.stats.rounds_committed, node.stats.rounds_failed, node.committed.superseded) == (0, 1, 1)
        assert node.committed.lost(P) == "r1"  # its result holds our progress: a later follow decides with it
        last = node.stats.recent[-1]
        assert (last.committed, last.reason, last.version) == (False, "superseded", anchor.version + 1)
    finally:
        await net.close()


@pytest.mark.asyncio
async def test_a_commit_waits_for_a_follow_of_its_fragment_in_progress_and_is_then_superseded():
    """The ledger's lock (``CommittedStates.lock``): a catch-up that chose the swarm's v1 and is
    downloading it from a real donor holds fragment P; a round that merged meanwhile waits, then
    finds P moved and is recorded as superseded. Without the lock the round committed its own v1
    and the download then replaced it, a committed round undone with nothing recorded."""
    net = MemoryNet()
    try:
        node, anchor, group, merged, contrib = await node_and_round(net)
        dswarm = await net.swarm()
        donor = Node(await asyncio.to_thread(Setup.build, node.cfg, "n1", dswarm.peer_id), dswarm)
        theirs = FragmentState.create(P, anchor.version + 1, [t + 0.01 for t in anchor.theta], anchor.momentum,
                                      anchor.ledger)
        donor.committed.install(P, theirs, "r0")
        await donor.sync.start()
        head = Head(theirs.version, theirs.digest, (donor.swarm.peer_id,))
        records = {donor.swarm.peer_id: HeadsRecord(tuple((s.version, s.digest) for s in donor.committed),
                                                    donor.committed.round_ids())}

        follow = asyncio.create_task(node._follow(P, head, records, anchor))
        await until(lambda: node.sync._pending, 5.0, "the download of v1 to start", every=0)  # the transfer in flight
        assert await node._commit(P, anchor, group, merged, contrib, t0=0.0) is None
        assert (await follow)[0].digest == theirs.digest

        assert node.committed.holds(P, theirs) and node.committed.round_ids()[P] == "r0"
        assert (node.stats.rounds_committed, node.stats.rounds_failed, node.committed.superseded) == (0, 1, 1)
        assert node.stats.catchups == 1 and node.stats.recent[-1].reason == "superseded"
    finally:
        await net.close()
