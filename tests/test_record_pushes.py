"""Heads records pushed to the learners a node knows (``st.heads``, net.state.statesync) over real
sockets: pushes carry every publish, the DHT gets a store every ``STORE_EVERY_S`` only, a
reader reuses a DHT read with the newer pushes merged in (longer while it receives pushes), and a hostile push is refused at the
parsing boundary. Every swarm started here is shut down in ``finally`` (its p2pd with it)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import swarms, until

from p2pdiloco.core.fragments import Fragment, TensorSlot
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.net.records.patches import Received
from p2pdiloco.net.records.pushes import Pusher
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.state.heads_records import READ_EVERY_S, READ_QUIET_S, STORE_ALONE_S, STORE_EVERY_S
from p2pdiloco.net.state.statesync import StateSync
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.net.transport.dht_access import NARROW_BEAM
from p2pdiloco.trust.identity import Identity

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_daemon_left")]

FRAGMENT = Fragment(0, (TensorSlot("w", (4,), 4, False),))


def state(version: int) -> FragmentState:
    return FragmentState.create(0, version, (torch.full((4,), float(version)),), (torch.zeros(4),))


async def started_syncs(*peers) -> tuple[dict[str, list[FragmentState]], list[StateSync]]:
    """A started StateSync on each transport, each holding state(0) until the test changes ``held``."""
    held = {s.peer_id: [state(0)] for s in peers}
    syncs = [StateSync(s, "run", [FRAGMENT], lambda p=s.peer_id: held[p]) for s in peers]
    for sync in syncs:
        await sync.start()
    return held, syncs


@pytest.mark.asyncio
async def test_records_are_pushed_on_every_publish_and_stored_every_few_seconds():
    async with swarms(3) as (a, b, c):
        held, (sync_a, sync_b) = await started_syncs(a, b)
        sync_a.pusher.audience = lambda: [b.peer_id]
        pusher = asyncio.create_task(sync_a.pusher.push_forever())
        try:
            assert sync_b.read_age() == READ_EVERY_S  # nobody pushed to b yet: it looks for the swarm in the DHT
            await sync_a.publish({"name": "a"})  # the first publish is stored
            await sync_b.publish({"name": "b"})
            assert a.stats.dht["store:heads"] == 1
            first = await sync_b.records()
            assert first[a.peer_id].fragments == ((0, state(0).digest),)
            gets = b.stats.dht["get:heads"]
            # a commits twice within STORE_EVERY_S: both publishes are pushed, neither is stored
            for v in (1, 2):
                held[a.peer_id] = [state(v)]
                await sync_a.publish({"name": "a"})
            assert a.stats.dht["store:heads"] == 1 and STORE_EVERY_S >= 4
            await until(lambda: sync_a.pusher.stats["sent"] >= 2 and sync_b.pushes_received["received"] >= 2,
                        10, "a's pushes at b", every=0.05)
            assert sync_b.read_age() == READ_QUIET_S > READ_EVERY_S  # a pushes to b: b's DHT reads slow down
            now = await sync_b.records(max_dht_age=60.0)  # the DHT read above, the newer push merged in
            assert now[a.peer_id].fragments == ((2, state(2).digest),)
            assert b.stats.dht["get:heads"] == gets
            fresh = await sync_b.records()  # a DHT read (a stored v0): the push is newer and stays
            assert fresh[a.peer_id].fragments == ((2, state(2).digest),) and b.stats.dht["get:heads"] == gets + 1

            # hostile pushes: another run is refused and counted; a malformed record bans its author
            good = {"r": now[a.peer_id].to_wire(), "run": "other-run"}
            with pytest.raises(ProtocolError, match="another run"):
                await c.call(b.peer_id, "st.heads", good, timeout=5)
            assert sync_b.pushes_received["other_run"] == 1 and c.peer_id not in b.bans
            with pytest.raises(ProtocolError):
                await c.call(b.peer_id, "st.heads", {"r": {"f": "x"}, "run": "run"}, timeout=5)
            assert c.peer_id in b.bans and b.drops.reasons["heads_record"] == 1
            assert set(await sync_b.records(max_dht_age=60.0)) == {a.peer_id, b.peer_id}
        finally:
            pusher.cancel()


@pytest.mark.asyncio
async def test_the_newer_of_a_pushed_and_a_stored_record_counts_and_a_future_one_is_dropped():
    """A peer's pushed record newer than its stored one counts (progress travels by pushes),
    at a newer version or at the same version with another digest (an honest node that
    followed a split brain's winner); a record stamped an hour ahead is dropped (it would never
    age out), its author not banned."""
    async with swarms(2) as (a, b):
        sync_b = StateSync(b, "run", [FRAGMENT], lambda: [state(0)])
        await sync_b.start()
        stored = HeadsRecord(((3, state(3).digest),), t=a.clock.now())
        await a.store("run/heads", a.peer_id, stored.to_wire(), 60)
        switched = HeadsRecord(((3, "ee" * 32),), t=a.clock.now() + 1)
        await a.call(b.peer_id, "st.heads", {"r": switched.to_wire(), "run": "run"}, timeout=5)
        assert (await sync_b.records())[a.peer_id].fragments == ((3, "ee" * 32),)
        newer = HeadsRecord(((4, state(4).digest),), t=a.clock.now() + 2)
        await a.call(b.peer_id, "st.heads", {"r": newer.to_wire(), "run": "run"}, timeout=5)
        assert (await sync_b.records(max_dht_age=60.0))[a.peer_id].fragments == ((4, state(4).digest),)
        future = HeadsRecord(((5, state(5).digest),), t=a.clock.now() + 3600)
        with pytest.raises(ProtocolError, match="future"):
            await a.call(b.peer_id, "st.heads", {"r": future.to_wire(), "run": "run"}, timeout=5)
        assert b.drops.reasons["heads_future"] == 1 and a.peer_id not in b.bans
        assert (await sync_b.records(max_dht_age=60.0))[a.peer_id].fragments == ((4, state(4).digest),)


@pytest.mark.asyncio
async def test_a_newcomer_that_pushes_to_a_node_gets_its_newest_record_at_once(monkeypatch):
    """A node that knows no other learner stores its record every ``STORE_ALONE_S``; once a
    newcomer (which found it in the DHT) pushes to it, it pushes its newest record back at once,
    outside its audience and before its next change, so the newcomer does not act on the stored
    record, up to ``STORE_EVERY_S`` old; a peer that already holds the newest value gets nothing."""
    async with swarms(2) as (a, b):
        held, (sync_a, sync_b) = await started_syncs(a, b)
        sync_b.pusher.audience = lambda: [a.peer_id]  # b found a in the DHT; a knows nobody
        tasks = [asyncio.create_task(s.pusher.push_forever()) for s in (sync_a, sync_b)]
        try:
            await sync_a.publish({"name": "a"})
            held[a.peer_id] = [state(1)]
            skew = [0.0]
            monotonic = swarm_clock.monotonic
            monkeypatch.setattr(swarm_clock, "monotonic", lambda: monotonic() + skew[0])
            skew[0] = STORE_ALONE_S  # a commits STORE_ALONE_S later: nobody to push to, so stored again
            await sync_a.publish({"name": "a"})
            assert a.stats.dht["store:heads"] == 2 and STORE_ALONE_S < STORE_EVERY_S
            await sync_b.publish({"name": "b"})
            await until(lambda: sync_b.pushes_received["received"] == 1, 10, "a's record pushed back to b",
                        every=0.05)
            assert (await sync_b.records(max_dht_age=60.0))[a.peer_id].fragments == ((1, state(1).digest),)
            held[b.peer_id] = [state(1)]  # b follows a and publishes it: a pushes nothing more (b holds its newest)
            await sync_b.publish({"name": "b"})
            await until(lambda: sync_a.pushes_received["received"] == 2, 10, "b's second push at a", every=0.05)
            assert sync_a.pusher.stats["sent"] == 1 and sync_b.pushes_received["received"] == 1
        finally:
            for task in tasks:
                task.cancel()


async def receivers(monkeypatch, *peers) -> tuple[dict[str, list[int]], list[float]]:
    """A ``t.push`` handler on each of ``peers`` recording the pushed ``n`` ({peer ID: [n, ...]}),
    and a skew (seconds) added to this process's ``clock.monotonic``."""
    got: dict[str, list[int]] = {s.peer_id: [] for s in peers}
    for s in peers:
        async def on_push(peer, header, _, me=s.peer_id, bases=Received(s.drop)):
            if (header := bases.expand(peer, header)) is None:  # a patch of a value we do not hold
                return {"resend": True}, b""
            bases.keep(peer, header)
            got[me].append(header["n"])
            return {}, b""
        await s.add_handler("t.push", on_push)
    skew = [0.0]
    monotonic = swarm_clock.monotonic
    monkeypatch.setattr(swarm_clock, "monotonic", lambda: monotonic() + skew[0])
    return got, skew


