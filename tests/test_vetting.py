"""Earned trust (docs/trust.md, "Earned trust"): whose records move a node's state.

Real ``Node`` objects (TINY model) on the in-memory network (virtual time is not needed: every
wait is a download over a fast link), real donors serving real states; the attackers are nodes
whose committed states were replaced with a zeroed or a shrunk model, as a hostile peer would
serve them, at versions far ahead. Fresh identities: nobody merged with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

import pytest
from conftest import TINY

from node.runtime import Node
from node.setup import Setup
from node.vetting import ROUND_TOLERANCE, trusted_records
from p2pdiloco.config import load_config
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.data import evaluate
from p2pdiloco.net.state.strikes import IGNORE_S
from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.net.transport.memory import MemoryNet
from p2pdiloco.net.rounds.results import ResultRefused
from p2pdiloco.trust.reputation import REFUTED_HOLD, TRUSTED, Reputation, Standing


def test_reputation_is_earned_by_merged_rounds_and_lost_to_a_refusal() -> None:
    rep = Reputation()
    assert rep.score("fresh") == 0.0 and not rep.trusted("fresh")
    for _ in range(int(TRUSTED)):
        rep.merged("a")
    assert rep.trusted("a") and rep.trusted_peers() == {"a"}
    rep.refuted("a", "its state raised the held-out loss")
    assert rep.score("a") == 0.0 and not rep.trusted("a")
    for _ in range(int(REFUTED_HOLD)):  # the points owed are paid back, no score yet
        rep.merged("a")
    assert rep.score("a") == 0.0
    for _ in range(int(TRUSTED)):
        rep.merged("a")
    assert rep.trusted("a") and rep.standing("a").merged == 2 * TRUSTED + REFUTED_HOLD
    rep.vetted("b")
    assert rep.trusted("b") and rep.snapshot()["b"] == {"score": TRUSTED, "merged": 0, "refuted": 0}
    rep.refuted("b", "its state raised the held-out loss")
    rep.vetted("b")  # a state of it that this node checked itself forgives the points owed
    assert rep.trusted("b") and rep.standing("b") == Standing(TRUSTED, 0, 1, 0.0)


def test_merge_weight_grows_from_a_quarter_to_one_with_merged_rounds_and_falls_with_a_refusal() -> None:
    rep = Reputation()
    assert rep.merge_weight("fresh") == 0.25  # FRESH_WEIGHT
    rep.merged("a")
    assert rep.merge_weight("a") == 0.25 + 0.75 * 1 / 4  # 1 point of FULL_WEIGHT_AT 4: 0.4375
    for _ in range(5):
        rep.merged("a")
    assert rep.merge_weight("a") == 1.0  # capped at 4 points
    rep.refuted("a", "refused state")
    assert rep.merge_weight("a") == 0.25


async def _node(net: MemoryNet, cfg, name: str) -> Node:
    swarm = await net.swarm()
    node = Node(await asyncio.to_thread(Setup.build, cfg, name, swarm.peer_id), swarm)
    await node.sync.start()
    return node


@contextlib.asynccontextmanager
async def _nodes(n: int) -> AsyncIterator[list[Node]]:
    """``n`` real nodes (TINY model, services started, no training) on one in-memory network."""
    cfg, net = load_config(env={}, overrides=TINY), MemoryNet()
    try:
        yield [await _node(net, cfg, f"n{i}") for i in range(n)]
    finally:
        await net.close()


def _trained(node: Node, steps: int = 30) -> list[FragmentState]:
    """The node's global states after ``steps`` inner steps of its own (Θ := θ, version 5)."""
    learner, sampler = node.setup.learner, node.setup.sampler
    for _ in range(steps):
        learner.inner_step(*sampler.next())
    named = dict(learner.model.named_parameters())
    return [FragmentState.create(st.index, 5, [named[s.name].detach().clone() for s in frag.slots],
                                 st.momentum, st.ledger)
            for frag, st in zip(node.setup.fragments, node.committed)]


def _serve(node: Node, states: list[FragmentState]) -> None:
    for st in states:
        node.committed.install(st.index, st, f"r{st.version}")


