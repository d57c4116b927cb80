"""Trust unit tests: identities, signatures, certificates, revocation, robust merge rule, CLI."""

from __future__ import annotations

import math
import os
import stat
import statistics
import time
from pathlib import Path

import msgpack
import pytest
import torch

from p2pdiloco.cli import main as cli_main
from p2pdiloco.config import load_config
from p2pdiloco.core.merge import contribution_weight, merge_pseudo_gradients
from p2pdiloco.core.robust import robust_merge
from p2pdiloco.errors import ConfigError
from p2pdiloco.net.transport.clock import SwarmClock
from p2pdiloco.trust import load_node_trust, signing
from p2pdiloco.trust.certificates import Certificate, Membership, RevocationList, SwarmKey, parse_public_key
from p2pdiloco.trust.errors import AccessDenied, CertificateError, IdentityError
from p2pdiloco.trust.identity import Identity, b58decode, b58encode, is_peer_id, peer_id_of, public_key_of

t = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


# ---- identity ----------------------------------------------------------------------------

def test_identity_file_is_private_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "p2p.key"
    ident, created = Identity.load_or_create(path)
    assert created and ident.created
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = path.read_bytes()
    assert len(data) == 68 and data[:4] == bytes([0x08, 0x01, 0x12, 0x40])  # libp2p PrivateKey{Ed25519}
    again, created = Identity.load_or_create(path)
    assert not created and again.peer_id == ident.peer_id and again.public_key == ident.public_key


def test_peer_id_is_the_public_key() -> None:
    ident = Identity.generate()
    assert ident.peer_id.startswith("12D3KooW")  # identity multihash of an Ed25519 key
    assert public_key_of(ident.peer_id) == ident.public_key and peer_id_of(ident.public_key) == ident.peer_id
    assert is_peer_id(ident.peer_id)
    assert not is_peer_id("QmV6bPa3xB8gg5YhjHnmHBCvVpymShB3aaPJmsvxWoq5LB")  # RSA-style: only a hash
    assert not is_peer_id("3") and not is_peer_id(None)
    assert b58decode(b58encode(b"\0\0abc")) == b"\0\0abc"
    with pytest.raises(ValueError, match="not the peer ID of an Ed25519 key"):
        public_key_of("QmV6bPa3xB8gg5YhjHnmHBCvVpymShB3aaPJmsvxWoq5LB")


def test_identity_file_problems_are_clear(tmp_path: Path) -> None:
    path = tmp_path / "p2p.key"
    Identity.generate().write(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match=r"accessible by other users \(mode 0644\); run `chmod 600"):
        Identity.load(path)
    rsa = tmp_path / "old.key"
    rsa.write_bytes(bytes([0x08, 0x00, 0x12, 0x80, 0x09]) + b"\1" * 1200)
    os.chmod(rsa, 0o600)
    with pytest.raises(IdentityError, match="RSA key written by an older version"):
        Identity.load(rsa)
    bad = tmp_path / "bad.key"
    data = bytearray(Identity.generate().to_libp2p_bytes())
    data[-1] ^= 1  # public half no longer matches the seed
    bad.write_bytes(bytes(data))
    os.chmod(bad, 0o600)
    with pytest.raises(IdentityError, match="corrupt"):
        Identity.load(bad)
    with pytest.raises(IdentityError, match="does not exist"):
        Identity.load(tmp_path / "missing.key")


# ---- signatures --------------------------------------------------------------------------

def test_signed_message_layout_and_verification() -> None:
    ident = Identity.generate()
    fields = signing.contribution_fields("run/tag", 2, 7, "ab" * 32, "r1", ["A", "B"], 1, 1000, 10, 1, 120,
                                         signing.sha256(b"payload"))
    assert signing.message("ar.contrib", fields) == (
        b"p2pdiloco/v1/ar.contrib\0" + msgpack.packb(fields, use_bin_type=True))
    sig = signing.sign(ident, "ar.contrib", fields)
    assert len(sig) == 64
    assert signing.verify_by_peer(ident.peer_id, "ar.contrib", fields, sig)
    assert not signing.verify_by_peer(ident.peer_id, "ar.merged", fields, sig)  # other purpose
    for i, changed in [(7, 1001), (8, 11), (9, signing.sha256(b"payloaD")), (4, "r2"), (2, 8)]:
        tampered = list(fields)
        tampered[i] = changed
        assert not signing.verify_by_peer(ident.peer_id, "ar.contrib", tampered, sig)
    assert not signing.verify_by_peer(Identity.generate().peer_id, "ar.contrib", fields, sig)  # other key
    assert not signing.verify_by_peer("QmV6bPa3xB8gg5YhjHnmHBCvVpymShB3aaPJmsvxWoq5LB", "ar.contrib", fields, sig)
    assert not signing.verify(ident.public_key, "ar.contrib", fields, sig[:63])
    with pytest.raises(ValueError):
        signing.message("anything", [])


