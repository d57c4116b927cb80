"""Which state a node follows (``Node._targets``) when one member of a group committed it.

Found in CI (test_member_that_loses_a_completed_round_follows_instead_of_retrying): three
learners start at v0; two form the first round of fragment 1, the third is late. One member
commits v1, the other loses the round. Both others had never seen a step of fragment 1, so the
joining rule (a state two peers hold) kept them at v0; the committer, ahead alone, fell back to
v0 and the group's progress was lost. Now the member that lost the round follows a state that a
member of that round holds and says the round made; then two peers hold it and the late one
follows too. A single stranger still cannot hand a node its state before it has seen a step
(the plausibility bound is loose then): not by claiming a newer version after the node tried a
round (a hostile review's reproduction of a first version of this fix), nor by naming the lost
round without having been in it. A real ``Node`` (TINY model) on one in-memory peer; records as
peers publish them.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import TINY

from node.runtime import Node
from node.setup import Setup
from p2pdiloco.config import load_config
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.net.matchmaking import Group, GroupKey
from p2pdiloco.net.memory import MemoryNet
from p2pdiloco.net.records import HeadsRecord

P = 1


@pytest.mark.asyncio
async def test_a_member_that_lost_a_round_follows_its_one_committer_and_no_stranger():
    net = MemoryNet()
    try:
        swarm = await net.swarm()
        node = Node(await asyncio.to_thread(Setup.build, load_config(env={}, overrides=TINY), "n0", swarm.peer_id),
                    swarm)
        committer, late, stranger = [(await net.swarm()).peer_id for _ in range(3)]
        v0 = node.committed[P]
        v1 = FragmentState.create(P, 1, [t + 0.01 for t in v0.theta], v0.momentum, v0.ledger)
        ours = tuple((st.version, st.digest) for st in node.committed)
        theirs = tuple((1, v1.digest) if p == P else c for p, c in enumerate(ours))
        made = tuple("r1" if p == P else "" for p in range(len(ours)))

        def records(holder: str, rounds=made) -> dict[str, HeadsRecord]:
            return {swarm.peer_id: HeadsRecord(ours), late: HeadsRecord(ours), holder: HeadsRecord(theirs, rounds)}

        assert node._targets(records(committer))[P] is None  # joining fragment 1: one holder is not enough
        node._stepped.add(P)  # it tried a round of fragment 1 (Node._round): still joining it
        assert node._targets(records(stranger))[P] is None

        node._failed_round[P] = Group("r1", GroupKey(P, 0, v0.digest), tuple(sorted((swarm.peer_id, committer))),
                                      0.1, committer)
        head = node._targets(records(committer))[P]
        assert (head.version, head.digest, head.holders) == (1, v1.digest, (committer,))
        assert all(node._targets(records(committer))[p] is None for p in range(len(ours)) if p != P)
        assert node._targets(records(stranger))[P] is None  # names our round, was not in it
        other = tuple("r2" if p == P else "" for p in range(len(ours)))
        assert node._targets(records(committer, other))[P] is None  # made by another round
    finally:
        await net.close()
