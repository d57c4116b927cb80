"""Protocol tests: matchmaking, the all-reduce, the outer step and state transfer among 4 to 64
learners in one process, on the in-memory network (``p2pdiloco.net.transport.memory``: every peer a real
``Swarm`` with its framing, limits, signatures and bans) and virtual time (``looptime``: the
loop's clock jumps to the next timer whenever every task waits, as trio's ``MockClock`` with
autojump; protocol code reads time only through the loop, ``net.transport.clock.monotonic``).

Beside the integration tests over real p2pd (tests/test_trust_net.py, test_swarm_integration.py
and the others), not instead of them. Peer identities come from seeds (``Identity.from_seed``),
so a seed fixes leaders, groups and digests: ``test_same_seed_same_digests_in_20_repeats``.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import looptime
import pytest
import torch
from conftest import until
from test_trust_net import FRAGMENT, SHAPES, Resigned, delta

from p2pdiloco.core.fragments import assign_parts
from p2pdiloco.core.outer import FragmentState, nesterov_outer_step
from p2pdiloco.core.periods import round_fraction
from p2pdiloco.errors import StateSyncError
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution, ContributionExcluded, RoundResult
from p2pdiloco.net.rounds.matchmaking import Group, GroupKey, Matchmaker
from p2pdiloco.net.transport.memory import Link, MemoryNet
from p2pdiloco.net.state.heads import Head
from p2pdiloco.net.state.statesync import StateSync
from p2pdiloco.trust.identity import Identity

pytestmark = pytest.mark.timeout(120)  # real seconds; the scenarios run in virtual ones

LINK = Link(latency=0.025, rate=20e6 / 8)  # 50 ms round trips, 20 Mbit/s
GRACE, GRACE_MAX, QUORUM_TIMEOUT = 1.0, 3.0, 10.0  # the demo's (node/demo.py)
H, LR, MOMENTUM = 10, 0.7, 0.9  # inner steps per outer round; the outer Nesterov step's rate and momentum


def identities(n: int, seed: int) -> list[Identity]:
    return [Identity.from_seed(hashlib.sha256(f"protocol/{seed}/{i}".encode()).digest()) for i in range(n)]


@asynccontextmanager
async def learners(n: int, seed: int, link: Link = LINK) -> AsyncIterator[tuple[MemoryNet, list, list, list]]:
    """``n`` peers with seeded identities, each with a started Matchmaker and AllReducer."""
    net = MemoryNet(default=link, seed=seed)
    try:
        sw = [await net.swarm(identity=i) for i in identities(n, seed)]
        mms = [Matchmaker(s, "run", 1, num_fragments=1) for s in sw]
        reducers = [AllReducer(s, [FRAGMENT], "fp32", QUORUM_TIMEOUT, sync_every=H, run_id="run", outlier_factor=4.0)
                    for s in sw]
        for m, r in zip(mms, reducers):
            m.listed_in = r.expect  # as the node wires them
            await m.start()
            await r.start()
        yield net, sw, mms, reducers
    finally:
        await net.close()


def initial_state(seed: int) -> FragmentState:
    g = torch.Generator().manual_seed(seed)
    theta = [torch.randn(s, generator=g) for s in SHAPES]
    return FragmentState.create(0, 0, theta, [torch.zeros_like(t) for t in theta])


async def outer_rounds(n: int, seed: int, rounds: int, spread: float = 2.0) -> list[tuple]:
    """``rounds`` outer rounds of ``n`` learners that share one state: each becomes ready at a
    seeded random time within ``spread`` virtual seconds, declares with the demo's grace window
    and every other learner expected, and, in a group, all-reduces its pseudo-gradient and
    applies the outer step; late learners follow the group's state (as ``Node`` does).

    Returns per round (members of each group, late learners, digest of each member's new
    state). Asserts invariant I2 on the way: every member of a group commits the same state."""
    rng, state, out = random.Random(seed), initial_state(seed), []
    async with learners(n, seed) as (_, sw, mms, reducers):
        for r in range(rounds):
            key = GroupKey(0, state.version, state.digest)
            offsets = [rng.uniform(0, spread) for _ in range(n)]

            async def one(i: int) -> tuple[str, Group | None, FragmentState | None]:
                await asyncio.sleep(offsets[i])
                outcome, group = await mms[i].form_group(key, grace=GRACE, quorum_timeout=QUORUM_TIMEOUT,
                                                         expected=n, max_grace=GRACE_MAX)
                if group is None:
                    return outcome, None, None
                merged = await reducers[i].run(group, Contribution(delta(1000 * seed + n * r + i), 1000, H))
                fraction, ledger = round_fraction(state.ledger, merged.tokens, merged.position, H, merged.first)
                return outcome, group, nesterov_outer_step(state, merged.delta, LR, MOMENTUM, fraction, ledger)

            results = await asyncio.gather(*(one(i) for i in range(n)))
            groups = sorted({g.members for _, g, _ in results if g is not None})
            late = tuple(sorted(sw[i].peer_id for i, (o, _, _) in enumerate(results) if o == "late"))
            digests = {g: {s.digest for _, grp, s in results if grp is not None and grp.members == g} for g in groups}
            assert all(len(d) == 1 for d in digests.values()), digests  # one state per group (I2)
            out.append((tuple(groups), late, tuple(next(iter(digests[g])) for g in groups)))
            state = next(s for _, g, s in results if g is not None and g.members == groups[0])
    return out


@pytest.mark.looptime(end=3600)
@pytest.mark.parametrize("n", [4, 16, 64])
@pytest.mark.asyncio
async def test_groups_form_and_rounds_commit(n: int):
    """3 outer rounds of n learners ready within 2 s of each other: one group per version
    (no fork), holding most of the learners, every member with the same new state; the rest
    are late and follow it. Virtual time: a round takes the links' latency and the grace
    window, not this machine's CPU."""
    rounds = await outer_rounds(n, seed=n, rounds=3)
    for groups, late, digests in rounds:
        assert len(groups) == 1, groups  # one group per version: no fork
        assert len(groups[0]) + len(late) == n and len(groups[0]) >= n // 2, (len(groups[0]), len(late))
    assert len({d for _, _, ds in rounds for d in ds}) == 3  # the state moved every round


