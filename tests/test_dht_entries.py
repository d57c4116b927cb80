"""DHT reads are validated per entry: a hostile peer's bad entries under a key (bad signature,
another owner's subkey, oversize, not an envelope, a non-member's) must not hide the valid
entries stored beside them (docs/trust.md, "Signed records": one bad entry, one entry dropped).

Real in-process swarms (one p2pd each) on 127.0.0.1; every swarm is shut down in ``finally``
and ``no_daemon_left`` checks that no p2pd outlives a test."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import msgpack
import pytest

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.net.records.parse import HeadsRecord, parse_heads
from p2pdiloco.net.state.revocation import RevocationWatch, revocations_key
from p2pdiloco.net.records.signed import MAX_LOOKUP_ENTRIES, SignedRecords
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.trust import signing
from p2pdiloco.trust.certificates import Membership, SwarmKey
from p2pdiloco.trust.identity import Identity

HEADS = "run/heads"
NOW = 1_800_000_000.0


# ---- unit: the per-entry filter ----------------------------------------------------------

def signed(author: SignedRecords, key_id: bytes, subkey: object, value: object, expiry: float) -> DHTRecord:
    """A record as ``author``'s node stores it (hivemind's msgpack, then the signed envelope)."""
    record = DHTRecord(key_id, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiry)
    return DHTRecord(key_id, record.subkey, author.sign_value(record), expiry)


def test_a_lookup_drops_each_bad_entry_alone_and_counts_it() -> None:
    owner = SwarmKey.generate()
    a_id, b_id, x_id = (Identity.generate() for _ in range(3))
    a = SignedRecords(a_id, Membership(owner.public_key, owner.admit(a_id.public_key, valid_for=3600)))
    b = SignedRecords(b_id, Membership(owner.public_key, owner.admit(b_id.public_key, valid_for=3600)))
    outsider = SignedRecords(x_id, Membership())  # validly signed, no certificate
    key = DHTID.generate(source=HEADS).to_bytes()
    mine = signed(a, key, a_id.peer_id, {"v": 1}, NOW + 60)
    newer = signed(a, key, a_id.peer_id, {"v": 2}, NOW + 90)
    other = signed(a, key, "shared", [1, 2], NOW + 60)
    forged_owner = signed(outsider, key, a_id.peer_id, {"v": 999}, NOW + 10_000)  # later expiry than A's
    bad = {
        "not_owner": [forged_owner],
        "bad_signature": [DHTRecord(key, other.subkey, other.value, NOW + 61)],  # the expiry is signed too
        "unsigned": [DHTRecord(key, MSGPackSerializer.dumps("raw"), MSGPackSerializer.dumps(7), NOW + 60),
                     DHTRecord(key, MSGPackSerializer.dumps("junk"), os.urandom(50), NOW + 60)],
        "oversize": [signed(a, key, "big", b"\0" * (70 << 10), NOW + 60)],
        "missing": [signed(outsider, key, x_id.peer_id, {"v": 5}, NOW + 60)],
        "no_subkey": [signed(a, key, None, {"plain": True}, NOW + 10_000)],  # hivemind: replaces the dictionary
    }
    with b.lookup(key, NOW) as entries:
        for record in (mine, forged_owner, *[r for rs in bad.values() for r in rs], other, newer, mine,
                       signed(a, key, "gone", 1, NOW - 1)):  # the last one expired: not counted
            assert b.validate(record) is True  # hivemind keeps every answer whole ...
            assert b.strip_value(record) == msgpack.packb(None)  # ... and its merge is ignored
    assert entries.values() == {a_id.peer_id: {"v": 2}, "shared": [1, 2]}
    assert entries.dropped == {reason: len(records) for reason, records in bad.items()}
    assert b.read_dropped == entries.dropped
    # outside a lookup the validator is strict again, and keeps counting
    assert not entries.open and b.validate(forged_owner) is False and b.validate(mine) is True
    assert b.rejected["not_owner"] == 2 and b.read_dropped["not_owner"] == 1
    # a lookup of another key leaves these records strict
    with b.lookup(DHTID.generate(source="other").to_bytes(), NOW) as elsewhere:
        assert b.validate(forged_owner) is False
    assert elsewhere.values() == {} and not elsewhere.dropped


def test_a_lookup_examines_a_bounded_number_of_entries_and_drops_undecodable_values() -> None:
    owner_id = Identity.generate()
    records = SignedRecords(owner_id, Membership())
    key = DHTID.generate(source=HEADS).to_bytes()
    with records.lookup(key, NOW) as entries:
        for i in range(MAX_LOOKUP_ENTRIES + 5):
            entries.offer(DHTRecord(key, MSGPackSerializer.dumps(f"s{i}"), b"\x01", NOW + 60))
        # a valid signature over bytes that hivemind's serializer cannot decode
        entries.offer(signed(records, key, "odd", 0, NOW + 60).__class__(
            key, MSGPackSerializer.dumps("odd"),
            records.sign_value(DHTRecord(key, MSGPackSerializer.dumps("odd"), b"\xc1", NOW + 60)), NOW + 60))
    assert entries.values() == {}
    assert entries.dropped == {"unsigned": MAX_LOOKUP_ENTRIES, "too_many": 6}


@contextlib.asynccontextmanager
async def started() -> AsyncIterator[list[Swarm]]:
    """A list to append started swarms to; all of them are shut down at the end."""
    swarms: list[Swarm] = []
    try:
        yield swarms
    finally:
        await asyncio.gather(*(s.shutdown() for s in swarms), return_exceptions=True)


def make_hostile(x: Swarm) -> dict[str, str]:
    """Turn ``x`` into a hostile peer with hivemind's public hooks only: its own node accepts
    every record (a permissive validator), and the subkeys of :data:`FORGERIES` get envelopes
    that fail a member's checks. Returns {subkey kind: reason a member rejects it for}."""
    records = x.records
    honest = records.sign_value

    def forge(record):
        subkey = msgpack.unpackb(record.subkey, raw=False)
        fields = [record.key, record.subkey, record.value, float(record.expiration_time)]
        if isinstance(subkey, str) and subkey.startswith("sig-"):  # signature of other bytes
            return msgpack.packb([1, x.peer_id, record.value, signing.sign(x.identity, "dht.record", [b"other"]),
                                  None], use_bin_type=True)
        if subkey == "raw":  # no envelope at all
            return b"\x93\x01\x02"
        if subkey == "big":  # over signed_records.MAX_RECORD_BYTES
            return msgpack.packb([1, x.peer_id, b"\x00" * (80 << 10), signing.sign(x.identity, "dht.record", fields),
                                  None], use_bin_type=True)
        return honest(record)  # its own ID (a non-member in a private swarm), or a member's ID (not the owner)

    records.sign_value, records.validate = forge, lambda record: True
    return {"sig-1": "bad_signature", "raw": "unsigned", "big": "oversize"}


