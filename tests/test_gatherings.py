"""Gathering announcements pushed to the audience (``p2pdiloco.net.rounds.gatherings``), on the
in-memory network and virtual time: a learner hears of another's gathering, and of its end,
without the DHT; a malformed push is dropped and its author banned."""

from __future__ import annotations

import asyncio

import pytest
from conftest import until
from test_memory_net import memory_swarms
from test_trust_net import KEY

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.rounds.matchmaking import GroupKey, Matchmaker, leader_rank
from p2pdiloco.net.transport.memory import Link, MemoryNet

pytestmark = pytest.mark.looptime(end=3600)
AB, CD, ZERO, KEY_D = (bytes.fromhex(d) for d in ("ab" * 32, "cd" * 32, "00" * 32, KEY.digest))  # digests as sent


@pytest.mark.asyncio
async def test_a_gathering_is_pushed_to_the_audience_and_withdrawn_without_dht_reads():
    """A gathers at KEY (expecting a second learner that never comes); B, in A's audience,
    learns of it from A's push within a second, with no DHT read, and of its withdrawal when
    A's gathering ends; C, not in the audience, hears nothing; nobody reads or stores anything
    in the DHT (A, with an audience, declares by its pushes alone); a push of another run is
    refused, not read."""
    async with memory_swarms(3, MemoryNet(default=Link(latency=0.01))) as (net, (a, b, c)):
        mm_a, mm_b, mm_c = (Matchmaker(s, "run", 1) for s in (a, b, c))
        for m in (mm_a, mm_b, mm_c):
            await m.start()
        mm_a.gatherings.audience = lambda: [b.peer_id, a.peer_id]  # itself is skipped
        pusher = asyncio.create_task(mm_a.gatherings.push_forever())
        try:
            loop = asyncio.get_running_loop()
            gathering = asyncio.create_task(mm_a.form_group(KEY, grace=5.0, quorum_timeout=10.0, expected=2))
            t0, reads = loop.time(), net.dht_gets[b.peer_id]
            await mm_b.gatherings.watch()
            assert loop.time() - t0 < 1.0
            assert mm_b.open_gatherings() == {0: {KEY}} and mm_c.open_gatherings() == {}
            assert (await gathering)[0] == "group"
            await until(lambda: mm_b.gatherings.stats["received"] >= 2, 5, "A's withdrawal pushed to B", every=0.1)
            assert mm_b.open_gatherings() == {}
            assert net.dht_gets[b.peer_id] == reads and dict(b.stats.dht) == {}
            assert dict(a.stats.dht) == {}
            assert mm_a.gatherings.stats["sent"] >= 2 and mm_a.gatherings.stats["failed"] == 0
        finally:
            pusher.cancel()
        with pytest.raises(ProtocolError, match="another run"):
            await c.call(b.peer_id, "mm.gather", {"g": [[0, 9, KEY_D]], "t": c.clock.now(), "run": "other"},
                         timeout=5)
        assert mm_b.gatherings.stats["other_run"] == 1 and mm_b.open_gatherings() == {} and b.bans == {}


@pytest.mark.asyncio
async def test_a_malformed_push_is_dropped_and_its_author_banned_and_a_late_push_is_not_newer():
    async with memory_swarms(2, MemoryNet(default=Link(latency=0.01))) as (net, (a, b)):
        mm_b = Matchmaker(b, "run", 1, num_fragments=2)
        await mm_b.start()
        newer = {"g": [[1, 4, CD]], "t": b.clock.now(), "run": "run"}
        await a.call(b.peer_id, "mm.gather", newer, timeout=5)
        await a.call(b.peer_id, "mm.gather", {**newer, "g": [[1, 3, AB]], "t": newer["t"] - 1}, timeout=5)
        assert mm_b.open_gatherings() == {1: {GroupKey(1, 4, "cd" * 32)}}
        with pytest.raises(ProtocolError):  # fragment 7 of 2
            await a.call(b.peer_id, "mm.gather", {"g": [[7, 1, AB]], "t": 1.0, "run": "run"}, timeout=5)
        assert b.drop_reasons["gathering_push"] == 1 and a.peer_id in b.bans
        assert mm_b.open_gatherings() == {}  # a banned author's pushes are ignored
        with pytest.raises(ProtocolError):
            await a.call(b.peer_id, "mm.gather", newer, timeout=5)