@pytest.mark.asyncio
async def test_a_change_its_peers_know_is_pushed_to_them_with_the_next_one_or_after_max_defer(monkeypatch):
    """``Pusher.set``'s ``later``: the peers that took part in a change (a round's members) get
    it with the next change they do not know, or at the first change ``max_defer`` seconds after
    their last push, or when spared ``max_deferred`` changes in a row already; ``quiet``: nobody
    now. The others get every change at once."""
    async with swarms(3) as (a, b, c):
        got, skew = await receivers(monkeypatch, b, c)
        pusher = Pusher(a, "t.push", max_defer=10.0)
        pusher.audience = lambda: [b.peer_id, c.peer_id]
        task = asyncio.create_task(pusher.push_forever())

        async def settled(n: int) -> None:  # c (never deferred here) holds n, and nothing is in flight
            await until(lambda: got[c.peer_id][-1:] == [n] and not pusher._sending, 10, f"push {n}", every=0.02)

        try:
            pusher.set({"n": 1})
            await settled(1)
            assert got[b.peer_id] == [1]
            pusher.set({"n": 2}, [b.peer_id])  # b took part in change 2
            await settled(2)
            pusher.set({"n": 3}, [b.peer_id])  # ... and in change 3
            await settled(3)
            assert got[b.peer_id] == [1]
            pusher.set({"n": 4})  # a change b does not know: b gets the newest value, which holds all three
            await settled(4)
            assert got[b.peer_id] == [1, 4]
            pusher.set({"n": 5}, [b.peer_id, c.peer_id])  # both know it: the pusher wakes and sends nothing
            await until(lambda: not pusher._changed.is_set(), 10, "the pusher's wake", every=0.02)
            assert not pusher._sending and got[c.peer_id][-1] == 4
            pusher.set({"n": 6}, quiet=True)  # nobody hears of it now
            assert not pusher._changed.is_set()
            skew[0] = 10.0  # max_defer later, a change both know: they get the newest value all the same
            pusher.set({"n": 7}, [b.peer_id, c.peer_id])
            await settled(7)
            assert got == {b.peer_id: [1, 4, 7], c.peer_id: [1, 2, 3, 4, 7]}
            assert pusher.stats["sent"] == 8
            pusher.max_deferred = 1  # as heads records: at most one change a peer knows goes unpushed
            pusher.set({"n": 8}, [b.peer_id])
            await settled(8)
            pusher.set({"n": 9}, [b.peer_id])  # b would be spared two in a row: it gets this one
            await settled(9)
            assert got[b.peer_id] == [1, 4, 7, 9]
        finally:
            task.cancel()


