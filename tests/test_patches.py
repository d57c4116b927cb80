"""Pushed values as patches (``p2pdiloco.net.records.patches``): hand-computed patches, the checks at
the receiving boundary, and over real sockets a heads record pushed whole once, then as
patches, and whole again to a receiver that lost its base."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import torch
from conftest import swarms, until

from p2pdiloco.core.fragments import Fragment, TensorSlot
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records import patches
from p2pdiloco.net.records.patches import Received, apply_patch, patch_of
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.state.statesync import StateSync

pytestmark = [pytest.mark.timeout(120)]


def test_a_patch_sets_changed_keys_changes_list_elements_and_reaches_one_map_deep():
    old = {"r": {"f": [[1, "aa"], [2, "bb"], [3, "cc"], [4, "dd"]], "t": 1.0, "name": "n0"}, "run": "x", "gone": 1}
    new = {"r": {"f": [[1, "aa"], [2, "bb"], [5, "ee"], [4, "dd"]], "t": 2.5, "name": "n0"}, "run": "x", "g": []}
    patch = patch_of(old, new)
    assert patch == {"s": {"g": []}, "n": {"r": {"s": {"t": 2.5}, "e": {"f": [[2, [5, "ee"]]]}}}, "x": ["gone"]}
    assert apply_patch(old, patch) == new and "gone" in old  # old is left as it was
    assert patch_of(new, new) == {} and apply_patch(new, {}) == new
    # a list of another length, or with more than half its elements changed, is set whole
    assert patch_of({"l": [1, 2]}, {"l": [1, 2, 3]}) == {"s": {"l": [1, 2, 3]}}
    assert patch_of({"l": [1, 2, 3, 4]}, {"l": [1, 9, 9, 9]}) == {"s": {"l": [1, 9, 9, 9]}}
    assert patch_of({"l": [1, 2, 3, 4]}, {"l": [1, 9, 3, 9]}) == {"e": {"l": [[1, 9], [3, 9]]}}
    # maps within maps within maps are set whole (MAX_DEPTH = 1)
    assert patch_of({"a": {"b": {"c": 1}}}, {"a": {"b": {"c": 2}}}) == {"n": {"a": {"s": {"b": {"c": 2}}}}}


@pytest.mark.parametrize("patch", [
    [1], {"q": {}}, {"s": []}, {"x": "gone"}, {"x": ["absent"]}, {"x": [1]},
    {"e": {"l": [[4, 0]]}}, {"e": {"l": [[-1, 0]]}}, {"e": {"l": [[True, 0]]}}, {"e": {"l": [[0]]}},
    {"e": {"m": [[0, 1]]}}, {"e": {"l": "x"}}, {"n": {"l": {}}}, {"n": {"m": {"n": {"k": {}}}}},
])
def test_a_patch_that_is_not_one_of_the_value_is_refused(patch):
    with pytest.raises(ProtocolError):
        apply_patch({"l": [1, 2, 3, 4], "m": {"k": {"z": 1}}}, patch)


def test_a_receiver_expands_patches_of_its_base_only_and_keeps_bounded_bases(monkeypatch):
    drops = []
    got = Received(lambda peer, why: drops.append((peer, why)))
    whole = {"n": 1, "l": [1, 2], "run": "x", "_v": 3}
    assert got.expand("A", whole) is whole  # a whole value passes as it is
    got.keep("A", {**whole, "hello": True})  # a hello is not part of the base
    assert got.expand("A", {"_v": 4, "_b": 3, "_p": {"s": {"n": 2}}}) == {"n": 2, "l": [1, 2], "run": "x", "_v": 4}
    assert got.patches == 1
    assert got.expand("A", {"_v": 5, "_b": 4, "_p": {}}) is None  # 4 was expanded but not kept: ask again
    assert got.expand("B", {"_v": 1, "_b": 0, "_p": {}}) is None and got.resends == 2
    for bad in ({"_v": 4, "_b": "3", "_p": {}}, {"_v": 4, "_b": 3, "_p": {"e": {"l": [[2, 0]]}}}):
        with pytest.raises(ProtocolError):
            got.expand("A", bad)
    assert drops == [("A", "push_patch")] * 2
    got.keep("A", {"n": 1})  # no change counter (a push_now hello): no base, the old one forgotten
    assert got.expand("A", {"_v": 4, "_b": 3, "_p": {}}) is None
    got.keep("A", {"blob": "x" * patches.MAX_KEPT_BYTES, "_v": 9})  # too large to keep
    assert got.expand("A", {"_v": 10, "_b": 9, "_p": {}}) is None
    monkeypatch.setattr(patches, "MAX_KEPT", 2)
    for peer in ("P", "Q", "R"):  # the least recent author goes first
        got.keep(peer, {"n": 0, "_v": 1})
    assert [got.expand(p, {"_v": 2, "_b": 1, "_p": {}}) is not None for p in "PQR"] == [False, True, True]


def test_a_base_takes_the_memory_of_its_bytes_on_the_wire():
    """A hostile value of many small parts (8,100 empty maps: 8.1 kB of msgpack, over 0.5 MB
    decoded) is kept as it came: 200 authors' bases take about their bytes on the wire, not
    100 MB; a patch still applies to it."""
    import tracemalloc  # noqa: PLC0415

    from p2pdiloco.net.transport import framing  # noqa: PLC0415

    got = Received(lambda *a: None)
    sent = framing.pack({"_v": 1, "junk": [{}] * 8100, "run": "x"})
    assert len(sent) <= patches.MAX_KEPT_BYTES
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            got.keep(f"P{i}", framing.unpack(sent))  # each decoded anew, as pushes arrive
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 200 * 2 * len(sent), kept
    value = got.expand("P7", {"_v": 2, "_b": 1, "_p": {"s": {"run": "y"}}})
    assert value == {"junk": [{}] * 8100, "run": "y", "_v": 2}


def test_a_heads_patch_after_a_round_and_after_a_heartbeat_is_a_fraction_of_the_record():
    """The sizes the module docstring states: a 4-fragment heads record as pushed, and the
    patches a round (one fragment's version, digest and round ID, and the figures) and a
    heartbeat (the figures) make of it."""
    def push(fragments, rounds, t, step, tps, loss, merged):
        record = HeadsRecord(fragments, rounds, t=t, name="volunteer-7", state="training", step=step, tps=tps,
                             loss=loss, tag="0123456789", merged=merged, mine=merged // 4, reach="public")
        return {"r": record.to_wire(), "run": "demo-0123456789"}

    t = time.time()
    frags = [(120 + i, f"{i:02x}" * 32) for i in range(4)]  # sha256 digests
    before = push(tuple(frags), ("ab" * 8,) * 4, t, 24000, 65993.1, 2.0837, 10_000_000)
    frags[2] = (123, "ff" * 32)
    after_round = push(tuple(frags), ("ab" * 8, "ab" * 8, "cd" * 8, "ab" * 8), t + 0.9, 24100, 66001.4, 2.0812,
                       10_400_000)
    beat = push(tuple(frags), ("ab" * 8, "ab" * 8, "cd" * 8, "ab" * 8), t + 20.1, 26300, 65870.2, 2.0790, 10_400_000)

    def size(header):
        return len(msgpack.packb(header, use_bin_type=True))

    whole = size(dict(before, _v=7))
    round_patch = size({"_v": 8, "_b": 7, "_p": patch_of(before, after_round)})
    beat_patch = size({"_v": 9, "_b": 8, "_p": patch_of(after_round, beat)})
    assert 360 <= whole <= 390 and 135 <= round_patch <= 165 and 60 <= beat_patch <= 80, (whole, round_patch, beat_patch)
    assert apply_patch(before, patch_of(before, after_round)) == after_round


def state(version: int) -> FragmentState:
    return FragmentState.create(0, version, (torch.full((4,), float(version)),), (torch.zeros(4),))


@pytest.mark.asyncio
@pytest.mark.usefixtures("no_daemon_left")
async def test_heads_records_are_pushed_whole_once_then_as_patches_and_whole_again_to_a_receiver_without_a_base():
    fragment = Fragment(0, (TensorSlot("w", (4,), 4, False),))
    async with swarms(2) as (a, b):
        held = {a.peer_id: [state(0)], b.peer_id: [state(0)]}
        sync_a, sync_b = (StateSync(s, "run", [fragment], lambda p=s.peer_id: held[p]) for s in (a, b))
        await sync_a.start()
        await sync_b.start()
        sync_a.pusher.audience = lambda: [b.peer_id]
        pusher = asyncio.create_task(sync_a.pusher.push_forever())

        async def publish(version: int) -> None:
            held[a.peer_id] = [state(version)]
            await sync_a.publish({"name": "a"})
            await until(lambda: sync_b._pushed.get(a.peer_id) is not None
                        and sync_b._pushed[a.peer_id].fragments == ((version, state(version).digest),),
                        10, f"b holds a's v{version}", every=0.02)
            await until(lambda: sync_a.pusher.stats["sent"] >= version + 1, 10, f"a's push {version}", every=0.02)

        try:
            await publish(0)  # the first push is whole
            first = a.stats.header_bytes["st.heads"]
            for v in (1, 2, 3):  # then patches of it
                await publish(v)
            assert sync_b.patches.patches == 3 and sync_a.pusher.stats["resent"] == 0
            assert a.stats.header_bytes["st.heads"] - first < 3 * first * 0.7  # each patch well under the whole
            sync_b.patches = Received(b.drop)  # b forgot every base (a restart keeps no push state)
            await publish(4)  # asked to, a sends it whole at once
            assert sync_a.pusher.stats["resent"] == 1 and sync_b.patches.resends == 1
            await publish(5)  # and patches again
            assert sync_b.patches.patches == 1 and sync_a.pusher.stats["failed"] == 0
            assert b.drops.reasons["push_patch"] == 0
        finally:
            pusher.cancel()
