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


def test_node_status_and_swarm_status_judge_a_node_alike() -> None:
    """A live node at versions 8 7 7 7 and three records of nodes that left at 3 3 3 3 (still
    within the DHT's window): `node status` (the node's own view) and `swarm status` (the
    records, from no node's seat) give the same per-fragment status, newest versions and share
    through one rule (node.swarm_view.fragment_status, share); before it, `swarm status` judged
    the live node behind on every fragment against 3 3 3 3 and took its share of a median."""
    import time

    import torch

    from node.main import SwarmView as NodeView
    from node.status_view import progress, summarize_swarm
    from p2pdiloco.core.outer import FragmentState
    from p2pdiloco.net.records.parse import HeadsRecord
    from p2pdiloco.trust.identity import Identity

    now = time.time()
    me, *gone = (Identity.generate().peer_id for _ in range(4))
    states = [FragmentState.create(i, v, [torch.full((2,), float(v))], [torch.zeros(2)])
              for i, v in enumerate((8, 7, 7, 7))]
    old = tuple((3, FragmentState.create(i, 3, [torch.zeros(2)], [torch.zeros(2)]).digest) for i in range(4))
    mine = HeadsRecord(tuple((s.version, s.digest) for s in states), t=now - 1, name="live", state="training",
                       merged=4000, mine=3004)
    records = {me: mine, **{p: HeadsRecord(old, t=now - 200, name=f"left{i}", state="stopped", done=True,
                                           merged=1000, mine=300) for i, p in enumerate(gone)}}
    node_view = NodeView()
    node_view.records, node_view.read_at = dict(records), now
    figures, frags = node_view.summary(states, me)
    swarm = summarize_swarm("r", {p: r.to_wire() for p, r in records.items()}, now)
    (live,) = [p for p in swarm["peers"] if p["peer_id"] == me]
    assert [f.status for f in frags] == live["status"] == ["newest"] * 4 and live["behind"] == figures.behind == []
    assert swarm["newest"] == figures.newest == [8, 7, 7, 7]
    assert live["share"] == progress(4000, 3004.0, 0, None).share == 0.751
    for p in swarm["peers"]:  # from their own seat, one node's claim 5 versions ahead is uncorroborated (heads.LEAD)
        assert p["peer_id"] == me or p["status"] == ["newest"] * 4
