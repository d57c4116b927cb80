"""Two colluding reducers of four: every honest member checks their merged parts against its own
Δ (``core.audit``): a reversed or x1000 part names its reducer a suspect (the node then weighs
the round by its held-out loss and refuses it: tests/test_vetting.py); after a refusal the
honest members distrust the colluders and form their next groups without them
(``Matchmaker.avoid``).

The first test runs the round over real sockets (one p2pd per swarm); the second runs the
round and the next matchmaking on the in-memory transport in virtual time, as the node wires
them.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import swarms, until
from test_memory_net import memory_swarms
from test_trust_net import FRAGMENT, KEY, delta, run_round

from p2pdiloco.core.fragments import assign_parts
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution, RoundResult
from p2pdiloco.net.rounds.matchmaking import Group, GroupKey, Matchmaker, leader_rank
from p2pdiloco.net.transport.memory import Link, MemoryNet
from p2pdiloco.trust.reputation import Reputation


class FlippingReducer(AllReducer):
    """Merges honestly, then signs and returns -2x the merge of its part (a reducer that
    reverses the group's progress on the tensors it owns)."""

    def _statement(self, rnd, phase, contributors, merged):
        return super()._statement(rnd, phase, contributors, [-2.0 * t for t in merged])


class ScalingReducer(AllReducer):
    """Returns x1000 the merge of its part."""

    def _statement(self, rnd, phase, contributors, merged):
        return super()._statement(rnd, phase, contributors, [1000.0 * t for t in merged])


def _colluders(ids: list[str]) -> set[str]:
    """Two members that reduce a part each in a group of ``ids`` (every member does, 9 slots of 4)."""
    parts = assign_parts([s.numel for s in FRAGMENT.slots], len(ids))
    assert all(parts)
    return {ids[1], ids[3]}


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_daemon_left")
@pytest.mark.asyncio
@pytest.mark.parametrize("kind,reason", [(FlippingReducer, "misaligned_result"), (ScalingReducer, "oversized_result")])
async def test_honest_members_name_two_colluding_reducers_suspects_over_real_sockets(kind, reason):
    async with swarms(4) as sw:
        ids = sorted(s.peer_id for s in sw)
        evil = _colluders(ids)
        reducers = {s.peer_id: (kind if s.peer_id in evil else AllReducer)(
            s, [FRAGMENT], "fp32", 4.0, sync_every=10, run_id="run", outlier_factor=4.0) for s in sw}
        for r in reducers.values():
            await r.start()
        results = await run_round(reducers, {p: Contribution(delta(i), 1000, 10) for i, p in enumerate(ids)})
        for p in ids:
            if p in evil:
                continue
            # the node weighs the round by its held-out loss with and without these parts (tests/test_vetting.py)
            assert isinstance(results[p], RoundResult) and set(results[p].suspects) == evil, results[p]
            assert reducers[p].stats.rejected[reason] == 2
            assert not sw[[s.peer_id for s in sw].index(p)].bans  # evidence against our own Δ: not a ban


@pytest.mark.timeout(120)
@pytest.mark.looptime(end=3600)
@pytest.mark.asyncio
async def test_after_a_refusal_the_honest_members_group_without_the_colluders():
    """Round 1: the group of four with two x1000 reducers; both honest members name them
    suspects (the node's weighing then refuses the round: the parts raise its held-out loss).
    Each honest member then does what the node does with that ResultRefused (node.runtime:
    ``Reputation.refuted`` and ``Matchmaker.avoid``), and at the next key the honest members
    form a group of their own and merge exactly, though a colluder leads the key."""
    async with memory_swarms(4, MemoryNet(default=Link(latency=0.005))) as (net, sw):
        ids = sorted(s.peer_id for s in sw)
        ranked = sorted(ids, key=lambda p: leader_rank(KEY.dht_key("run"), p))
        evil = {ranked[0], ranked[2]}  # one of them leads the key: the honest members must pass it over
        honest = [p for p in ids if p not in evil]
        reducers = {s.peer_id: (ScalingReducer if s.peer_id in evil else AllReducer)(
            s, [FRAGMENT], "fp32", 2.0, sync_every=10, run_id="run", outlier_factor=4.0) for s in sw}
        for r in reducers.values():
            await r.start()
        by_id = {s.peer_id: s for s in sw}
        mms = {p: Matchmaker(by_id[p], "run", 1) for p in ids}
        for m in mms.values():
            await m.start()
        for p in ids:
            mms[p].listed_in = reducers[p].expect
        contribs = {p: Contribution(delta(i), 1000, 10) for i, p in enumerate(ids)}
        group = Group("r1", KEY, tuple(ids), 0.0)
        first = await asyncio.gather(*(reducers[p].run(group, contribs[p]) for p in ids), return_exceptions=True)
        reputations = {p: Reputation() for p in honest}
        for p, res in zip(ids, first):
            if p in honest:
                assert isinstance(res, RoundResult) and set(res.suspects) == evil
                for q in res.suspects:  # as node.runtime does with the weighing's ResultRefused
                    reputations[p].refuted(q, "raised_loss")
                    mms[p].avoid(q, "raised_loss")
        assert all(set(mms[p].avoiding()) == evil for p in honest)
        assert all(reputations[p].standing(q).refuted == 1 and not reputations[p].trusted(q)
                   for p in honest for q in evil)

        key = GroupKey(0, KEY.version, KEY.digest)  # the honest members are still at the version
        formed = await asyncio.gather(*(mms[p].form_group(key, grace=0.5, quorum_timeout=10.0, expected=4)
                                         for p in ids))
        groups = {p: g for p, (outcome, g) in zip(ids, formed) if outcome == "group"}
        assert set(honest) <= set(groups)
        assert all(set(groups[p].members) == set(honest) for p in honest)
        second = await asyncio.gather(*(reducers[p].run(groups[honest[0]], contribs[p]) for p in honest))
        assert all(isinstance(r, RoundResult) for r in second)
        assert all(r.contributors == tuple(honest) for r in second)
        assert all(a.equal(b) for a, b in zip(second[0].delta, second[1].delta))


@pytest.mark.timeout(60)
@pytest.mark.looptime(end=600)
@pytest.mark.asyncio
async def test_a_member_whose_delta_is_muted_is_named_so_that_it_earns_no_reputation():
    """A member sending −Δ (a flipper) is muted in every honest reducer's merge (``core.merge``:
    it points against the reducer's own Δ); the reducer records it per round
    (``AllReducer.muted``), which ``Node._credit`` reads: listed among the contributors of a
    committed round, it still earns no point there."""
    async with memory_swarms(3, MemoryNet(default=Link(latency=0.005))) as (net, sw):
        ids = sorted(s.peer_id for s in sw)
        reducers = {s.peer_id: AllReducer(s, [FRAGMENT], "fp32", 2.0, sync_every=10, run_id="run",
                                          outlier_factor=4.0) for s in sw}
        for r in reducers.values():
            await r.start()
        flipper = ids[2]
        contribs = {p: Contribution(tuple(-t for t in delta(i)) if p == flipper else delta(i), 1000, 10)
                    for i, p in enumerate(ids)}
        group = Group("r1", KEY, tuple(ids), 0.0)
        results = await asyncio.gather(*(reducers[p].run(group, contribs[p]) for p in ids), return_exceptions=True)
        assert all(isinstance(r, RoundResult) and flipper in r.contributors for r in results[:2]), results
        assert all(reducers[p].muted["r1"] == {flipper} for p in ids[:2])


@pytest.mark.timeout(60)
@pytest.mark.looptime(end=600)
@pytest.mark.asyncio
async def test_a_group_of_avoided_colluders_at_our_key_does_not_make_the_honest_members_late():
    """Two colluders, avoided by both honest members after a refused round, form a group of their
    own at the honest members' key and say so (pushed declarations). The honest members are not
    late there (they would wait for a state they refuse to follow: in bench/trust_poison.py
    --honest-first 300 two fragments of an honest node stayed at one version for the last 40 s of
    the run, every round "late"); they form a group of their own."""
    async with memory_swarms(4, MemoryNet(default=Link(latency=0.005))) as (net, sw):
        ids = sorted(s.peer_id for s in sw)
        evil, honest = ids[:2], ids[2:]
        by_id = {s.peer_id: s for s in sw}
        mms = {p: Matchmaker(by_id[p], "run", 1) for p in ids}
        for m in mms.values():
            await m.start()
            m.gatherings.audience = lambda: ids  # learners that know each other: declarations are pushed
        pushers = [asyncio.create_task(m.gatherings.push_forever()) for m in mms.values()]
        try:
            for p in honest:
                for q in evil:
                    mms[p].avoid(q, "raised_loss")
            key = GroupKey(0, KEY.version, KEY.digest)
            theirs = await asyncio.gather(*(mms[p].form_group(key, grace=0.5, quorum_timeout=10.0, expected=2)
                                            for p in evil))
            assert [o for o, _ in theirs] == ["group"] * 2 and set(theirs[0][1].members) == set(evil)
            leader = theirs[0][1].leader

            def heard(p: str) -> bool:  # the colluders' leader's closed key reached honest member p
                d = mms[p].gatherings.declarations(key.fragment, key.version, key.digest).get(leader)
                return d is not None and d.grouped

            await until(lambda: all(heard(p) for p in honest), 10, "the colluders' group at the honest members")
            ours = await asyncio.gather(*(mms[p].form_group(key, grace=0.5, quorum_timeout=10.0, expected=2)
                                          for p in honest))
            assert [o for o, _ in ours] == ["group"] * 2 and set(ours[0][1].members) == set(honest)
        finally:
            for task in pushers:
                task.cancel()