def test_keys_of_small_order_verify_nothing() -> None:
    """A "public key" of small order (the identity point 01 00..00, say) has, over any
    message, a signature R || 0 with R of small order that OpenSSL's check accepts: a hostile
    leader could list such members in a join answer with signatures that pass the ghost check.
    Every such encoding (both x signs) is refused, whatever R; a real key is not."""
    import secrets  # noqa: PLC0415

    from p2pdiloco.trust.identity import _SMALL_ORDER, is_small_order, verify_raw  # noqa: PLC0415

    encodings = [*_SMALL_ORDER, *(e[:31] + bytes([e[31] | 0x80]) for e in _SMALL_ORDER)]
    assert len(set(encodings)) == 14 and all(is_small_order(e) for e in encodings)
    ident = Identity.generate()
    assert not is_small_order(ident.public_key)
    for key in encodings:
        for _ in range(4):
            message = secrets.token_bytes(16)
            assert not any(verify_raw(key, message, r + bytes(32)) for r in encodings)
            assert not signing.verify_by_peer(peer_id_of(key), "mm.join", [message], secrets.token_bytes(64))
    assert verify_raw(ident.public_key, b"m", ident.sign_raw(b"m"))


# ---- certificates ------------------------------------------------------------------------

NOW = 1_800_000_000


def test_certificate_checks() -> None:
    owner, other_swarm = SwarmKey.generate(), SwarmKey.generate()
    member, stranger = Identity.generate(), Identity.generate()
    cert = owner.admit(member.public_key, valid_for=3600, now=NOW)
    assert Certificate.decode(cert.encode()) == cert
    cert.verify(owner.public_key, member.public_key, now=NOW + 10)
    cert.verify(owner.public_key, member.public_key, now=NOW - 200)  # within the allowed clock skew
    cases = [
        (dict(swarm=other_swarm.public_key, member=member.public_key, now=NOW), "wrong_swarm"),
        (dict(swarm=owner.public_key, member=stranger.public_key, now=NOW), "wrong_member"),
        (dict(swarm=owner.public_key, member=member.public_key, now=NOW + 3600), "expired"),
        (dict(swarm=owner.public_key, member=member.public_key, now=NOW - 1000), "not_yet_valid"),
    ]
    for kw, reason in cases:
        with pytest.raises(CertificateError) as e:
            cert.verify(kw["swarm"], kw["member"], now=kw["now"])
        assert e.value.reason == reason
    forged = Certificate(cert.swarm, cert.member, cert.issued, cert.expires + 10**6, cert.signature)
    with pytest.raises(CertificateError, match="valid signature") as e:
        forged.verify(owner.public_key, member.public_key, now=NOW)
    by_other = other_swarm.admit(member.public_key, valid_for=3600, now=NOW)
    with pytest.raises(CertificateError) as e:
        by_other.verify(owner.public_key, member.public_key, now=NOW)
    assert e.value.reason == "wrong_swarm"
    with pytest.raises(CertificateError, match="malformed"):
        Certificate.decode(b"\x93\x01\x02\x03")