def _loss(node: Node, states) -> float:
    return evaluate(node.setup.global_model(states), node.setup.heldout)


@pytest.mark.asyncio
async def test_a_suspect_round_is_committed_only_if_it_does_not_raise_the_held_out_loss() -> None:
    """A round whose merged parts point against this node's own Δ (core.audit: ``suspects``) is
    weighed by the held-out loss with and without those parts (``Vetting.weigh_round``, as
    ``Node._commit`` does): parts that train fragment 0 (30 inner steps' worth) are committed;
    the same parts reversed are refused, naming the suspects."""
    async with _nodes(1) as (node,):
        start, trained = list(node.committed), _trained(node)
        moved = FragmentState.create(0, 1, trained[0].theta, start[0].momentum, start[0].ledger)
        back = FragmentState.create(0, 1, [2 * s - t for s, t in zip(start[0].theta, trained[0].theta)],
                                    start[0].momentum, start[0].ledger)
        without = FragmentState.create(0, 1, start[0].theta, start[0].momentum, start[0].ledger)
        assert _loss(node, [moved, *start[1:]]) < _loss(node, start)  # the premise: the step helps
        await node.vetting.weigh_round(start, moved, without, {"suspect": (0,)}, "r1")  # committed: no exception
        with pytest.raises(ResultRefused) as refused:
            await node.vetting.weigh_round(start, back, without, {"suspect": (0,)}, "r2")
        assert refused.value.reducers == {"suspect": "raised_loss"}
        assert _loss(node, [back, *start[1:]]) > _loss(node, [without, *start[1:]]) * (1 + ROUND_TOLERANCE)


@pytest.mark.asyncio
async def test_a_newer_state_of_a_trusted_peer_is_followed_only_if_it_does_not_raise_the_held_out_loss() -> None:
    """Colluders that earned trust by honest work, then serve reversed states between rounds:
    ``Vetting.weigh_follow`` (``Node._follow``) installs a newer state that trains the model and
    refuses one that undoes training, striking and distrusting its holder."""
    async with _nodes(1) as (node,):
        start, trained = list(node.committed), _trained(node)
        for _ in range(int(TRUSTED)):
            node.reputation.merged("turned")
        better = FragmentState.create(0, 1, trained[0].theta, start[0].momentum, start[0].ledger)
        worse = FragmentState.create(0, 1, [2 * s - t for s, t in zip(start[0].theta, trained[0].theta)],
                                     start[0].momentum, start[0].ledger)
        assert await node.vetting.weigh_follow(start, better, ("turned",))
        assert node.reputation.trusted("turned")
        assert not await node.vetting.weigh_follow(start, worse, ("turned",))
        assert not node.reputation.trusted("turned") and node.reputation.standing("turned").refuted == 1
        assert node.sync.refused_states == 1 and "turned" in node.sync.strikes.ignoring()


@pytest.mark.looptime(end=600)
@pytest.mark.asyncio
async def test_an_honest_peer_refused_once_is_still_grouped_with_and_followed_again_once_vetted() -> None:
    """A trusted peer fooled by a poisoned round serves a state that raises this node's held-out
    loss: refused (struck once, distrusted) but not avoided in matchmaking; when its records
    count again and it holds a state within the tolerance of this node's loss while this node
    trusts no other live peer, the node vets it, even a round further than its record, trusts it again and follows
    it (bench.trust_poison --honest-first 300 on 5eac509: two honest nodes that refused each
    other trained apart to the end)."""
    async with _nodes(2) as (node, peer):
        pid = peer.swarm.peer_id
        for _ in range(int(TRUSTED)):
            node.reputation.merged(pid)
        start, good = list(node.committed), _trained(peer)
        _serve(peer, [FragmentState.create(s.index, 1, [2 * b - t for b, t in zip(s.theta, g.theta)], s.momentum,
                                           s.ledger) for s, g in zip(start, good)])  # every fragment undone
        await peer.sync.publish(peer.record(), store=True)
        await node._catch_up()

        assert [(s.version, s.digest) for s in node.committed] == [(s.version, s.digest) for s in start]
        assert not node.reputation.trusted(pid) and node.reputation.standing(pid).refuted >= 1
        assert pid not in node.matchmaker.avoiding()  # still grouped with: its rounds are checked one by one
        until, _ = node.sync.strikes.ignored[pid]  # one strike for one refusal, not one per fragment
        assert until - swarm_clock.monotonic() <= IGNORE_S
        refused = node.sync.refused_states

        await asyncio.sleep(IGNORE_S)  # virtual seconds: its records count again
        _serve(peer, good)  # a better state, 5 versions ahead; the record says so ...
        await peer.sync.publish(peer.record(), store=True)
        await node.view.read(fresh=True)
        newest = [FragmentState.create(s.index, 6, s.theta, s.momentum, s.ledger) for s in good]
        _serve(peer, newest)  # ... but the peer moved on before the download: vetted at v6
        await node._catch_up()

        assert node.reputation.trusted(pid)
        assert node.vetting.vetted == 1 and node.sync.refused_states == refused
        await peer.sync.publish(peer.record(), store=True)
        await node.view.read(fresh=True)  # the records read anew from the DHT, as the next catch-up's
        await node._catch_up()  # its record counts now: followed to where it is
        assert [(s.version, s.digest) for s in node.committed] == [(s.version, s.digest) for s in newest]


