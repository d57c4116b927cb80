"""Signed DHT records: the envelope every record of this project is stored in, and the
validator that hivemind runs on every record stored at or returned to this node.

Wraps hivemind's public ``RecordValidatorBase`` (``hivemind.dht.validation``); used by
:class:`p2pdiloco.net.transport.Swarm`. Layout and rules: :class:`SignedRecords`, and
docs/trust.md ("Signed records").
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import msgpack
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from p2pdiloco.trust import signing
from p2pdiloco.trust.certificates import Membership
from p2pdiloco.trust.errors import AccessDenied
from p2pdiloco.trust.identity import Identity, is_peer_id

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 64 << 10  # bytes: largest signed DHT record value accepted (heads records are ~1 kB)
_ENVELOPE_FORMAT = 1


class SignedRecords(RecordValidatorBase):
    """Signs every DHT record this node stores and rejects records that fail the checks.

    A record's stored value is the envelope
    ``msgpack([1, author peer ID (str), value (bin), signature (bin, 64), certificate (bin or nil)])``
    where ``value`` is what the application stored (hivemind's msgpack) and ``signature`` is
    the author's over ``signing.message("dht.record", [key id, subkey bytes, value,
    expiration time])``: the DHT key (hashed to its 20-byte id), the subkey and the expiry are
    all covered, so a record cannot be moved to another key, subkey or lifetime.

    :meth:`validate` (run by hivemind when another peer asks us to store a record and on
    every record a peer returns to our lookups) accepts a record only if the envelope
    decodes, the signature verifies with the key inlined in the author's peer ID, a subkey
    that is an Ed25519 peer ID equals the author (owner-only records: ``{run}/heads``,
    matchmaking declarations), and, in a private swarm, the certificate admits the author.
    Rejections are counted in :attr:`rejected` by reason. hivemind drops a whole
    dictionary value when one of its entries fails, so a forged entry never reaches the
    application.
    """

    def __init__(self, identity: Identity, membership: Membership):
        self.identity, self.membership = identity, membership
        self.rejected: Counter[str] = Counter()
        self.seconds = 0.0  # CPU time spent signing and validating records
        self.signed = self.validated = 0
        self._valid: dict[tuple, float] = {}  # records that passed: until when to trust that (60 s at most)

    @staticmethod
    def _fields(record: DHTRecord, value: bytes) -> list[Any]:
        return [record.key, record.subkey, value, float(record.expiration_time)]

    def sign_value(self, record: DHTRecord) -> bytes:
        t0 = time.perf_counter()
        sig = signing.sign(self.identity, "dht.record", self._fields(record, record.value))
        envelope = [_ENVELOPE_FORMAT, self.identity.peer_id, record.value, sig, self.membership.own_certificate]
        self.signed += 1
        self.seconds += time.perf_counter() - t0
        return msgpack.packb(envelope, use_bin_type=True)

    @staticmethod
    def _open(value: bytes) -> tuple[str, bytes, bytes, bytes | None] | None:
        try:
            fmt, author, inner, sig, cert = msgpack.unpackb(value, raw=False)
        except Exception:  # not an envelope (unsigned or foreign record)
            return None
        if fmt != _ENVELOPE_FORMAT or not isinstance(author, str) or not isinstance(inner, bytes) \
                or not isinstance(sig, bytes) or not (cert is None or isinstance(cert, bytes)):
            return None
        return author, inner, sig, cert

    def validate(self, record: DHTRecord) -> bool:
        t0 = time.perf_counter()
        try:
            fingerprint = (record.key, record.subkey, record.value, record.expiration_time)
            valid_until = self._valid.get(fingerprint)
            if valid_until is not None and time.time() < valid_until:
                return True  # the same bytes passed before (lookups return each record many times)
            ok = self._validate(record)
            if ok:
                if len(self._valid) >= 8192:
                    self._valid.clear()
                self._valid[fingerprint] = min(time.time() + 60.0, float(record.expiration_time) + 60.0)
            return ok
        finally:
            self.validated += 1
            self.seconds += time.perf_counter() - t0

    def _validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_RECORD_BYTES or len(record.subkey or b"") > 256:
            return self._reject("oversize", record)
        opened = self._open(record.value)
        if opened is None:
            return self._reject("unsigned", record)
        author, inner, sig, cert = opened
        if not signing.verify_by_peer(author, "dht.record", self._fields(record, inner), sig):
            return self._reject("bad_signature", record, author)
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False) if record.subkey else None
        except Exception:
            subkey = None
        if is_peer_id(subkey) and subkey != author:
            return self._reject("not_owner", record, author)
        try:
            self.membership.check(author, cert)
        except AccessDenied as e:
            return self._reject(e.reason, record, author)
        return True

    def _reject(self, reason: str, record: DHTRecord, author: str = "?") -> bool:
        self.rejected[reason] += 1
        log.debug("rejected DHT record from %s: %s (subkey %r)", author[-8:], reason, record.subkey[:60])
        return False

    def strip_value(self, record: DHTRecord) -> bytes:
        opened = self._open(record.value)
        return opened[1] if opened is not None else record.value

    @property
    def priority(self) -> int:
        return 10  # outermost: validated before anything else looks at the value