@pytest.mark.asyncio
async def test_only_the_leader_announces():
    """The learner that leads a key pushes its announcement; one that joins it pushes nothing:
    a round costs each node about two pushes, whatever the swarm's size (before, every member
    announced to every other: O(N) pushes per node and round)."""
    async with memory_swarms(3, MemoryNet(default=Link(latency=0.01))) as (net, sw):
        observer, *learners = sw
        dht_key = KEY.dht_key("run")
        leader, joiner = sorted(learners, key=lambda s: leader_rank(dht_key, s.peer_id))
        mms = {s.peer_id: Matchmaker(s, "run", 1) for s in sw}
        for m in mms.values():
            await m.start()
            m.gatherings.audience = lambda: [s.peer_id for s in sw]
        pushers = [asyncio.create_task(mms[s.peer_id].gatherings.push_forever()) for s in learners]
        try:
            leading = asyncio.create_task(mms[leader.peer_id].form_group(KEY, grace=1.0, quorum_timeout=10.0,
                                                                        expected=2))
            watcher = mms[observer.peer_id]
            await until(lambda: watcher.open_gatherings() == {0: {KEY}}, 5, "the leader's announcement", every=0.05)
            joined = await mms[joiner.peer_id].form_group(KEY, grace=1.0, quorum_timeout=10.0, expected=2)
            assert joined[0] == (await leading)[0] == "group"
            await until(lambda: watcher.open_gatherings() == {}, 5, "the leader's withdrawal", every=0.05)
            assert mms[joiner.peer_id].gatherings.stats["sent"] == 0
            assert set(watcher.gatherings._pushes) == {leader.peer_id} and watcher.gatherings.stats["received"] == 2
        finally:
            for task in pushers:
                task.cancel()


@pytest.mark.asyncio
async def test_no_push_hides_another_a_future_one_is_refused_and_one_fragment_twice_is_banned():
    """Every fresh announcement counts, so a hostile one at a made-up higher version does not
    hide an honest one at ours (before, one winner per fragment: the higher version won); an
    announcement stamped in the future (it would never age out) is dropped, its author not
    banned (a clock may be off); one naming a fragment twice (a second vote) bans its author."""
    async with memory_swarms(3, MemoryNet(default=Link(latency=0.01))) as (net, (honest, hostile, b)):
        mm_b = Matchmaker(b, "run", 1, num_fragments=2)
        await mm_b.start()
        now = b.clock.now()
        await honest.call(b.peer_id, "mm.gather", {"g": [[0, 3, AB]], "t": now, "run": "run"}, timeout=5)
        await hostile.call(b.peer_id, "mm.gather", {"g": [[0, 4, ZERO]], "t": now, "run": "run"}, timeout=5)
        assert mm_b.open_gatherings() == {0: {GroupKey(0, 3, "ab" * 32), GroupKey(0, 4, "00" * 32)}}
        with pytest.raises(ProtocolError, match="future"):
            await hostile.call(b.peer_id, "mm.gather", {"g": [[0, 5, ZERO]], "t": now + 3600, "run": "run"},
                               timeout=5)
        assert b.drop_reasons["gathering_future"] == 1 and b.bans == {}
        with pytest.raises(ProtocolError):
            await hostile.call(b.peer_id, "mm.gather", {"g": [[0, 4, ZERO], [0, 4, ZERO]], "t": now,
                                                        "run": "run"}, timeout=5)
        assert set(b.bans) == {hostile.peer_id}
        assert mm_b.open_gatherings() == {0: {GroupKey(0, 3, "ab" * 32)}}
        with pytest.raises(ProtocolError):  # a closed key named twice for one fragment: banned too
            await honest.call(b.peer_id, "mm.gather", {"g": [], "t": now, "run": "run",
                                                       "l": [[0, 1, AB, now], [0, 2, AB, now]]},
                              timeout=5)
        assert set(b.bans) == {hostile.peer_id, honest.peer_id} and b.drop_reasons["gathering_push"] == 2