def test_revocation_list(tmp_path: Path) -> None:
    owner = SwarmKey.generate()
    a, b = Identity.generate(), Identity.generate()
    first = owner.revoke([a.public_key], now=NOW)
    second = owner.revoke([b.public_key], first, now=NOW + 1)
    assert second.serial == 2 and second.revoked == {a.public_key, b.public_key}
    second.save(tmp_path / "rev.txt")
    loaded = RevocationList.load(tmp_path / "rev.txt", owner.public_key)
    assert loaded == second
    with pytest.raises(CertificateError) as e:
        RevocationList.load(tmp_path / "rev.txt", SwarmKey.generate().public_key)
    assert e.value.reason == "wrong_swarm"
    tampered = RevocationList(owner.public_key, 3, NOW, frozenset(), second.signature)
    with pytest.raises(CertificateError, match="not signed by the swarm key"):
        RevocationList.decode(tampered.encode(), owner.public_key)
    cert = owner.admit(a.public_key, valid_for=3600, now=NOW)
    with pytest.raises(CertificateError) as e:
        cert.verify(owner.public_key, a.public_key, now=NOW, revocations=loaded)
    assert e.value.reason == "revoked"


def test_membership_admits_members_only() -> None:
    owner = SwarmKey.generate()
    member, outsider = Identity.generate(), Identity.generate()
    cert = owner.admit(member.public_key, valid_for=3600).encode()
    private = Membership(owner.public_key)
    private.check(member.peer_id, cert)
    private.check(member.peer_id, cert)  # cached
    for peer, presented, reason in [(outsider.peer_id, None, "missing"), (outsider.peer_id, cert, "wrong_member"),
                                    (member.peer_id, b"junk", "malformed")]:
        with pytest.raises(AccessDenied, match="not a member of private swarm") as e:
            private.check(peer, presented)
        assert e.value.reason == reason
    Membership().check(outsider.peer_id, None)  # public swarm: everyone


def test_files_and_public_key_forms(tmp_path: Path) -> None:
    owner = SwarmKey.generate()
    key_path, pub_path = owner.save(tmp_path)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert SwarmKey.load(key_path).public_key == owner.public_key
    with pytest.raises(CertificateError, match="exists already"):
        owner.save(tmp_path)
    ident = Identity.generate()
    assert parse_public_key(ident.peer_id) == parse_public_key(ident.public_key.hex()) == ident.public_key
    with pytest.raises(CertificateError, match="is not a public key"):
        parse_public_key("nope")
    cert = owner.admit(ident.public_key, valid_for=60)
    cert.save(tmp_path / "m.cert")
    assert Certificate.load(tmp_path / "m.cert") == cert
    assert pub_path.read_text().strip() == owner.public_key.hex()
    with pytest.raises(CertificateError, match="is the swarm's public key; signing needs the private key"):
        SwarmKey.load(pub_path)  # a user who passes swarm.pub where swarm.key is needed
    with pytest.raises(CertificateError, match="cannot be read"):
        SwarmKey.load(tmp_path)  # a folder


def test_node_trust_from_config(tmp_path: Path) -> None:
    owner = SwarmKey.generate()
    _, pub = owner.save(tmp_path / "owner")
    public = load_node_trust(load_config(env={}).trust, tmp_path / "n0")
    assert not public.membership.private and (tmp_path / "n0" / "p2p.key").exists()
    cfg = load_config(env={}, overrides={"trust.swarm_key": str(pub)}).trust
    with pytest.raises(CertificateError, match=r"no membership certificate at .*member.cert.*swarm admit 12D3KooW"):
        load_node_trust(cfg, tmp_path / "n1")
    ident = Identity.load(tmp_path / "n1" / "p2p.key")  # created by the refused start: admit it
    owner.admit(ident.public_key, valid_for=60, now=time.time() - 120).save(tmp_path / "n1" / "member.cert")
    with pytest.raises(CertificateError, match="cannot join private swarm .* expired at"):
        load_node_trust(cfg, tmp_path / "n1")
    owner.admit(ident.public_key, valid_for=60).save(tmp_path / "n1" / "member.cert")
    trust = load_node_trust(cfg, tmp_path / "n1")
    assert trust.membership.private and trust.identity.peer_id == ident.peer_id
    with pytest.raises(ConfigError, match="trust.swarm_key: expected 64 hex digits"):
        load_config(env={}, overrides={"trust.swarm_key": "abc"})
    with pytest.raises(ConfigError, match="trust.outliers: must be one of clip, drop, off"):
        load_config(env={}, overrides={"trust.outliers": "median"})


# ---- robust merge ------------------------------------------------------------------------

