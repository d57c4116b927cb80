"""Trust over real sockets: several in-process swarms (one p2pd each) on 127.0.0.1.

Signed and robust all-reduce rounds with faulty and malicious members, owner-only DHT
records, private-swarm admission, and an identity used twice. Every swarm started here is
shut down in ``finally`` (its p2pd with it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest
from conftest import swarms, until
import torch

from p2pdiloco.core.fragments import Fragment, TensorSlot, assign_parts
from p2pdiloco.core.merge import contribution_weight
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.core.periods import span_fraction
from p2pdiloco.core.robust import robust_merge
from p2pdiloco.errors import ProtocolError, RoundFailed
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution, ContributionExcluded, RoundResult
from p2pdiloco.net.rounds.matchmaking import Group, GroupKey, Matchmaker, leader_rank
from p2pdiloco.net.state.statesync import StateSync
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.trust import signing
from p2pdiloco.trust.certificates import Membership, SwarmKey, fingerprint
from p2pdiloco.trust.errors import AccessDenied, IdentityError
from p2pdiloco.trust.identity import Identity

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_daemon_left")]



SHAPES = [(24, 16), (16,), (16, 16), (40,), (8, 8), (12, 4), (30,), (6, 6), (20,)]
FRAGMENT = Fragment(0, tuple(TensorSlot(f"t{i}", s, int(torch.Size(s).numel()), i == 0) for i, s in enumerate(SHAPES)))
KEY = GroupKey(0, 3, "ab" * 32)




def delta(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """A member's Δ: a direction common to every seed plus as much of the seed's own, so two
    members' Δ have a cosine of about 0.5, as honest learners' do (docs/trust.md §5)."""
    g, common = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(2**31 - 1)
    return tuple((torch.randn(s, generator=common) + torch.randn(s, generator=g)) * scale * 1e-2 for s in SHAPES)


class Resigned(AllReducer):
    """A member whose requests are tampered with after signing."""

    def __init__(self, *args, mode: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode, self.other = mode, Identity.generate()

    async def run(self, group, contrib):
        self.members = list(group.members)
        return await super().run(group, contrib)

    def _outgoing(self, reducer, head, payload):
        head = dict(head)
        if self.mode == "bad_signature":  # the signature no longer matches the bytes
            head["sig"] = bytes([head["sig"][0] ^ 1]) + head["sig"][1:]
        elif self.mode == "other_key":  # signed by a key that is not its peer ID's (sent along, as
            # requests did before WIRE_VERSION 11: the reducer checks with the peer ID's key only)
            fields = signing.contribution_fields(self.run_id, KEY.fragment, KEY.version, KEY.digest,
                                                 head["round"], self.members, reducer, head["tokens"],
                                                 head["steps"], head["span"], head["pos"], signing.sha256(payload))
            head["sig"], head["k"] = signing.sign(self.other, "ar.contrib", fields), self.other.public_key
        elif self.mode == "two_spans":  # validly signed, but a different span for each reducer
            head["span"] = 1 + reducer
            fields = signing.contribution_fields(self.run_id, KEY.fragment, KEY.version, KEY.digest,
                                                 head["round"], self.members, reducer, head["tokens"],
                                                 head["steps"], head["span"], head["pos"], signing.sha256(payload))
            head["sig"] = signing.sign(self.swarm.identity, "ar.contrib", fields)
        return head, payload


async def run_round(reducers: dict[str, AllReducer], contribs: dict[str, Contribution]) -> dict[str, object]:
    members = tuple(sorted(reducers))
    group = Group("r1", KEY, members, 0.0)

    async def one(peer: str):
        try:
            return await reducers[peer].run(group, contribs[peer])
        except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
            return e

    results = await asyncio.gather(*(one(p) for p in members))
    return dict(zip(members, results))


def expected_merge(contribs: list[Contribution], policy: str = "drop", *, group: int | None = None,
                   positions: tuple[int, ...] | None = None, shares: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """The round's result computed in one process: each reducer r of a group of ``group``
    members (default: the contributors) merges its tensors (``assign_parts``) with its own Δ as
    the reference (``robust_merge(own=...)``) when it is a contributor; ``positions[k]``: the
    group index of ``contribs[k]`` (default k)."""
    positions = tuple(range(len(contribs))) if positions is None else positions
    weights = [contribution_weight(c.tokens, c.steps) for c in contribs]
    merged: dict[int, torch.Tensor] = {}
    for r, slots in enumerate(assign_parts([s.numel for s in FRAGMENT.slots], group or len(contribs), shares)):
        if slots:
            out = robust_merge([[c.delta[i] for i in slots] for c in contribs], weights,
                               [FRAGMENT.embedding_mask[i] for i in slots], policy=policy, factor=4.0,
                               own=positions.index(r) if r in positions else None)
            merged.update(zip(slots, out.merged))
    return [merged[i] for i in range(len(SHAPES))]


@pytest.mark.asyncio
async def test_faulty_and_malicious_members_are_rejected_and_honest_members_agree():
    """Three honest members and four bad ones in one group: NaN in one tensor (only that
    tensor's reducer sees it, so the reducers disagree and phase 2 reconciles), a 10^6 times
    larger norm (dropped as an outlier), a broken signature, a signature by another key."""
    async with swarms(7) as sw:
        ids = [s.peer_id for s in sw]
        honest, (nan, huge, badsig, otherkey) = ids[:3], ids[3:]
        reducers: dict[str, AllReducer] = {}
        for s in sw:
            mode = {badsig: "bad_signature", otherkey: "other_key"}.get(s.peer_id)
            cls_kwargs = dict(run_id="run/tag", outliers="drop", outlier_factor=4.0)
            reducers[s.peer_id] = (Resigned(s, [FRAGMENT], "fp32", 4.0, sync_every=10, mode=mode, **cls_kwargs) if mode
                                   else AllReducer(s, [FRAGMENT], "fp32", 4.0, sync_every=10, **cls_kwargs))
            await reducers[s.peer_id].start()
        contribs = {p: Contribution(delta(i), 1000 + 100 * i, 10 + i) for i, p in enumerate(ids)}
        poisoned = list(contribs[nan].delta)
        poisoned[2] = poisoned[2].clone()
        poisoned[2][0, 0] = float("nan")
        contribs[nan] = dataclasses.replace(contribs[nan], delta=tuple(poisoned))
        contribs[huge] = dataclasses.replace(contribs[huge], delta=tuple(t * 1e6 for t in contribs[huge].delta))

        results = await run_round(reducers, contribs)

        expected = expected_merge([contribs[p] for p in sorted(honest)], group=len(ids),
                                  positions=tuple(sorted(ids).index(p) for p in sorted(honest)))
        # the round's counters, from the honest contributions only (H = 10, spans 1)
        clean = [contribs[p] for p in sorted(honest)]
        counters = (sum(c.tokens for c in clean), sorted(c.position for c in clean)[(len(clean) - 1) // 2],
                    span_fraction([(c.tokens, c.steps, c.span) for c in clean], 10))
        for p in honest:
            result = results[p]
            assert isinstance(result, RoundResult), result
            assert all(torch.isfinite(t).all() for t in result.delta)
            assert all(torch.equal(a, b) for a, b in zip(result.delta, expected)), "not the clean merge of the honest"
            assert set(result.contributors) == set(honest)
            assert (result.tokens, result.position, result.first) == counters
        for p in (nan, huge, badsig, otherkey):
            assert isinstance(results[p], ContributionExcluded), results[p]
        rejected = sum((r.stats.rejected for r in reducers.values()), start=Counter())
        assert rejected["non_finite"] == 1  # only the reducer of tensor 2 saw the NaN
        assert rejected["outlier"] == 7 and rejected["bad_signature"] == 14  # tampered, and signed by another key
        assert sum(r.stats.reconciled for r in reducers.values()) == 7  # every member needed phase 2
        for s in sw:  # verification failures ban the sender on every reducer that saw them; outliers are not banned
            assert badsig in s.bans or s.peer_id == badsig
            assert otherkey in s.bans or s.peer_id == otherkey
            assert huge not in s.bans


@pytest.mark.asyncio
async def test_a_member_dropped_by_every_reducer_in_phase_one_gets_the_round_result_with_its_exclusion():
    """Three members, one sending a 10^6 times larger Δ, drop policy: every reducer drops it
    in phase 1 (one contributor set, no phase 2), so the excluded member holds the same signed
    bodies as the others: its ContributionExcluded carries their result, tensors and counters
    equal, which it commits with its progress rebased (``Node._take_excluded``)."""
    async with swarms(3) as sw:
        reducers = {s.peer_id: AllReducer(s, [FRAGMENT], "fp32", 4.0, sync_every=10, run_id="run", outliers="drop",
                                          outlier_factor=4.0) for s in sw}
        for r in reducers.values():
            await r.start()
        ids = sorted(reducers)
        contribs = {p: Contribution(delta(i, 1e6 if i == 0 else 1.0), 1000 + i, 10, 1, 50 + i)
                    for i, p in enumerate(ids)}
        results = await run_round(reducers, contribs)
        excluded = results[ids[0]]
        assert isinstance(excluded, ContributionExcluded) and excluded.result is not None, excluded
        expected = expected_merge([contribs[p] for p in ids])  # every reducer drops member 0 (its weight
        # still counts in the median cap, taken before the norm bound)
        for got in (excluded.result, results[ids[1]], results[ids[2]]):
            assert isinstance(got, RoundResult), got
            assert all(torch.equal(a, b) for a, b in zip(got.delta, expected))
            # tokens 1001 + 1002, positions 51, 52: lower median 51; both one whole period
            assert (got.tokens, got.position, got.first, got.contributors) == (2003, 51, 1.0, tuple(ids[1:]))
        assert reducers[ids[0]].stats.excluded == 1 and reducers[ids[0]].stats.rounds == 0


@pytest.mark.asyncio
async def test_clip_policy_keeps_a_scaled_contribution_bounded():
    async with swarms(3) as sw:
        reducers = {s.peer_id: AllReducer(s, [FRAGMENT], "fp32", 4.0, sync_every=10, run_id="run", outliers="clip", outlier_factor=4.0)
                    for s in sw}
        for r in reducers.values():
            await r.start()
        ids = sorted(reducers)
        contribs = {p: Contribution(delta(i, 1e6 if i == 0 else 1.0), 1000, 10) for i, p in enumerate(ids)}
        results = await run_round(reducers, contribs)
        expected = expected_merge([contribs[p] for p in ids], policy="clip")
        plain = expected_merge([contribs[p] for p in ids], policy="off")
        for p in ids:
            assert all(torch.equal(a, b) for a, b in zip(results[p].delta, expected))
        honest_norm = max(float(t.norm()) for p in ids[1:] for t in contribs[p].delta)
        assert max(float(t.norm()) for t in expected) < 4 * 4 * honest_norm < max(float(t.norm()) for t in plain)
        assert sum(r.stats.clipped for r in reducers.values()) == len(SHAPES)


@pytest.mark.asyncio
async def test_fractions_come_from_signed_counters_and_a_member_signing_two_versions_fails_the_round():
    """Three members; the round's counters (tokens summed, lower median schedule position, span
    fraction) are computed by each reducer from the counters it accepted and stated under its
    signature. Honest counters: every member gets the same (H = 10: one member worked a whole
    period over one round, one half a period, one a whole period spread over two rounds). A
    member that signs a different span for each reducer makes their statements differ: nobody
    commits."""
    async with swarms(3) as sw:
        ids = sorted(s.peer_id for s in sw)
        counters = {ids[0]: (1000, 10, 1, 40), ids[1]: (500, 5, 1, 35), ids[2]: (1000, 10, 2, 41)}
        reducers = {s.peer_id: AllReducer(s, [FRAGMENT], "fp32", 4.0, sync_every=10, run_id="run", outlier_factor=4.0)
                    for s in sw}
        for r in reducers.values():
            await r.start()
        contribs = {p: Contribution(delta(i), *counters[p]) for i, p in enumerate(ids)}
        results = await run_round(reducers, contribs)
        # weights tokens²/steps: 100000, 50000, 100000; shares 1, 0.5, 0.5 -> 175000/250000 = 0.7
        # positions 40, 35, 41: the lower median is 40
        assert {(r.tokens, r.position, r.first) for r in results.values()} == {(2500, 40, round(0.7 * 1024) / 1024)}

    async with swarms(3) as sw:
        ids = sorted(s.peer_id for s in sw)
        two = sw[0].peer_id
        reducers = {s.peer_id: (Resigned(s, [FRAGMENT], "fp32", 4.0, sync_every=10, run_id="run", mode="two_spans")
                                if s.peer_id == two else AllReducer(s, [FRAGMENT], "fp32", 4.0, sync_every=10,
                                                                    run_id="run"))
                    for s in sw}
        for r in reducers.values():
            await r.start()
        results = await run_round(reducers, {p: Contribution(delta(i), 1000, 10) for i, p in enumerate(ids)})
        # the same contributor set everywhere (no phase 2), yet no result: the stated counters differ
        assert all(isinstance(r, RoundFailed) and not isinstance(r, ContributionExcluded) for r in results.values()), \
            results
        assert all(r.stats.reconciled == 0 and r.stats.failed == 1 for r in reducers.values())


@pytest.mark.asyncio
async def test_a_reducer_answer_that_fails_verification_fails_the_round():
    class ForgingReducer(AllReducer):
        def _statement(self, rnd, phase, contributors, merged):
            head, body = super()._statement(rnd, phase, contributors, merged)
            return head, body[:-4] + b"\0\0\0\0"  # bytes no longer match the signed digest

    async with swarms(2) as sw:
        good = AllReducer(sw[0], [FRAGMENT], "fp32", 4.0, sync_every=10, run_id="run")
        bad = ForgingReducer(sw[1], [FRAGMENT], "fp32", 4.0, sync_every=10, run_id="run")
        for r in (good, bad):
            await r.start()
        results = await run_round({sw[0].peer_id: good, sw[1].peer_id: bad},
                                  {s.peer_id: Contribution(delta(i), 100, 5) for i, s in enumerate(sw)})
        assert all(isinstance(r, Exception) for r in results.values())
        assert good.stats.rejected["bad_result"] == 1 and sw[1].peer_id in sw[0].bans


# ---- DHT records -------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_dht_record_under_another_nodes_key_is_rejected():
    async with swarms(3) as (a, b, c):
        key = "run/heads"
        assert await a.store(key, a.peer_id, {"f": [[1, "a" * 64]]}, 30)
        # b writes under a's peer ID, signed by b: every validating peer refuses it
        assert not await b.store(key, a.peer_id, {"f": [[99, "b" * 64]]}, 60)
        # b bypasses its own checks and forges the envelope: author a, signature by b
        forged_author = a.peer_id

        def forge(record):
            inner = record.value
            fields = [record.key, record.subkey, inner, float(record.expiration_time)]
            return msgpack.packb([1, forged_author, inner, signing.sign(b.identity, "dht.record", fields), None],
                                 use_bin_type=True)

        b.records.sign_value, b.records.validate = forge, lambda record: True
        await b.store(key, a.peer_id, {"f": [[1000, "c" * 64]]}, 90)
        for peer in (a, c):
            seen = await peer.get(key)
            assert seen.get(a.peer_id) == {"f": [[1, "a" * 64]]}, seen
        assert a.records.rejected["not_owner"] >= 1 and a.records.rejected["bad_signature"] >= 1


# ---- private swarms ----------------------------------------------------------------------

@pytest.mark.asyncio
async def test_private_swarm_refuses_non_members_and_members_carry_on():
    owner = SwarmKey.generate()
    ids = [Identity.generate() for _ in range(4)]
    now = time.time()
    members = [Membership(owner.public_key, owner.admit(i.public_key, valid_for=3600)) for i in ids[:2]]
    expired = Membership(owner.public_key, owner.admit(ids[3].public_key, valid_for=60, now=now - 3600))
    async with swarms(4, [*members, None, expired], ids) as (a, b, outsider, lapsed):
        name = f"private swarm {fingerprint(owner.public_key)}"
        reducers = {s.peer_id: AllReducer(s, [FRAGMENT], "fp32", 4.0, sync_every=10, run_id="run", outlier_factor=4.0) for s in (a, b)}
        zeros = tuple(torch.zeros(s) for s in SHAPES)
        start = [FragmentState.create(0, 0, zeros, zeros)]
        sync_a = StateSync(a, "run", [FRAGMENT], lambda: start)
        for service in (*reducers.values(), Matchmaker(a, "run", 1), sync_a):
            await service.start()
        assert await b.hello(a.peer_id) == name
        with pytest.raises(AccessDenied, match="presented no membership certificate"):
            await outsider.hello(a.peer_id)
        with pytest.raises(AccessDenied, match="expired at"):
            await lapsed.hello(b.peer_id)
        for rpc in ("ar.reduce", "mm.join", "state.get"):
            with pytest.raises(AccessDenied, match=f"refused {rpc}: not a member of {name}"):
                await outsider.call(a.peer_id, rpc, {"f": 0}, timeout=5)
        # a node started on the swarm's records is told why it cannot join
        await sync_a.publish({"name": "a"})
        for intruder in (outsider, lapsed):
            with pytest.raises(AccessDenied, match="the swarm refused this node"):
                await StateSync(intruder, "run", [FRAGMENT], lambda: []).start()
        # non-members' DHT writes are not accepted by members
        await outsider.store("run/heads", outsider.peer_id, {"f": []}, 30)
        await lapsed.store("run/heads", lapsed.peer_id, {"f": []}, 30)
        assert set(await sync_a.records()) == {a.peer_id}
        assert a.records.rejected["missing"] + b.records.rejected["missing"] >= 1
        assert a.refused["missing"] >= 4 and b.refused["expired"] >= 1
        # members still merge together
        contribs = {p: Contribution(delta(i), 100, 5) for i, p in enumerate(sorted(reducers))}
        results = await run_round(reducers, contribs)
        expected = expected_merge([contribs[p] for p in sorted(reducers)], policy="clip")
        assert all(all(torch.equal(x, y) for x, y in zip(r.delta, expected)) for r in results.values())


@pytest.mark.asyncio
async def test_matchmaking_ignores_banned_peers():
    async with swarms(2) as (a, b):
        mm_a, mm_b = Matchmaker(a, "run", 1), Matchmaker(b, "run", 1)
        await mm_a.start()
        await mm_b.start()
        a.ban(b.peer_id, "test")
        b.ban(a.peer_id, "test")
        (oa, ga), (ob, gb) = await asyncio.gather(mm_a.form_group(KEY, grace=1.0, quorum_timeout=3.0, expected=2),
                                                  mm_b.form_group(KEY, grace=1.0, quorum_timeout=3.0, expected=2))
        assert oa == ob == "group" and ga.members == (a.peer_id,) and gb.members == (b.peer_id,)
        with pytest.raises(ProtocolError, match="excluded from this run"):
            await mm_a._on_join(b.peer_id, {"f": 0, "v": 3, "d": bytes.fromhex(KEY.digest), "sig": bytes(64)}, b"")
        # gathering announcements are pushed by their authors; a banned peer's are ignored
        a.bans.clear()
        b.bans.clear()
        mm_a.gatherings.audience = lambda: [b.peer_id]
        pusher = asyncio.create_task(mm_a.gatherings.push_forever())
        try:
            key = GroupKey(0, KEY.version + 1, KEY.digest)  # at KEY, b's group of one makes a late at once
            task = asyncio.create_task(mm_a.form_group(key, grace=3.0, quorum_timeout=3.0, expected=2))
            await until(mm_b.open_gatherings, 3, "a's gathering announcement", every=0.1)
            assert mm_b.open_gatherings() == {0: {key}}
            b.ban(a.peer_id, "test")
            assert mm_b.open_gatherings() == {}
            b.bans.clear()
            assert mm_b.open_gatherings() == {0: {key}}
            await task
            await until(lambda: mm_b.open_gatherings() == {}, 5, "a's withdrawal", every=0.1)  # when its group closed
        finally:
            pusher.cancel()


@pytest.mark.asyncio
async def test_a_leader_admits_only_joiners_that_signed_and_members_check_every_signature():
    """A stranger whose ``mm.join`` carries no valid join signature is refused, counted and
    banned, and is not made a member. One that signs its join at the key is a member like any
    other: the joiner verifies every member's join signature against its peer ID (no DHT
    read) and bans nobody. A leader whose answer lists a member with a signature that does not
    verify (a peer that never asked to join) is banned by the joiner."""
    async with swarms(3) as (a, b, c):
        dht_key = KEY.dht_key("run")
        (leader, mm_l), (joiner, mm_j) = sorted(
            [(a, Matchmaker(a, "run", 2)), (b, Matchmaker(b, "run", 2))], key=lambda x: leader_rank(dht_key, x[0].peer_id))
        await mm_l.start()
        await mm_j.start()
        fields = signing.join_fields("run", KEY.fragment, KEY.version, KEY.digest, leader.peer_id)
        request = {"f": KEY.fragment, "v": KEY.version, "d": bytes.fromhex(KEY.digest)}
        gathering = lambda: mm_l._gatherings.get(0)  # noqa: E731

        # 1. a forged signature: refused at once, and its sender banned by the leader
        leading = asyncio.create_task(mm_l.form_group(KEY, grace=1.0, quorum_timeout=10.0, expected=3))
        await until(lambda: gathering() and gathering().key == KEY, 10, "the leader's gathering", every=0.05)
        with pytest.raises(ProtocolError, match="join signature does not verify"):
            await c.call(leader.peer_id, "mm.join", dict(request, sig=bytes(64)), timeout=10.0)
        assert c.peer_id in leader.bans and leader.drops.reasons["join_signature"] == 1
        (outcome_l, group_l), (outcome_j, group_j) = await asyncio.gather(
            leading, mm_j.form_group(KEY, grace=1.0, quorum_timeout=10.0, expected=3))
        assert outcome_l == outcome_j == "group"
        assert group_l.members == group_j.members == tuple(sorted([leader.peer_id, joiner.peer_id]))
        assert joiner.bans == {}

        # 2. a signed join at the next key: a member, verified by the other joiner
        leader.bans.clear()
        key2 = GroupKey(0, 4, "cd" * 32)
        (leader, mm_l), (joiner, mm_j) = sorted([(a, mm_l if a is leader else mm_j), (b, mm_j if b is joiner else mm_l)],
                                                key=lambda x: leader_rank(key2.dht_key("run"), x[0].peer_id))
        fields2 = signing.join_fields("run", key2.fragment, key2.version, key2.digest, leader.peer_id)
        leading = asyncio.create_task(mm_l.form_group(key2, grace=1.0, quorum_timeout=10.0, expected=3))
        await until(lambda: gathering() and gathering().key == key2, 10, "the leader's gathering", every=0.05)
        signed = {"f": key2.fragment, "v": key2.version, "d": bytes.fromhex(key2.digest),
                  "sig": signing.sign(c.identity, "mm.join", fields2)}
        joining_c = asyncio.create_task(c.call(leader.peer_id, "mm.join", signed, timeout=10.0))
        (outcome_l, group_l), (outcome_j, group_j) = await asyncio.gather(
            leading, mm_j.form_group(key2, grace=1.0, quorum_timeout=10.0, expected=3))
        reply, _ = await joining_c
        members = tuple(sorted([a.peer_id, b.peer_id, c.peer_id]))
        assert outcome_l == outcome_j == "group" and group_l.members == group_j.members == members
        assert rec.parse_join_answer(reply).members == members and len(reply["js"]) == 3
        assert all(signing.verify_by_peer(m, "mm.join", fields2, sig) if m != c.peer_id else sig == b""
                   for m, sig in zip(members, reply["js"]))  # c's own signature is left out: c need not check it
        assert leader.bans == {} and joiner.bans == {}
        assert fields != fields2  # a signature is for one key: it does not carry over to another round

        # 3. a leader that lists a member whose signature does not verify for it is banned: here
        # a valid signature of that member, made for another leader (itself)
        key3 = GroupKey(0, 5, "ef" * 32)
        other = leader  # signs a join at key3 with itself as the leader: not a join of c's group
        stolen = signing.sign(other.identity, "mm.join", signing.join_fields("run", 0, 5, "ef" * 32, other.peer_id))

        async def forging_leader(peer: str, header: dict, payload: bytes) -> tuple[dict, bytes]:
            group = sorted([peer, c.peer_id, other.peer_id])
            own = signing.sign(c.identity, "mm.join", signing.join_fields("run", 0, 5, "ef" * 32, c.peer_id))
            sigs = [header["sig"] if m == peer else own if m == c.peer_id else stolen for m in group]
            return {"members": rec.wire_members(group), "round": "r3", "t": 0.1, "s": [], "bw": [], "js": sigs}, b""

        await c.add_handler("mm.join", forging_leader)
        assert await mm_j._join(c.peer_id, key3, 10.0) == "gone" and c.peer_id in joiner.bans


# ---- identity ----------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_second_node_with_the_same_identity_refuses_to_start(tmp_path: Path):
    path = tmp_path / "p2p.key"
    ident, created = Identity.load_or_create(path)
    assert created and (path.stat().st_mode & 0o777) == 0o600
    async with swarms(1, identities=[Identity.load(path)]) as (first,):
        assert first.peer_id == ident.peer_id
        maddrs = await first.visible_maddrs()
        t0 = time.monotonic()
        with pytest.raises(IdentityError, match="is already used by a running node"):
            await Swarm.start(initial_peers=maddrs, identity_path=str(path))
        assert time.monotonic() - t0 < 15
        other = await Swarm.start(initial_peers=maddrs, identity_path=str(tmp_path / "new.key"))
        await other.shutdown()


@pytest.mark.asyncio
async def test_lossy_rounds_return_each_members_quantisation_residual_for_error_feedback():
    """Two members, int4 or topk2 on the wire: each gets back, exactly, its Δ minus what the
    reducers decoded from its slices (its own slice too), and both get the same merge: the
    robust merge of those decoded slices, through the precision's merged-slice coding. With
    fp32 on the wire nothing is lost and no residual comes back."""
    from p2pdiloco.net.codecs import wire

    for precision in ("int4", "topk2", "fp32"):
        async with swarms(2) as sw:
            ids = sorted(s.peer_id for s in sw)
            reducers = {s.peer_id: AllReducer(s, [FRAGMENT], precision, 4.0, sync_every=10, run_id="run",
                                              outliers="off") for s in sw}
            for r in reducers.values():
                await r.start()
            contribs = {p: Contribution(delta(i), 1000, 10) for i, p in enumerate(ids)}
            results = await run_round(reducers, contribs)
        if precision == "fp32":
            assert all(r.residual is None for r in results.values())
            continue
        decoded: dict[str, list[torch.Tensor]] = {}
        for p in ids:
            got: dict[int, torch.Tensor] = {}
            for slots in assign_parts([slot.numel for slot in FRAGMENT.slots], 2):  # whole tensors per reducer
                tensors = [contribs[p].delta[i] for i in slots]
                got.update(zip(slots, wire.decode(wire.encode(tensors, precision), [t.shape for t in tensors],
                                                  precision)))
            decoded[p] = [got[i] for i in range(len(SHAPES))]
            residual = results[p].residual
            assert all(torch.equal(e, contribs[p].delta[i] - got[i]) for i, e in enumerate(residual))
            assert max(float(e.norm() / d.norm()) for e, d in zip(residual, contribs[p].delta)) > 0.01
        weights = [contribution_weight(1000, 10)] * 2
        merged = robust_merge([decoded[p] for p in ids], weights, FRAGMENT.embedding_mask, policy="off").merged
        for slots in assign_parts([slot.numel for slot in FRAGMENT.slots], 2):
            shapes = [SHAPES[i] for i in slots]
            coded = wire.decode_merged(wire.encode_merged([merged[i] for i in slots], precision), shapes, precision)
            for p in ids:
                assert all(torch.equal(results[p].delta[i], c) for i, c in zip(slots, coded))


class NonFiniteReducer(AllReducer):
    """A reducer that signs a merged slice holding an infinity."""

    def _statement(self, rnd, phase, contributors, merged):
        merged = [t.clone() for t in merged]
        merged[0].view(-1)[0] = float("inf")
        return super()._statement(rnd, phase, contributors, merged)


@pytest.mark.asyncio
async def test_a_reducer_that_signs_a_non_finite_merged_slice_fails_the_round_and_is_banned():
    """Its statement verifies (it signed those bytes), so the fault is provable: the other
    member commits nothing (the round fails) and bans it, instead of installing Θ = inf."""
    async with swarms(2) as sw:
        ids = sorted(s.peer_id for s in sw)
        evil = ids[0]  # the first member reduces slot 0 (assign_parts: the largest tensors first)
        reducers = {s.peer_id: (NonFiniteReducer if s.peer_id == evil else AllReducer)(
            s, [FRAGMENT], "fp32", 4.0, sync_every=10, run_id="run", outliers="off") for s in sw}
        for r in reducers.values():
            await r.start()
        slots = assign_parts([slot.numel for slot in FRAGMENT.slots], 2)
        assert 0 in slots[0]
        results = await run_round(reducers, {p: Contribution(delta(i), 1000, 10) for i, p in enumerate(ids)})
        honest = next(s for s in sw if s.peer_id != evil)
        assert isinstance(results[honest.peer_id], RoundFailed) and evil in honest.bans
        assert reducers[honest.peer_id].stats.rejected["bad_result"] == 1


@pytest.mark.asyncio
async def test_a_lone_round_returns_the_contribution_unquantised_and_refuses_a_non_finite_one():
    """A group of one member with int4 on the wire: the merged Δ is the contribution itself, bit
    for bit in fp32 (a wire round trip would round 4-bit), and a NaN Δ fails the round."""
    from p2pdiloco.errors import RoundFailed
    from p2pdiloco.net.codecs import wire

    async with swarms(1) as (s,):
        reducer = AllReducer(s, [FRAGMENT], "int4", 4.0, sync_every=10, run_id="run")
        await reducer.start()
        group = Group("lone", KEY, (s.peer_id,), 0.0)
        mine = delta(7)
        merged = await reducer.run(group, Contribution(mine, 1000, 5, span=2, position=77))
        assert all(torch.equal(m, d) and m.dtype == torch.float32 for m, d in zip(merged.delta, mine))
        assert (merged.tokens, merged.position, merged.first) == (1000, 77, 0.25)  # 5 of H = 10 steps over 2 rounds
        coded = wire.decode(wire.encode(list(mine), "int4"), SHAPES, "int4")
        assert not all(torch.equal(c, d) for c, d in zip(coded, mine))  # what a wire round trip gives
        assert merged.contributors == (s.peer_id,) and reducer.stats.rounds == 1
        assert merged.residual is None  # nothing was sent, so nothing was lost
        bad = tuple(t.clone() for t in mine)
        bad[1][0] = float("nan")
        with pytest.raises(RoundFailed, match="not finite"):
            await reducer.run(Group("lone2", KEY, (s.peer_id,), 0.0), Contribution(bad, 1000, 10))
