"""Heads records pushed to the learners a node knows (``st.heads``, net.statesync) over real
sockets: pushes carry every publish, the DHT gets a store every ``STORE_EVERY_S`` only, a
reader reuses a DHT read with the newer pushes merged in, and a hostile push is refused at the
parsing boundary. Every swarm started here is shut down in ``finally`` (its p2pd with it)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import swarms, until

from p2pdiloco.core.fragments import Fragment, TensorSlot
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records import HeadsRecord
from p2pdiloco.net.statesync import STORE_EVERY_S, StateSync

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_daemon_left")]

FRAGMENT = Fragment(0, (TensorSlot("w", (4,), 4, False),))


def state(version: int) -> FragmentState:
    return FragmentState.create(0, version, (torch.full((4,), float(version)),), (torch.zeros(4),))


@pytest.mark.asyncio
async def test_records_are_pushed_on_every_publish_and_stored_every_few_seconds():
    async with swarms(3) as (a, b, c):
        held = {a.peer_id: [state(0)], b.peer_id: [state(0)]}
        sync_a = StateSync(a, "run", [FRAGMENT], lambda: held[a.peer_id])
        sync_b = StateSync(b, "run", [FRAGMENT], lambda: held[b.peer_id])
        for sync in (sync_a, sync_b):
            await sync.start()
        sync_a.pusher.audience = lambda: [b.peer_id]
        pusher = asyncio.create_task(sync_a.pusher.push_forever())
        try:
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