W = [contribution_weight(10, 1)] * 3  # equal weights, 100 each


def test_robust_merge_drops_non_finite_and_keeps_the_plain_merge_of_the_rest() -> None:
    members = [[t(3, 4)], [t(0, 2)], [t(float("nan"), 1)]]
    out = robust_merge(members, W, [False], factor=4.0)  # norms 5 and 2: within 4 x the lower median
    assert out.kept == (0, 1) and out.dropped == {2: "non_finite"}
    assert torch.equal(out.merged[0], merge_pseudo_gradients(members[:2], W[:2], [False])[0])


def test_robust_merge_clips_norms_far_above_the_lower_median() -> None:
    # norms 5, 2 and 500: lower median 5, bound 4 * 5 = 20; [300, 400] is scaled to [12, 16]
    members = [[t(3, 4)], [t(0, 2)], [t(300, 400)]]
    out = robust_merge(members, W, [True], policy="clip", factor=4.0)
    assert out.clipped == ((2, 0),) and out.kept == (0, 1, 2)
    # embedding: weighted mean of [3, 4], [0, 2], [12, 16] with equal weights = [5, 22/3]
    assert torch.allclose(out.merged[0], t(5.0, 22 / 3), atol=1e-6)
    dropped = robust_merge(members, W, [True], policy="drop", factor=4.0)
    assert dropped.kept == (0, 1) and dropped.dropped == {2: "outlier"}
    assert torch.allclose(dropped.merged[0], t(1.5, 3.0), atol=1e-6)
    off = robust_merge(members, W, [True], policy="off")
    assert torch.allclose(off.merged[0], t(101, 406 / 3), atol=1e-4)


def test_robust_merge_caps_inflated_weights() -> None:
    # weights 100, 100 and 10**8 (claimed tokens): capped at the lower median 100, whatever the
    # factor, so a third of the mean
    members = [[t(1, 0)], [t(1, 0)], [t(0, 1)]]
    out = robust_merge(members, [100.0, 100.0, 1e8], [True])
    assert out.weights == (100.0, 100.0, 100.0)
    assert torch.allclose(out.merged[0], t(2 / 3, 1 / 3), atol=1e-6)
    assert robust_merge(members, [100.0, 100.0, 1e8], [True], factor=4.0).weights == (100.0, 100.0, 100.0)


def test_robust_merge_two_members_and_edge_cases() -> None:
    # with two members the lower median is the smaller norm: a 10^6 times larger Δ is bounded
    out = robust_merge([[t(0, 1)], [t(0, 1e6)]], [1.0, 1.0], [False], factor=4.0)
    assert math.isclose(out.merged[0].norm().item(), (1 + 4) / 2, rel_tol=1e-6)
    # a median norm of 0 defines no bound; one member alone is its own Δ
    z = robust_merge([[t(0, 0)], [t(0, 0)], [t(1, 1)]], W, [False])
    assert z.clipped == () and torch.allclose(z.merged[0], t(1 / 3, 1 / 3))
    assert torch.equal(robust_merge([[t(2, 3)]], [5.0], [False]).merged[0], t(2, 3))
    with pytest.raises(ValueError, match="no contribution left"):
        robust_merge([[t(float("inf"), 0)]], [1.0], [False])
    with pytest.raises(ValueError, match="unknown outlier policy"):
        robust_merge([[t(1, 0)]], [1.0], [False], policy="median")
    with pytest.raises(ValueError, match="factor"):
        robust_merge([[t(1, 0)]], [1.0], [False], factor=1.0)


# ---- CLI ---------------------------------------------------------------------------------

