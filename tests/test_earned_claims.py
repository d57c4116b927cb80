"""Claims a peer makes about itself must be earned: hand-computed cases of the corroboration
rule of the heads (``heads.newest_heads``), the joining rule, the holder strikes, and the
matchmaking leader order. No network: the rules are pure functions of the records."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from p2pdiloco.net.transport.clock import SwarmClock
from p2pdiloco.net.transport.drops import TrafficStats
from p2pdiloco.net.rounds.matchmaking import leader_rank
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.state.heads import LEAD, Head, newest_heads
from p2pdiloco.net.state.statesync import StateSync
from p2pdiloco.net.state.strikes import IGNORE_S

A, B, C, X = "A", "B", "C", "X"  # newest_heads takes any keys; the DHT only yields peer IDs
D1, D2, D3 = "1" * 64, "2" * 64, "3" * 64


def recs(**claims: tuple[int, str] | None) -> dict[str, HeadsRecord]:
    return {peer: HeadsRecord((claim,)) for peer, claim in claims.items()}


def test_one_peer_far_ahead_is_not_followed_when_two_others_disagree() -> None:
    records = recs(A=(53, D1), B=(53, D1), X=(1_000_000_053, D2))
    # A's view: others are B (53) and X: second-highest other version 53, ceiling 53 + LEAD
    assert newest_heads(records, 1, me=A) == [Head(53, D1, (A, B))]
    # a claim within the lead counts: an honest node one commit ahead of the others
    records = recs(A=(53, D1), B=(53, D1), X=(53 + LEAD, D2))
    assert newest_heads(records, 1, me=A) == [Head(53 + LEAD, D2, (X,))]


def test_with_a_single_other_peer_its_claim_counts() -> None:
    # B came back far behind; A is the only other peer: nothing can be corroborated
    assert newest_heads(recs(A=(100, D1), B=(50, D2)), 1, me=B) == [Head(100, D1, (A,))]
    # three peers, the one far ahead is corroborated by a second peer
    records = recs(A=(100, D1), C=(100, D1), B=(50, D2))
    assert newest_heads(records, 1, me=B) == [Head(100, D1, (A, C))]


def test_a_joining_node_follows_only_a_state_two_peers_hold() -> None:
    records = recs(A=(53, D1), B=(53, D1), X=(54, D2), N=(0, D3))
    assert newest_heads(records, 1, me="N") == [Head(54, D2, (X,))]  # within the lead
    assert newest_heads(records, 1, me="N", min_holders=2) == [Head(53, D1, (A, B))]
    # with a single other holder in the whole swarm it cannot ask for two
    assert newest_heads(recs(X=(54, D2), N=(0, D3)), 1, me="N", min_holders=2) == [Head(54, D2, (X,))]


def test_heads_parse_raw_records_and_drop_out_of_range_versions() -> None:
    w1, w2 = bytes.fromhex(D1), bytes.fromhex(D2)  # as sent
    raw = {A: {"f": [[3, w1]]}, X: {"f": [[2**63, w2]]}, C: {"f": [[float("inf"), w2]]}}
    assert newest_heads(raw, 1) == [Head(3, D1, (A,))]


def test_leader_order_is_a_hash_of_key_and_peer_and_changes_with_the_key() -> None:
    peers = [f"peer{i}" for i in range(8)]
    key1 = "run/tag/mm/0/5/abcd"
    lead1 = min(peers, key=lambda p: leader_rank(key1, p))
    assert leader_rank(key1, lead1) == hashlib.sha256(f"{key1}\x00{lead1}".encode()).digest()
    leaders = {min(peers, key=lambda p: leader_rank(f"run/tag/mm/0/{v}/abcd", p)) for v in range(64)}
    assert len(leaders) >= 5  # over 64 versions, no single peer leads every round (8 peers)


class _Swarm:
    """The part of the transport StateSync's strike rule touches (no network involved); its
    traffic counters have no link rate measured, so deadlines are at the ceiling rate. The
    swarm's clock reads 10 s: records stamped before it are that much old."""

    peer_id = "me"
    bans: dict[str, str] = {}
    stats = TrafficStats()
    clock = SwarmClock(local=lambda: 10.0)
    stored = 0

    async def store(self, *args, **kwargs) -> bool:
        self.stored += 1
        return True


