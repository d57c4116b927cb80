"""Live revocation: adopting revocation lists, hostile DHT entries, and a revocation published
through the CLI path reaching running members of a private swarm (real in-process swarms, one
p2pd each, on 127.0.0.1). Every swarm started here is shut down in ``finally``."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest

from tests.conftest import until

from p2pdiloco.cli import main as cli_main
from p2pdiloco.net.state.revocation import (MAX_LIST_BYTES, RevocationWatch, parse_entry, publish_revocations,
                                      revocations_key)
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.trust.certificates import Membership, RevocationList, SwarmKey
from p2pdiloco.trust.errors import AccessDenied, CertificateError
from p2pdiloco.trust.identity import Identity

NOW = 1_800_000_000


# ---- unit: adopting lists ----------------------------------------------------------------

def test_membership_adopts_only_newer_lists_signed_by_its_swarm() -> None:
    owner, other = SwarmKey.generate(), SwarmKey.generate()
    a, b = Identity.generate(), Identity.generate()
    cert_b = owner.admit(b.public_key, valid_for=3600).encode()
    m = Membership(owner.public_key, owner.admit(a.public_key, valid_for=3600))
    m.check(b.peer_id, cert_b)  # admitted, and cached
    first = owner.revoke([Identity.generate().public_key], now=NOW)
    second = owner.revoke([b.public_key], first, now=NOW + 1)
    third = owner.revoke([Identity.generate().public_key], second, now=NOW + 2)
    assert m.adopt_revocations(second) and m.revocations == second
    assert not m.adopt_revocations(first) and not m.adopt_revocations(second)  # lower, equal serial
    with pytest.raises(AccessDenied) as e:  # the verification cache was cleared
        m.check(b.peer_id, cert_b)
    assert e.value.reason == "revoked" and m.revokes(b.public_key)
    # another swarm's list, and a list naming our swarm but signed by another key
    assert not m.adopt_revocations(other.revoke([a.public_key], third, now=NOW))
    forged = other.revoke([a.public_key], third, now=NOW)
    assert not m.adopt_revocations(RevocationList(owner.public_key, forged.serial, forged.issued, forged.revoked,
                                                  forged.signature))
    assert m.revocations == second
    assert m.adopt_revocations(third) and m.revocations.serial == 3
    assert not Membership().adopt_revocations(third)  # public swarm: nothing to adopt


def test_parse_entry_drops_hostile_values_without_raising() -> None:
    owner, other = SwarmKey.generate(), SwarmKey.generate()
    good = owner.revoke([Identity.generate().public_key], now=NOW)
    assert parse_entry(good.encode(), owner.public_key) == good
    fields = msgpack.unpackb(good.encode(), raw=False)
    tampered = msgpack.packb([fields[0], fields[1], 99, *fields[3:]], use_bin_type=True)
    cases = {
        "not_bytes": [None, 7, 1.5, True, "text", [good.encode()], {"a": good.encode()}, bytearray(good.encode())],
        "oversize": [b"\x00" * (MAX_LIST_BYTES + 1)],
        "malformed": [b"", os.urandom(64), os.urandom(4096), b"\xc1", b"\xdd\xff\xff\xff\xff",  # 4 G-entry array
                      msgpack.packb([1, owner.public_key, 2, NOW, [b"short"], b"sig"]),
                      msgpack.packb({"swarm": owner.public_key})],
        "wrong_swarm": [other.revoke([], now=NOW).encode()],
        "bad_signature": [tampered],
    }
    for reason, values in cases.items():
        for value in values:
            assert parse_entry(value, owner.public_key) == reason, (reason, repr(value)[:40])
    for _ in range(200):  # random bytes, some of them valid msgpack of every shape
        assert isinstance(parse_entry(os.urandom(int.from_bytes(os.urandom(1), "big")), owner.public_key), str)


# ---- real swarms -------------------------------------------------------------------------



@contextlib.asynccontextmanager
async def swarms(memberships: list[Membership], identities: list[Identity],
                 initial: list[str] | None = None) -> AsyncIterator[list[Swarm]]:
    started: list[Swarm] = []
    try:
        for membership, identity in zip(memberships, identities):
            peers = initial or (await started[0].visible_maddrs() if started else [])
            started.append(await Swarm.start(initial_peers=peers, membership=membership, identity=identity))
        yield started
    finally:
        await asyncio.gather(*(s.shutdown() for s in started), return_exceptions=True)


def members(owner: SwarmKey, n: int,
            revocations: RevocationList | None = None) -> tuple[list[Identity], list[Membership]]:
    ids = [Identity.generate() for _ in range(n)]
    return ids, [Membership(owner.public_key, owner.admit(i.public_key, valid_for=3600), revocations) for i in ids]


@pytest.mark.timeout(180)
@pytest.mark.asyncio
async def test_published_revocation_reaches_running_members_and_outlives_its_publisher(
        tmp_path: Path, capsys, no_daemon_left) -> None:
    poll = 1.0
    owner = SwarmKey.generate()
    owner.save(tmp_path)
    # list #1 (revoking a node that never runs) is every member's file list: all of them,
    # C included, keep it in the DHT, so C's entry is there when C gets revoked
    first = owner.revoke([Identity.generate().public_key])
    first.save(tmp_path / "rev.txt")
    ids, ms = members(owner, 4, first)
    key = revocations_key(owner.public_key)
    async with swarms(ms[:3], ids[:3]) as (a, b, c):
        watches = {s.peer_id: RevocationWatch(s, s.membership, poll_s=poll) for s in (a, b, c)}
        tasks = [asyncio.create_task(w.run_forever()) for w in watches.values()]
        try:
            async def all_hold_first() -> bool:
                return {s.peer_id for s in (a, b, c)} <= set(await a.get(key))

            await until(all_hold_first, 30, "the members re-store their list #1")
            assert await a.hello(c.peer_id) and await c.hello(b.peer_id)
            maddr = (await a.visible_maddrs())[0]
            capsys.readouterr()
            # the owner revokes C: exactly `p2pdiloco swarm revoke C --publish ...` (in a thread: it runs its own loop)
            rc = await asyncio.to_thread(cli_main, [
                "swarm", "revoke", c.peer_id, "--swarm-key", str(tmp_path / "swarm.key"), "--list",
                str(tmp_path / "rev.txt"), "--publish", "--initial-peers", maddr, "--wait", "30"])
            out = capsys.readouterr()
            assert rc == 0, out.err
            assert "published revocation list #2" in out.out and "member(s) hold a copy" in out.out
            second = RevocationList.load(tmp_path / "rev.txt", owner.public_key)
            assert second.serial == 2 and ids[2].public_key in second.revoked

            async def a_and_b_adopted() -> bool:
                return all(s.membership.revocations.serial == 2 for s in (a, b))

            waited = await until(a_and_b_adopted, poll + 10, "A and B adopt list #2")
            print(f"adopted {waited:.1f} s after the publisher returned")
            for s in (a, b):
                assert s.membership.revokes(ids[2].public_key) and c.peer_id in s.bans
                assert not watches[s.peer_id].revoked_self
            async def c_knows() -> bool:
                return watches[c.peer_id].revoked_self

            await until(c_knows, poll + 10, "C learns that it is revoked")
            # C's RPCs are refused ...
            for s in (a, b):
                with pytest.raises(AccessDenied) as e:
                    await c.hello(s.peer_id)
                assert e.value.reason == "revoked"
            assert a.refused["revoked"] + b.refused["revoked"] >= 2
            # ... and so are its DHT records (a fresh key: only C writes there)
            rejected = sum(s.records.rejected["revoked"] for s in (a, b))
            await c.store("test/after-revocation", c.peer_id, {"v": 1}, 30)
            assert c.peer_id not in await a.get("test/after-revocation")
            assert c.peer_id not in await b.get("test/after-revocation")
            assert sum(s.records.rejected["revoked"] for s in (a, b)) > rejected
            # A and B still work together
            assert await a.hello(b.peer_id)

            # the publisher is gone: a member that starts now, without the file, learns list #2
            # from the copies A and B keep in the DHT
            late = Membership(owner.public_key, ms[3].certificate)
            async with swarms([late], [ids[3]], initial=[maddr]) as (d,):
                found = await d.get(key)
                copies = {p for p, v in found.items() if parse_entry(v, owner.public_key) == second}
                assert {a.peer_id, b.peer_id} <= copies, sorted(found)
                assert c.peer_id not in copies  # the revoked member stopped re-publishing
                watch_d = RevocationWatch(d, d.membership, poll_s=poll)
                assert await watch_d.poll_once() and d.membership.revocations == second
                assert c.peer_id in d.bans
                with pytest.raises(AccessDenied):
                    await c.hello(d.peer_id)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.timeout(180)
@pytest.mark.asyncio
async def test_watch_drops_garbage_entries_and_adopts_the_valid_list(no_daemon_left) -> None:
    owner, other = SwarmKey.generate(), SwarmKey.generate()
    ids, ms = members(owner, 2)
    key = revocations_key(owner.public_key)
    good = owner.revoke([Identity.generate().public_key])
    newer = owner.revoke([ids[1].public_key], good)
    forged = RevocationList(owner.public_key, 7, good.issued, good.revoked, good.signature)
    async with swarms(ms, ids) as (a, b):
        watch = RevocationWatch(a, a.membership, poll_s=1.0)
        assert await watch.poll_once() is False and a.membership.revocations is None  # nothing published yet
        garbage = {"junk-random": os.urandom(300), "junk-int": 7, "junk-str": "revoked", "junk-list": [1, b"x"],
                   "junk-none": None, "junk-map": {"serial": 99}, "junk-huge": b"\x92" * (MAX_LIST_BYTES + 1),
                   "junk-other-swarm": other.revoke([a.identity.public_key]).encode(),
                   "junk-forged": forged.encode()}
        for subkey, value in garbage.items():  # subkeys that are not peer IDs: anyone may write them
            assert await b.store(key, subkey, value, 60), subkey

        async def garbage_visible() -> bool:
            return set(garbage) <= set(await a.get(key))

        await until(garbage_visible, 30, "the garbage entries are in the DHT")
        assert await watch.poll_once() is False
        assert a.membership.revocations is None and not a.bans
        assert watch.dropped == {"not_bytes": 5, "oversize": 1, "malformed": 1, "wrong_swarm": 1,
                                 "bad_signature": 1}, watch.dropped
        assert a.drop_reasons["revocations.not_bytes"] == 5 and a.dropped["?"] == 9
        # b publishes the valid list next to the garbage: adopted, then re-stored by a
        assert await b.store(key, b.peer_id, good.encode(), 60)
        assert await watch.poll_once() is True and a.membership.revocations == good
        assert (await a.get(key)).get(a.peer_id) == good.encode()
        assert await watch.poll_once() is False  # the same list again
        # a list that revokes b: a bans b and refuses it; b's own watch finds itself revoked
        assert await a.store(key, "owner-copy", newer.encode(), 60)
        assert await watch.poll_once() is True and b.peer_id in a.bans
        with pytest.raises(AccessDenied):
            await b.hello(a.peer_id)
        watch_b = RevocationWatch(b, b.membership, poll_s=1.0)
        assert await watch_b.poll_once() is True and watch_b.revoked_self
        assert b.peer_id not in b.bans


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_public_swarm_watch_is_a_no_op(no_daemon_left) -> None:
    async with swarms([Membership()], [Identity.generate()]) as (a,):
        watch = RevocationWatch(a, a.membership, poll_s=1.0)
        assert await watch.poll_once() is False
        await asyncio.wait_for(watch.run_forever(), 5)  # returns at once
        assert watch.polls == 0


def test_cli_revoke_publish_rejects_bad_input(tmp_path: Path, capsys) -> None:
    SwarmKey.generate().save(tmp_path)
    peer = Identity.generate().peer_id
    base = ["swarm", "revoke", peer, "--swarm-key", str(tmp_path / "swarm.key"), "--list", str(tmp_path / "r.txt")]
    for extra, message in [(["--publish"], "--publish needs --initial-peers"),
                           (["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/" + peer], "only used with --publish"),
                           (["--publish", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "missing the /p2p/PEER_ID"),
                           (["--publish", "--wait", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/" + peer],
                            "--wait must be > 0")]:
        assert cli_main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("p2pdiloco: ") and message in err and err.count("\n") == 1, err
        assert not (tmp_path / "r.txt").exists()  # nothing written on bad input
    # nobody listens there: one line, exit 1, nothing written
    with socket_closed_port() as port:
        assert cli_main(base + ["--publish", "--initial-peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("p2pdiloco: none of the initial peers is reachable") and err.count("\n") == 1, err
    assert not (tmp_path / "r.txt").exists()


@contextlib.contextmanager
def socket_closed_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield port


@pytest.mark.asyncio
async def test_publish_refuses_a_list_not_signed_by_the_given_key() -> None:
    owner, other = SwarmKey.generate(), SwarmKey.generate()
    with pytest.raises(CertificateError, match="is for swarm"):
        await publish_revocations(other.revoke([]), owner, ["/ip4/127.0.0.1/tcp/1/p2p/x"], wait=1)