def test_swarm_cli_init_identity_admit_revoke(tmp_path: Path, capsys) -> None:
    assert cli_main(["swarm", "init", "--dir", str(tmp_path)]) == 0
    pub = (tmp_path / "swarm.pub").read_text().strip()
    assert f"trust.swarm_key={pub}" in capsys.readouterr().out
    assert cli_main(["swarm", "init", "--dir", str(tmp_path)]) == 2
    assert "exists already" in capsys.readouterr().err
    assert cli_main(["swarm", "identity", "--data-dir", str(tmp_path / "node")]) == 0
    peer = capsys.readouterr().out.strip()
    assert is_peer_id(peer)
    cert_path = tmp_path / "node" / "member.cert"
    assert cli_main(["swarm", "admit", peer, "--swarm-key", str(tmp_path / "swarm.key"), "--days", "2",
                     "--out", str(cert_path)]) == 0
    cert = Certificate.load(cert_path)
    assert cert.member == public_key_of(peer) and cert.swarm.hex() == pub
    assert 2 * 86400 - 5 <= cert.expires - time.time() <= 2 * 86400
    rev = tmp_path / "rev.txt"
    assert cli_main(["swarm", "revoke", peer, "--swarm-key", str(tmp_path / "swarm.key"), "--list", str(rev)]) == 0
    assert RevocationList.load(rev, cert.swarm).revoked == {cert.member}
    capsys.readouterr()
    assert cli_main(["swarm", "admit", "not-a-key", "--swarm-key", str(tmp_path / "swarm.key")]) == 2
    assert "is not a public key" in capsys.readouterr().err
    assert cli_main(["swarm", "admit", peer, "--swarm-key", str(tmp_path / "none.key")]) == 2
    assert "swarm init" in capsys.readouterr().err


# ---- plausible follows -------------------------------------------------------------------

def test_state_sync_refuses_a_state_whose_momentum_would_wreck_the_next_step() -> None:
    """Θ left in place, the buffer b huge: the jump bound passes it, but its next outer step
    moves Θ by at least lr·μ²·‖b‖ (core.outer.nesterov_outer_step), held to one version's
    bound (found by a hostile review: momentum was only checked for being finite)."""
    from p2pdiloco.core.fragments import Fragment, TensorSlot
    from p2pdiloco.core.outer import FragmentState
    from p2pdiloco.errors import StateSyncError
    from p2pdiloco.net.state.statesync import StateSync

    frag = Fragment(0, (TensorSlot("w", (4,), 4, False),))
    zeros = (torch.zeros(4),)
    states = [FragmentState.create(0, 0, (torch.ones(4),), zeros)]
    sync = StateSync(None, "run", [frag], lambda: states, outer=(0.7, 0.9))
    sync._observe()
    for v in range(1, 5):  # four own commits, each moving Θ by 0.5: one version may move it by 10 x 0.5 = 5
        states[0] = FragmentState.create(0, v, (states[0].theta[0] + 0.25,), zeros)
        sync._observe()
    mine = states[0].theta[0]  # [2, 2, 2, 2]: |theta| 4, so 4 x |theta| = 16 is the looser bound
    sync._check_plausible(FragmentState.create(0, 5, (mine,), (torch.full((4,), 4.0),)))  # 0.7 x 0.81 x 8 = 4.5
    for b in (5.0, 1e30):  # 0.7 x 0.81 x 10 = 5.67 > 5, and the attack
        with pytest.raises(StateSyncError, match="momentum buffer moves the parameters by .* largest recent step"):
            sync._check_plausible(FragmentState.create(0, 5, (mine,), (torch.full((4,), b),)))
    # without the run's outer settings (lr 0) the buffer is not bounded: the node passes them
    StateSync(None, "run", [frag], lambda: states)._check_plausible(
        FragmentState.create(0, 5, (mine,), (torch.full((4,), 5.0),)))


