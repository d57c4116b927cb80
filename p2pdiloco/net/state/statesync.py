"""Swarm records and global-state transfer.

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

Transfer: ``state.get`` returns a fragment's Θ and outer momentum (fp32) with its version and digest; the
receiver installs nothing unless the digest of the bytes it got matches the record it chose.

Trust (docs/trust.md). Records are signed DHT records under their owner's peer ID
(``transport.SignedRecords``): nobody can write another node's record. But a signature
proves who claims a state, not that the claim is honest, so a claim has to be earned:

* **Earned heads** (:mod:`p2pdiloco.net.state.heads`): corroborated versions (a claim counts only
  up to ``LEAD`` versions above what two other peers hold) and the fallback of a node ahead
  alone, applied by the node to the records of the peers it trusts only (:attr:`reputation`,
  ``node.vetting``: trust earned by merged rounds or a vetted state, never by counting holders).
* **Bounded moves** (:mod:`p2pdiloco.net.state.bounded_moves`): a downloaded state that moves Θ (or
  whose momentum would move it) further than recent steps, or this node's own, allow for the
  versions apart is refused (``StateSyncError``; counted in ``refused_states``), and every
  peer whose signed record claims it gets a strike.
* **Deliver or be ignored.** A holder that does not deliver the state it claims (no answer
  within the deadline: ``STATE_TIMEOUT_S`` + size / ``MIN_RATE``, or over this node's own
  measured link rate when slower, ``LinkMeter.held_to``) gets a strike; one that
  does not even begin its answer within :meth:`StateSync.first_reply_s` (a few times this
  node's recent transfer times: a staller costs a fraction of a second, not the transfer's
  deadline) gets one too, or from the second time in a row if it delivered to us before; other
  failed deliveries (truncated, refused, an older state than claimed; a newer one is an honest
  holder that moved on) count a strike from the second in a row. A holder with strikes has its
  records ignored for ``IGNORE_S`` × 2^(strikes − 1) seconds (at most ``IGNORE_MAX_S``; ``net.state.strikes``); a
  successful delivery clears its strikes. Rotating digests do not reset anything: strikes
  belong to the peer. Answers that no honest peer sends (a header out of range, a body of the
  wrong size, too short or over the state's bytes, bytes that do not hash to the digest the
  answer states) ban the sender.
* Concurrent downloads of one (fragment, version, digest) share one transfer.

A state it cannot fetch is a state it cannot merge at (invariant I3): ignoring a dead or
lying holder lets the swarm go on from the newest state a live peer holds. If an ignored
peer comes back, its claims count again afterwards and the heads rule (I7) settles any split.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.core.fragments import Fragment
from p2pdiloco.core.outer import FragmentState
from p2pdiloco.errors import NetworkError, ProtocolError, StateSyncError
from p2pdiloco.net.state import deltas
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.codecs import wire
from p2pdiloco.net.state.downloads import Downloads
from p2pdiloco.net.state.bounded_moves import FOLLOW_HISTORY, distance, implausible
from p2pdiloco.net.rounds.gatherings import FUTURE_SLACK_S
from p2pdiloco.net.records.patches import Received
from p2pdiloco.net.state.heads import LEAD, ROLLBACK_MAX, claim_ceiling
from p2pdiloco.net.records.pushes import MAX_PUSHED, STALE_S, Pusher, beat_period, stale_after
from p2pdiloco.net.records.parse import HeadsRecord
from p2pdiloco.net.state.strikes import IGNORE_S, Strikes
from p2pdiloco.net.transport.swarm import Header, Swarm
from p2pdiloco.net.transport.dht_access import NARROW_BEAM
from p2pdiloco.trust.reputation import Reputation

log = logging.getLogger(__name__)

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


class StateSync(Downloads):
    """Publishes this node's record and transfers fragment states. One per node; the owner of
    what this node believes about other peers' claims (refused states, strikes, ignores).

    Args:
        swarm: the transport.
        run_id: the run's name.
        fragments: the model's fragments.
        committed: callable returning this node's committed states, one per fragment
            (``node.committed.CommittedStates.states``).
        on_event: called as ``on_event("download_failed", fragment=, version=, donor=, reason=)``
            for each failed download (the node's journal); None: nothing is called.
    """

    def __init__(self, swarm: Swarm, run_id: str, fragments: Sequence[Fragment],
                 committed: Callable[[], Sequence[FragmentState]], on_event: Callable[..., None] | None = None,
                 tag: str = "", outer: tuple[float, float] = (0.0, 0.0), rounds: tuple[int, str] | None = None):
        self.swarm, self.run_id, self.fragments, self.committed = swarm, run_id, tuple(fragments), committed
        self.outer_lr, self.outer_momentum = outer  # the run's outer lr and μ: the momentum bound (_check_plausible)
        # catch-ups as deltas (net.state.deltas), given (H, wire precision); None: full states only
        self.deltas = None if rounds is None else deltas.Deltas(swarm, self.fragments, self.state_bytes, *rounds, outer)
        self.on_event, self.tag = on_event, tag  # tag: our protocol tag (records with another are not ours to follow)
        # nodes of this run that cannot merge with us (``other_settings``): peer -> (tag or "other fragment count", seen at)
        self._other_settings: dict[str, tuple[str, float]] = {}
        self.downloads = self.failed_downloads = 0
        self.fetched: dict[int, tuple[int, int]] = {}  # fragment -> (payload bytes, rounds: 0 for the state) of its last download
        self.refused_states = 0  # downloads refused as implausible (see the module docstring)
        self._seen: dict[int, FragmentState] = {}  # last committed state observed, per fragment
        self._shared: dict[int, int] = {}  # fragment -> version of the last state another peer held too
        self._steps: dict[int, deque[float]] = {i: deque(maxlen=FOLLOW_HISTORY) for i in range(len(self.fragments))}
        self._own: dict[int, float] = {}  # fragment -> the outer step this node's own last contribution would make
        self._refused: set[tuple[int, int, str]] = set()  # (fragment, version, digest) not to follow
        # states this node followed (downloaded): not steps of its own rounds, so _observe does not count them
        self._followed: deque[tuple[int, int, str]] = deque(maxlen=64)
        self._vetted: dict[tuple[int, int, str], FragmentState] = {}  # checked by node.vetting, to install
        self.reputation: Reputation | None = None  # the node's (p2pdiloco.trust.reputation): refusals lower it
        self.strikes = Strikes()  # holders that did not deliver, and the peers ignored (net.state.strikes)
        self._pending: dict[tuple[int, int, str], asyncio.Future] = {}
        self._donors: dict[str, None] = {}  # holders that delivered a state to us (insertion-ordered set)
        self._took: deque[float] = deque(maxlen=FOLLOW_HISTORY)  # seconds of recent successful downloads
        self._changed: dict[str, tuple[float, float]] = {}  # peer -> (its record's t, monotonic s we first saw it)
        self.pusher = Pusher(swarm, "st.heads", PUSH_DEFER_S, 1, rec.BEAT_S)  # pushes our record to the learners we know
        self._known_by: set[str] | None = None  # peers that know what our next publish changes (known_by)
        self.pushes_received: Counter[str] = Counter()  # "received", "other_run", "ignored" (refused)
        self.on_heard: Callable[[str, bool], object] = self.pusher.heard_from  # a peer pushed (hello?): the node widens it
        self._pushed: dict[str, HeadsRecord] = {}  # author -> its newest pushed record, oldest author first
        self.patches = Received(lambda peer, why: self.swarm.drop(peer, why))  # bases of authors' patches
        self._mine: HeadsRecord | None = None  # our last published record
        self._stored: tuple[float, str] = (-math.inf, "")  # monotonic s and life-cycle state of our last DHT store
        self._state: tuple[str, float] = ("", -math.inf)  # our life-cycle state and since when (monotonic s)
        self._pushed_at = -math.inf  # monotonic s of the last record pushed to us
        self._heard = asyncio.Event()  # set at every record pushed to us (greet waits on it)
        self._read: tuple[float, dict[str, HeadsRecord], set[str]] = (-math.inf, {}, set())  # last DHT read:
        # (monotonic s it began, parsed records, every author under the key)

    @property
    def heads_key(self) -> str:
        return f"{self.run_id}/heads"

    async def start(self) -> None:
        """Serve ``state.get``, then check that the swarm accepts us (``Swarm.check_admission``
        on the records' owners).

        Raises:
            AccessDenied: the swarm's members refuse this node (private swarm, no valid
                certificate); the message carries their reason.
        """
        await self.swarm.add_handler("state.get", self._on_get, max_payload=0)
        if self.deltas is not None:
            await self.swarm.add_handler("state.deltas", self.deltas.serve, max_payload=0)
        await self.swarm.add_handler("st.heads", self._on_heads, max_payload=0)
        await self.swarm.check_admission(self.heads_key)

    def state_bytes(self, fragment: int) -> int:
        """Bytes of fragment ``fragment``'s state on the wire (Θ and b, fp32)."""
        shapes = [s.shape for s in self.fragments[fragment].slots]
        return wire.wire_nbytes(shapes + shapes, "fp32")

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

    def _observe(self) -> None:
        """Record the per-version step of every fragment whose committed state moved on."""
        for p, state in enumerate(self.committed()):
            prev = self._seen.get(p)
            followed = (p, state.version, state.digest) in self._followed
            if prev is not None and state.version > prev.version and p in self._steps and not followed:
                step = distance(prev, state) / (state.version - prev.version)
                if math.isfinite(step):
                    self._steps[p].append(step)
            self._seen[p] = state
            self._shared.setdefault(p, state.version)  # the state we started from came from the swarm

    def shared(self, fragment: int, version: int) -> None:
        """Record that another peer held ``fragment`` at ``version`` too (a group formed at it,
        or a state was downloaded): the common ancestor of a later divergence, see
        :meth:`_check_plausible`."""
        self._observe()
        self._shared[fragment] = version

    def own_step(self, fragment: int, size: float) -> None:
        """Record the outer step (L2 distance of Θ) this node's own contribution to ``fragment``
        would make alone (lr·(1 + μ)·‖Δ‖ from a zero buffer, per H steps of progress, times the
        periods one version may hold: ``bounded_moves.periods_per_version``): one honest step no
        peer can inflate, bounding followed states (:meth:`_check_plausible`:
        ``FOLLOW_FACTOR`` times it per version, at most ``OWN_RELATIVE`` × ‖Θ‖; once this node
        has seen steps, when larger than the largest of them). Non-finite or negative sizes are ignored."""
        if math.isfinite(size) and size >= 0:
            self._own[fragment] = size

    def has_seen_steps(self, fragment: int) -> bool:
        """Whether this node has seen a step of ``fragment`` (else it is joining it)."""
        self._observe()
        return bool(self._steps.get(fragment))

    def _check_plausible(self, state: FragmentState) -> None:
        """Raise StateSyncError when ``state`` is not a plausible successor of ours
        (:func:`p2pdiloco.net.state.bounded_moves.implausible`)."""
        self._observe()
        p = state.index
        mine = self.committed()[p]
        reason = implausible(state, mine, self._shared.get(p, mine.version), self._steps.get(p, ()),
                             self._own.get(p, 0.0), self.outer_lr, self.outer_momentum)
        if reason is None:
            return
        self._refused.add((p, state.version, state.digest))
        self.refused_states += 1
        log.warning("not following fragment %d v%d (%s): %s", p, state.version, state.short(), reason)
        raise StateSyncError(f"fragment {p} v{state.version} refused: {reason}")

    def refuse(self, states: Iterable[FragmentState], holders: Iterable[str], reason: str) -> None:
        """Never follow any of ``states`` (each its fragment, version and digest) again; each of
        ``holders`` claimed them: struck once for them all (ignored for a doubling while: a bound
        is evidence, not proof, so no ban) and, with :attr:`reputation`, refuted. ``reason``:
        why they were refused."""
        for state in states:
            key = (state.index, state.version, state.digest)
            self.refused_states += key not in self._refused  # once per state (_check_plausible counts its own)
            self._refused.add(key)
        for holder in holders:
            self.strikes.strike(holder, reason, hard=True)
            if self.reputation is not None:
                self.reputation.refuted(holder, reason)

    def keep_vetted(self, states: Iterable[FragmentState]) -> None:
        """States the node checked before trusting their holder (``node.vetting``): the download
        of the follow that installs one returns it instead of fetching it again."""
        for st in states:
            self._vetted[(st.index, st.version, st.digest)] = st
        while len(self._vetted) > 4 * len(self.fragments):  # bounded: the oldest go
            del self._vetted[next(iter(self._vetted))]

    def _delivered(self, peer: str) -> None:
        self.strikes.delivered(peer)
        self._donors[peer] = None
        if len(self._donors) > 4096:  # bounded: forget the oldest donors
            for p in list(self._donors)[:1024]:
                del self._donors[p]

    async def _on_get(self, peer: str, header: Header, __: bytes) -> tuple[Header, bytes]:
        try:
            request = rec.parse_state_request(header, len(self.fragments))
        except ProtocolError:
            self.swarm.drop(peer, "state_request")
            raise
        state = self.committed()[request.fragment]
        body = wire.encode_view(list(state.theta) + list(state.momentum))  # one copy, not two
        return {"v": state.version, "d": rec.wire_digest(state.digest), "l": state.ledger.to_list()}, body

