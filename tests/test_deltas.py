"""Catch-ups as deltas (p2pdiloco.net.state.deltas): a node a few rounds behind computes the swarm's
state from the rounds' merged slices, checked digest by digest, instead of downloading it.

Hand-built rounds for the chain, parsing and tampering; real all-reduces of 4 learners on the
in-memory network (int4 on the wire) for the transfer, next to tests/test_protocol.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_protocol import GRACE, GRACE_MAX, H, LR, MOMENTUM, QUORUM_TIMEOUT, identities, initial_state
from test_trust_net import FRAGMENT, SHAPES, delta

from p2pdiloco.core.outer import FragmentState, nesterov_outer_step
from p2pdiloco.core.periods import FRACTION_GRID, round_fraction
from p2pdiloco.errors import ProtocolError, StateSyncError
from p2pdiloco.net.state import deltas
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.rounds.allreduce import AllReducer, Contribution, RoundResult
from p2pdiloco.net.state.heads import Head
from p2pdiloco.net.rounds.matchmaking import GroupKey, Matchmaker
from p2pdiloco.net.transport.memory import Link, MemoryNet
from p2pdiloco.net.records.parse import parse_delta_answer, parse_delta_request
from p2pdiloco.net.state.statesync import StateSync

PRECISIONS = frozenset({"int4", "fp32"})


def _round(state: FragmentState, seed: int, lone: bool = False) -> tuple[FragmentState, deltas.LoggedRound]:
    """One round of two members on ``state`` as a member commits it: the merged Δ coded in int4
    in two reducers' slices (slots 0-4, 5-8), or a lone round's fp32 Δ; the outer step."""
    d = delta(seed)
    if lone:
        merged = RoundResult(list(d), 1000, 40 * (seed + 1), 0.5, ("a",))
    else:
        parts = ((0, 1, 2, 3, 4), (5, 6, 7, 8))
        bodies = [wire.encode_merged([d[i] for i in slots], "int4") for slots in parts]
        decoded = [t for slots, b in zip(parts, bodies) for t in wire.decode_merged(b, [SHAPES[i] for i in slots], "int4", 2)]
        merged = RoundResult(decoded, 2000, 40 * (seed + 1), 1.0, ("a", "b"), wire=tuple(zip(parts, bodies)))
    fraction, ledger = round_fraction(state.ledger, merged.tokens, merged.position, H, merged.first)
    new = nesterov_outer_step(state, merged.delta, LR, MOMENTUM, fraction, ledger)
    return new, deltas.logged(state, new, merged, 1 if lone else 2, "int4")


def _chain(n: int, lone: int | None = 1) -> tuple[list[FragmentState], list[deltas.LoggedRound]]:
    """States v0..vn and the logged rounds between them (round ``lone`` a lone one)."""
    states, entries = [initial_state(0)], []
    for i in range(n):
        new, entry = _round(states[-1], i, lone=i == lone)
        states.append(new)
        entries.append(entry)
    return states, entries


def _answer_round_trip(entries):
    header, body = deltas.answer(entries)
    steps = parse_delta_answer(header, len(entries), len(SHAPES), PRECISIONS)
    return steps, deltas.split(steps, body)


def test_a_chain_of_rounds_computes_the_same_states_digest_by_digest():
    """Three rounds (int4, a lone fp32 one, int4) logged by a member, sent as one answer and
    applied from v0: each step makes the member's state bit for bit (same digest), and the
    answer is far smaller than the state (int4: about 1/16 of Θ and momentum in fp32)."""
    states, entries = _chain(3)
    steps, bodies = _answer_round_trip(entries)
    got = states[0]
    for step, b, want in zip(steps, bodies, states[1:]):
        got = deltas.replay_round(got, step, b, FRAGMENT, H, LR, MOMENTUM)
        assert (got.version, got.digest) == (want.version, want.digest)
        assert all(torch.equal(x, y) for x, y in zip(got.theta + got.momentum, want.theta + want.momentum))
    state_bytes = wire.wire_nbytes(SHAPES + SHAPES, "fp32")
    assert entries[0].nbytes < state_bytes / 12 and entries[1].nbytes == state_bytes // 2  # int4; a lone round: fp32 Δ


def test_a_tampered_round_does_not_compute():
    """One code flipped in a round's int4 slices: decoding works, the digest does not match
    (ProtocolError); slices of the wrong size or not finite are refused before the step."""
    states, entries = _chain(1)
    steps, bodies = _answer_round_trip(entries)
    body = bytearray(bodies[0][1])
    body[-1] ^= 0x11
    with pytest.raises(ProtocolError, match="digest"):
        deltas.replay_round(states[0], steps[0], (bodies[0][0], bytes(body)), FRAGMENT, H, LR, MOMENTUM)
    with pytest.raises(ProtocolError):
        deltas.replay_round(states[0], steps[0], (bodies[0][0], bytes(body[:-1])), FRAGMENT, H, LR, MOMENTUM)
    fp32 = deltas.logged(states[0], states[1], RoundResult([torch.full(s, float("nan")) for s in SHAPES], 1, 1, 1.0,
                                                           ("a",)), 1, "int4")
    with pytest.raises(ProtocolError, match="not finite"):
        deltas.replay_round(states[0], fp32.step, fp32.bodies, FRAGMENT, H, LR, MOMENTUM)


def test_the_round_log_keeps_its_budget_and_says_why_it_has_no_chain():
    """A log of 2 rounds' bytes: the oldest goes first; a chain from a state it has no round
    from, past its end, or over the bytes asked for is refused with a reason."""
    states, entries = _chain(4)
    log = deltas.RoundLog([entries[2].nbytes + entries[3].nbytes])
    for e in entries:
        log.add(0, e)
    at = [(s.version, s.digest) for s in states]
    assert log.chain(0, at[2], at[4], 10**9) == entries[2:]
    assert "no round from v0" in log.chain(0, at[0], at[4], 10**9)
    assert "no round from v1" in log.chain(0, at[1], at[4], 10**9)
    assert "do not reach" in log.chain(0, at[2], (4, "ab" * 32), 10**9)
    assert "over the" in log.chain(0, at[2], at[4], 100)


@pytest.mark.parametrize("header", [
    {"s": "x"}, {"s": [[]]}, {"s": [["ab" * 32, 1, 1, 1, 2, "int8", [[[0, 1, 2, 3, 4, 5, 6, 7, 8], 10]]]]},
    {"s": [["ab" * 32, 1, 1, 1, 2, "int4", [[[0, 1, 2, 3], 10]]]]},  # slots 4-8 missing
    {"s": [["ab" * 32, 1, 1, 1, 2, "int4", [[[0, 1, 2, 3, 4, 5, 6, 7, 8, 8], 10]]]]},  # one slot twice
    {"s": [["ab" * 32, 1, 1, FRACTION_GRID + 1, 2, "int4", [[list(range(9)), 10]]]]},
    {"s": [["ab" * 32, 1, 1, 1, 0, "int4", [[list(range(9)), 10]]]]},
    {"s": [["ab" * 32, 1, 1, 1, 2, ["int4"], [[list(range(9)), 10]]]]},
    {"s": [["ab" * 32, 1, 1, 1, 2, "int4", [[list(range(9)), -1]]]]},
    {"none": 7},
])
def test_a_malformed_delta_answer_is_refused(header):
    with pytest.raises(ProtocolError):
        parse_delta_answer(header, 1, len(SHAPES), PRECISIONS)


def test_a_delta_request_asks_for_one_to_max_steps_rounds_ahead():
    ok = {"f": 0, "v": 3, "d": bytes.fromhex("ab" * 32), "tv": 5, "td": bytes.fromhex("cd" * 32), "max": 1000}
    assert parse_delta_request(ok, 1, deltas.MAX_STEPS).to_version == 5
    for bad in ({**ok, "tv": 3}, {**ok, "tv": 3 + deltas.MAX_STEPS + 1}, {**ok, "f": 1}, {**ok, "max": -1},
                {**ok, "d": "xy"}, {**ok, "d": "ab" * 32}):
        with pytest.raises(ProtocolError):
            parse_delta_request(bad, 1, deltas.MAX_STEPS)


async def _rounds(net: MemoryNet, n: int, rounds: int) -> tuple[list, list[FragmentState], list]:
    """``rounds`` real rounds of ``n`` learners on ``net`` (int4 on the wire), all in one group:
    returns the swarms, the states v0..v``rounds`` and per round learner 0's logged round."""
    sw = [await net.swarm(identity=i) for i in identities(n, 21)]
    mms = [Matchmaker(s, "run", 1, num_fragments=1) for s in sw]
    reducers = [AllReducer(s, [FRAGMENT], "int4", QUORUM_TIMEOUT, sync_every=H, run_id="run", outlier_factor=4.0)
                for s in sw]
    for m, r in zip(mms, reducers):
        m.listed_in = r.expect
        await m.start()
        await r.start()
    states, logged = [initial_state(5)], []
    for r in range(rounds):
        state = states[-1]

        async def one(i: int):
            _, group = await mms[i].form_group(GroupKey(0, state.version, state.digest), grace=GRACE,
                                               quorum_timeout=QUORUM_TIMEOUT, expected=n, max_grace=GRACE_MAX)
            merged = await reducers[i].run(group, Contribution(delta(100 * r + i), 1000, H))
            fraction, ledger = round_fraction(state.ledger, merged.tokens, merged.position, H, merged.first)
            new = nesterov_outer_step(state, merged.delta, LR, MOMENTUM, fraction, ledger)
            return new, deltas.logged(state, new, merged, len(group.members), "int4")

        results = await asyncio.gather(*(one(i) for i in range(n)))
        assert len({s.digest for s, _ in results}) == 1
        states.append(results[0][0])
        logged.append(results[0][1])
    return sw, states, logged