def test_state_sync_refuses_implausible_successors_and_hides_them_from_the_heads() -> None:
    import asyncio

    from p2pdiloco.core.fragments import Fragment, TensorSlot
    from p2pdiloco.core.outer import FragmentState
    from p2pdiloco.errors import StateSyncError
    from p2pdiloco.net.state.heads import newest_heads
    from p2pdiloco.net.state.bounded_moves import FOLLOW_FACTOR
    from p2pdiloco.net.state.statesync import StateSync

    frag = Fragment(0, (TensorSlot("w", (4,), 4, False),))
    zeros = (torch.zeros(4),)
    states = [FragmentState.create(0, 0, (torch.ones(4),), zeros)]
    sync = StateSync(None, "run", [frag], lambda: states)
    sync._observe()
    for v in range(1, 5):  # four own commits, each moving Θ by 0.5 (norm)
        states[0] = FragmentState.create(0, v, (states[0].theta[0] + 0.25,), zeros)
        sync._observe()
    assert list(sync._steps[0]) == [0.5, 0.5, 0.5, 0.5]
    mine = states[0].theta[0]
    ok = FragmentState.create(0, 6, (mine + 0.25 * FOLLOW_FACTOR,), zeros)  # 2 versions, 5 steps' worth
    sync._check_plausible(ok)
    wrecked = FragmentState.create(0, 5, (mine * 1000,), zeros)
    with pytest.raises(StateSyncError, match="moves the parameters by .* largest recent step"):
        sync._check_plausible(wrecked)
    fresh = StateSync(None, "run", [frag], lambda: states)  # no step seen yet: only the |theta| bound
    fresh._check_plausible(ok)
    with pytest.raises(StateSyncError, match=r"x \|theta\|"):
        fresh._check_plausible(FragmentState.create(0, 5, (mine * 6,), zeros))
    with pytest.raises(StateSyncError, match="not finite"):
        sync._check_plausible(FragmentState.create(0, 5, (mine * float("nan"),), zeros))
    # early in a run with a large H one honest step moves Θ by several |theta| (measured: 26.7
    # against |theta| 3.62 at H = 250): a node that has not seen a step yet but made progress
    # of its own measures a step by that (10 x its own step), never below the |theta| bound
    big = FragmentState.create(0, 5, (mine * 6,), zeros)  # moves Θ by 5 x |theta| 4 = 20 > 4 x 4
    fresh.own_step(0, float("nan"))  # ignored
    fresh.own_step(0, 0.1)  # 10 x 0.1 < 4 x |theta|: the |theta| bound stays
    with pytest.raises(StateSyncError, match=r"x \|theta\|"):
        fresh._check_plausible(big)
    fresh.own_step(0, 2.5)  # our own last contribution would move Θ by 2.5: up to 25 per version
    fresh._check_plausible(big)
    with pytest.raises(StateSyncError, match="this node's own step"):
        fresh._check_plausible(FragmentState.create(0, 5, (mine * 1000,), zeros))
    fresh.own_step(0, 100.0)  # never above 16 x |theta| = 64 per version
    fresh._check_plausible(FragmentState.create(0, 5, (mine * 16,), zeros))  # moves 60
    with pytest.raises(StateSyncError, match=r"at most 16 x \|theta\| 4"):
        fresh._check_plausible(FragmentState.create(0, 5, (mine * 18,), zeros))  # moves 68
    with pytest.raises(StateSyncError, match="largest recent step"):  # 9 versions apart from v0:
        sync._check_plausible(FragmentState.create(0, 5, (mine * 13,), zeros))  # 10 x 9 x 0.5 = 45 < 48
    sync.own_step(0, 100.0)  # once steps were seen, our own step (at most 6.4 = 16 x 4 / 10) widens the
    sync._check_plausible(FragmentState.create(0, 5, (mine * 13,), zeros))  # steps' bound: 48 < 10 x 9 x 6.4
    with pytest.raises(StateSyncError, match=r"4 x 9 version\(s\) x \|theta\| 4"):  # but never the |theta|
        sync._check_plausible(FragmentState.create(0, 5, (mine * 38,), zeros))  # one: 148 > 144

    class Stub:
        bans = {"12D3KooWBanned": "non_finite"}
        peer_id = "me"
        clock = SwarmClock(local=lambda: 0.0)  # the records below were stamped t = 0: fresh

        def drop(self, peer, reason):
            raise AssertionError(f"dropped a well-formed record of {peer}: {reason}")

        async def get(self, key, beam=None):
            return {honest: {"f": [[4, bytes.fromhex(states[0].digest)]]},
                    attacker: {"f": [[5, bytes.fromhex(wrecked.digest)]]}}

    honest, attacker = Identity.generate().peer_id, Identity.generate().peer_id
    sync.swarm = Stub()
    records = asyncio.run(sync.records())
    assert records[attacker].fragments == (None,)  # the refused head is hidden: the honest one wins
    assert newest_heads(records, 1)[0].version == 4
    Stub.bans = {attacker: "non_finite"}
    assert set(asyncio.run(sync.records())) == {honest}  # a banned peer's records are ignored