def test_same_seed_same_digests_in_20_repeats():
    """The same seed gives the same groups, late learners and digests in 20 repeats of 3 outer
    rounds of 8 learners, each repeat on a fresh loop with virtual time; another seed gives
    other digests (the figures are not constant)."""
    def run(seed: int) -> list[tuple]:
        with asyncio.Runner(loop_factory=lambda: looptime.new_event_loop(start=0.0)) as runner:
            return runner.run(outer_rounds(8, seed, rounds=3))
    first = run(7)
    for _ in range(19):
        assert run(7) == first
    assert {d for _, _, ds in run(8) for d in ds}.isdisjoint({d for _, _, ds in first for d in ds})


@pytest.mark.looptime(end=3600)
@pytest.mark.asyncio
async def test_a_newcomer_whose_donor_dies_midway_gets_the_state_from_another_holder():
    """Two holders of fragment 0 at v1; a newcomer at v0 downloads it over 2 Mbit/s links (the
    state takes about 0.1 s); its first donor dies once the transfer is under way. The
    newcomer gets the state, digest checked, from the other holder, and counts one failed
    download and one good one."""
    state0 = initial_state(3)
    g = torch.Generator().manual_seed(4)
    v1 = FragmentState.create(0, 1, [t + 1e-3 * torch.randn(t.shape, generator=g) for t in state0.theta],
                              [torch.zeros_like(t) for t in state0.theta])
    net = MemoryNet(default=Link(latency=0.025, rate=2e6 / 8))
    try:
        holders = [await net.swarm(identity=i) for i in identities(2, 3)]
        newcomer = await net.swarm(identity=identities(3, 4)[2])
        for h in holders:
            await StateSync(h, "run", [FRAGMENT], lambda: [v1]).start()
        sync = StateSync(newcomer, "run", [FRAGMENT], lambda: [state0])
        await sync.start()
        download = asyncio.create_task(sync.download(0, Head(1, v1.digest, tuple(h.peer_id for h in holders)),
                                                     joining=True))
        await until(lambda: any(net.bytes_sent[h.peer_id] > 4096 for h in holders), 5, "a holder sending the state",
                    every=0.001)
        first = next(h for h in holders if net.bytes_sent[h.peer_id] > 4096)
        net.kill(first.peer_id)
        got = await download
        assert (got.version, got.digest) == (1, v1.digest)
        assert (sync.downloads, sync.failed_downloads) == (1, 1)
        with pytest.raises(StateSyncError):  # and with no holder left, a clear failure, not a hang
            net.kill(next(h for h in holders if h is not first).peer_id)
            await sync.download(0, Head(1, "cd" * 32, tuple(h.peer_id for h in holders)))
    finally:
        await net.close()


