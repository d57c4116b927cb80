"""Live revocation for private swarms: the swarm's signed revocation list, spread through the DHT.

The owner publishes the list (``p2pdiloco swarm revoke ... --publish``, :func:`publish_revocations`)
under the DHT key ``p2pdiloco/revocations/{fingerprint of the swarm key}``, one entry per
subkey: ``{peer ID of the holder: encoded list (bytes)}``. Every member runs a
:class:`RevocationWatch`: every ``poll_s`` seconds it reads the key, adopts a list that is
newer (higher serial) than the one it holds, and keeps the newest list alive in the DHT by
storing it again under its own peer ID, so the list outlives its publisher (docs/trust.md,
"Live revocation").

Latency: a member adopts a published list within ``poll_s`` (default 20 s) plus one DHT
lookup (about a second on a small swarm), so within a minute with the default.

Trust: every entry read from the DHT is hostile. Only ``bytes`` values of at most
:data:`MAX_LIST_BYTES` are decoded, and a list is adopted only when the swarm key's signature
verifies (:meth:`RevocationList.decode`, :meth:`Membership.adopt_revocations`); the entry's
author does not matter, so any member may carry the list. Entries that fail are counted in
:attr:`RevocationWatch.dropped` by reason and reported through ``Swarm.drop(peer, reason)``
(reason ``revocations.{reason}``; peer ``?`` when the subkey is not a peer ID).

What adopting a list does: :class:`Membership` refuses the revoked members from then on (its
cache of verified certificates is cleared), so their DHT records are rejected by the record
validator and their RPCs refused with ``AccessDenied``; they are also banned
(``Swarm.ban``), which takes them out of matchmaking and the all-reduce. A member that finds
itself revoked sets :attr:`RevocationWatch.revoked_self` and stops re-publishing the list.

Lookups are validated per entry (``Swarm.get``, ``SignedRecords.lookup``): an entry stored by
a member before its revocation, or a non-member's, is dropped alone and the other copies in
the same answer count (docs/trust.md, "Signed records").
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2pdiloco.errors import NetworkError
from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.trust.certificates import Membership, RevocationList, SwarmKey, fingerprint
from p2pdiloco.trust.errors import CertificateError
from p2pdiloco.trust.identity import Identity, is_peer_id, peer_id_of, public_key_of

if TYPE_CHECKING:
    from p2pdiloco.net.transport.swarm import Swarm

__all__ = ["RevocationWatch", "Publication", "publish_revocations", "revocations_key", "parse_entry",
           "MAX_LIST_BYTES", "REPLICAS", "PUBLISHER_CERT_S", "PUBLISH_TTL"]

log = logging.getLogger(__name__)

MAX_LIST_BYTES = 60 << 10  # larger DHT values are dropped unread (about 1,900 revoked keys fit; the DHT itself refuses records over signed_records.MAX_RECORD_BYTES)
REPLICAS = 8  # members that keep re-storing the newest list (the others let their copy expire)
PUBLISHER_CERT_S = 600  # validity of the certificate the owner issues to its transient publisher (s)
PUBLISH_TTL = 540  # lifetime of the publisher's own entry (s): ends before its certificate does


def revocations_key(swarm_key: bytes) -> str:
    """The DHT key of a private swarm's revocation list: ``p2pdiloco/revocations/{fingerprint}``
    (the first 16 hex digits of sha256 of the raw 32-byte swarm public key)."""
    return f"p2pdiloco/revocations/{fingerprint(swarm_key)}"


def parse_entry(value: Any, swarm_key: bytes) -> RevocationList | str:
    """Decode one DHT entry of the revocations key, written by anybody.

    Returns:
        the verified list, or the reason it was dropped (a word for counting): ``not_bytes``
        (any value that is not ``bytes``), ``oversize`` (more than :data:`MAX_LIST_BYTES`),
        ``malformed``, ``wrong_swarm``, ``bad_signature``. Never raises.
    """
    if not isinstance(value, bytes):
        return "not_bytes"
    if len(value) > MAX_LIST_BYTES:
        return "oversize"
    try:
        return RevocationList.decode(value, swarm_key)
    except CertificateError as e:
        return e.reason
    except Exception:  # noqa: BLE001 - hostile bytes: nothing they make the decoder raise may escape
        return "malformed"


class RevocationWatch:
    """Keeps a member's revocation list up to date from the DHT and keeps the list there.

    Args:
        swarm: the member's :class:`~p2pdiloco.net.transport.swarm.Swarm` (``get``, ``store``,
            ``ban``, ``drop``, ``peer_id``).
        membership: the membership the swarm checks peers with (``swarm.membership``); its
            ``revocations`` is replaced by newer lists.
        poll_s: seconds between two reads of the key (> 0).
        ttl: lifetime of this member's own copy in the DHT (s); default max(60, 3 x poll_s).

    Attributes:
        revoked_self: this node's own key is in the adopted list: the other members refuse
            it from now on; the node should stop.
        adopted: lists adopted since start.
        dropped: DHT entries that were not a valid list of this swarm, by reason
            (see :func:`parse_entry`).
        polls, failures: reads done, and reads or stores that failed (``NetworkError``).

    Raises:
        ValueError: ``poll_s`` or ``ttl`` not > 0.
    """

    def __init__(self, swarm: Any, membership: Membership, *, poll_s: float = 20.0, ttl: float | None = None):
        if not poll_s > 0 or (ttl is not None and not ttl > 0):
            raise ValueError(f"poll_s and ttl must be > 0 (got {poll_s}, {ttl})")
        self.swarm, self.membership, self.poll_s = swarm, membership, float(poll_s)
        self.ttl = float(ttl) if ttl is not None else max(60.0, 3 * self.poll_s)
        self.key = revocations_key(membership.swarm) if membership.private else None
        self.revoked_self = False
        self.adopted = self.polls = self.failures = 0
        self.dropped: Counter[str] = Counter()
        self._me = public_key_of(swarm.peer_id) if is_peer_id(swarm.peer_id) else None
        if membership.revocations is not None:  # a list from the file: ban and self-check as if adopted
            self._apply(membership.revocations)

    async def run_forever(self) -> None:
        """Poll every ``poll_s`` seconds until cancelled; returns at once in a public swarm.

        Network failures are logged and counted in :attr:`failures`; the next poll retries.
        """
        if self.key is None:
            return
        while True:
            try:
                await self.poll_once()
            except NetworkError as e:
                self.failures += 1
                log.info("revocation list: %s", e)
            except Exception:  # a bug here must not end the watch (nor the node)
                self.failures += 1
                log.exception("revocation watch failed; retrying in %.0f s", self.poll_s)
            await asyncio.sleep(self.poll_s)

    async def poll_once(self) -> bool:
        """Read the key once, adopt a newer list, re-store the newest one held.

        Returns:
            True when a newer list was adopted (False in a public swarm).

        Raises:
            NetworkError: the DHT read failed (a failed re-store is only counted).
        """
        if self.key is None:
            return False
        found = await self.swarm.get(self.key)
        self.polls += 1
        adopted = self.absorb(found)
        await self._keep_alive(found)
        return adopted

    def absorb(self, found: dict[str, Any]) -> bool:
        """Adopt the newest valid list among ``found`` ({subkey: value}, as ``Swarm.get``
        returns) when it is newer than the held one; drop (count) the invalid entries.

        Returns:
            True when a list was adopted. Never raises for any content of ``found``.
        """
        if self.key is None or not isinstance(found, dict):
            return False
        held = self.membership.revocations
        held_bytes = held.encode() if held is not None else None
        best: RevocationList | None = None
        for subkey, value in found.items():
            if held_bytes is not None and value == held_bytes:
                continue  # the list we hold (most entries): verified already
            parsed = parse_entry(value, self.membership.swarm)
            if isinstance(parsed, str):
                self._drop(subkey, parsed)
            elif best is None or parsed.serial > best.serial:
                best = parsed
        if best is None or not self.membership.adopt_revocations(best):
            return False
        self.adopted += 1
        log.warning("adopted revocation list #%d of %s: %d member(s) revoked", best.serial, self.membership.name,
                    len(best.revoked))
        self._apply(best)
        return True

    def _apply(self, revocations: RevocationList) -> None:
        records = getattr(self.swarm, "records", None)
        validated = getattr(records, "_valid", None)  # SignedRecords' 60 s cache of records that passed
        if isinstance(validated, dict):
            validated.clear()
        reason = f"revoked by the swarm owner (revocation list #{revocations.serial})"
        for key in sorted(revocations.revoked):
            if key == self._me:
                if not self.revoked_self:
                    log.error("this node's certificate was revoked by the owner of %s (revocation list #%d): "
                              "the other members refuse it from now on", self.membership.name, revocations.serial)
                self.revoked_self = True
            else:
                self.swarm.ban(peer_id_of(key), reason)

    def _drop(self, subkey: Any, reason: str) -> None:
        self.dropped[reason] += 1
        peer = subkey if is_peer_id(subkey) else "?"  # a peer-ID subkey is its author's (record validator)
        log.debug("dropped revocation entry under %r: %s", str(subkey)[:60], reason)
        self.swarm.drop(peer, f"revocations.{reason}")  # Swarm.dropped / drop_reasons; never raises

    async def _keep_alive(self, found: dict[str, Any]) -> None:
        """Store the held list under our peer ID, unless :data:`REPLICAS` members with lower
        peer IDs keep it already (so the number of copies stays bounded) or we are revoked."""
        held = self.membership.revocations
        if held is None or self.revoked_self:
            return
        data = held.encode()
        me = self.swarm.peer_id
        holders = sorted(str(s) for s, v in found.items() if v == data and is_peer_id(s))
        if me not in holders and len(holders) >= REPLICAS:
            return
        if me in holders and holders.index(me) >= REPLICAS:
            return  # enough copies from others: let ours expire
        try:
            await self.swarm.store(self.key, me, data, self.ttl)
        except NetworkError as e:
            self.failures += 1
            log.info("could not re-store revocation list #%d: %s", held.serial, e)


@dataclass(frozen=True)
class Publication:
    """What :func:`publish_revocations` did.

    Attributes:
        key: the DHT key.
        publisher: the transient peer ID that stored the list (its entry lives ``PUBLISH_TTL`` s).
        holders: members (peer IDs) that held a copy of this list, or a newer one, when it returned.
        seconds: from the transient peer's start to the result (s; its shutdown not included).
    """

    key: str
    publisher: str
    holders: tuple[str, ...]
    seconds: float


async def publish_revocations(revocations: RevocationList, swarm_key: SwarmKey, initial_peers: Sequence[str], *,
                              wait: float = 60.0, ttl: float = PUBLISH_TTL) -> Publication:
    """Publish ``revocations`` in the private swarm reached through ``initial_peers``.

    Starts a transient peer with a fresh identity and a certificate the owner issues to it with
    ``swarm_key`` (valid :data:`PUBLISHER_CERT_S` s, so the members' record validator accepts
    its record), stores the encoded list under its own peer ID for ``ttl`` seconds (less where
    its entry would otherwise outlive its certificate in the DHT), waits until a
    lookup returns it and then until a member holds a copy (a member's watch re-stores it within
    its poll interval) or ``wait`` seconds passed, and shuts the peer down (always).

    Raises:
        CertificateError: the list is not signed by ``swarm_key``, or larger than
            :data:`MAX_LIST_BYTES` (members would drop it).
        NetworkError: the peer did not start or reach ``initial_peers``, or no lookup returned
            the list within ``wait`` seconds.
        ValueError: ``ttl`` not in (0, PUBLISHER_CERT_S) or ``wait`` not > 0.
    """
    from p2pdiloco.net.transport.swarm import Swarm  # noqa: PLC0415  (imports hivemind)

    if not 0 < ttl < PUBLISHER_CERT_S or not wait > 0:
        raise ValueError(f"ttl must be in (0, {PUBLISHER_CERT_S}) s and wait > 0 (got {ttl}, {wait})")
    data = revocations.encode()
    RevocationList.decode(data, swarm_key.public_key)  # raises unless the owner's key signed it
    if len(data) > MAX_LIST_BYTES:
        raise CertificateError(f"revocation list #{revocations.serial} is {len(data)} bytes; members read at "
                               f"most {MAX_LIST_BYTES} bytes from the DHT", "malformed")
    identity = Identity.generate()
    # no revocations here: the publisher only counts the members' copies (entries of members it
    # revokes would be dropped one by one anyway: lookups are validated per entry)
    cert = swarm_key.admit(identity.public_key, valid_for=PUBLISHER_CERT_S)
    membership = Membership(swarm_key.public_key, cert)
    key = revocations_key(swarm_key.public_key)
    swarm = await Swarm.start(initial_peers=list(initial_peers), identity=identity, membership=membership)
    # the entry leaves the DHT (its TTL plus the clock slack, in the swarm's time) a minute
    # before its certificate expires, which each validator judges by the same clock it drops
    # expired records with: an entry outliving it would hide the whole key's lookups
    ttl = max(1.0, min(ttl, cert.expires - swarm.clock.now() - swarm_clock.TOLERANCE_S - 60))
    t0 = swarm_clock.monotonic()
    try:
        deadline = t0 + wait
        await _store_until_found(swarm, key, data, ttl, deadline, f"revocation list #{revocations.serial}", wait)
        holders = await _member_copies(swarm, key, swarm_key.public_key, revocations.serial, deadline)
        return Publication(key, swarm.peer_id, tuple(holders), swarm_clock.monotonic() - t0)
    finally:
        await swarm.shutdown()


async def _store_until_found(swarm: Swarm, key: str, data: bytes, ttl: float, deadline: float, what: str,
                             wait: float) -> None:
    """Store ``data`` under ``key`` (subkey: our peer ID, ``ttl`` seconds) until a lookup returns
    it, every 0.5 s. Raises NetworkError once the monotonic ``deadline`` passed (``wait``
    seconds after the first store: for the message)."""
    stored = False
    while not stored:
        await swarm.store(key, swarm.peer_id, data, ttl)
        stored = (await swarm.get(key)).get(swarm.peer_id) == data
        if not stored:
            if swarm_clock.monotonic() >= deadline:
                raise NetworkError(f"the DHT did not return {what} within {wait:g} s of storing it")
            await asyncio.sleep(0.5)


async def _member_copies(swarm: Swarm, key: str, owner: bytes, serial: int, deadline: float) -> list[str]:
    """The members (sorted peer IDs) holding a copy of the list ``serial`` or a later one under
    ``key``, signed by ``owner`` (the swarm key's public key): looked up every second until one does or the monotonic
    ``deadline`` passed (then possibly none)."""
    holders: list[str] = []
    while True:
        found = await swarm.get(key)
        holders = sorted(s for s, v in found.items() if s != swarm.peer_id and is_peer_id(s)
                         and isinstance(parsed := parse_entry(v, owner), RevocationList)
                         and parsed.serial >= serial)
        if holders or swarm_clock.monotonic() >= deadline:
            break
        await asyncio.sleep(1.0)
    return holders