@pytest.mark.asyncio
async def test_a_value_too_large_to_keep_as_a_base_is_pushed_whole_without_a_resend(monkeypatch):
    """A receiver keeps no value over ``patches.MAX_KEPT_BYTES`` as a base, so a patch of one
    would only be answered "resend" (two calls a push, for ever): the pusher sends it whole.
    A small value after it goes whole once (the receiver holds no base of ours), then as a
    patch: no push is ever resent."""
    async with swarms(2) as (a, b):
        got, _ = await receivers(monkeypatch, b)
        pusher = Pusher(a, "t.push")
        pusher.audience = lambda: [b.peer_id]
        task = asyncio.create_task(pusher.push_forever())
        try:
            for n, blob in enumerate(["x" * 9000, "y" * 9000, "y", "z"], 1):
                pusher.set({"n": n, "blob": blob})
                await until(lambda n=n: got[b.peer_id][-1:] == [n] and not pusher._sending, 10, f"push {n}",
                            every=0.02)
            assert got[b.peer_id] == [1, 2, 3, 4] and pusher.stats["sent"] == 4 and pusher.stats["resent"] == 0
        finally:
            task.cancel()


@pytest.mark.asyncio
async def test_a_heartbeat_reaches_each_peer_once_per_beat_every_and_a_change_at_once(monkeypatch):
    """``Pusher.set``'s ``beat``: a value that only refreshes figures reaches a peer holding the
    last substantive change at the first change ``beat_every`` seconds after its last push; a
    substantive change reaches everyone at once; a peer that pushes to us gets our newest
    value only if it lacks the last substantive change (a newcomer) or says hello (restarted),
    not for a heartbeat."""
    async with swarms(3) as (a, b, c):
        got, skew = await receivers(monkeypatch, b, c)
        pusher = Pusher(a, "t.push", beat_every=20.0)
        pusher.audience = lambda: [b.peer_id]
        task = asyncio.create_task(pusher.push_forever())

        async def quiet() -> None:  # the pusher has woken and nothing is in flight
            await until(lambda: not pusher._changed.is_set() and not pusher._sending, 10, "the pusher", every=0.02)

        try:
            pusher.set({"n": 1})
            await until(lambda: got[b.peer_id] == [1], 10, "push 1", every=0.02)
            for n in (2, 3):  # heartbeats within beat_every of the last push: nothing is sent
                skew[0] += 5.0
                pusher.set({"n": n}, beat=True)
                await quiet()
            assert got[b.peer_id] == [1] and pusher.stats["sent"] == 1
            pusher.heard_from(b.peer_id)  # b holds our last substantive change: no greeting for a heartbeat
            await quiet()
            assert got[b.peer_id] == [1]
            pusher.heard_from(b.peer_id, hello=True)  # b says it just started (restarted): it gets our newest
            # b has it, and the pusher has counted it (and noted the push's time, which the skew below must follow)
            await until(lambda: got[b.peer_id] == [1, 3] and pusher.stats["sent"] == 2, 10, "the answer to b's hello",
                        every=0.02)
            skew[0] += 20.0  # 20 s after the last push
            pusher.set({"n": 4}, beat=True)
            await until(lambda: got[b.peer_id] == [1, 3, 4], 10, "heartbeat 4", every=0.02)
            pusher.set({"n": 5})  # a substantive change goes at once
            await until(lambda: got[b.peer_id] == [1, 3, 4, 5], 10, "change 5", every=0.02)
            pusher.set({"n": 6}, beat=True)
            await quiet()
            pusher.heard_from(c.peer_id)  # c never had our value (it just joined): it gets the newest now
            await until(lambda: got[c.peer_id] == [6], 10, "greeting c", every=0.02)
            await until(lambda: pusher.stats["sent"] == 5, 10, "c's answer to the greeting", every=0.02)
            assert got[b.peer_id] == [1, 3, 4, 5]
        finally:
            task.cancel()


