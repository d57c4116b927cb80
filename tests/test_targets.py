"""Which state a node follows (``Node._targets``) when one member of a group committed it.

Found in CI (test_member_that_loses_a_completed_round_follows_instead_of_retrying): three
learners start at v0; two form the first round of fragment 1, the third is late. One member
commits v1, the other loses the round. Both others had never seen a step of fragment 1, so the
joining rule (a state two peers hold) kept them at v0; the committer, ahead alone, fell back to
v0 and the group's progress was lost. A learner that tried a round of the fragment shares the
swarm's state and follows a single holder, as any member does; a joiner still needs two.
A real ``Node`` (TINY model) on one in-memory peer; records as peers publish them.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import TINY

from node.runtime import Node
from node.setup import Setup
from p2pdiloco.config import load_config
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.net.memory import MemoryNet
from p2pdiloco.net.records import HeadsRecord

P = 1


@pytest.mark.asyncio
async def test_a_learner_that_tried_a_round_follows_a_state_one_member_holds_a_joiner_does_not():
    net = MemoryNet()
    try:
        swarm = await net.swarm()
        node = Node(await asyncio.to_thread(Setup.build, load_config(env={}, overrides=TINY), "n0", swarm.peer_id),
                    swarm)
        committer, loser = (await net.swarm()).peer_id, (await net.swarm()).peer_id
        v0 = node.committed[P]
        v1 = FragmentState.create(P, 1, [t + 0.01 for t in v0.theta], v0.momentum, v0.ledger)
        ours = tuple((st.version, st.digest) for st in node.committed)
        theirs = tuple((1, v1.digest) if p == P else c for p, c in enumerate(ours))
        records = {swarm.peer_id: HeadsRecord(ours), loser: HeadsRecord(ours), committer: HeadsRecord(theirs)}

        assert node._targets(records)[P] is None  # joining fragment 1: one holder is not enough

        node._stepped.add(P)  # as Node._round does when the node tries a round of fragment 1
        head = node._targets(records)[P]
        assert (head.version, head.digest, head.holders) == (1, v1.digest, (committer,))
        assert all(node._targets(records)[p] is None for p in range(len(ours)) if p != P)
    finally:
        await net.close()