async def poison(x: Swarm, key: str, owner: str) -> None:
    """Store ``x``'s bad entries under ``key``: one of each forgery, one under ``owner``'s
    peer ID signed by ``x`` (later expiry than any honest entry), one under its own ID."""
    for subkey in make_hostile(x):
        await x.store(key, subkey, {"junk": 1}, 300)
    await x.store(key, owner, {"forged": True}, 300)
    await x.store(key, x.peer_id, {"outsider": True}, 300)


@pytest.mark.timeout(240)
@pytest.mark.asyncio
@pytest.mark.parametrize("bootstrap_knows_swarm", [False, True])
async def test_bad_entries_do_not_hide_a_members_heads_and_revocation_list(no_daemon_left,
                                                                          bootstrap_knows_swarm) -> None:
    owner = SwarmKey.generate()
    ids = [Identity.generate() for _ in range(2)]
    ms = [Membership(owner.public_key, owner.admit(i.public_key, valid_for=3600)) for i in ids]
    revoked = Identity.generate()
    revocations = owner.revoke([revoked.public_key])
    rev_key = revocations_key(owner.public_key)
    async with started() as swarms:
        boot = await Swarm.start(record_swarm=owner.public_key if bootstrap_knows_swarm else None)
        swarms.append(boot)
        maddrs = await boot.visible_maddrs()
        a = await Swarm.start(initial_peers=maddrs, identity=ids[0], membership=ms[0])
        x = await Swarm.start(initial_peers=maddrs)  # the attacker: no certificate, its own validator
        swarms += [a, x]
        heads = HeadsRecord(((3, "ab" * 32),), rounds=("r1",), t=a.clock.now(), name="a")
        assert await a.store(HEADS, a.peer_id, heads.to_wire(), 60)
        assert await a.store(rev_key, a.peer_id, revocations.encode(), 60)
        for key in (HEADS, rev_key):
            await poison(x, key, a.peer_id)
        # the bootstrap peer keeps a non-member's correctly signed entry only while it does not know the swarm
        assert (x.peer_id in boot.held(HEADS)) is not bootstrap_knows_swarm
        assert a.peer_id in boot.held(HEADS) and a.peer_id in boot.held(rev_key)
        # A leaves (as the publisher of a revocation list always does): its entries live on at the bootstrap and X
        await a.shutdown()
        b = await Swarm.start(initial_peers=maddrs, identity=ids[1], membership=ms[1])
        swarms.append(b)
        seen = await b.get(HEADS)
        assert set(seen) == {a.peer_id}, sorted(seen)
        assert parse_heads(seen[a.peer_id], 1) == heads
        watch = RevocationWatch(b, b.membership, poll_s=1.0)
        assert await watch.poll_once() and b.membership.revocations == revocations
        assert b.membership.revokes(revoked.public_key)
        # every bad entry was dropped alone and counted by reason
        dropped = b.records.read_dropped
        for reason in ("bad_signature", "unsigned", "oversize", "not_owner", "missing"):
            assert dropped[reason] >= 1, dict(dropped)
