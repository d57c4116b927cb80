"""The issue "A public swarm that one stranger cannot crash, stall or take over", as tests.

Two honest node processes and a bootstrap peer on 127.0.0.1 (one swarm for the module, see
``conftest.PublicSwarm``), two fragments, K = 1. Each test connects a fresh attacker peer
built on the project's library (``attacker.Attacker``), runs one attack for a window and
asserts that the honest nodes neither crash nor follow the attacker, keep their round rate
within 20% of the baseline window, keep equal digests and their held-out loss, and ban (where
the misbehaviour is provable) or at least ignore or drop the attacker.

The numbered tests are the issue's eight attacks (attack 8, live revocation, needs a private
swarm: test_revocation_live.py); the others are attacks of the same kinds.
"""

from __future__ import annotations

import pytest

from tests.attacks import attacker as A

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

WINDOW = 15.0  # seconds of attack for the attacks
SHORT = 10.0  # ... and for the other attacks of the same kinds


def below_honest(peer_ids: list[str]):
    """An identity whose peer ID sorts below every honest node's (the matchmaking leader)."""
    return A.grind_identity(below=peer_ids)


def above_honest(peer_ids: list[str]):
    return A.grind_identity(above=peer_ids)


def ban_askers(stats, peer: str) -> str | None:
    """For attacks on ``state.get``: a node that received the attacker's answer bans it; one
    that never asked owes nothing once another did (the attacker's record may not have reached
    it: records come by push), and when nobody asked, each ignored the claim."""
    if stats[f"state_answers:{peer}"]:
        return "ban"
    return None if stats["state_answers"] else "ignore"


# ---- 1. one DHT record crashes every node ----------------------------------------------------
def test_1_gathering_record_with_infinity_or_empty_map(public_swarm):
    """A gathering record whose entries hold a float infinity, or an empty map, under the run's
    gathering key. Provable (signed by the attacker): banned."""
    public_swarm.attack("1 gathering record: infinity / empty map", A.gathering_crash, WINDOW, expect="ban")


# ---- 2. one state answer crashes every node --------------------------------------------------
def test_2_state_answer_with_infinite_or_int64_overflow_version(public_swarm):
    """Heads one version ahead; ``state.get`` answered with version infinity, then 2**63.
    Banned once a node actually received such an answer; else at least ignored."""
    public_swarm.attack("2 state answer: version inf / 2**63", A.state_answer_crash, WINDOW,
                        expect=ban_askers)


# ---- 3. the model is taken over --------------------------------------------------------------
def test_3_takeover_by_a_billion_versions_ahead(public_swarm):
    """Heads a billion versions ahead, serving a zeroed state and momentum with its correct
    digest: nobody follows it, the held-out loss stays; the claim is ignored."""
    w = public_swarm.attack("3 takeover: zero state 1e9 versions ahead", A.takeover, WINDOW, expect="ignore")
    assert w.max_claim >= A.TAKEOVER_AHEAD  # the attack did claim (sanity of the attacker itself)


# ---- 4. matchmaking is hijacked --------------------------------------------------------------
def test_4_matchmaking_hijack_by_a_low_peer_id(public_swarm):
    """An identity sorting below the honest ones declares itself open under every matchmaking
    key and answers joins with the joiner and a peer that does not exist. If it was followed
    as leader at all, it must end up ignored (or banned)."""
    public_swarm.attack("4 matchmaking hijack: ghost member", A.mm_hijack, WINDOW, identity=below_honest,
                        expect=lambda st, peer: "ignore" if st["joins"] else None)


# ---- 5. rounds stall -------------------------------------------------------------------------
def test_5_stall_by_unanswered_heads(public_swarm):
    """Every 3 s heads one version ahead with a new random digest; ``state.get`` never answered:
    each node loses one first-reply deadline (``StateSync.first_reply_s``, 0.5-1 s here) per
    fragment before it ignores the staller."""
    # ignored once a node asked it for a state; on a fast swarm the claim (one version ahead
    # every 3 s) can be outrun before any node asks, and then it cost nothing to ignore
    public_swarm.attack("5 stall: unanswerable heads", A.stall, WINDOW,
                        expect=lambda st, peer: "ignore" if st["state_requests_held"] else None)


# ---- 6. memory before authentication ---------------------------------------------------------
def test_6_stream_declaring_a_terabyte(public_swarm):
    """One stream declaring 2**40 payload bytes and sending up to 1 GiB: the node's memory
    stays within 256 MiB of where it was, and the stream is dropped."""
    public_swarm.attack("6 memory: 2**40 declared, 1 GiB sent", A.memory_flood, WINDOW, expect="ignore",
                        observers=(0,), rss_limit=256 << 20)


# ---- 7. no per-peer limits -------------------------------------------------------------------
def test_7a_three_hundred_idle_streams(public_swarm):
    """300 idle streams from one peer: at most 100 more descriptors on the node; dropped."""
    public_swarm.attack("7a 300 idle streams", A.idle_streams, WINDOW, expect="ignore", observers=(0,),
                        fds_limit=100)


def test_7b_reduce_request_naming_100000_members(public_swarm):
    """A signed ``ar.reduce`` request naming 100,000 made-up members, to both nodes, every 6 s:
    no CPU or log flood (the log-growth bound), the request dropped."""
    public_swarm.attack("7b ar.reduce with 100,000 members", A.reduce_many_members, WINDOW, expect="ignore",
                        identity=above_honest)