@pytest.mark.looptime(end=3600)
@pytest.mark.asyncio
async def test_a_node_three_rounds_behind_computes_the_state_from_the_rounds():
    """4 learners merge 3 rounds (int4); a fifth node still at v0 follows v3: it asks the
    holder for the rounds and computes v3 (digest checked), receiving under a third of the
    bytes of the state's download. A holder whose log lost round 1 answers "none", and the node downloads the
    state; one whose rounds were tampered with is banned, and the state comes from another."""
    net = MemoryNet(default=Link(latency=0.025, rate=20e6 / 8))
    try:
        sw, states, logged = await _rounds(net, 4, 3)
        v0, v3 = states[0], states[3]
        syncs = [StateSync(s, "run", [FRAGMENT], lambda: [v3], outer=(LR, MOMENTUM), rounds=(H, "int4")) for s in sw]
        for s in syncs:
            await s.start()
        for e in logged:
            syncs[0].deltas.log.add(0, e)
        newcomer = await net.swarm(identity=identities(6, 22)[5])
        sync = StateSync(newcomer, "run", [FRAGMENT], lambda: [v0], outer=(LR, MOMENTUM), rounds=(H, "int4"))
        await sync.start()
        before = net.bytes_sent[sw[0].peer_id]
        got = await sync.download(0, Head(3, v3.digest, (sw[0].peer_id,)))
        assert (got.version, got.digest) == (3, v3.digest)
        assert (sync.deltas.catchups, sync.downloads) == (1, 1)
        by_rounds = net.bytes_sent[sw[0].peer_id] - before
        assert len(sync.deltas.log.chain(0, (0, v0.digest), (3, v3.digest), 10**9)) == 3  # its own to serve now

        for e in logged[1:]:  # a holder that has only rounds 2 and 3: the state instead
            syncs[1].deltas.log.add(0, e)
        late = StateSync(await net.swarm(identity=identities(7, 23)[6]), "run", [FRAGMENT], lambda: [v0],
                         outer=(LR, MOMENTUM), rounds=(H, "int4"))
        await late.start()
        before = net.bytes_sent[sw[1].peer_id]
        got = await late.download(0, Head(3, v3.digest, (sw[1].peer_id,)))
        assert got.digest == v3.digest and (late.deltas.catchups, late.downloads) == (0, 1)
        # 894 parameters: the headers weigh; 3 rounds in int4 still cost under a third of the state
        assert by_rounds < (net.bytes_sent[sw[1].peer_id] - before) / 3

        bad = logged[0]  # holders whose round 1 has one code changed: the one asked is banned, the state from the other
        body = bytearray(bad.bodies[0])
        body[-1] ^= 0x11
        for holder in syncs[2:]:
            holder.deltas.log.add(0, deltas.LoggedRound(bad.anchor, bad.step, (bytes(body), *bad.bodies[1:])))
            for e in logged[1:]:
                holder.deltas.log.add(0, e)
        third = await net.swarm(identity=identities(8, 24)[7])
        victim = StateSync(third, "run", [FRAGMENT], lambda: [v0], outer=(LR, MOMENTUM), rounds=(H, "int4"))
        await victim.start()
        got = await victim.download(0, Head(3, v3.digest, (sw[2].peer_id, sw[3].peer_id)))
        assert got.digest == v3.digest and (victim.deltas.catchups, victim.downloads) == (0, 1)
        assert len({sw[2].peer_id, sw[3].peer_id} & set(third.bans)) == 1
    finally:
        await net.close()


