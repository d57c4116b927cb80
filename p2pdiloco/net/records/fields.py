"""The field checks of the parsing boundary (:mod:`p2pdiloco.net.records.parse`): each takes one
value of a peer's message and returns it typed and in range, or raises
:class:`~p2pdiloco.errors.ProtocolError`.

Bounds (module constants; far above anything an honest peer sends):

* versions: ``0 <= v <= MAX_VERSION`` (2**48: one outer step a millisecond for 8,900
  years; ``fragment_digest`` packs versions as int64, so 2**63 would not even hash);
* digests: sha256, 32 bytes on the wire (:func:`wire_digest`; 64 lower-case hex digits in the
  node, what :func:`digest` returns); round IDs: 1 to ``MAX_ROUND_ID`` characters;
* fragment indices: ``0 <= p < num_fragments`` (the run's P, at most ``MAX_FRAGMENTS``);
* member lists: 1 to ``MAX_GROUP`` Ed25519 public keys (32 bytes) whose peer IDs are sorted, no
  duplicates;
* counters (tokens, steps): ``0 <= n <= MAX_COUNT`` (2**53, exact in a float); heartbeat
  periods 1 to ``MAX_BEAT_S`` seconds; other numbers finite; names and states at most
  ``MAX_TEXT`` characters; signatures 64 bytes, public keys 32 bytes;
* link rates (``mm.join``'s ``bw``): 0 to ``MAX_RATE_KIB`` KiB/s; all-reduce shares: one
  integer in [0, ``SHARE_GRID``] per member, summing to 1 .. ``SHARE_GRID`` (or absent: equal).

Integers must be ``int`` (not ``bool``, not ``float``): msgpack keeps the distinction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from p2pdiloco.errors import ProtocolError
from p2pdiloco.trust.identity import peer_id_of, public_key_of

MAX_VERSION = 2**48
MAX_FRAGMENTS = 1024
MAX_GROUP = 256
MAX_ROUND_ID = 64
MAX_TEXT = 64
MAX_COUNT = 2**53
MAX_RECORD_KEYS = 32
MAX_RATE_KIB = 2**32  # KiB/s: 4 TiB/s
BEAT_S = 20  # seconds: the shortest heartbeat period a node states (pushes.beat_period), and a record's without "b"
MAX_BEAT_S = 160  # ... and the longest (pushes.beat_period at MAX_AUDIENCE): a dead record lives 205 s at most
SHARE_GRID = 1000  # all-reduce shares are integers in [0, SHARE_GRID] (shares.bandwidth_shares)


# ---- field checks ---------------------------------------------------------------------------
def _int(x: Any, what: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise ProtocolError(f"{what}: expected an integer in [{lo}, {hi}]")
    return x


def _finite(x: Any, what: str) -> float:
    if type(x) not in (int, float) or not math.isfinite(x):
        raise ProtocolError(f"{what}: expected a finite number")
    return float(x)


def _text(x: Any, what: str, hi: int = MAX_TEXT, lo: int = 0) -> str:
    if not isinstance(x, str) or not lo <= len(x) <= hi:
        raise ProtocolError(f"{what}: expected a string of {lo} to {hi} characters")
    return x


def _bytes(x: Any, what: str, size: int) -> bytes:
    if not isinstance(x, bytes) or len(x) != size:
        raise ProtocolError(f"{what}: expected {size} bytes")
    return x


def digest(x: Any, what: str = "digest") -> str:
    """A sha256 digest as sent (:func:`wire_digest`: exactly 32 bytes), returned in the node's
    own form, 64 lower-case hex digits."""
    if not isinstance(x, bytes) or len(x) != 32:
        raise ProtocolError(f"{what}: expected 32 bytes")
    return x.hex()


def wire_digest(d: str) -> bytes:
    """The wire form of the node's digest ``d`` (64 hex digits): its 32 bytes, half the size
    (a digest is in most pushes and matchmaking calls: docs/benchmarks/control_plane.md).
    :func:`digest` reads it back.

    Raises:
        ValueError: ``d`` is not hex (the node's own digests always are).
    """
    return bytes.fromhex(d)


def version(x: Any, what: str = "version") -> int:
    """A fragment version: an int in [0, MAX_VERSION]."""
    return _int(x, what, 0, MAX_VERSION)


def fragment(x: Any, num_fragments: int, what: str = "fragment") -> int:
    """A fragment index: an int in [0, num_fragments)."""
    return _int(x, what, 0, num_fragments - 1)


def round_id(x: Any) -> str:
    return _text(x, "round id", MAX_ROUND_ID, 1)


def members(x: Any) -> tuple[str, ...]:
    """A group's member list as sent (:func:`wire_members`): 1 to MAX_GROUP Ed25519 public keys
    of 32 bytes (length checked first) whose peer IDs are sorted and distinct; returned as those
    peer IDs."""
    if not isinstance(x, list) or not 1 <= len(x) <= MAX_GROUP:
        raise ProtocolError(f"members: expected a list of 1 to {MAX_GROUP} public keys")
    if not all(isinstance(m, bytes) and len(m) == 32 for m in x):
        raise ProtocolError("members: expected 32-byte Ed25519 public keys")
    peers = [peer_id_of(m) for m in x]
    if peers != sorted(set(peers)):
        raise ProtocolError("members: expected sorted, distinct peer IDs")
    return tuple(peers)


def wire_members(peers: Sequence[str]) -> list[bytes]:
    """The wire form of a member list of Ed25519 peer IDs: their public keys, 32 bytes each (the
    peer ID inlines the key; its base58 text takes 52 characters), which
    :func:`members` reads back.

    Raises:
        ValueError: a peer ID that inlines no Ed25519 key (the node's groups hold none).
    """
    return [public_key_of(p) for p in peers]


def shares(x: Any, group_size: int) -> tuple[int, ...]:
    """All-reduce shares of a group (``core.fragments.assign_parts``): absent or empty means equal
    shares, ``()``; else ``group_size`` integers in [0, SHARE_GRID] summing to 1 .. SHARE_GRID."""
    if x is None or x == []:
        return ()
    if not isinstance(x, list) or len(x) != group_size:
        raise ProtocolError(f"shares: expected a list of {group_size} integers")
    out = tuple(_int(v, "share", 0, SHARE_GRID) for v in x)
    if not 1 <= sum(out) <= SHARE_GRID:
        raise ProtocolError(f"shares: the sum must be in [1, {SHARE_GRID}]")
    return out


def rates(x: Any, group_size: int) -> tuple[int, ...]:
    """Members' link rates as the leader had them (KiB/s, 0: unknown): absent or empty is
    ``()``, else ``group_size`` integers in [0, MAX_RATE_KIB]."""
    if x is None or x == []:
        return ()
    if not isinstance(x, list) or len(x) != group_size:
        raise ProtocolError(f"rates: expected a list of {group_size} integers")
    return tuple(_int(v, "rate", 0, MAX_RATE_KIB) for v in x)


def _map(value: Any, what: str) -> dict:
    if not isinstance(value, dict) or len(value) > MAX_RECORD_KEYS:
        raise ProtocolError(f"{what}: expected a map of at most {MAX_RECORD_KEYS} fields")
    return value


def _bool(x: Any, what: str) -> bool:
    if type(x) is not bool:
        raise ProtocolError(f"{what}: expected a boolean")
    return x
