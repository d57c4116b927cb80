"""A node's identity: one Ed25519 key pair that is also its libp2p identity.

The key pair is created with ``cryptography`` on first start and kept in the node's data
directory (default ``{data_dir}/p2p.key``), created with mode 0600 and refused when group or
others can read it. The file holds libp2p's protobuf ``PrivateKey`` message, which the
libp2p daemon (p2pd) reads directly, so the node's peer ID *is* its public key:

    file   = 08 01 12 40 || seed (32 bytes) || public key (32 bytes)      (68 bytes)
    peer ID = base58(00 24 || 08 01 12 20 || public key)                   ("12D3KooW...")

(libp2p peer-ID spec: an Ed25519 public key is short enough to be inlined with the
"identity" multihash, code 0x00, length 0x24; https://github.com/libp2p/specs/blob/master/peer-ids/peer-ids.md).
Every verifier recovers the public key from the authenticated peer ID alone, so a signature
binds to exactly one peer ID and a peer ID to exactly one key: neither can stand in for the
other, and no extra binding record is needed.

Domain separation: everything p2pdiloco signs starts with ``p2pdiloco/v1/<purpose>\\0``
(:mod:`p2pdiloco.trust.signing`); libp2p's own signatures with the same key start with its own
context strings ("libp2p-tls-handshake:", "noise-libp2p-static-key:"), so a signature made in
one context never verifies in the other.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2pdiloco.trust.errors import IdentityError

__all__ = ["Identity", "peer_id_of", "public_key_of", "is_peer_id", "is_small_order", "verify_raw", "b58encode",
           "b58decode"]

_LIBP2P_PRIVATE_PREFIX = bytes([0x08, 0x01, 0x12, 0x40])  # PrivateKey{Type: Ed25519, Data: 64 bytes}
_LIBP2P_PUBLIC_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])  # PublicKey{Type: Ed25519, Data: 32 bytes}
_IDENTITY_MULTIHASH = bytes([0x00, 0x24])  # identity hash function, 36 bytes of digest
# The encodings of Ed25519's 8 points of small order (and the non-canonical ones of 0 and 1),
# with the x-sign bit (bit 255) cleared: libsodium's blocklist (ge25519_has_small_order). A
# signature of such a "key" verifies over any message for one of a few R, S = 0 (OpenSSL's
# cofactorless check accepts them: tests/test_trust.py), so it proves nothing.
_SMALL_ORDER = frozenset(bytes.fromhex(h) for h in (
    "00" * 32,  # y = 0: order 4
    "01" + "00" * 31,  # y = 1: the identity
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",  # order 8
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",  # order 8
    "ec" + "ff" * 30 + "7f",  # y = p - 1: order 2
    "ed" + "ff" * 30 + "7f",  # y = p (0, not canonical)
    "ee" + "ff" * 30 + "7f"))  # y = p + 1 (1, not canonical)
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}


def b58encode(data: bytes) -> str:
    """Bitcoin base58 (the alphabet libp2p peer IDs use)."""
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def b58decode(text: str) -> bytes:
    """Inverse of :func:`b58encode`; ValueError on a character outside the alphabet."""
    n = 0
    for c in text:
        try:
            n = n * 58 + _B58_INDEX[c]
        except KeyError:
            raise ValueError(f"not base58: {c!r}") from None
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * (len(text) - len(text.lstrip("1"))) + body


def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer ID (base58 string) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    return b58encode(_IDENTITY_MULTIHASH + _LIBP2P_PUBLIC_PREFIX + public_key)


@functools.lru_cache(maxsize=4096)
def public_key_of(peer_id: str) -> bytes:
    """The raw 32-byte Ed25519 public key inlined in ``peer_id``.

    Raises:
        ValueError: ``peer_id`` is not the peer ID of an Ed25519 key (for example an RSA
            peer ID "Qm...", which holds only a hash of its key).
    """
    raw = b58decode(peer_id) if isinstance(peer_id, str) else b""
    head = _IDENTITY_MULTIHASH + _LIBP2P_PUBLIC_PREFIX
    if len(raw) != len(head) + 32 or not raw.startswith(head):
        raise ValueError(f"{str(peer_id)[:60]!r} is not the peer ID of an Ed25519 key")
    return raw[len(head):]


def is_peer_id(text: object) -> bool:
    """True when ``text`` is a string that is the peer ID of an Ed25519 key."""
    if not isinstance(text, str) or not 40 <= len(text) <= 60:
        return False
    try:
        public_key_of(text)
    except ValueError:
        return False
    return True


def is_small_order(public_key: bytes) -> bool:
    """True when the 32 bytes ``public_key`` encode a point of small order (``_SMALL_ORDER``):
    a key whose signatures anyone can make."""
    return len(public_key) == 32 and bytes(public_key[:31]) + bytes([public_key[31] & 0x7F]) in _SMALL_ORDER


def verify_raw(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Ed25519 verification of ``signature`` over ``message``; False on any malformed input
    and for a key of small order (:func:`is_small_order`: its signatures prove nothing)."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != 64 or len(public_key) != 32 \
            or is_small_order(public_key):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True, eq=False)
class Identity:
    """An Ed25519 key pair and the peer ID it gives (see the module docstring).

    Attributes:
        public_key: raw 32-byte public key.
        peer_id: the libp2p peer ID (base58), a function of ``public_key``.
        path: the file it was loaded from or written to (None for a key only in memory).
        created: True when :meth:`load_or_create` wrote the file just now (nobody else can be
            using it yet).
    """

    private_key: Ed25519PrivateKey
    public_key: bytes
    peer_id: str
    path: Path | None = None
    created: bool = False

    @classmethod
    def generate(cls, path: Path | None = None) -> Identity:
        key = Ed25519PrivateKey.generate()
        pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(key, pub, peer_id_of(pub), path)

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a 32-byte Ed25519 seed (RFC 8032 private key): the same seed gives
        the same peer ID, for reproducible protocol tests and benchmarks. Raises ValueError
        when ``seed`` is not 32 bytes."""
        if len(seed) != 32:
            raise ValueError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        key = Ed25519PrivateKey.from_private_bytes(bytes(seed))
        pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(key, pub, peer_id_of(pub))

    @classmethod
    def from_libp2p_bytes(cls, data: bytes, path: Path | None = None) -> Identity:
        """Parse the 68-byte libp2p protobuf form. Raises IdentityError on anything else."""
        where = f"identity file {path}" if path else "identity"
        if len(data) != 68 or not data.startswith(_LIBP2P_PRIVATE_PREFIX):
            if data[:2] == bytes([0x08, 0x00]):  # PrivateKey{Type: RSA, ...}
                raise IdentityError(f"{where} holds an RSA key written by an older version of p2pdiloco; "
                                    "identities are Ed25519 now: delete the file to create a new one "
                                    "(the node gets a new peer ID)")
            raise IdentityError(f"{where} is not an Ed25519 libp2p private key (68 bytes, 08 01 12 40 ...)")
        seed, pub = data[4:36], data[36:]
        key = Ed25519PrivateKey.from_private_bytes(seed)
        derived = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        if derived != pub:
            raise IdentityError(f"{where} is corrupt: its public key does not match its private key")
        return cls(key, pub, peer_id_of(pub), path)

    def to_libp2p_bytes(self) -> bytes:
        seed = self.private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                              serialization.NoEncryption())
        return _LIBP2P_PRIVATE_PREFIX + seed + self.public_key

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        """Load an identity file.

        Raises:
            IdentityError: missing, unreadable, readable by group or others, or not an
                Ed25519 libp2p key.
        """
        path = Path(path)
        try:
            st = path.stat()
            data = path.read_bytes()
        except FileNotFoundError:
            raise IdentityError(f"identity file {path} does not exist") from None
        except OSError as e:
            raise IdentityError(f"identity file {path} cannot be read: {e.strerror or e}") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(f"identity file {path} is accessible by other users (mode "
                                f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`")
        return cls.from_libp2p_bytes(data, path)

    @classmethod
    def load_or_create(cls, path: str | Path) -> tuple[Identity, bool]:
        """Load ``path``, or create a new key pair there (mode 0600, parent folders created).

        Returns:
            (identity, created): created is True when the file was written now.
        Raises:
            IdentityError: as :meth:`load`, or the file cannot be written.
        """
        path = Path(path)
        if path.exists():
            return cls.load(path), False
        ident = dataclasses.replace(cls.generate(path), created=True)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            ident.write(path)
        except FileExistsError:  # another process created it meanwhile: use theirs
            return cls.load(path), False
        except OSError as e:
            raise IdentityError(f"cannot write identity file {path}: {e.strerror or e}") from None
        return ident, True

    def write(self, path: str | Path) -> None:
        """Write the key to a new file with mode 0600 (O_EXCL: never overwrites)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, self.to_libp2p_bytes())
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_temporary(self) -> Path:
        """Write the key to a fresh private temporary file (0600) and return its path; the
        caller deletes it (used to hand an in-memory identity to p2pd, which reads a file)."""
        folder = tempfile.mkdtemp(prefix="p2pdiloco-id-")
        path = Path(folder) / "p2p.key"
        self.write(path)
        return path

    def sign_raw(self, message: bytes) -> bytes:
        """Ed25519 signature (64 bytes) over ``message``. Use :mod:`p2pdiloco.trust.signing`,
        which adds the domain prefix, rather than this."""
        return self.private_key.sign(message)
