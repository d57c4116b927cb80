"""The state a round goes on at (``Node._rebase_if_behind``), against installs made meanwhile.

Found by a hostile review of the fragment ledger (node/committed.py): the head was chosen
against the round's anchor, which can be older than the state held (a delivery the training
thread has not drained yet), so a round could install an older state over a newer committed
one; and a follow that waited for a catch-up and was then skipped sent the round on at its
stale anchor. A real ``Node`` (TINY model) on the in-memory network, with real donors serving
their states; no round is run, the rebase is called as ``Node._round`` calls it.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import TINY, until

from node.runtime import Node
from node.setup import Setup
from p2pdiloco.config import load_config
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.net.state.heads import Head
from p2pdiloco.net.transport.memory import Link, MemoryNet
from p2pdiloco.net.records.parse import HeadsRecord

P = 1  # the fragment of the round


async def node_and_donors(net: MemoryNet, *made: tuple[str, int]) -> tuple[Node, list[Node], list[FragmentState]]:
    """A node at v0 that has seen a step of fragment P and trusts its donors (it merged rounds with
    them: trust.reputation), and per (round ID,
    version) in ``made`` a donor holding that version of P (Θ moved by 0.001 x version) and
    serving it. Returns the node, the donors and their states."""
    cfg = load_config(env={}, overrides=TINY)
    swarm = await net.swarm()
    node = Node(await asyncio.to_thread(Setup.build, cfg, "n0", swarm.peer_id), swarm)
    await node.sync.start()
    node.sync._steps[P].append(0.5)  # a step of fragment P seen: past joining
    v0 = node.committed[P]
    states = [FragmentState.create(P, v, [t + 0.001 * v for t in v0.theta], v0.momentum, v0.ledger) for _, v in made]
    donors = []
    for i, ((round_id, _), state) in enumerate(zip(made, states), 1):
        ds = await net.swarm()
        donor = Node(await asyncio.to_thread(Setup.build, cfg, f"n{i}", ds.peer_id), ds)
        donor.committed.install(P, state, round_id)
        await donor.sync.start()
        for _ in range(2):  # rounds merged with it before: its records may move the node's state
            node.reputation.merged(ds.peer_id)
        donors.append(donor)
    return node, donors, states


@pytest.mark.asyncio
async def test_a_round_never_installs_a_state_older_than_the_one_held():
    net = MemoryNet()
    try:
        node, (donor,), (v1,) = await node_and_donors(net, ("r1", 1))
        v2 = FragmentState.create(P, 2, [t + 0.002 for t in node.committed[P].theta], v1.momentum, v1.ledger)
        async with node.committed.lock(P):
            node.committed.install(P, v2, "r2")  # a catch-up installed v2; the round's anchor is still v0
        await donor.sync.publish(donor.record())  # the only record the node reads names v1

        state, _, ours = await node._rebase_if_behind(P)

        assert node.committed.holds(P, v2) and (state.version, state.digest, ours) == (2, v2.digest, False)
        assert node.stats.catchups == 0
    finally:
        await net.close()


@pytest.mark.asyncio
async def test_a_round_that_waited_for_a_catch_up_goes_on_at_the_swarms_newest_state():
    net = MemoryNet()
    try:
        node, (slow, fast), (v1, v2) = await node_and_donors(net, ("r1", 1), ("r2", 2))
        # the donor of v1 sends its state in about 3 s: the catch-up below holds fragment P meanwhile
        net.set_link(node.swarm.peer_id, slow.swarm.peer_id, Link(latency=0.05, rate=node.sync.state_bytes(P) / 3.0))
        records = {slow.swarm.peer_id: HeadsRecord(tuple((s.version, s.digest) for s in slow.committed),
                                                   slow.committed.round_ids())}
        catch_up = asyncio.create_task(node._follow(P, Head(1, v1.digest, (slow.swarm.peer_id,)), records,
                                                    node.committed[P]))
        await until(lambda: node.sync._pending, 5.0, "the download of v1 to start", every=0)
        await fast.sync.publish(fast.record())  # meanwhile the swarm moved to v2

        state, _, ours = await node._rebase_if_behind(P)  # a round of P dispatched at v0

        assert (await catch_up)[0].version == 1
        assert (state.version, state.digest, ours) == (2, v2.digest, False) and node.committed.holds(P, v2)
        assert node.stats.catchups == 2
    finally:
        await net.close()


@pytest.mark.asyncio
async def test_a_round_sends_nothing_when_the_state_it_follows_holds_its_progress_already():
    """The node lost round r1 of P (it failed on its side); the others committed it, so the
    state they hold has this node's contribution inside. Δ, accumulated since the anchor of
    r1, holds that progress too: the round must not send it again (invariant I2)."""
    net = MemoryNet()
    try:
        node, (donor,), (v1,) = await node_and_donors(net, ("r1", 1))
        node.committed.lose(P, "r1")
        await donor.sync.publish(donor.record())  # names the round that made v1: r1

        state, _, ours = await node._rebase_if_behind(P)

        assert (state.version, state.digest, ours) == (1, v1.digest, True) and node.committed.holds(P, v1)
        assert node.committed.round_ids()[P] == "r1" and node.committed.lost(P) is None
    finally:
        await net.close()
