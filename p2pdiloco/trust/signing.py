"""What p2pdiloco signs, byte for byte, and the helpers that sign and verify it.

Every signed message is

    b"p2pdiloco/v1/" + PURPOSE + b"\\0" + msgpack(FIELDS)

signed with Ed25519 (RFC 8032) by the author's identity key (:mod:`p2pdiloco.trust.identity`)
or, for certificates and revocation lists, by the swarm key. ``msgpack`` is msgpack-python's
``packb(fields, use_bin_type=True)``: str fields are UTF-8 "str", bytes fields "bin", ints
the shortest int encoding, floats float64. The purpose prefix keeps a signature for one use
from verifying for another (and from libp2p's own handshakes, made with the same key).

Purposes and fields (``sha256`` is the 32-byte digest of exactly the payload bytes sent):

=================  =====================================================================
``ar.contrib``     [run, fragment, version, state digest, round id, members (list of peer
                   IDs), reducer index, tokens, steps, sha256(slice bytes)]: one member's
                   pseudo-gradient slice sent to one reducer (``ar.reduce``).
``ar.merged``      [run, fragment, version, state digest, round id, reducer index, phase
                   (1 or 2), contributors (list of member indices), sha256(merged bytes)]:
                   a reducer's merged slice and the contributor set it used.
``dht.record``     [DHT key id (20 bytes), subkey (msgpack bytes), value (msgpack bytes),
                   expiration time (float64, DHT time)]: a DHT record (heads, matchmaking
                   declarations, gatherings), see ``p2pdiloco.net.transport.swarm``.
``cert``           certificate body, see :mod:`p2pdiloco.trust.certificates`.
``revocations``    revocation-list body, see :mod:`p2pdiloco.trust.certificates`.
``run.manifest``   [format, run ID, [[setting, value]...], initial peers, target tokens,
                   created (Unix s), owner public key]: a run's manifest, signed by its
                   owner's identity key, see :mod:`p2pdiloco.manifest`.
=================  =====================================================================
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgpack

from p2pdiloco.trust.identity import Identity, public_key_of, verify_raw

__all__ = ["PREFIX", "message", "sign", "verify", "verify_by_peer", "sha256", "contribution_fields",
           "merged_fields", "join_fields"]

PREFIX = b"p2pdiloco/v1/"
PURPOSES = ("ar.contrib", "ar.merged", "dht.record", "cert", "revocations", "run.manifest", "mm.join")


def message(purpose: str, fields: Sequence[Any]) -> bytes:
    """The exact bytes signed for ``purpose`` over ``fields`` (see the module docstring)."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown signing purpose {purpose!r}")
    return PREFIX + purpose.encode() + b"\0" + msgpack.packb(list(fields), use_bin_type=True)


def sign(identity: Identity, purpose: str, fields: Sequence[Any]) -> bytes:
    """A 64-byte Ed25519 signature of ``identity`` over :func:`message`."""
    return identity.sign_raw(message(purpose, fields))


def verify(public_key: bytes, purpose: str, fields: Sequence[Any], signature: bytes) -> bool:
    """True when ``signature`` is ``public_key``'s signature over :func:`message`."""
    return verify_raw(public_key, message(purpose, fields), signature)


def verify_by_peer(peer_id: str, purpose: str, fields: Sequence[Any], signature: bytes) -> bool:
    """:func:`verify` with the public key inlined in ``peer_id``; False for a peer ID that
    does not hold an Ed25519 key."""
    try:
        key = public_key_of(peer_id)
    except ValueError:
        return False
    return verify(key, purpose, fields, signature)


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def contribution_fields(run: str, fragment: int, version: int, digest: str, round_id: str,
                        members: Sequence[str], reducer: int, tokens: int, steps: int, span: int,
                        position: int, payload_sha256: bytes, shares: Sequence[int] = ()) -> list[Any]:
    """Fields of an ``ar.contrib`` signature, in order (``shares``: the group's all-reduce
    shares, which decide the slots of the slice; empty for equal shares)."""
    return [run, fragment, version, digest, round_id, list(members), reducer, tokens, steps, span, position,
            payload_sha256, list(shares)]


def join_fields(run: str, fragment: int, version: int, digest: str, leader: str) -> list[Any]:
    """Fields of an ``mm.join`` signature, in order: a learner asks to merge fragment
    ``fragment`` at (``version``, ``digest``) in ``run`` in the group ``leader`` (a peer ID)
    gathers (net.rounds.matchmaking); the leader signs the same with itself as leader."""
    return [run, fragment, version, digest, leader]


def merged_fields(run: str, fragment: int, version: int, digest: str, round_id: str, reducer: int,
                  phase: int, contributors: Sequence[int], counters: Sequence[int], payload_sha256: bytes) -> list[Any]:
    """Fields of an ``ar.merged`` signature, in order (counters: the round's tokens summed,
    lower median schedule position, and span fraction in 1/FRACTION_GRID units)."""
    return [run, fragment, version, digest, round_id, reducer, phase, list(contributors), list(counters),
            payload_sha256]