@pytest.mark.asyncio
async def test_a_joiner_vets_donors_by_its_held_out_loss_and_refuses_zeroed_and_shrunk_states() -> None:
    async with _nodes(4) as (joiner, honest, zeroer, shrinker):
        good = _trained(honest)
        _serve(honest, good)
        # the coalition: 1e9 versions ahead with a zeroed model, and one version ahead with the
        # honest model shrunk to half (both with their correct digests)
        _serve(zeroer, [FragmentState.create(s.index, 10**9, [t * 0 for t in s.theta], [m * 0 for m in s.momentum],
                                             s.ledger) for s in good])
        _serve(shrinker, [FragmentState.create(s.index, 6, [t * 0.5 for t in s.theta], s.momentum, s.ledger)
                          for s in good])
        for n in (honest, zeroer, shrinker):
            await n.sync.publish(n.record(), store=True)
        own = _loss(joiner, joiner.committed.states())
        assert _loss(joiner, good) < own  # the honest donor's model is better than the joiner's start

        await joiner._catch_up(initial=True)

        assert [(s.version, s.digest) for s in joiner.committed] == [(s.version, s.digest) for s in good]
        assert joiner.reputation.trusted_peers() == {honest.swarm.peer_id}
        # the claim a billion versions ahead is ignored unread; the shrunk state is downloaded,
        # evaluated and refused: its holder struck and refuted
        assert {zeroer.swarm.peer_id, shrinker.swarm.peer_id} <= joiner.sync.strikes.ignoring().keys()
        assert joiner.reputation.standing(shrinker.swarm.peer_id).refuted >= 1
        assert joiner.vetting.refused == 1 and joiner.sync.refused_states == len(good)


@pytest.mark.asyncio
async def test_a_node_with_trusted_peers_never_follows_untrusted_claims_however_many() -> None:
    async with _nodes(5) as (node, peer, *sybils):
        for _ in range(int(TRUSTED)):
            node.reputation.merged(peer.swarm.peer_id)  # rounds merged with it
        base = node.committed.states()
        ahead = [FragmentState.create(s.index, 20, [t * 0 for t in s.theta], s.momentum, s.ledger) for s in base]
        for sybil in sybils:  # four identities all claiming (and serving) the same zero state 20 versions ahead
            _serve(sybil, ahead)
        for n in (node, peer, *sybils):
            await n.sync.publish(n.record(), store=True)
        records = await node.view.read(fresh=True)
        kept = trusted_records(records, node.swarm.peer_id, node.reputation)

        assert kept is not None and set(kept) == {node.swarm.peer_id, peer.swarm.peer_id}
        assert node._targets(records) == [None] * len(base)
        await node._catch_up()
        assert [(s.version, s.digest) for s in node.committed] == [(s.version, s.digest) for s in base]
        assert {s.swarm.peer_id for s in sybils} <= node.sync.strikes.ignoring().keys()
        assert node.sync.downloads == 0 and math.isfinite(_loss(node, node.committed.states()))