def test_strikes_ignore_a_holder_for_a_doubling_while_and_delivery_clears_them(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("p2pdiloco.net.transport.clock.monotonic", lambda: now[0])
    sync = StateSync(_Swarm(), "run", [], lambda: [])
    sync.strikes.strike(X, "no answer", hard=True)
    assert sync.strikes.ignoring() == {X: "no answer"}
    now[0] += IGNORE_S + 0.1
    assert sync.strikes.ignoring() == {}
    sync.strikes.strike(X, "no answer", hard=True)  # second strike: twice as long
    now[0] += IGNORE_S + 0.1
    assert X in sync.strikes.ignoring()
    now[0] += IGNORE_S
    assert X not in sync.strikes.ignoring()
    sync.strikes.strike(B, "truncated", hard=False)  # a soft failure strikes from the second in a row
    assert B not in sync.strikes.ignoring()
    sync.strikes.strike(B, "truncated", hard=False)
    assert B in sync.strikes.ignoring()
    sync._delivered(X)
    sync.strikes.strike(X, "no answer", hard=True)  # cleared: back to the first strike's length
    assert sync.strikes.ignored[X][0] == pytest.approx(now[0] + IGNORE_S)


def test_own_version_counts_so_a_newcomer_behind_does_not_hide_an_honest_lead() -> None:
    # A (me) at 50, B one commit ahead, a newcomer N still at 0: the second-highest other
    # version is 0, but A's own 50 corroborates B's 51
    records = recs(A=(50, D1), B=(51, D2), N=(0, D3))
    assert newest_heads(records, 1, me=A, mine=[50]) == [Head(51, D2, (B,))]
    assert newest_heads(records, 1, me=A, mine=[50])[0].version == 50 + LEAD


def test_a_node_ahead_alone_falls_back_to_the_state_two_others_hold() -> None:
    import torch

    from p2pdiloco.core.outer import FragmentState
    from p2pdiloco.net.state.heads import ROLLBACK_MAX, runaway_heads

    zeros = (torch.zeros(2),)

    def state(v: int) -> FragmentState:
        return FragmentState.create(0, v, zeros, zeros)

    # A made v54 alone while B and C merged v52 together: the others look past A (54 > 52 + LEAD)
    records = recs(A=(54, D1), B=(52, D2), C=(52, D2))
    assert newest_heads(records, 1, me=B, mine=[52]) == [Head(52, D2, (B, C))]
    assert runaway_heads(records, [state(54)], A) == [Head(52, D2, (B, C))]
    assert runaway_heads(records, [state(53)], A) == [None]  # within the lead: no fall-back
    # two newcomers at v0 are no fall-back for a node far ahead of them
    records = recs(A=(50, D1), N1=(0, D3), N2=(0, D3))
    assert runaway_heads(records, [state(50)], A) == [None]
    assert ROLLBACK_MAX < 50


def test_a_record_left_unchanged_for_stale_s_drops_out_so_a_dead_peer_corroborates_nothing(monkeypatch) -> None:
    from p2pdiloco.net.records.pushes import STALE_S

    now = [1000.0]
    monkeypatch.setattr("p2pdiloco.net.transport.clock.monotonic", lambda: now[0])
    sync = StateSync(_Swarm(), "run", [], lambda: [])

    def heads(t_b: float, t_dead: float) -> dict[str, HeadsRecord]:
        # me at 48, B (alive, merging alone) at 50, a node killed long ago still listed at v2
        return {"me": HeadsRecord(((48, D1),), t=now[0]), B: HeadsRecord(((50, D2),), t=t_b),
                C: HeadsRecord(((2, D3),), t=t_dead)}

    assert set(sync._live(heads(1.0, 1.0))) == {"me", B, C}  # first sight: every record counts
    now[0] += STALE_S
    assert set(sync._live(heads(2.0, 1.0))) == {"me", B, C}  # C unchanged for exactly STALE_S
    now[0] += 0.5
    live = sync._live(heads(3.0, 1.0))
    assert set(live) == {"me", B}  # B republished; C did not for STALE_S + 0.5 s
    # with the dead record C counted, B's v50 is two above our 48 and the second-highest other
    # claim (C's v2): looked past. Without it B is the only other peer and its claim counts.
    assert newest_heads(heads(3.0, 1.0), 1, me="me", mine=[48]) == [Head(48, D1, ("me",))]
    assert newest_heads(live, 1, me="me", mine=[48]) == [Head(50, D2, (B,))]
    now[0] += 1.0
    assert set(sync._live(heads(3.0, 7.0))) == {"me", B, C}  # C published again: live again


def test_a_node_with_many_peers_beats_less_often_and_its_readers_wait_longer(monkeypatch) -> None:
    """Heartbeats per node stay at BEATS_PER_S (0.4/s) at most: 20 s to each of up to 8 peers,
    ceil(15 / 0.4) = 38 s to each of 15, 160 s from 64 on; a record states its period and is
    stale after STALE_S + (period - 20): 65 s at 20, 83 s at 38 (one heartbeat may fail, the
    next comes SKIP_S + 5 s later). A longer period is pushed at once, not as a heartbeat: a
    reader holding the shorter one would count the author gone before its next heartbeat."""
    from p2pdiloco.errors import ProtocolError
    from p2pdiloco.net.records.pushes import STALE_S, beat_period, stale_after
    from p2pdiloco.net.records.parse import MAX_BEAT_S, parse_heads

    assert [beat_period(n) for n in (0, 3, 8, 9, 15, 63, 64, 1000)] == [20, 20, 20, 23, 38, 158, 160, 160]
    assert MAX_BEAT_S == 160  # the parser refuses what no honest node states
    assert (stale_after(20), stale_after(38), stale_after(160)) == (STALE_S, 83.0, 205.0) and STALE_S == 65.0
    wire = HeadsRecord(((4, D1),), beat=38).to_wire()
    assert wire["b"] == 38 and parse_heads(wire, 1).beat == 38
    assert parse_heads({"f": [[4, bytes.fromhex(D1)]]}, 1).beat == 20  # a record without "b": the shortest period
    for bad in (0, 161, 600, 20.0, True, "38"):
        with pytest.raises(ProtocolError):
            parse_heads({**wire, "b": bad}, 1)

    now = [1000.0]
    monkeypatch.setattr("p2pdiloco.net.transport.clock.monotonic", lambda: now[0])
    sync = StateSync(_Swarm(), "run", [], lambda: [])
    records = {"me": HeadsRecord(((48, D1),), t=5.0), B: HeadsRecord(((48, D1),), t=1.0),
               C: HeadsRecord(((48, D1),), t=1.0, beat=38)}
    assert set(sync._live(records)) == {"me", B, C}
    now[0] += 65.5
    assert set(sync._live(records)) == {"me", C}  # B (20 s) is gone; C (38 s) has until 83 s
    now[0] += 83.0 - 65.5
    assert set(sync._live(records)) == {"me", C}
    now[0] += 0.5
    assert set(sync._live(records)) == {"me"}

    peers: list[str] = [f"p{i}" for i in range(3)]
    sync.pusher.audience = lambda: peers
    substance = []
    for n in (3, 30, 30, 3):  # same figures each time; 30 peers beat every 75 s, 3 every 20 s
        peers[:] = [f"p{i}" for i in range(n)]
        asyncio.run(sync.publish({"name": "me"}))
        substance.append((sync._mine.beat, sync.pusher._substance))
    assert substance == [(20, 1), (75, 2), (75, 2), (20, 2)]  # only the rise is pushed at once


def test_a_dht_record_older_than_a_store_period_counts_as_unchanged_that_much_longer(monkeypatch) -> None:
    """A DHT record whose author last stored it more than STORE_EVERY_S (300 s) ago missed a
    store: the excess counts as time unchanged, so a node that died long ago is not live for
    another STALE_S to a reader seeing it for the first time (the DHT keeps it HEAD_TTL)."""
    from p2pdiloco.net.records.pushes import STALE_S
    from p2pdiloco.net.state.heads_records import STORE_EVERY_S

    now = [1000.0]
    monkeypatch.setattr("p2pdiloco.net.transport.clock.monotonic", lambda: now[0])
    sync = StateSync(_Swarm(), "run", [], lambda: [])  # the swarm's clock reads 10 s
    records = {B: HeadsRecord(((48, D1),), t=10.0 - STORE_EVERY_S - 60.0),  # 60 s past its next store
               C: HeadsRecord(((48, D1),), t=10.0 - STORE_EVERY_S)}  # due to store now: live for STALE_S
    assert set(sync._live(records)) == {B, C}
    now[0] += STALE_S - 60.0 + 0.5
    assert set(sync._live(records)) == {C}
    now[0] += 60.0
    assert set(sync._live(records)) == set()


def test_the_first_reply_deadline_follows_recent_transfers_within_its_bounds() -> None:
    from p2pdiloco.net.state.downloads import FIRST_REPLY_FACTOR, FIRST_REPLY_MIN_S, FIRST_REPLY_S, STATE_TIMEOUT_S

    sync = StateSync(_Swarm(), "run", [], lambda: [])
    assert sync.first_reply_s() == FIRST_REPLY_S == 1.0  # nothing measured yet
    sync._took.extend([0.05, 0.2, 0.1])
    assert FIRST_REPLY_FACTOR == 4.0 and sync.first_reply_s() == pytest.approx(0.8)  # 4 x the slowest
    sync._took.clear()
    sync._took.append(0.01)
    assert sync.first_reply_s() == FIRST_REPLY_MIN_S == 0.5
    sync._took.append(2.0)
    assert sync.first_reply_s() == STATE_TIMEOUT_S


@pytest.mark.asyncio
async def test_silence_past_the_first_reply_deadline_strikes_a_stranger_at_once_and_a_known_donor_from_the_second() -> None:
    from p2pdiloco.core.fragments import Fragment, TensorSlot
    from p2pdiloco.errors import PeerSilent, StateSyncError

    class Silent(_Swarm):
        calls: list[tuple[str, float]] = []

        async def call(self, peer, name, header, payload=b"", *, timeout, max_reply, first_reply, min_rate=None):
            self.calls.append((peer, first_reply))
            raise PeerSilent(f"{name} to {peer} failed: no answer within {first_reply} s")

    swarm = Silent()
    sync = StateSync(swarm, "run", [Fragment(0, (TensorSlot("w", (2,), 2, False),))], lambda: [])
    with pytest.raises(StateSyncError, match="no answer within 1.0 s"):
        await sync.download(0, Head(7, D1, (X,)))
    assert X in sync.strikes.ignoring()  # never delivered to us: struck at once
    sync._delivered(B)  # B delivered before
    sync._took.append(0.1)
    for attempt in (1, 2):
        with pytest.raises(StateSyncError, match="no answer within 0.5 s"):
            await sync.download(0, Head(7 + attempt, D1, (B,)))
        assert (B in sync.strikes.ignoring()) == (attempt == 2)  # forgiven once
    assert swarm.calls == [(X, 1.0), (B, 0.5), (B, 0.5)]


@pytest.mark.asyncio
async def test_a_dead_peer_ignored_for_a_while_is_still_stale_when_its_ignore_ends(monkeypatch) -> None:
    import torch

    from p2pdiloco.core.fragments import Fragment, TensorSlot
    from p2pdiloco.core.outer import FragmentState
    from p2pdiloco.net.records.pushes import STALE_S

    now = [1000.0]
    monkeypatch.setattr("p2pdiloco.net.transport.clock.monotonic", lambda: now[0])
    ours = FragmentState.create(0, 48, (torch.zeros(2),), (torch.zeros(2),))

    from p2pdiloco.trust.identity import Identity

    me, b, c = (Identity.generate().peer_id for _ in range(3))  # the DHT yields Ed25519 peer IDs only

    class Dht(_Swarm):
        peer_id = me
        t_b = 1.0

        def drop(self, peer, reason):
            raise AssertionError(f"{peer} dropped: {reason}")

        async def get(self, key, beam=None):
            return {me: HeadsRecord(((48, ours.digest),), t=now[0]).to_wire(),
                    b: HeadsRecord(((49, D2),), t=self.t_b).to_wire(),
                    c: HeadsRecord(((2, D3),), t=5.0).to_wire()}  # c died: its record never changes

    swarm = Dht()
    sync = StateSync(swarm, "run", [Fragment(0, (TensorSlot("w", (2,), 2, False),))], lambda: [ours])
    assert set(await sync.records()) == {me, b, c}
    sync.strikes.ignored[c] = (now[0] + IGNORE_S, "did not deliver")  # e.g. struck for a failed download
    now[0] += max(IGNORE_S, STALE_S) + 1.0  # the ignore has ended and c is stale
    swarm.t_b = 2.0
    assert set(await sync.records()) == {me, b}  # not "seen for the first time" again


def test_a_new_life_cycle_state_is_stored_restore_s_after_the_last_store(monkeypatch) -> None:
    """``swarm status`` reads only the DHT, where a record is stored every STORE_EVERY_S (300 s):
    a node's new state (joining -> training) is stored once it has lasted RESTORE_S (30 s), so
    the table does not show a training node as joining for 5 minutes; a state that lasts less
    (a catch-up's few seconds of "catching up") costs no store."""
    from p2pdiloco.net.state.heads_records import RESTORE_S, STORE_EVERY_S

    now = [1000.0]
    monkeypatch.setattr("p2pdiloco.net.transport.clock.monotonic", lambda: now[0])
    swarm = _Swarm()
    sync = StateSync(swarm, "run", [], lambda: [])
    sync.pusher.audience = lambda: ["p0"]  # a peer: the store period is STORE_EVERY_S, not STORE_ALONE_S
    stored = []
    for dt, state in ((0.0, "joining"), (5.0, "training"), (RESTORE_S - 1.0, "training"), (1.0, "training"),
                      (10.0, "catching up"), (3.0, "training"), (RESTORE_S, "training"),
                      (STORE_EVERY_S - 43.0 - 1.0, "training"), (1.0, "training")):
        now[0] += dt
        asyncio.run(sync.publish({"state": state}))
        stored.append(swarm.stored)
    # first; training for 0 and 29 s: not yet; for 30 s: stored; a 3 s catch-up and after it: nothing new;
    # 299 s after the last store: not yet; 300 s: stored
    assert stored == [1, 1, 1, 2, 2, 2, 2, 2, 3]