def test_a_lone_peers_step_after_group_rounds_is_followed_within_ten_own_steps() -> None:
    """A node that saw only group rounds (averaged progress, small steps) follows a peer that
    then merges alone: one learner's unaveraged progress with momentum on top steps by more
    than 10 x the group's steps (a restarted node refused such a step, 4.39 against 10 x 0.366,
    and forked: tests/test_churn.py). Its own step, which no peer can inflate, widens the
    bound; a state beyond 10 x that is still refused."""
    from p2pdiloco.core.fragments import Fragment, TensorSlot
    from p2pdiloco.core.outer import FragmentState
    from p2pdiloco.errors import StateSyncError
    from p2pdiloco.net.state.statesync import StateSync

    frag = Fragment(0, (TensorSlot("w", (4,), 4, False),))
    zeros = (torch.zeros(4),)
    states = [FragmentState.create(0, 0, (torch.full((4,), 10.0),), zeros)]  # |theta| 20 at v0
    sync = StateSync(None, "run", [frag], lambda: states)
    for v in range(1, 4):  # three group rounds, each moving Θ by 0.4 (norm of 0.2 x ones(4))
        states[0] = FragmentState.create(0, v, (states[0].theta[0] + 0.2,), zeros)
        sync.shared(0, v - 1)
    sync.shared(0, 3)  # the last group's result, held by the peer too
    mine = states[0].theta[0]
    lone = FragmentState.create(0, 4, (mine + 2.25,), zeros)  # one version, moves Θ by 4.5 > 10 x 0.4
    with pytest.raises(StateSyncError, match=r"over 10 x 1 version\(s\) x the largest recent step 0.4"):
        sync._check_plausible(lone)
    sync.own_step(0, 0.6)  # our own contribution alone would move Θ by 0.6: up to 6 per version
    sync._check_plausible(lone)
    with pytest.raises(StateSyncError, match=r"over 10 x 1 version\(s\) x this node's own step 0.6"):
        sync._check_plausible(FragmentState.create(0, 4, (mine + 3.25,), zeros))  # 6.5 > 6


def test_a_version_may_hold_the_progress_of_a_whole_grace_window() -> None:
    """A learner trains on while its round waits: with H = 20 steps of 8.5 ms (a 0.17 s period)
    and a 3 s grace window, one lone version may hold 1 + 3 / 0.17 = 18.6 periods of progress;
    with a 40 s period (DiLoCo's regime) 1.075; never over 1 + SPAN_PERIODS; 1 while the step
    time is unknown (a CI run's restarted node refused 5.4 against 10 x 0.298 and forked)."""
    from p2pdiloco.net.state.bounded_moves import SPAN_PERIODS, periods_per_version

    assert periods_per_version(3.0, 20, 0.0085) == pytest.approx(1 + 3.0 / 0.17)  # 18.65
    assert periods_per_version(3.0, 100, 0.4) == pytest.approx(1.075)
    assert periods_per_version(3.0, 20, 1e-9) == 1 + SPAN_PERIODS == 33.0
    assert periods_per_version(3.0, 20, None) == periods_per_version(3.0, 20, 0.0) == 1.0
    assert periods_per_version(3.0, 20, float("nan")) == 1.0


def test_a_nodes_own_step_is_per_period_of_progress_times_the_periods_a_version_may_hold() -> None:
    """lr 0.7, μ 0.9, H = 20, grace_max 3 s: Δ of norm 1.0 over 40 steps is 0.5 per period, an
    outer step of 0.7 x 1.9 x 0.5 = 0.665 from a zero buffer; at 8.5 ms a step a version may hold
    18.65 periods: 12.40. Over 10 steps (less than a period) it is not scaled up: 1.33 x 18.65."""
    import dataclasses

    from p2pdiloco.config import OuterConfig
    from p2pdiloco.net.state.bounded_moves import own_step

    outer = dataclasses.replace(OuterConfig(), lr=0.7, momentum=0.9, sync_every=20, grace_max=3.0)
    delta = (torch.full((4,), 0.5),)  # norm 1.0
    assert own_step(outer, delta, 40, 0.0085) == pytest.approx(0.665 * (1 + 3.0 / 0.17))
    assert own_step(outer, delta, 40, None) == pytest.approx(0.665)
    assert own_step(outer, delta, 10, 0.0085) == pytest.approx(1.33 * (1 + 3.0 / 0.17))


