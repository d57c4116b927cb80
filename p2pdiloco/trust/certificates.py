"""Private swarms: the swarm key pair, membership certificates and the revocation list.

A private swarm is an Ed25519 key pair (``p2pdiloco swarm init``). Its owner admits a node
offline by signing a certificate for the node's public key with an expiry
(``p2pdiloco swarm admit PUBLIC_KEY``) and may revoke members with a signed list
(``p2pdiloco swarm revoke``), handed out as a file or published in the DHT, where members
pick it up while they run (:mod:`p2pdiloco.net.state.revocation`, :meth:`Membership.adopt_revocations`).
Members present their certificate with every DHT record and RPC; a member accepts a peer
only when :meth:`Membership.check` passes. The owner's private key never has to be online.

Byte layouts (msgpack as in :mod:`p2pdiloco.trust.signing`; keys are raw 32-byte Ed25519
public keys; times are integer Unix seconds, UTC):

* certificate = msgpack([1, swarm key, member key, issued, expires, signature]); the signature
  is the swarm key's over ``signing.message("cert", [swarm key, member key, issued, expires])``.
* revocation list = msgpack([1, swarm key, serial, issued, [member keys, sorted], signature]);
  signature over ``signing.message("revocations", [swarm key, serial, issued, [member keys]])``.
  A higher serial replaces a lower one.
* files: ``swarm.key`` is the swarm's private key as PKCS#8 PEM (mode 0600); ``swarm.pub``
  the public key as 64 hex digits; certificates and revocation lists are text files of
  ``#`` comment lines and one base64 line of the bytes above.

A certificate is valid for a peer at time t when it decodes, names this swarm's key and the
peer's own key (the one inlined in its peer ID), carries a valid swarm signature, has
issued - 300 s <= t < expires (5 minutes of clock skew allowed), and its member key is not
in the revocation list.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2pdiloco.trust import signing
from p2pdiloco.trust.errors import AccessDenied, CertificateError
from p2pdiloco.trust.identity import is_peer_id, peer_id_of, public_key_of
from p2pdiloco.trust.keyfiles import (decode_swarm_key, fingerprint, iso_time, parse_public_key, read_text, write_private,
                                     write_text)

__all__ = ["SwarmKey", "Certificate", "RevocationList", "Membership", "parse_public_key", "fingerprint",
           "CLOCK_SKEW", "decode_swarm_key"]

CLOCK_SKEW = 300  # seconds a certificate may be "issued in the future" (clocks differ)
_FORMAT = 1


@dataclass(frozen=True, eq=False)
class SwarmKey:
    """The private key of a private swarm (only its owner holds it)."""

    private_key: Ed25519PrivateKey
    public_key: bytes

    @classmethod
    def generate(cls) -> SwarmKey:
        key = Ed25519PrivateKey.generate()
        return cls(key, key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))

    def save(self, folder: Path) -> tuple[Path, Path]:
        """Write ``swarm.key`` (PKCS#8 PEM, 0600, never overwritten) and ``swarm.pub`` (hex).

        Raises:
            CertificateError: ``swarm.key`` exists already (reason ``exists``) or cannot be written.
        """
        key_path, pub_path = Path(folder) / "swarm.key", Path(folder) / "swarm.pub"
        pem = self.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption())
        try:
            write_private(key_path, pem)
        except FileExistsError:
            raise CertificateError(f"{key_path} exists already; a new swarm key would lock out every member "
                                   "admitted with it (remove it yourself if that is what you want)", "exists") from None
        except OSError as e:
            raise CertificateError(f"cannot write {key_path}: {e.strerror or e}", "malformed") from None
        pub_path.write_text(self.public_key.hex() + "\n")
        return key_path, pub_path

    @classmethod
    def load(cls, path: Path) -> SwarmKey:
        """Raises CertificateError when the file is missing, unreadable or not an Ed25519 key."""
        data = b""
        try:
            data = Path(path).read_bytes()
            key = serialization.load_pem_private_key(data, password=None)
        except FileNotFoundError:
            raise CertificateError(f"swarm key {path} does not exist (create one with `p2pdiloco swarm init`)",
                                   "missing") from None
        except (OSError, ValueError, TypeError) as e:
            if b"PRIVATE KEY" not in data and len(data.strip()) == 64:  # the hex of a public key
                raise CertificateError(f"swarm key {path} is the swarm's public key; signing needs the private "
                                       "key (swarm.key, written by `p2pdiloco swarm init`)", "malformed") from None
            raise CertificateError(f"swarm key {path} cannot be read: {e}", "malformed") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise CertificateError(f"swarm key {path} is not an Ed25519 key", "malformed")
        return cls(key, key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))

    def sign(self, purpose: str, fields: list) -> bytes:
        return self.private_key.sign(signing.message(purpose, fields))

    def admit(self, member: bytes, *, valid_for: float, now: float | None = None) -> Certificate:
        """A certificate for ``member`` (raw public key) valid ``valid_for`` seconds from ``now``."""
        issued = int(time.time() if now is None else now)
        expires = issued + int(valid_for)
        body = [self.public_key, bytes(member), issued, expires]
        return Certificate(self.public_key, bytes(member), issued, expires, self.sign("cert", body))

    def revoke(self, members: Iterable[bytes], previous: RevocationList | None = None,
               now: float | None = None) -> RevocationList:
        """A revocation list holding ``previous``'s members and ``members``, serial + 1."""
        revoked = sorted({*(previous.revoked if previous else ()), *(bytes(m) for m in members)})
        serial = (previous.serial if previous else 0) + 1
        issued = int(time.time() if now is None else now)
        sig = self.sign("revocations", [self.public_key, serial, issued, revoked])
        return RevocationList(self.public_key, serial, issued, frozenset(revoked), sig)


@dataclass(frozen=True)
class Certificate:
    """A swarm's signed statement that ``member`` belongs to it until ``expires``."""

    swarm: bytes
    member: bytes
    issued: int
    expires: int
    signature: bytes

    def encode(self) -> bytes:
        return msgpack.packb([_FORMAT, self.swarm, self.member, self.issued, self.expires, self.signature],
                             use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Certificate:
        """Raises CertificateError (``malformed``) on anything but the layout above."""
        try:
            fmt, swarm, member, issued, expires, sig = msgpack.unpackb(data, raw=False)
            ok = (fmt == _FORMAT and all(isinstance(b, bytes) for b in (swarm, member, sig))
                  and len(swarm) == 32 and len(member) == 32 and type(issued) is int and type(expires) is int)
        except Exception:  # msgpack raises several unrelated types; unpacking a wrong shape too
            ok = False
        if not ok:
            raise CertificateError("malformed membership certificate", "malformed")
        return cls(swarm, member, issued, expires, sig)

    @property
    def member_peer_id(self) -> str:
        return peer_id_of(self.member)

    def verify(self, swarm: bytes, member: bytes, *, now: float | None = None,
               revocations: RevocationList | None = None) -> None:
        """Check this certificate for ``member`` in ``swarm`` at ``now`` (see the module docstring).

        Raises:
            CertificateError: with ``reason`` one of wrong_swarm, wrong_member, bad_signature,
                not_yet_valid, expired, revoked; the message says which and what to do.
        """
        now = time.time() if now is None else now
        who = peer_id_of(member)[-8:]
        if self.swarm != swarm:
            raise CertificateError(f"the certificate of {who} is for swarm {fingerprint(self.swarm)}, "
                                   f"not this swarm {fingerprint(swarm)}", "wrong_swarm")
        if self.member != member:
            raise CertificateError(f"the certificate presented by {who} was issued to another key "
                                   f"({peer_id_of(self.member)[-8:]})", "wrong_member")
        body = [self.swarm, self.member, self.issued, self.expires]
        if not signing.verify(swarm, "cert", body, self.signature):
            raise CertificateError(f"the certificate of {who} does not carry a valid signature of swarm "
                                   f"{fingerprint(swarm)}", "bad_signature")
        if now + CLOCK_SKEW < self.issued:
            raise CertificateError(f"the certificate of {who} is not valid before {iso_time(self.issued)}",
                                   "not_yet_valid")
        if now >= self.expires:
            raise CertificateError(f"the certificate of {who} expired at {iso_time(self.expires)}; the swarm owner "
                                   f"renews it with `p2pdiloco swarm admit {peer_id_of(member)}`", "expired")
        if revocations is not None and self.member in revocations.revoked:
            raise CertificateError(f"the certificate of {who} was revoked (revocation list #{revocations.serial})",
                                   "revoked")

    def save(self, path: Path) -> None:
        write_text(Path(path), [f"p2pdiloco membership certificate for {self.member_peer_id}",
                                 f"swarm {fingerprint(self.swarm)} ({self.swarm.hex()})",
                                 f"valid {iso_time(self.issued)} to {iso_time(self.expires)}"], self.encode())

    @classmethod
    def load(cls, path: Path) -> Certificate:
        return cls.decode(read_text(Path(path), "certificate"))


@dataclass(frozen=True)
class RevocationList:
    """The swarm's signed list of revoked member keys."""

    swarm: bytes
    serial: int
    issued: int
    revoked: frozenset[bytes]
    signature: bytes

    def encode(self) -> bytes:
        return msgpack.packb([_FORMAT, self.swarm, self.serial, self.issued, sorted(self.revoked), self.signature],
                             use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes, swarm: bytes) -> RevocationList:
        """Decode and verify against ``swarm``.

        Raises:
            CertificateError: malformed, another swarm's, or not signed by ``swarm``.
        """
        try:
            fmt, sw, serial, issued, revoked, sig = msgpack.unpackb(data, raw=False)
            ok = (fmt == _FORMAT and isinstance(sw, bytes) and type(serial) is int and type(issued) is int
                  and isinstance(revoked, list) and all(isinstance(m, bytes) and len(m) == 32 for m in revoked)
                  and isinstance(sig, bytes))
        except Exception:
            ok = False
        if not ok:
            raise CertificateError("malformed revocation list", "malformed")
        if sw != swarm:
            raise CertificateError(f"the revocation list is for swarm {fingerprint(sw)}, not {fingerprint(swarm)}",
                                   "wrong_swarm")
        if not signing.verify(swarm, "revocations", [sw, serial, issued, list(revoked)], sig):
            raise CertificateError("the revocation list is not signed by the swarm key", "bad_signature")
        return cls(sw, serial, issued, frozenset(revoked), sig)

    def save(self, path: Path) -> None:
        write_text(Path(path), [f"p2pdiloco revocation list #{self.serial} of swarm {fingerprint(self.swarm)}",
                                 f"issued {iso_time(self.issued)}; {len(self.revoked)} revoked:",
                                 *(peer_id_of(m) for m in sorted(self.revoked))], self.encode())

    @classmethod
    def load(cls, path: Path, swarm: bytes) -> RevocationList:
        return cls.decode(read_text(Path(path), "revocation list"), swarm)


@dataclass
class Membership:
    """Who may talk to this node: everyone (public swarm, ``swarm`` None) or the holders of a
    valid certificate of ``swarm`` (private swarm).

    Attributes:
        swarm: the swarm's public key, or None for a public swarm.
        certificate: this node's own certificate (sent with every record and request).
        revocations: the swarm's revocation list, if any; replaced by a newer one with
            :meth:`adopt_revocations` while the node runs.
    """

    swarm: bytes | None = None
    certificate: Certificate | None = None
    revocations: RevocationList | None = None
    _verified: dict[str, tuple[bytes, int]] = field(default_factory=dict, repr=False)

    @property
    def private(self) -> bool:
        return self.swarm is not None

    @property
    def name(self) -> str:
        return f"private swarm {fingerprint(self.swarm)}" if self.swarm else "public swarm"

    @property
    def own_certificate(self) -> bytes | None:
        """The encoded certificate to attach to records and requests (None in a public swarm)."""
        return self.certificate.encode() if self.private and self.certificate else None

    def check_own(self, peer_id: str, now: float | None = None) -> None:
        """Raise CertificateError unless this node's own certificate admits ``peer_id``."""
        if not self.private:
            return
        if self.certificate is None:
            raise CertificateError(f"this node is not a member of {self.name}: no membership certificate. "
                                   f"Ask the swarm owner to run `p2pdiloco swarm admit {peer_id}` and put the "
                                   "certificate at trust.certificate", "missing")
        self.certificate.verify(self.swarm, public_key_of(peer_id), now=now, revocations=self.revocations)

    def adopt_revocations(self, revocations: RevocationList) -> bool:
        """Replace the held revocation list with ``revocations`` when its serial is higher.

        From then on :meth:`check` and :meth:`check_own` refuse the revoked members: the cache
        of verified certificates is cleared, so a peer admitted before is checked again at its
        next record or request. Lists of another swarm, lists whose swarm signature does not
        verify, lists with the same or a lower serial and public swarms are not adopted.

        Returns:
            True when the list was adopted, False when it was ignored (never raises).
        """
        if not self.private or revocations.swarm != self.swarm:
            return False
        if self.revocations is not None and revocations.serial <= self.revocations.serial:
            return False
        try:
            body = [revocations.swarm, revocations.serial, revocations.issued, sorted(revocations.revoked)]
            if not signing.verify(self.swarm, "revocations", body, revocations.signature):
                return False
        except Exception:  # noqa: BLE001 - a hand-built list of the wrong types: not adopted
            return False
        self.revocations = revocations
        self._verified.clear()
        return True

    def revokes(self, public_key: bytes) -> bool:
        """Whether the held revocation list names ``public_key`` (raw 32 bytes)."""
        return self.revocations is not None and bytes(public_key) in self.revocations.revoked

    def check(self, peer_id: str, certificate: bytes | None, now: float | None = None) -> None:
        """Admit ``peer_id`` presenting ``certificate`` (encoded), or raise.

        Raises:
            AccessDenied: private swarm and no valid certificate for this peer; the message
                names the swarm and the reason, for the refused peer to read.
        """
        if not self.private:
            return
        now = time.time() if now is None else now
        cached = self._verified.get(peer_id)
        if cached is not None and certificate is not None and cached[0] == certificate and now < cached[1]:
            return
        try:
            if not is_peer_id(peer_id):
                raise CertificateError(f"{peer_id[-8:]} is not an Ed25519 peer ID", "malformed")
            if not certificate:
                raise CertificateError(f"{peer_id[-8:]} presented no membership certificate", "missing")
            if not isinstance(certificate, bytes) or len(certificate) > 4096:
                raise CertificateError(f"{peer_id[-8:]} presented a certificate that is not a short byte string",
                                       "malformed")
            cert = Certificate.decode(certificate)
            cert.verify(self.swarm, public_key_of(peer_id), now=now, revocations=self.revocations)
        except CertificateError as e:
            raise AccessDenied(f"not a member of {self.name}: {e}", e.reason) from None
        if len(self._verified) > 4096:
            self._verified.clear()
        self._verified[peer_id] = (bytes(certificate), cert.expires)