@pytest.mark.looptime(end=3600)
@pytest.mark.asyncio
async def test_a_bad_signer_is_banned_and_excluded_while_the_others_merge():
    """16 learners, one of which sends slices whose signature does not match their bytes, in 3
    outer rounds with matchmaking: in the first (one group of all 16), the 15 others merge
    without it and each reducer of a tensor (9 tensors, so 9 of the 16 members reduce) bans it;
    in the later rounds a peer that banned it ignores its declarations, and every honest
    learner's merge leaves it out; the honest learners never disagree within a group."""
    async with learners(16, seed=11) as (net, sw, mms, reducers):
        bad = 5
        reducers[bad] = Resigned(sw[bad], [FRAGMENT], "fp32", QUORUM_TIMEOUT, sync_every=H, run_id="run",
                                 outlier_factor=4.0, mode="bad_signature")
        await reducers[bad].start()
        ids, honest = [s.peer_id for s in sw], [i for i in range(16) if i != bad]

        async def member(i: int, grp: Group):
            try:
                return await reducers[i].run(grp, Contribution(delta(i), 1000, H))
            except ContributionExcluded as e:
                return e
        members = tuple(sorted(ids))
        results = await asyncio.gather(*(member(i, Group("r-bad", GroupKey(0, 3, "ab" * 32), members, 0.0))
                                         for i in range(16)))
        assert all(isinstance(results[i], RoundResult) and ids[bad] not in results[i].contributors for i in honest)
        assert isinstance(results[bad], ContributionExcluded)
        parts = assign_parts([s.numel for s in FRAGMENT.slots], 16)
        reducing = {members[r] for r, slots in enumerate(parts) if slots} - {ids[bad]}
        assert {ids[i] for i in honest if ids[bad] in sw[i].bans} == reducing and len(reducing) >= 8

        for version in (4, 5):
            key = GroupKey(0, version, f"{version:064x}")

            async def one(i: int):
                outcome, group = await mms[i].form_group(key, grace=GRACE, quorum_timeout=QUORUM_TIMEOUT,
                                                         expected=16, max_grace=GRACE_MAX)
                return (outcome, None) if group is None else (outcome, await member(i, group))
            rounds = await asyncio.gather(*(one(i) for i in range(16)))
            merged = [r for i, (_, r) in enumerate(rounds) if i != bad and r is not None]
            assert merged and all(isinstance(r, RoundResult) and ids[bad] not in r.contributors for r in merged)
            by_set: dict[tuple, set] = {}
            for r in merged:
                by_set.setdefault(r.contributors, set()).add(tuple(t.sum().item() for t in r.delta))
            assert all(len(v) == 1 for v in by_set.values())  # one result per group (I2)