def test_two_lone_runs_are_as_far_apart_as_both_together() -> None:
    """Two honest nodes that merged alone for a while after their last group round (anchor v3,
    result v4; then 6 lone rounds here, 7 there, in opposite directions) are 15 versions apart
    through v3, not 1: a follow across the split must pass the bound, which counts both paths
    from the last version both are known to have held."""
    from p2pdiloco.core.fragments import Fragment, TensorSlot
    from p2pdiloco.core.outer import FragmentState
    from p2pdiloco.errors import StateSyncError
    from p2pdiloco.net.state.bounded_moves import FOLLOW_FACTOR
    from p2pdiloco.net.state.statesync import StateSync

    frag = Fragment(0, (TensorSlot("w", (4,), 4, False),))
    zeros = (torch.zeros(4),)
    states = [FragmentState.create(0, 0, (torch.ones(4),), zeros)]
    sync = StateSync(None, "run", [frag], lambda: states)
    for v in range(1, 5):  # four group rounds, each moving Θ by 0.5 (norm of 0.25 x ones(4))
        states[0] = FragmentState.create(0, v, (states[0].theta[0] + 0.25,), zeros)
        sync.shared(0, v - 1)  # the group formed at the anchor v-1
    base = states[0].theta[0]
    for v in range(5, 11):  # six lone rounds: +1.5 per coordinate
        states[0] = FragmentState.create(0, v, (states[0].theta[0] + 0.25,), zeros)
        sync._observe()
    assert statistics.median(sync._steps[0]) == 0.5
    other = FragmentState.create(0, 11, (base - 7 * 0.25,), zeros)  # seven lone rounds the other way
    # |Θ_mine - Θ_other| = (1.5 + 1.75) x |ones(4)| = 6.5: over FOLLOW_FACTOR x 1 x 0.5 = 5 (the
    # version gap alone), within FOLLOW_FACTOR x ((11 - 3) + (10 - 3)) x 0.5 = 75
    assert 6.5 > FOLLOW_FACTOR * 1 * 0.5
    sync._check_plausible(other)
    with pytest.raises(StateSyncError, match=r"over 10 x 15 version\(s\) x the largest recent step 0.5"):
        sync._check_plausible(FragmentState.create(0, 11, (base + 40,), zeros))  # (40 - 1.5) x 2 = 77 > 75
    # a download is a shared state: once the other side's v11 is installed, 1 version is 1 version
    sync.shared(0, 11)
    states[0] = other
    with pytest.raises(StateSyncError, match=r"x 1 version\(s\)"):
        sync._check_plausible(FragmentState.create(0, 12, (other.theta[0] + 6,), zeros))


def test_robust_merge_leaves_out_a_direction_against_the_group() -> None:
    # three members along one direction with some spread, one flipped: the coordinate-wise median
    # of the unit vectors points along the honest ones; the flipped tensor has cosine about -1 with
    # it, below -max(0.1, 3/sqrt(400)) = -0.15
    g = torch.Generator().manual_seed(1)
    honest = [torch.ones(400) + 0.5 * torch.randn(400, generator=g) for _ in range(3)]
    members = [[h] for h in honest] + [[-honest[0]]]
    w = [1.0] * 4
    out = robust_merge(members, w, [True])
    assert out.misaligned == ((3, 0),) and out.kept == (0, 1, 2, 3)
    assert torch.equal(out.merged[0], merge_pseudo_gradients([[h] for h in honest], [1.0] * 3, [True])[0])
    dropped = robust_merge(members, w, [True], policy="drop")
    assert dropped.dropped == {3: "misaligned"}
    assert robust_merge(members, w, [True], policy="off").misaligned == ()
    # two against two: no majority, nothing is left out
    assert robust_merge([[honest[0]], [honest[1]], [-honest[0]], [-honest[1]]], w, [True]).misaligned == ()
    # nearly orthogonal members (the paper's regime) are not flagged: the margin is 3/sqrt(numel)
    ortho = [[torch.randn(1000, generator=g)] for _ in range(5)]
    assert robust_merge(ortho, [1.0] * 5, [False]).misaligned == ()
