"""Which state a node follows (``Node._targets``) before it has seen a step of a fragment.

Two holders, always: a node that tried a round of the fragment, or lost one, still does not
follow a state one peer holds, since the plausibility bound is loose before a step is seen
(up to 4 x |theta| per version). A first fix for a CI failure (a member that lost the first
round of a fragment, which one other member alone committed, stayed at v0) let such a node
follow one holder; a hostile review showed one stranger could then hand every node its state
at the start of a run, and a narrower version (a member of the lost round, naming it) still let
a member that withheld the node's result do so. Once a step is seen, one holder suffices, under
the tighter bound of the steps seen. A real ``Node`` (TINY model) on one in-memory peer;
records as peers publish them.
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
async def test_before_a_step_is_seen_one_holder_never_suffices_after_it_does():
    net = MemoryNet()
    try:
        swarm = await net.swarm()
        node = Node(await asyncio.to_thread(Setup.build, load_config(env={}, overrides=TINY), "n0", swarm.peer_id),
                    swarm)
        holder, other = (await net.swarm()).peer_id, (await net.swarm()).peer_id
        v0 = node.committed[P]
        v1 = FragmentState.create(P, 1, [t + 0.01 for t in v0.theta], v0.momentum, v0.ledger)
        ours = tuple((st.version, st.digest) for st in node.committed)
        theirs = tuple((1, v1.digest) if p == P else c for p, c in enumerate(ours))
        made = tuple("r1" if p == P else "" for p in range(len(ours)))
        records = {swarm.peer_id: HeadsRecord(ours), other: HeadsRecord(ours), holder: HeadsRecord(theirs, made)}

        assert node._targets(records)[P] is None  # joining fragment 1
        node._stepped.add(P)  # it tried a round of fragment 1 (Node._round) ...
        node.committed.lose(P, "r1")  # ... and lost it; the holder names that round
        assert node._targets(records)[P] is None

        records[other] = HeadsRecord(theirs, made)  # a second holder
        head = node._targets(records)[P]
        assert (head.version, head.digest, head.holders) == (1, v1.digest, tuple(sorted((holder, other))))

        records[other] = HeadsRecord(ours)
        node.sync._steps[P].append(0.5)  # a step of fragment 1 seen: no longer joining it
        head = node._targets(records)[P]
        assert (head.version, head.digest, head.holders) == (1, v1.digest, (holder,))
        assert all(node._targets(records)[p] is None for p in range(len(ours)) if p != P)
    finally:
        await net.close()
