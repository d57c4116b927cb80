"""Which state a node follows (``Node._targets``): only what this node and the peers it trusts
hold (docs/trust.md, "Earned trust").

History: a first rule counted holders (a joining node followed a state two peers held); a
coalition of two fresh identities then handed every node a zeroed model. Now no number of
holders makes a head: a peer's records move this node's state once it merged rounds with that
peer (``trust.reputation``), or once the node, trusting nobody, vetted the peer's state by its
own held-out loss (``node.vetting``, tests/test_vetting.py). A real ``Node`` (TINY model) on
one in-memory peer; records as peers publish them.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import TINY

from node.runtime import Node
from node.setup import Setup
from p2pdiloco.config import load_config
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.net.transport.memory import MemoryNet
from p2pdiloco.net.records.parse import HeadsRecord

P = 1


@pytest.mark.asyncio
async def test_no_number_of_untrusted_holders_makes_a_head_one_trusted_holder_does():
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
        records = {swarm.peer_id: HeadsRecord(ours), other: HeadsRecord(theirs, made), holder: HeadsRecord(theirs, made)}

        assert node._targets(records) == [None] * len(ours)  # two holders, neither trusted
        node.sync._steps[P].append(0.5)  # a step of fragment 1 seen: still no trust, no head
        assert node._targets(records) == [None] * len(ours)

        node.reputation.merged(holder)  # one round merged with the holder: not yet trusted
        assert node._targets(records) == [None] * len(ours)
        node.reputation.merged(holder)  # two: its records count, the untrusted second holder's do not
        head = node._targets(records)[P]
        assert (head.version, head.digest, head.holders) == (1, v1.digest, (holder,))
        assert all(node._targets(records)[p] is None for p in range(len(ours)) if p != P)

        node.reputation.refuted(holder, "a state it claimed was refused")  # trust lost at once
        assert node._targets(records) == [None] * len(ours)
    finally:
        await net.close()