@pytest.mark.asyncio
async def test_a_joining_node_greets_the_learners_it_found_and_has_their_fresh_records():
    """``StateSync.greet``: a joiner pushes its record to every learner the DHT names and waits
    for each to push its own back, so it does not choose its first states from a stored record
    up to ``STORE_EVERY_S`` old (here a commits after its last store); a node that greets again
    (restarted with its peer ID) has the record pushed back again."""
    async with swarms(2) as (a, b):
        held, (sync_a, sync_b) = await started_syncs(a, b)
        sync_a.pusher.audience = lambda: [p for p in [b.peer_id] if p in sync_a._pushed]  # a knows who pushed to it
        task = asyncio.create_task(sync_a.pusher.push_forever())
        try:
            await sync_a.publish({"name": "a"}, store=True)
            held[a.peer_id] = [state(3)]
            await sync_a.publish({"name": "a"})  # not stored: the DHT says v0
            assert sync_a.pushes_received["received"] == 0
            assert await sync_b.greet({"name": "b"}, timeout=10) == 1
            assert sync_a.pushes_received["received"] == 1
            assert (await sync_b.records(max_dht_age=60.0))[a.peer_id].fragments == ((3, state(3).digest),)
            # b greets again as a restarted node would (same peer ID): a pushed it its record already
            # and has not changed since, but the hello makes it push again
            got = sync_b.pushes_received["received"]
            assert await sync_b.greet({"name": "b"}, timeout=10) == 1
            await until(lambda: sync_b.pushes_received["received"] == got + 1, 10, "a's answer to the hello", every=0.05)
        finally:
            task.cancel()


@pytest.mark.asyncio
async def test_nine_nodes_find_every_record_with_narrow_dht_searches_and_beat_by_their_audience():
    """Stores and every read after a node's first visit NARROW_BEAM (5) DHT peers, not all of
    them: over real sockets with 9 nodes (more than the beam), a node's narrow read still finds
    all 9 records, as its first, full read did, and so does a node that joins after the stores
    and searches only 5 peers. A node that pushes to 15 peers beats every 38 s
    and says so in its record (net.records.pushes.beat_period)."""
    async with swarms(9) as peers:
        held, syncs = await started_syncs(*peers)
        for i, sync in enumerate(syncs):
            await sync.publish({"name": f"n{i}"})  # the first publish is stored (narrow)
        reader = syncs[-1]
        first = await reader.records()  # full search
        assert set(first) == {s.peer_id for s in peers}
        held[peers[3].peer_id] = [state(1)]
        await syncs[3].publish({"name": "n3"}, store=True)
        again = await reader.records(max_dht_age=0.0)  # narrow search
        assert set(again) == set(first) and again[peers[3].peer_id].fragments[0][0] == 1
        assert all(r.beat == 20 for r in again.values())  # nobody had an audience
        late = await Swarm.start(initial_peers=[(await peers[0].visible_maddrs())[0]])  # joins after the stores:
        try:  # nothing of the key in its storage or cache, so what it finds it found on the 5 it searched
            found = await late.get(reader.heads_key, beam=NARROW_BEAM)
        finally:
            await late.shutdown()
        assert set(found) == set(first) and late.stats.dht["get:heads"] == 1

        audience = [s.peer_id for s in peers[1:]] + [Identity.generate().peer_id for _ in range(7)]
        syncs[0].pusher.audience = lambda: audience + audience[:3]  # 15 distinct peers
        await syncs[0].publish({"name": "n0"})
        assert syncs[0].pusher.beat_every == 38 and syncs[0]._mine.beat == 38