@pytest.mark.asyncio
async def test_a_peer_that_fails_a_push_is_skipped_for_a_while():
    """A peer in the audience that does not serve ``mm.gather`` fails one push and then gets
    none for SKIP_S, so a peer that stalls delays the others' pushes once in that time; once it
    pushes to us itself (it restarted), it gets ours again at once."""
    from p2pdiloco.net.records.pushes import SKIP_S

    async with memory_swarms(3, MemoryNet(default=Link(latency=0.01))) as (net, (a, b, mute)):
        mm_a, mm_b = Matchmaker(a, "run", 1), Matchmaker(b, "run", 1)
        for m in (mm_a, mm_b):
            await m.start()
        mm_a.gatherings.audience = lambda: [b.peer_id, mute.peer_id]
        pusher = asyncio.create_task(mm_a.gatherings.push_forever())
        try:
            for n in (1, 2):
                mm_a.gatherings.announce([[0, n, KEY.digest]])
                await until(lambda: mm_b.gatherings.stats["received"] >= n, 5, "the push to b", every=0.05)
            assert mm_a.gatherings.stats["failed"] == 1 and mm_a.gatherings.stats["sent"] == 2
            await asyncio.sleep(SKIP_S)  # virtual time: the skip runs out
            mm_a.gatherings.announce([])
            await until(lambda: mm_a.gatherings.stats["failed"] == 2, 5, "the mute peer's second failure", every=0.05)
            # the mute peer comes back (restarted): its first push to a lifts the skip at once, and a
            # pushes it the newest announcement without waiting for a change
            mm_mute = Matchmaker(mute, "run", 1)
            await mm_mute.start()
            await mute.call(a.peer_id, "mm.gather", {"g": [], "t": mute.clock.now(), "run": "run"}, timeout=5)
            await until(lambda: mm_mute.gatherings.stats["received"] == 1, 5, "a's push to the returned peer",
                        every=0.05)
            assert mm_a.gatherings.stats["failed"] == 2
        finally:
            pusher.cancel()


@pytest.mark.asyncio
async def test_with_an_audience_matchmaking_needs_no_dht_and_a_latecomer_learns_it_is_late_from_a_push():
    """Three learners who know each other (the node's audience): the lowest-ranked of the first
    two leads, the other joins it, both from pushes alone; the third, ready after the group
    closed, is late at once because the leader's announcement names the key where it closed
    a group. No learner reads or stores a matchmaking declaration in the DHT."""
    async with memory_swarms(3, MemoryNet(default=Link(latency=0.01))) as (net, sw):
        mms = {s.peer_id: Matchmaker(s, "run", 1) for s in sw}
        for m in mms.values():
            await m.start()
            m.gatherings.audience = lambda: [s.peer_id for s in sw]
        pushers = [asyncio.create_task(m.gatherings.push_forever()) for m in mms.values()]
        try:
            first, second, third = (mms[s.peer_id] for s in sw)
            (o1, g1), (o2, g2) = await asyncio.gather(
                first.form_group(KEY, grace=1.0, quorum_timeout=10.0, expected=2),
                second.form_group(KEY, grace=1.0, quorum_timeout=10.0, expected=2))
            assert o1 == o2 == "group" and g1.members == g2.members and len(g1.members) == 2
            leader = g1.leader
            assert leader == min(g1.members, key=lambda p: leader_rank(KEY.dht_key("run"), p))
            await until(lambda: third.gatherings.declarations(KEY.fragment, KEY.version, KEY.digest).get(leader) is not None
                        and not third.gatherings.declarations(KEY.fragment, KEY.version, KEY.digest)[leader].open,
                        5, "the leader's closed key at the third learner", every=0.05)
            assert await third.form_group(KEY, grace=1.0, quorum_timeout=10.0, expected=3) == ("late", None)
            assert all(not any(k.endswith(":mm") for k in s.stats.dht) for s in sw), [dict(s.stats.dht) for s in sw]
        finally:
            for task in pushers:
                task.cancel()