@pytest.mark.looptime(end=3600)
@pytest.mark.asyncio
async def test_rounds_that_compute_to_another_state_than_asked_ban_their_holder():
    """A holder answers with a chain of real, self-consistent rounds (each digest as stated) that
    ends at another state than the head asked for: the caller installs nothing from it and bans
    it; with another holder, it downloads the head's state from that one."""
    net = MemoryNet(default=Link(latency=0.025, rate=20e6 / 8))
    try:
        sw, states, logged = await _rounds(net, 2, 2)
        v2 = states[2]
        other, entries = _chain(2, lone=None)  # another run of int4 rounds, from another v0: swapped in below
        syncs = [StateSync(s, "run", [FRAGMENT], lambda: [v2], outer=(LR, MOMENTUM), rounds=(H, "int4")) for s in sw]
        for s in syncs:
            await s.start()
        liar = syncs[0].deltas
        liar.log.chain = lambda *a: entries  # answers every request with that chain
        caller = await net.swarm(identity=identities(9, 25)[8])
        sync = StateSync(caller, "run", [FRAGMENT], lambda: [other[0]], outer=(LR, MOMENTUM), rounds=(H, "int4"))
        await sync.start()
        with pytest.raises(StateSyncError):  # its only holder banned: nothing installed
            await sync.download(0, Head(2, v2.digest, (sw[0].peer_id,)))
        assert sw[0].peer_id in caller.bans and sync.deltas.catchups == 0
        got = await sync.download(0, Head(2, v2.digest, (sw[0].peer_id, sw[1].peer_id)))
        assert got.digest == v2.digest and sync.deltas.catchups == 0  # the state, from the honest holder
    finally:
        await net.close()
