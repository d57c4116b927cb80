"""The node's shared view of the swarm's records (``node.swarm_view.SwarmView``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from conftest import until

from node.swarm_view import SwarmView

REC = SimpleNamespace(step=7)  # what the view reads of a record


class _Sync:
    """A records source whose reads end when the test says (``StateSync.records``'s part)."""

    def __init__(self) -> None:
        self.reads: list[asyncio.Future] = []

    def read_age(self) -> float:
        return 5.0

    async def records(self, max_dht_age: float = 0.0) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self.reads.append(fut)
        return await fut


def test_a_recent_read_is_reused_and_an_older_read_ending_last_does_not_replace_a_newer_one() -> None:
    async def scenario() -> None:
        sync = _Sync()
        view = SwarmView(sync, "me")  # type: ignore[arg-type]
        older = asyncio.create_task(view.read())
        await until(lambda: len(sync.reads) == 1, 5, "the first read to begin", every=0.001)
        newer = asyncio.create_task(view.read())
        await until(lambda: len(sync.reads) == 2, 5, "the second read to begin", every=0.001)
        sync.reads[1].set_result({"me": REC, "b": REC})
        await newer
        sync.reads[0].set_result({"a": REC})
        await older
        assert set(view.records) == {"me", "b"} and view.others == {"b"} and view.read_ok and view.swarm_step == 7
        assert set(await view.read(max_age=60.0)) == {"me", "b"} and len(sync.reads) == 2  # reused
        fresh = asyncio.create_task(view.read())  # max_age 0: a new read
        await until(lambda: len(sync.reads) == 3, 5, "a third read to begin", every=0.001)
        sync.reads[2].set_result({})
        assert await fresh == {} and view.others == set()

    asyncio.run(scenario())
