"""The heads records: this node's own, published, and every other node's, read
(:class:`HeadsRecords`, a base of :class:`~p2pdiloco.net.state.statesync.StateSync`).

Records: every node publishes one DHT record under ``{run}/heads`` (subkey: its peer ID)
with, per fragment, the version and digest of the global state it holds, plus heartbeat
figures (inner step, tokens/s, loss): a :class:`~p2pdiloco.net.records.parse.HeadsRecord`, parsed
at the one boundary in :mod:`p2pdiloco.net.records.parse` (malformed records are dropped and
counted per peer). Readers pick, per fragment, the newest version; at a version held with
two digests (two groups merged the same version: split brain, invariant I7) the digest held
by more peers wins, ties to the smaller digest, so every node resolves it the same way and
the losers re-sync. A node pushes its record to the learners it knows on every publish that
changes a version, digest or setting, and at most every :func:`beat_period` s to each
otherwise (a heartbeat: ``st.heads``, ``net.records.pushes``; a patch of the record the peer took last,
``net.records.patches``), and stores it in the DHT every
``STORE_EVERY_S`` (:meth:`StateSync.publish`), for nodes that do not know it yet; readers
reuse a DHT read with the newer pushes merged in (:meth:`StateSync.read_age`); after the
first read, reads and stores visit ``NARROW_BEAM`` peers (every answer carries every record).
A node that joins reads the DHT, pushes its record to every node it found there, and so enters
their views (and audiences) at once; the DHT is how it finds them, not how they follow it.

Trust (docs/trust.md): a record is parsed at the records boundary, and a malformed one bans its
author (:meth:`HeadsRecords._malformed`); a record of a dead node does not count
(:meth:`HeadsRecords._live`); and a peer whose claims run further ahead than what this node and
the peers it trusts hold could have earned is ignored for a while
(:meth:`HeadsRecords._uncorroborated`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from p2pdiloco.errors import NetworkError, ProtocolError
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.records.patches import Received
from p2pdiloco.net.records.pushes import MAX_PUSHED, STALE_S, Pusher, beat_period, stale_after
from p2pdiloco.net.rounds.gatherings import FUTURE_SLACK_S
from p2pdiloco.net.state.heads import LEAD, ROLLBACK_MAX, claim_ceiling
from p2pdiloco.net.state.strikes import IGNORE_S, Strikes
from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.net.transport.dht_access import NARROW_BEAM

if TYPE_CHECKING:
    from p2pdiloco.core.fragments import Fragment
    from p2pdiloco.core.outer import FragmentState
    from p2pdiloco.net.transport.swarm import Header, Swarm
    from p2pdiloco.trust.reputation import Reputation

HEAD_TTL = 720.0  # seconds a record lives in the DHT without a store (STORE_EVERY_S: 2.4 of them)
_FIGURES = {"t": 0.0, "step": 0, "tps": 0.0, "loss": None, "merged": 0, "mine": 0, "beat": 0}  # a record that
# changed only these is a heartbeat: pushed to a peer every beat_period seconds at most
STORE_EVERY_S = 300.0  # seconds between DHT stores of our record (tens of kB at 16 nodes), for nodes that know us not ...
STORE_ALONE_S = 4.0  # ... but while we know none, every node is one that does not know us: stored this often
RESTORE_S = 30.0  # ... and a new life-cycle state (joining -> training) once it has lasted this long: a catch-up's
# few seconds of "catching up" cost no store (each one tens of kB at 16 nodes)
GREET_WAIT_S = 3.0  # seconds a joining node waits for the learners it found to push their records back
PUSH_DEFER_S = 5.0  # seconds a push waits at most for a peer that knows its change
READ_EVERY_S = 5.0  # seconds a DHT read of the records is reused while no peer pushes to us ...
READ_QUIET_S = 300.0  # ... and while peers do (within STALE_S): a newcomer pushes to us first (greet)


class HeadsRecords:
    """The records side of :class:`~p2pdiloco.net.state.statesync.StateSync` (which holds the
    state these methods read and write: run, fragments, committed states, protocol tag,
    strikes, reputation, and what was pushed, read, published and stored)."""

    swarm: Swarm
    run_id: str
    fragments: tuple[Fragment, ...]
    committed: Callable[[], Sequence[FragmentState]]
    tag: str
    reputation: Reputation | None
    strikes: Strikes
    pusher: Pusher
    patches: Received
    pushes_received: Counter[str]
    on_heard: Callable[[str, bool], object]
    _other_settings: dict[str, tuple[str, float]]
    _changed: dict[str, tuple[float, float]]
    _known_by: set[str] | None
    _pushed: dict[str, HeadsRecord]
    _mine: HeadsRecord | None
    _stored: tuple[float, str]
    _state: tuple[str, float]
    _pushed_at: float
    _heard: asyncio.Event
    _read: tuple[float, dict[str, HeadsRecord], set[str]]

    @property
    def heads_key(self) -> str:
        return f"{self.run_id}/heads"

    def known_by(self, peers: Iterable[str]) -> None:
        """``peers`` know the change our next publish carries: they committed the same round
        (the members of a group), so the push to them waits for our next change, at most
        ``PUSH_DEFER_S`` (``Pusher.set``'s ``later``); one such change at a time, so that the
        version they see us at is at most one behind, within ``heads.LEAD`` (a node more than
        that ahead of the others' records falls back: ``heads.runaway_heads``). Several calls
        before one publish: the peers in all of them."""
        self._known_by = set(peers) if self._known_by is None else self._known_by & set(peers)

    async def greet(self, extra: dict[str, Any], timeout: float = GREET_WAIT_S) -> int:
        """Joining: publish our record (``extra`` as in :meth:`publish`), push it at once to every
        live learner the DHT names, and wait until each that took it has pushed its own back
        (``Pusher.heard_from``), at most ``timeout`` seconds: what the DHT holds of a learner is
        up to ``STORE_EVERY_S`` old, and a joiner chooses its first states and donors from these
        records. Returns how many learners pushed back. Never raises for a peer or the DHT."""
        try:
            await self.publish(extra, store=True)
            stored = await self.records()
        except NetworkError:
            return 0
        reached = await self.pusher.push_now((p for p in stored if p != self.swarm.peer_id), hello=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not reached <= self._pushed.keys():
                    self._heard.clear()
                    await self._heard.wait()
        return len(reached & self._pushed.keys())

    async def publish(self, extra: dict[str, Any], *, store: bool = False) -> None:
        """Publish this node's record: per-fragment [version, digest] plus ``extra`` figures
        (the other fields of :class:`HeadsRecord`). It is pushed to the learners we know
        (``pusher``, ``st.heads``; to those it is :meth:`known_by` with our next change; a record
        that changed only its ``_FIGURES`` at most every :func:`beat_period`), and stored in the DHT, where
        nodes that do not know us yet find it, when ``store`` or ``STORE_EVERY_S`` after the last
        store (``STORE_ALONE_S`` while we know no other learner; a new life-cycle state once it has
        lasted ``RESTORE_S``).

        Raises:
            NetworkError: the DHT store failed (the push is made all the same).
        """
        audience = len(set(self.pusher.audience()))
        self.pusher.beat_every = beat_period(audience)
        record = HeadsRecord(tuple((s.version, s.digest) for s in self.committed()), t=self.swarm.clock.now(),
                             tag=self.tag, beat=self.pusher.beat_every, **extra)
        beat = self._mine is not None and record.beat <= self._mine.beat and replace(  # a longer period: at once
            record, **_FIGURES) == replace(self._mine, **_FIGURES)
        self._mine = record
        later, self._known_by = self._known_by or (), None
        self.pusher.set({"r": record.to_wire(), "run": self.run_id}, later, beat=beat)
        now = swarm_clock.monotonic()
        if self._state[0] != record.state:
            self._state = (record.state, now)
        since = now - self._stored[0]
        if store or since >= (STORE_EVERY_S if audience else STORE_ALONE_S) or (  # swarm status reads the DHT:
                record.state != self._stored[1] and now - self._state[1] >= RESTORE_S):  # a lasting new state
            await self.swarm.store(self.heads_key, self.swarm.peer_id, record.to_wire(), HEAD_TTL, beam=NARROW_BEAM)
            self._stored = (swarm_clock.monotonic(), record.state)

    async def _on_heads(self, peer: str, header: Header, _: bytes) -> tuple[Header, bytes]:
        """A peer's record, pushed (``st.heads``): its own, as the transport authenticates it,
        parsed like one read from the DHT (a malformed one bans its author); an older push
        never replaces a newer one."""
        if peer in self.swarm.bans:
            raise ProtocolError(f"excluded from this run: {self.swarm.bans[peer]}")
        if peer in self.strikes.ignored and peer in self.strikes.ignoring():  # unread: no parse, no push back
            self.pushes_received["ignored"] += 1
            raise ProtocolError("this node ignores your records for now")
        if (header := self.patches.expand(peer, header)) is None:  # a patch of another base than ours
            return {"resend": True}, b""
        if header.get("run") != self.run_id:
            self.pushes_received["other_run"] += 1
            raise ProtocolError("a record of another run")
        try:
            record = rec.parse_heads(header.get("r"), len(self.fragments))
        except ProtocolError:
            self._malformed(peer, header.get("r"))
            raise
        if record.t > self.swarm.clock.now() + FUTURE_SLACK_S:  # would never age out (clocks are corrected)
            self.swarm.drop(peer, "heads_future")
            raise ProtocolError("a record from the future")
        old = self._pushed.pop(peer, None)
        self._pushed[peer] = record if old is None or record.t >= old.t else old
        now = self.swarm.clock.now()
        self._pushed = {p: r for p, r in self._pushed.items() if now - r.t <= HEAD_TTL}  # authors long gone
        while len(self._pushed) > MAX_PUSHED:
            del self._pushed[next(iter(self._pushed))]
        self.patches.keep(peer, header)
        self.pushes_received["received"] += 1
        self._pushed_at = swarm_clock.monotonic()
        self._heard.set()
        self.on_heard(peer, header.get("hello") is True)  # a node that just started gets our record back
        return {}, b""

    def read_age(self) -> float:
        """Seconds a DHT read of the records may be reused (:meth:`records`' ``max_dht_age``):
        ``READ_QUIET_S`` while peers push their records to us (one did within ``STALE_S``),
        else ``READ_EVERY_S`` (module docstring)."""
        return READ_QUIET_S if swarm_clock.monotonic() - self._pushed_at <= STALE_S else READ_EVERY_S

    async def records(self, max_dht_age: float = 0.0) -> dict[str, HeadsRecord]:
        """Every live node's parsed record, {peer ID: record}: records under a peer ID, which
        the DHT accepted only when signed by that peer (and, in a private swarm, a member), or
        pushed by that peer (the newer of the two by its ``t``), and ours as last published;
        the DHT is read again when the last read began ``max_dht_age`` seconds ago or more;
        none of a banned or ignored peer; none that stayed unchanged too long (:meth:`_live`: a
        dead node's record, which the DHT keeps up to ``HEAD_TTL`` + ``clock.TOLERANCE_S``, must
        neither hold a head nor corroborate a claim); none that states another protocol tag than
        ours (:meth:`other_settings`); every refused (version, digest) replaced by None.
        Records that do not parse are dropped and counted (``Swarm.drop``).

        Raises:
            NetworkError: the DHT could not be read.
        """
        self._observe()
        ignoring = self.strikes.ignoring()
        if swarm_clock.monotonic() - self._read[0] >= max_dht_age:
            began = swarm_clock.monotonic()
            others = self._read[2] - {self.swarm.peer_id}
            stored = await self.swarm.get(self.heads_key, beam=NARROW_BEAM if others else None)
            values = {p: v for p, v in stored.items() if p not in self.swarm.bans and p not in ignoring}
            parsed, bad = rec.parse_many(values, rec.parse_heads, len(self.fragments))
            for peer in bad:
                self._malformed(peer, values[peer])
            self._read = (began, parsed, set(stored))
        _, parsed, authors = self._read
        good = {p: r for p, r in parsed.items() if p not in self.swarm.bans and p not in ignoring}
        now = self.swarm.clock.now() if self._pushed else 0.0
        for peer, pushed in self._pushed.items():
            if peer in self.swarm.bans or peer in ignoring or now - pushed.t > HEAD_TTL:
                continue
            if peer not in good or pushed.t > good[peer].t:
                good[peer] = pushed
        if self._mine is not None and self.swarm.peer_id in good:
            good[self.swarm.peer_id] = self._mine
        # gone from the DHT and no longer pushing: forgotten
        self._changed = {p: seen for p, seen in self._changed.items() if p in authors or p in self._pushed}
        out = {}
        for peer, record in self._live(good).items():
            if record.tag and self.tag and record.tag != self.tag:
                self._other(peer, f"protocol tag {record.tag}")
                continue
            for p, claim in enumerate(record.fragments):
                if claim is not None and (p, *claim) in self._refused:
                    record = record.without(p)
            out[peer] = record
        for peer, why in self._uncorroborated(out).items():
            self.strikes.ignore(peer, IGNORE_S, why)
            del out[peer]
        return out

    def _live(self, records: dict[str, HeadsRecord]) -> dict[str, HeadsRecord]:
        """``records`` without those whose ``t`` has not changed for :func:`stale_after` s since
        this node first saw it (its clock), counting the age beyond ``STORE_EVERY_S`` as unchanged
        (such a DHT record missed a store: its author is likely gone). Peers left out (ignored
        a while) keep their watch, so a dead peer does not look new when its ignore ends."""
        now, wall = swarm_clock.monotonic(), self.swarm.clock.now()
        for p, r in records.items():
            if p not in self._changed or self._changed[p][0] != r.t:
                self._changed[p] = (r.t, now - max(0.0, wall - r.t - STORE_EVERY_S))
        me = self.swarm.peer_id
        return {p: r for p, r in records.items() if p == me or now - self._changed[p][1] <= stale_after(r.beat)}

    def _malformed(self, peer: str, value: Any) -> None:
        """A heads record that does not parse: signed by ``peer``, so it is banned, unless the
        record is well formed but lists another fragment count (another model or P: a node
        with other settings, ignored, not banned)."""
        try:
            rec.parse_heads(value, None)
        except ProtocolError as e:
            self.swarm.drop(peer, "heads_record")
            self.swarm.ban(peer, f"signed a malformed heads record ({e})")
        else:
            self.swarm.drop(peer, "heads_other_fragments")
            self._other(peer, "another fragment count")

    def _other(self, peer: str, settings: str) -> None:
        self._other_settings[peer] = (settings, swarm_clock.monotonic())
        if len(self._other_settings) > 4096:  # bounded: forget the longest unseen
            for p in sorted(self._other_settings, key=lambda q: self._other_settings[q][1])[:1024]:
                del self._other_settings[p]

    def other_settings(self, within: float = STALE_S) -> dict[str, str]:
        """Nodes of this run whose records, seen in the last ``within`` seconds, state other
        settings than ours (another protocol tag or fragment count): they publish under the run's
        key but can never merge with us. {peer ID: their settings}."""
        now = swarm_clock.monotonic()
        return {p: what for p, (what, seen) in self._other_settings.items() if now - seen <= within}

    def _uncorroborated(self, records: dict[str, HeadsRecord]) -> dict[str, str]:
        """Peers whose whole records are ignored for a while, {peer: reason}, so that status shows
        who is ignored and nothing else of theirs (done, step) counts.

        With :attr:`reputation` set (the node's) and at least one other trusted peer
        in ``records``: every untrusted peer claiming a fragment version above the newest that
        this node or a trusted peer holds (nothing it could have earned; claims
        by fresh identities do not corroborate each other: docs/trust.md, "Earned trust").
        Otherwise (no trusted peer: joining, or a bare ``StateSync``): peers claiming a version
        more than ``ROLLBACK_MAX`` above :func:`claim_ceiling`. A claim above the ceiling by
        less is only looked past (:func:`newest_heads`): an honest node that merged a few
        rounds alone stays visible, so that it can be told it is ahead alone
        (:func:`runaway_heads`) and the others wait for it when they settle."""
        me, mine, out = self.swarm.peer_id, self.committed(), {}
        trusted = {q for q in records if q == me or (self.reputation is not None and self.reputation.trusted(q))}
        established = len(trusted - {me}) > 0
        for p in range(len(self.fragments)):
            claims = {q: r.fragments[p][0] for q, r in records.items() if r.fragments[p] is not None}
            own = mine[p].version if p < len(mine) else None
            if established:
                newest = max([-1 if own is None else own, *(v for q, v in claims.items() if q in trusted)])
                for q, v in claims.items():
                    if q not in trusted and v > newest:
                        out[q] = f"claims fragment {p} at v{v}, ahead of every state a peer this node trusts holds"
                continue
            ceiling = claim_ceiling(claims, me, own)
            for q, v in claims.items():
                if q != me and v > ceiling + ROLLBACK_MAX:
                    out[q] = (f"claims fragment {p} at v{v}, more than {LEAD + ROLLBACK_MAX} above what two "
                              "other peers hold")
        return out
