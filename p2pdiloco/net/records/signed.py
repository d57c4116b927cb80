"""Signed DHT records: the envelope every record of this project is stored in, and the
validator that hivemind runs on every record stored at or returned to this node.

Wraps hivemind's public ``RecordValidatorBase`` (``hivemind.dht.validation``); used by
:class:`p2pdiloco.net.transport.swarm.Swarm`. Layout and rules: :class:`SignedRecords`, and
docs/trust.md ("Signed records").
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import msgpack
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from p2pdiloco.trust import signing
from p2pdiloco.trust.certificates import Membership
from p2pdiloco.trust.errors import AccessDenied
from p2pdiloco.trust.identity import Identity, is_peer_id

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 64 << 10  # bytes: largest signed DHT record value accepted (heads records are ~1 kB)
MAX_LOOKUP_ENTRIES = 4096  # distinct entries one lookup examines; more are dropped as ``too_many``
_ENVELOPE_FORMAT = 1
_NIL = msgpack.packb(None)
_READING: ContextVar[Lookup | None] = ContextVar("p2pdiloco_dht_lookup", default=None)


class Lookup:
    """The per-entry filter of one DHT lookup: every entry of every answer is validated on
    its own, a bad one is dropped and counted, and of the valid entries under one subkey the
    one that expires last is kept (hivemind's own merge rule, applied after validation, so a
    forged entry with a later expiry cannot displace a valid one).

    Args:
        records: the node's :class:`SignedRecords` (checks and counters).
        key_id: the lookup's DHT key id (hivemind ``DHTID.to_bytes()``, 20 bytes).
        now: the time (hivemind's DHT time, Unix seconds) before which entries have expired.

    Attributes:
        kept: subkey bytes (msgpack) -> (inner value bytes, expiration time), the valid entries.
        dropped: entries dropped, by reason (``SignedRecords`` reasons, ``malformed`` for an
            inner value or subkey that does not decode, ``no_subkey`` for a plain value (no
            subkey: hivemind would let it replace the whole dictionary), ``too_many``).
        open: False once the lookup returned (the validator then checks strictly again).
    """

    def __init__(self, records: SignedRecords, key_id: bytes, now: float):
        self.records, self.key_id, self.now = records, key_id, now
        self.kept: dict[bytes, tuple[bytes, float]] = {}
        self.dropped: Counter[str] = Counter()
        self.open = True
        self._seen: set[tuple[bytes, bytes, float]] = set()

    def offer(self, record: DHTRecord) -> None:
        """Examine one entry (as stored: the signed envelope); never raises."""
        expiry = float(record.expiration_time)
        fingerprint = (bytes(record.subkey), bytes(record.value), expiry)
        if expiry < self.now or fingerprint in self._seen:  # expired, or returned by another peer too
            return
        if len(self._seen) >= MAX_LOOKUP_ENTRIES:
            self._drop("too_many")
            return
        self._seen.add(fingerprint)
        if fingerprint[0] == _NIL:  # a plain value (hivemind's subkey nil): this project stores none
            self._drop("no_subkey")
            return
        reason = self.records.verdict(record)
        if reason is not None:
            self._drop(reason)
            return
        inner = self.records.open_value(record.value)
        best = self.kept.get(fingerprint[0])
        if best is None or expiry > best[1]:
            self.kept[fingerprint[0]] = (inner, expiry)

    def _drop(self, reason: str) -> None:
        self.dropped[reason] += 1
        self.records.read_dropped[reason] += 1

    def values(self) -> dict[Any, Any]:
        """{subkey: value}, both decoded with hivemind's serializer (the one that encoded
        them); an entry whose subkey or value does not decode is dropped as ``malformed``."""
        out: dict[Any, Any] = {}
        for subkey, (inner, _) in self.kept.items():
            try:
                out[MSGPackSerializer.loads(subkey)] = MSGPackSerializer.loads(inner)
            except Exception:  # signed by its author, still hostile bytes; also an unhashable subkey
                self._drop("malformed")
        return out


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
    Rejections are counted in :attr:`rejected` by reason.

    Lookups are validated per entry (:meth:`lookup`, :class:`Lookup`): hivemind's own
    lookup drops a peer's whole dictionary answer when one entry fails ``validate``, so one
    bad entry stored beside valid ones (by a peer that does not validate, such as a bootstrap
    peer without the swarm key, or by the hostile peer's own node) would hide them all. Inside
    :meth:`lookup` ``validate`` accepts every entry of that key and hands it to the
    lookup's filter instead; everywhere else (stores from peers, other keys) it checks
    strictly. Entries dropped from lookups are counted in :attr:`read_dropped` by reason.
    """

    def __init__(self, identity: Identity, membership: Membership):
        self.identity, self.membership = identity, membership
        self.rejected: Counter[str] = Counter()
        self.read_dropped: Counter[str] = Counter()  # entries dropped from lookups (also in rejected)
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

    @contextlib.contextmanager
    def lookup(self, key_id: bytes, now: float) -> Iterator[Lookup]:
        """Validate per entry the records of ``key_id`` that hivemind hands to this validator
        from the calling task and the tasks it starts (a ``contextvars`` scope: hivemind's
        lookup runs in tasks created inside it; stores from peers are served by tasks created
        at the daemon's start and stay strict) until the block ends. Yields the
        :class:`Lookup` that collects the valid entries; hivemind's own merged result is then
        meaningless (every entry passed, and :meth:`strip_value` gives nil) and must be ignored."""
        entries = Lookup(self, bytes(key_id), now)
        token = _READING.set(entries)
        try:
            yield entries
        finally:
            entries.open = False
            _READING.reset(token)

    @staticmethod
    def _lookup_of(record: DHTRecord) -> Lookup | None:
        entries = _READING.get()
        return entries if entries is not None and entries.open and record.key == entries.key_id else None

    def validate(self, record: DHTRecord) -> bool:
        entries = self._lookup_of(record)
        if entries is not None:
            entries.offer(record)  # kept or dropped there, one entry at a time
            return True
        return self.verdict(record) is None

    def verdict(self, record: DHTRecord) -> str | None:
        """None when ``record`` (as stored: the signed envelope) passes every check, else the
        reason it fails (counted in :attr:`rejected`); never raises."""
        t0 = time.perf_counter()
        try:
            fingerprint = (record.key, record.subkey, record.value, record.expiration_time)
            valid_until = self._valid.get(fingerprint)
            if valid_until is not None and time.time() < valid_until:
                return None  # the same bytes passed before (lookups return each record many times)
            reason = self._check(record)
            if reason is None:
                if len(self._valid) >= 8192:
                    self._valid.clear()
                self._valid[fingerprint] = min(time.time() + 60.0, float(record.expiration_time) + 60.0)
            return reason
        except Exception:  # noqa: BLE001 - a record of the wrong types (hostile): fails, never raises
            return self._reject("malformed", record)
        finally:
            self.validated += 1
            self.seconds += time.perf_counter() - t0

    def _check(self, record: DHTRecord) -> str | None:
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
        return None

    def _reject(self, reason: str, record: DHTRecord, author: str = "?") -> str:
        self.rejected[reason] += 1
        log.debug("rejected DHT record from %s: %s (subkey %r)", author[-8:], reason, bytes(record.subkey[:60]))
        return reason

    def strip_value(self, record: DHTRecord) -> bytes:
        if self._lookup_of(record) is not None:
            return _NIL  # hivemind's merge of unchecked entries: ignored (the Lookup holds the result)
        return self.open_value(record.value)

    def open_value(self, value: bytes) -> bytes:
        """The application's value inside an envelope (``value`` itself if it is none)."""
        opened = self._open(value)
        return opened[1] if opened is not None else value

    @property
    def priority(self) -> int:
        return 10  # outermost: validated before anything else looks at the value
