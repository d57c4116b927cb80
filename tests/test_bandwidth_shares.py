"""Bandwidth-aware all-reduce shares: the packing rule, the leader's split, the link meter,
the wire fields, and a round over real sockets where a slow member reduces nothing.

Real swarms (one p2pd each) on 127.0.0.1 are shut down in ``finally`` (``conftest.swarms``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from conftest import swarms
from test_trust_net import FRAGMENT, KEY, SHAPES, delta, expected_merge

from p2pdiloco.core.fragments import assign_parts
from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution, RoundResult
from p2pdiloco.net.rounds.results import MAX_WAIT_FACTOR, round_wait
from p2pdiloco.net.transport.drops import RATE_MIN_BYTES, LinkMeter
from p2pdiloco.net.rounds.matchmaking import Matchmaker
from p2pdiloco.net.rounds.shares import bandwidth_shares, max_share
from p2pdiloco.trust.identity import Identity

pytestmark = pytest.mark.usefixtures("no_daemon_left")

FAST, SLOW = 50e6 / 8, 2e6 / 8  # bytes/s: 50 and 2 Mbit/s links


def test_weighted_packing_by_hand():
    # sizes 9,5,5,1 (slots 1,0,3,2); shares 3:1. 9 -> 0 (9/3 < 9/1); 5 -> 0: (9+5)/3 = 4.67 < 5/1;
    # 5 -> 1: (14+5)/3 = 6.33 > 5/1; 1 -> 0: (14+1)/3 = 5 < (5+1)/1 = 6
    assert assign_parts([5, 9, 1, 5], 2, (3, 1)) == ((0, 1, 2), (3,))
    # a share of 0 reduces nothing; equal shares give the unweighted packing exactly
    assert assign_parts([5, 9, 1, 5], 3, (1, 0, 1)) == ((1, 2), (), (0, 3))
    sizes = [100, 30, 30, 30, 10, 200, 50]
    assert assign_parts(sizes, 3, (333, 333, 333)) == assign_parts(sizes, 3) == assign_parts(sizes, 3, ())
    for bad in [(1, 1), (1, -1, 1), (0, 0, 0)]:
        with pytest.raises(ValueError, match="shares"):
            assign_parts(sizes, 3, bad)


def test_leader_split_follows_rates_and_caps_reports_at_the_median():
    # hivemind's LP: a member at 1/25 of the others' rate only sends and receives (share 0):
    # its traffic is then 1 vector (1/SLOW = 4.0e-6 s per byte) against 1 + 2/3 for the fast
    # members (2.7e-7): any share for it would make it the slowest
    assert bandwidth_shares([FAST, FAST, FAST, SLOW]) == (334, 333, 333, 0)
    assert bandwidth_shares([FAST] * 4) == (250,) * 4
    # unmeasured: the mean of the measured, 4.25e6 bytes/s: some share, less than a fast member's
    unmeasured = bandwidth_shares([None, FAST, FAST, SLOW])
    assert sum(unmeasured) == 1000 and unmeasured[3] == 0 and 250 < unmeasured[0] < min(unmeasured[1:3])
    # a report of 1000x the others counts at the lower median: no larger part of the merge
    assert bandwidth_shares([1000 * FAST, FAST, FAST, FAST]) == (250,) * 4
    # two colluding reports among four cannot lift the lower median (SLOW): equal shares
    assert bandwidth_shares([1000 * FAST, 1000 * FAST, SLOW, SLOW]) == (250,) * 4
    # what a joiner accepts from a leader: at most 2/n of the fragment (+1 for rounding)
    assert (max_share(2), max_share(3), max_share(4), max_share(10)) == (1000, 668, 501, 201)
    assert all(max(bandwidth_shares(r)) <= max_share(len(r)) for r in
               ([FAST, FAST, SLOW], [FAST] * 3 + [SLOW] * 2, [FAST, SLOW, SLOW, SLOW], [None, FAST, FAST, SLOW]))
    # groups of two (every split moves the same bytes) and groups without two rates: equal
    assert bandwidth_shares([FAST, SLOW]) == ()
    assert bandwidth_shares([FAST, None, None]) == ()


def test_link_meter_takes_the_median_of_large_recent_payloads():
    meter = LinkMeter()
    meter.add(RATE_MIN_BYTES - 1, 0.001)  # small payloads are not timed
    meter.add(RATE_MIN_BYTES, 0.0)
    assert meter.estimate() is None
    for seconds in (1.0, 2.0, 0.001):  # the last one sat in a buffer: the median ignores it
        meter.add(RATE_MIN_BYTES, seconds)
    assert meter.estimate() == RATE_MIN_BYTES / 1.0
    # deadlines: a transfer is held to the ceiling, or to this node's own rate when slower,
    # but never below 1/16 of the ceiling (slow replies cannot stretch deadlines without end)
    assert meter.held_to(1 << 20) == RATE_MIN_BYTES and meter.held_to(1024) == 1024
    assert meter.held_to(64 << 20) == (64 << 20) / 16 and LinkMeter().held_to(1024) == 1024


def test_round_wait_scales_with_payload_over_the_slowest_link():
    mib = 1 << 20
    # 1 MiB fragment, 4 members at 1024 KiB/s, equal shares: a member moves 1 + 2/4 = 1.5 MiB
    # each way, 1.5 s; x3 slack = 4.5 s, below the 20 s liveness timeout
    assert round_wait(20.0, mib, (), (1024,) * 4) == 20.0
    # one member at 64 KiB/s and share 0 moves 1 MiB: 16 s, x3 = 48 s; the fast ones
    # (share 1/3: 1 + 2/3 MiB at 1024 KiB/s, 1.67 s) do not set it
    assert round_wait(20.0, mib, (334, 333, 333, 0), (1024, 1024, 1024, 64)) == 48.0
    # the same member with an equal share would move 1.5 MiB: 72 s
    assert round_wait(20.0, mib, (), (1024, 1024, 1024, 64)) == 72.0
    # unknown rates (0) do not count; none known or a lone member: the timeout; a claimed
    # rate of 1 KiB/s (a member that then sends nothing) holds a round 4 x the timeout at most
    assert round_wait(20.0, mib, (), (0, 0, 1024, 0)) == 20.0
    assert round_wait(20.0, mib, (), ()) == round_wait(20.0, mib, (), (5,)) == 20.0
    assert round_wait(10.0, mib, (), (1024, 1)) == MAX_WAIT_FACTOR * 10.0 == 40.0


def test_share_and_rate_fields_are_bounded():
    answer = {"members": [Identity.generate().public_key], "round": "r", "t": 0.1, "s": [1000], "js": [b"s" * 64]}
    assert rec.parse_join_answer(answer).shares == (1000,)
    assert rec.parse_join_answer(dict(answer, s=[])).shares == ()
    for bad in ([1001], [0], [500, 500], [True], "x", [1.0]):
        with pytest.raises(ProtocolError):
            rec.parse_join_answer(dict(answer, s=bad))
    assert rec.parse_join_answer(dict(answer, bw=[6104])).rates == (6104,)
    for bad in ([-1], [2**33], [1, 2], [None]):
        with pytest.raises(ProtocolError):
            rec.parse_join_answer(dict(answer, bw=bad))
    for bad in ([], [b"s" * 64] * 2, [b"s" * 63], ["s" * 64], None):
        with pytest.raises(ProtocolError):
            rec.parse_join_answer(dict(answer, js=bad))
    req = {"f": 0, "v": 1, "d": bytes.fromhex("ab" * 32), "sig": b"s" * 64}
    assert rec.parse_join_request(dict(req, bw=1024), 4).bandwidth == 1024
    for bad in (None, b"s" * 63, "s" * 64):
        with pytest.raises(ProtocolError):
            rec.parse_join_request(dict(req, sig=bad), 4)
    assert rec.parse_join_request(req, 4).bandwidth == 0
    for bad in (-1, 2**33, 1.5):
        with pytest.raises(ProtocolError):
            rec.parse_join_request(dict(req, bw=bad), 4)


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_transport_times_large_payloads_for_the_link_rate():
    """Three 512 KiB requests answered with 512 KiB each: the caller has a rate, at least the
    payload over the slowest whole call (a reply's read is part of its call); the server
    has none (requests are not timed: a caller could send slowly on purpose)."""
    async with swarms(2) as (a, b):
        async def echo(peer, head, payload):
            return {}, payload
        await b.add_handler("test.echo", echo, max_payload=1 << 20)
        n, walls = 512 << 10, []
        for i in range(3):
            t0 = time.monotonic()
            _, body = await a.call(b.peer_id, "test.echo", {}, bytes([i]) * n, timeout=30, max_reply=n)
            walls.append(time.monotonic() - t0)
            assert len(body) == n
        assert a.stats.link.estimate() is not None and a.stats.link.estimate() >= n / max(walls)
        assert b.stats.link.estimate() is None and b.stats.bytes_in == 3 * n


@pytest.mark.timeout(180)
@pytest.mark.asyncio
async def test_a_slow_member_only_sends_and_receives_and_the_group_agrees():
    """Four members, one whose link meter reads 2 Mbit/s and three at 50 Mbit/s (measurements
    given to the meters: loopback has no slow link; tests/internet has real ones): the leader,
    whoever it is, gives the slow member share 0, every member gets the same group and
    shares, the slow member's AllReducer reduces nothing, and every member commits the same
    merge as with equal shares."""
    async with swarms(4) as sw:
        slow = sw[3].peer_id
        for s in sw:
            for _ in range(3):
                s.stats.link.add(RATE_MIN_BYTES, RATE_MIN_BYTES / (SLOW if s.peer_id == slow else FAST))
        mms = [Matchmaker(s, "run", 1) for s in sw]
        for m in mms:
            await m.start()
        # the group closes once all 4 have joined; a long grace only keeps a member that a busy
        # machine slowed (CI once saw one arrive after a 3 s grace, and it was "late")
        outcomes = await asyncio.gather(*(m.form_group(KEY, grace=15.0, quorum_timeout=20.0, expected=4) for m in mms))
        groups = [g for _, g in outcomes]
        assert [o for o, _ in outcomes] == ["group"] * 4
        assert len({(g.members, g.shares, g.rates, g.round_id) for g in groups}) == 1
        group = groups[0]
        assert group.rates[group.members.index(slow)] == round(SLOW / 1024)
        assert len(group.members) == 4 and sum(group.shares) == rec.SHARE_GRID
        assert group.shares[group.members.index(slow)] == 0
        assert all(group.shares[i] > 0 for i, p in enumerate(group.members) if p != slow)

        reducers = {s.peer_id: AllReducer(s, [FRAGMENT], "fp32", 10.0, sync_every=10, run_id="run", outlier_factor=4.0)
                    for s in sw}
        for r in reducers.values():
            await r.start()
        contribs = {p: Contribution(delta(i), 1000, 10) for i, p in enumerate(group.members)}
        by_member = {s.peer_id: g for s, g in zip(sw, groups)}
        results = await asyncio.gather(*(reducers[p].run(by_member[p], contribs[p]) for p in group.members))
        expected = expected_merge([contribs[p] for p in group.members], policy="clip", shares=group.shares)
        for res in results:
            assert isinstance(res, RoundResult) and len(res.contributors) == 4
            assert all(torch.equal(x, y) for x, y in zip(res.delta, expected))
        assert reducers[slow]._rounds == {}  # it reduced no tensor
        parts = assign_parts([s.numel for s in FRAGMENT.slots], 4, group.shares)
        assert parts[group.members.index(slow)] == () and sorted(i for p in parts for i in p) == list(range(len(SHAPES)))
