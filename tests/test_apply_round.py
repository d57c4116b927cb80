"""The rule "merged round -> next state" (``core.outer.apply_round``), which every node must
compute bit for bit alike (invariant I1, docs/architecture.md): by hand on two numbers, and
through the three paths that apply a round, on real nodes (TINY model) of the in-memory
network: the commit of a member (``Node._commit``), the commit of a member the round left out
(``Node._take_excluded``) and the catch-up of a node behind from the round's slices
(``net.state.deltas``: ``Deltas.fetch`` of the rounds a real donor logged, ``replay_round``)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import TINY

from node.runtime import Node
from node.setup import Setup
from p2pdiloco.config import load_config
from p2pdiloco.core.outer import FragmentState, apply_round, fragment_digest, lone_step_size
from p2pdiloco.core.periods import FRACTION_GRID, Ledger
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.rounds.allreduce import Contribution, RoundResult
from p2pdiloco.net.state.bounded_moves import own_step
from p2pdiloco.net.state.heads import Head
from p2pdiloco.net.rounds.matchmaking import Group, GroupKey
from p2pdiloco.net.transport.memory import MemoryNet

P = 1  # the fragment the rounds are for
# dyadic numbers: every product and sum below is exact in fp32, so the hand values are the bytes
THETA, BUF, DELTA, LR, MU = [1.0, -2.0], [0.5, 0.25], [0.25, -1.0], 0.5, 0.5


def _state() -> FragmentState:
    return FragmentState.create(0, 3, [torch.tensor(THETA)], [torch.tensor(BUF)])


def test_a_whole_period_round_is_the_nesterov_step_by_hand():
    """f = 1 (a fresh ledger takes ``first``): b' = μ·b + Δ = [0.5, −0.875]; Θ' = Θ − lr·(Δ + μ·b')
    = [1 − 0.5·0.5, −2 + 0.5·1.4375] = [0.75, −1.28125]; the ledger starts a period at the
    round's position with its tokens and the whole step used."""
    new, fraction = apply_round(_state(), [torch.tensor(DELTA)], 300, 40, 1.0, 20, LR, MU)
    assert fraction == 1.0 and new.version == 4 and new.index == 0
    assert torch.equal(new.momentum[0], torch.tensor([0.5, -0.875]))
    assert torch.equal(new.theta[0], torch.tensor([0.75, -1.28125]))
    assert new.ledger == Ledger(40, 300, 0.0, FRACTION_GRID, 300)
    assert new.digest == fragment_digest(0, 4, new.theta, new.momentum, new.ledger)


def test_a_half_period_round_applies_half_the_step_by_hand():
    """f = ``first`` = 1/2 on a fresh ledger (u = 0, d = 1): b' = (1 − f·(1 − μ))·b + f·Δ
    = 0.75·b + 0.5·Δ = [0.5, −0.3125]; Θ' = Θ − (lr·f)·((1 + μ)·Δ + μ²·b) = Θ − 0.25·[0.5, −1.4375]
    = [0.875, −1.640625]."""
    new, fraction = apply_round(_state(), [torch.tensor(DELTA)], 300, 40, 0.5, 20, LR, MU)
    assert fraction == 0.5 and new.ledger.period_fraction == FRACTION_GRID // 2
    assert torch.equal(new.momentum[0], torch.tensor([0.5, -0.3125]))
    assert torch.equal(new.theta[0], torch.tensor([0.875, -1.640625]))


def test_bad_counters_and_shapes_raise():
    with pytest.raises(ValueError, match="counters"):
        apply_round(_state(), [torch.tensor(DELTA)], -1, 40, 1.0, 20, LR, MU)
    with pytest.raises(ValueError, match="shape"):
        apply_round(_state(), [torch.zeros(3)], 300, 40, 1.0, 20, LR, MU)


def test_the_lone_step_is_the_distance_a_whole_step_moves_from_a_zero_buffer():
    """lr·(1 + μ)·‖Δ‖ is how far ``apply_round`` moves Θ with f = 1 and b = 0, and
    ``bounded_moves.own_step`` is it for H steps of progress, one period per version."""
    zero = FragmentState.create(0, 0, [torch.tensor(THETA)], [torch.zeros(2)])
    new, _ = apply_round(zero, [torch.tensor(DELTA)], 300, 40, 1.0, 20, LR, MU)
    norm = float(torch.linalg.vector_norm(torch.tensor(DELTA)))
    moved = float(torch.linalg.vector_norm(new.theta[0] - zero.theta[0]))
    assert lone_step_size(LR, MU, norm) == pytest.approx(moved, rel=1e-6)
    cfg = load_config(env={}, overrides={**TINY, "outer.lr": str(LR), "outer.momentum": str(MU)})
    assert own_step(cfg.outer, [torch.tensor(DELTA)], cfg.outer.sync_every, None) == lone_step_size(LR, MU, norm)


async def _node(net: MemoryNet, cfg, name: str) -> Node:
    swarm = await net.swarm()
    return Node(await asyncio.to_thread(Setup.build, cfg, name, swarm.peer_id), swarm)


def _merged(anchor: FragmentState, seed: int, tokens: int, position: int, first: float,
            members: tuple[str, ...]) -> RoundResult:
    """A round of two members as the all-reduce gives it: the merged Δ coded by two reducers
    in int4 (the first slot, the rest), decoded as every member decodes it."""
    g = torch.Generator().manual_seed(seed)
    d = [1e-3 * torch.randn(t.shape, generator=g) for t in anchor.theta]
    parts = ((0,), tuple(range(1, len(d))))
    bodies = [wire.encode_merged([d[i] for i in slots], "int4") for slots in parts]
    decoded = [t for slots, b in zip(parts, bodies)
               for t in wire.decode_merged(b, [tuple(d[i].shape) for i in slots], "int4", len(members))]
    return RoundResult(decoded, tokens, position, first, members, wire=tuple(zip(parts, bodies)))


@pytest.mark.asyncio
async def test_commit_excluded_and_catch_up_make_the_same_states():
    """Two rounds (a fresh ledger's half period, then one continuing that period: both branches
    of the fractional step) from the same anchor: member A commits each (``_commit``), B, left
    out, first computes it from A's logged slices over the network (``Deltas.fetch``, the
    catch-up path) and then takes it as an excluded member (``_take_excluded``). Every path
    gives ``apply_round``'s state: same version and digest, every tensor equal, and B's
    training thread gets it to rebase on."""
    net = MemoryNet()
    try:
        cfg = load_config(env={}, overrides={**TINY, "outer.wire_precision": "int4"})
        a, b = await _node(net, cfg, "a"), await _node(net, cfg, "b")
        b.training = b.setup.training_loop(b._dispatch)  # not run: its inbox receives the delivery
        await a.sync.start()  # A serves the rounds it logged (state.deltas)
        out, h = cfg.outer, cfg.outer.sync_every
        members = tuple(sorted((a.swarm.peer_id, b.swarm.peer_id)))
        assert a.committed[P].digest == b.committed[P].digest  # same seed, same initial state
        fractions = []
        for i, (tokens, position, first) in enumerate(((4096, h, 0.5), (2048, h + 1, 0.25))):
            anchor = a.committed[P]
            merged = _merged(anchor, i, tokens, position, first, members)
            want, fraction = apply_round(anchor, merged.delta, tokens, position, first, h, out.lr, out.momentum)
            fractions.append(fraction)
            group = Group(f"r{i}", GroupKey(P, anchor.version, anchor.digest), members, 0.1, a.swarm.peer_id)
            contrib = Contribution(merged.delta, tokens // 2, h)

            committed = await a._commit(P, anchor, group, merged, contrib, t0=0.0)
            fetched = await b.sync.deltas.fetch(a.swarm.peer_id, b.committed[P],
                                                Head(committed.version, committed.digest, (a.swarm.peer_id,)), 10.0, 10.0)
            assert fetched is not None, "the catch-up got no rounds"
            await b._take_excluded(P, b.committed[P], merged, group)
            excluded = b.committed[P]

            for got in (committed, fetched[0], excluded):
                assert (got.version, got.digest, got.ledger) == (anchor.version + 1, want.digest, want.ledger)
                assert all(torch.equal(x, y) for x, y in zip(got.theta + got.momentum, want.theta + want.momentum))
            assert b.training._inbox.get_nowait() == (P, excluded, True, False, 0)  # rebased on it
        assert fractions == [0.5, 0.25] and a.committed[P].ledger.period_fraction == 3 * FRACTION_GRID // 4  # one period
        assert b.sync.deltas.catchups == 2 and a.stats.rounds_committed == 2
    finally:
        await net.close()