def test_7c_two_thousand_round_ids(public_swarm):
    """2,000 signed ``ar.reduce`` requests with 2,000 round IDs from one peer: not all held."""
    # 16 at a time: as many streams as one peer may have served at once. Hundreds at once would
    # be a stream flood, whose remaining cost is p2pd's (docs/trust.md, threat table: limits)
    w = public_swarm.attack("7c 2,000 round ids", A.many_rounds, WINDOW, expect="ignore", observers=(0,),
                            concurrency=16)
    assert sum(v for k, v in w.stats.items() if k.startswith("rounds_")) > 0


# ---- others of the same kinds ----------------------------------------------------------------
def test_heads_records_of_wrong_types_and_huge_lists(public_swarm):
    """Heads records with floats, bools, unbounded ints, maps, 50,000-entry lists, non-hex
    digests, and values that are not maps at all. Provable: banned."""
    public_swarm.attack("heads records: wrong types, huge lists", A.heads_garbage, SHORT, expect="ban")


def test_state_answers_of_wrong_size_or_digest(public_swarm):
    """Heads one version ahead; ``state.get`` answered with too few or too many bytes, bytes
    that do not match the digest, a negative version, a version that is a list.

    Floor 50 % (each node 40 %), not the suite's 60 %: each node pays one or two refused
    downloads before the ban, and a node left behind meanwhile chases the other's moving head
    ("now holds v+1, not v": a gap left open, docs/trust.md). Measured in two fresh-clone CI
    runs of this suite: 72 % and 60 % of the baseline (one node 49 %)."""
    public_swarm.attack("state answers: wrong size / digest / types", A.state_answer_garbage, SHORT,
                        expect=ban_askers, rate_floor=0.5)


def test_join_replies_unsorted_huge_duplicated(public_swarm):
    """The low-ID leader answers joins with unsorted lists, 10,000 members, the joiner twice,
    a non-string member. Provable (malformed answers on an authenticated stream): banned."""
    public_swarm.attack("mm.join replies: unsorted / 10,000 / duplicate / non-string", A.mm_hijack, SHORT,
                        identity=below_honest, modes=("unsorted", "huge", "duplicate", "nonstr"),
                        expect=lambda st, peer: "ban" if st["joins"] else None)


def test_flood_of_junk_calls(public_swarm):
    """Three workers calling every RPC with malformed headers and random payloads, as fast as
    answers come back. After 50 drops the node blocks the peer: its streams are held unanswered
    (16 at a time) until the caller gives up, so the flood slows to the caller's own timeout."""
    public_swarm.attack("junk call flood", A.junk_flood, SHORT, expect="ignore")


# ---- coalitions of free identities -----------------------------------------------------------
COALITION_WINDOW = 12.0  # seconds of attack for each coalition window
LOSS_REL = 0.03  # held-out loss within 3% of the clean window's


@pytest.mark.parametrize("k, ahead, kind", [
    (1, 1, "shrunk"), (2, 20, "zero"), (2, 1, "shrunk"),
    (8, 1, "zero"), (8, 20, "shrunk"), (8, A.TAKEOVER_AHEAD, "zero"),
], ids=lambda v: f"{v:g}" if isinstance(v, int) and v >= 10**6 else str(v))
def test_coalition_takeover(public_swarm, k, ahead, kind):
    """``k`` identities, each with its own daemon, all publish heads ``ahead`` versions past the
    honest newest with the digest of one forged state (all-zero Θ and momentum, or the honest Θ
    x 0.5) and serve it with its correct digest. Many holders of a state are no evidence: no
    honest node installs it, the held-out loss stays within 3% of the clean window's, and every
    member of the coalition ends up ignored or banned. Each combination of k = 1, 2, 8, a lead
    of 1, 20, 1e9 and both states is covered once (the suite's time)."""
    w = public_swarm.attack(f"coalition takeover: {k} x {kind} at +{ahead}", A.coalition_takeover, COALITION_WINDOW,
                            identities=k, ahead=ahead, kind=kind, expect="ignore", loss_rel=LOSS_REL)
    assert w.stats["claims"] >= k and len(w.attackers) == k  # the coalition did claim (the attacker's sanity)


def test_ratchet_of_small_shrinks(public_swarm):
    """One identity, every 0.7 s: the honest state at v from an honest node, served as v + 1 with
    Θ shrunk a little more each time (x0.98, x0.96, ...) and its correct digest. No step alone is
    large; none is installed, the held-out loss stays, the attacker is ignored or banned."""
    w = public_swarm.attack("ratchet: v+1 shrunk 2% more every 0.7 s", A.ratchet, WINDOW, expect="ignore",
                            loss_rel=LOSS_REL)
    assert w.stats["claims"] > 0


def test_three_hundred_records_of_made_up_identities(public_swarm):
    """One attacker stores 300 heads records in 20 s, each signed by a made-up identity that
    runs no daemon, all claiming an all-zero state 20 versions past the honest newest. A count
    of signed records is no evidence: nothing changes for the honest nodes."""
    w = public_swarm.attack("free records: 300 made-up identities, zero state at +20", A.free_records, 20.0,
                            expect=None, loss_rel=LOSS_REL)
    assert w.stats["free_records_stored"] >= 100  # the DHT took them (the attacker's sanity)
