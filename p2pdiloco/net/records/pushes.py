"""Pushing a node's newest small record to the learners it knows, instead of having them poll
the DHT for it (the control plane's bytes: docs/benchmarks/control_plane.md). A DHT read is a Kademlia
traversal whose answers each carry every node's record (about 9 kB among 5 peers, measured in
docs/benchmarks/control_plane.md); a push is one RPC of about 100-400 bytes to each learner.

:class:`Pusher` holds the newest value and pushes it, whenever it changes, to the audience
(the live learners of the node's last records read; at most ``MAX_AUDIENCE``, a random sample
above that), each peer by a sender of its own, so that a peer that stalls delays nothing but
its own pushes. A learner that does not answer within ``PUSH_TIMEOUT_S`` gets no push for
``SKIP_S``, unless it pushes to us meanwhile (:meth:`Pusher.heard_from`: it restarted, say). A
learner that pushes to us and has not had our newest value (a node that just joined and found
us in the DHT) gets it at once, without waiting for our next change: the DHT holds our value as
last stored, up to ``heads_records.STORE_EVERY_S`` old, and the newcomer should not act on it
longer than a round trip. A value can spare the peers that already know what changed
(:meth:`Pusher.set`'s ``later``: the members of a round just committed, or of the group a
leader just closed; ``quiet``: everyone, for a withdrawal that changes nothing a receiver
does): they get it with the next change they do not know, at the first change ``max_defer``
seconds after their last push, or once spared ``max_deferred`` changes in a row (every
push is a libp2p stream of about 0.9 kB on the wire, docs/benchmarks/control_plane.md).
A change that only refreshes figures (``set``'s ``beat``: a heads record whose versions,
digests and settings are those of the last substantive change) is a heartbeat: a peer that
holds the last substantive change gets it only ``beat_every`` seconds after its last push, so
a node training between rounds costs each peer one push per ``beat_every``, not one per
publish; a heads record's ``beat_every`` grows with the audience (:func:`beat_period`), and
its readers count its author gone only after :func:`stale_after` of it.
What a receiver does with a push is its owner's business (``net.rounds.gatherings``, ``net.state.statesync``): the
transport authenticates the pusher, so a pushed value is its author's own, like a DHT record
under the author's peer ID.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
import math
from collections.abc import Callable, Collection, Iterable
from typing import Any

from p2pdiloco.errors import NetworkError, ProtocolError
from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.net.records.patches import keepable, patch_of
from p2pdiloco.net.records.parse import BEAT_S
from p2pdiloco.net.transport.swarm import Swarm

__all__ = ["Pusher", "MAX_AUDIENCE", "MAX_PUSHED", "PUSH_TIMEOUT_S", "SKIP_S", "STALE_S", "beat_period", "stale_after"]

MAX_AUDIENCE = 64  # learners a value is pushed to at most
MAX_PUSHED = 1024  # authors whose newest push a receiver keeps (the oldest go first)
PUSH_TIMEOUT_S = 1.0  # seconds for one push ...
SKIP_S = 30.0  # ... and a peer that failed one gets none for this long (seconds)
BEATS_PER_S = 0.4  # heartbeats a node pushes per second at most, to all its peers together (beat_period)
STALE_S = 65.0  # seconds a record stating records.BEAT_S may go unchanged before its author counts as gone: one
# heartbeat may fail (it comes BEAT_S + a publish period, 5 s, after the last; the next SKIP_S + 5 s later; 5 s slack)


def beat_period(audience: int) -> int:
    """Seconds between two heartbeats to one peer of a node that pushes to ``audience`` peers:
    ``records.BEAT_S`` (20), or more so that it sends ``BEATS_PER_S`` heartbeats a second at
    most in all (38 s at 15 peers, 160 s at ``MAX_AUDIENCE`` or more): a node's heartbeat bytes
    stay bounded as the swarm grows (docs/benchmarks/background_scale.md), and its heads
    record states the period (``HeadsRecord.beat``, at most ``records.MAX_BEAT_S``)."""
    return max(BEAT_S, math.ceil(min(audience, MAX_AUDIENCE) / BEATS_PER_S))


def stale_after(beat: float) -> float:
    """Seconds a record stating heartbeats every ``beat`` seconds may go unchanged before its
    author counts as gone: one heartbeat may fail, and the next comes ``SKIP_S`` + 5 s after it
    (``STALE_S`` at ``records.BEAT_S``; 205 s at 160)."""
    return STALE_S + (beat - BEAT_S)


class Pusher:
    """Pushes the newest value given to :meth:`set` as RPC ``method`` (module docstring).

    Attributes:
        audience: the node sets it: the live learners it knows (peer IDs).
        stats: pushes "sent" and "failed", and patches "resent" whole (the owner counts what it
            receives).
    """

    def __init__(self, swarm: Swarm, method: str, max_defer: float = math.inf, max_deferred: int | None = None,
                 beat_every: float = 0.0):
        self.swarm, self.method, self.max_defer = swarm, method, max_defer  # seconds (see set)
        self.beat_every = beat_every  # seconds between two pushes of heartbeat-only changes to one peer
        self.max_deferred = max_deferred  # changes in a row a peer may be spared (None: any number)
        self.audience: Callable[[], Iterable[str]] = tuple
        self.stats: Counter[str] = Counter()
        self._value: dict[str, Any] | None = None
        self._changed = asyncio.Event()
        self._skip: dict[str, float] = {}  # peer -> monotonic time until which it gets no push
        self._version = 0  # changes of the value so far
        self._substance = 0  # ... of which were not heartbeats (set's beat)
        self._held: dict[str, int] = {}  # peer -> the version of our value it acknowledged last
        self._held_substance: dict[str, int] = {}  # peer -> the substantive change that value held
        self._greet: set[str] = set()  # peers that pushed to us and get our value outside the audience
        self._sending: set[str] = set()  # peers with a push in flight
        self._defer: dict[str, int] = {}  # peer -> changes since the value it holds, all of which it knows
        self._pushed_at: dict[str, float] = {}  # peer -> monotonic s of our last push it took
        self._acked: dict[str, tuple[int, dict[str, Any]]] = {}  # peer -> (version, value) it took last: a patch's base

    def heard_from(self, peer: str, hello: bool = False) -> None:
        """``peer`` reached us (it pushed to us): if it was skipped after a failed push (it was
        down, and restarted since), it gets our pushes again from now on; if it does not hold
        our last substantive change (it just joined), it gets our newest value now, audience or
        not (at most ``MAX_AUDIENCE`` such peers at a time). ``hello``: the peer says it just
        started (``push_now``'s ``hello``), so whatever we pushed to it before is forgotten (it
        may be the same peer ID restarted)."""
        skipped = self._skip.pop(peer, None) is not None
        if peer == self.swarm.peer_id or peer in self.swarm.bans or self._value is None:
            return
        if hello:
            self._held.pop(peer, None), self._held_substance.pop(peer, None), self._defer.pop(peer, None)
            self._acked.pop(peer, None)
        if skipped or (self._held_substance.get(peer) != self._substance and peer not in self._defer
                       and len(self._greet) < MAX_AUDIENCE):
            self._greet.add(peer)
            self._changed.set()  # the newest value now, not at our next change

    def set(self, value: dict[str, Any], later: Collection[str] = (), *, quiet: bool = False,
            beat: bool = False) -> None:
        """Push ``value`` (an RPC header) next; a value not pushed yet is replaced.

        Args:
            later: peers that know what changed since our last value (they took part in the
                change): each gets this value with the next change it does not know, or at the
                first change ``max_defer`` seconds after its last push, or once it would be spared
                more than ``max_deferred`` changes in a row, whichever comes first;
                a peer still owed an earlier change gets it now.
            quiet: every peer gets it later (nothing is pushed for this change).
            beat: the change only refreshes figures: a peer that holds the last change made
                without ``beat`` gets it at the first change ``beat_every`` seconds after its
                last push (a peer that lacks that change gets it as any other change).
        """
        knows = set(later) if not quiet else {p for p, v in self._held.items() if v == self._version} | set(self._defer)
        most = math.inf if self.max_deferred is None else self.max_deferred
        self._defer = {p: self._defer.get(p, 0) + 1 for p in knows
                       if (p in self._defer or self._held.get(p) == self._version) and self._defer.get(p, 0) < most}
        self._value = value
        self._version += 1
        self._substance += 0 if beat else 1
        if not quiet:
            self._changed.set()

    def _due(self, peer: str, now: float) -> bool:
        """Whether ``peer`` gets our newest value now (it lacks it, and it is neither deferred
        nor owed only heartbeats within ``beat_every`` of its last push)."""
        since = now - self._pushed_at.get(peer, -math.inf)
        if self._held_substance.get(peer) == self._substance and since < self.beat_every:
            return False
        return self._held.get(peer) != self._version and (peer not in self._defer or since >= self.max_defer)

    async def push_forever(self) -> None:
        """Push the newest value to the audience each time it changes, for the node's life (the
        node runs it in its task group). Each peer has its own sender, at most one push in
        flight to it, which then sends the newest value if it changed meanwhile: a peer that
        stalls delays only its own pushes (before, each change waited for the slowest peer of
        the last one). Never raises for a peer's failure."""
        async with asyncio.TaskGroup() as tg:
            while True:
                await self._changed.wait()
                self._changed.clear()
                me, now = self.swarm.peer_id, swarm_clock.monotonic()
                self._skip = {p: t for p, t in self._skip.items() if t > now}
                peers = [p for p in dict.fromkeys(self.audience())
                         if p != me and p not in self.swarm.bans and p not in self._skip]
                if len(peers) > MAX_AUDIENCE:
                    peers = random.sample(peers, MAX_AUDIENCE)
                peers = list(dict.fromkeys([*peers, *(p for p in self._greet if p not in self.swarm.bans)]))
                self._greet.clear()
                self._held = {p: v for p, v in self._held.items() if p in self._sending or p in peers}
                self._held_substance = {p: v for p, v in self._held_substance.items() if p in self._held}
                self._pushed_at = {p: t for p, t in self._pushed_at.items() if p in self._held}
                self._acked = {p: a for p, a in self._acked.items() if p in self._held}
                for peer in peers:
                    if peer not in self._sending and self._due(peer, now):
                        self._sending.add(peer)
                        tg.create_task(self._sender(peer))

    async def push_now(self, peers: Iterable[str], hello: bool = False) -> set[str]:
        """Push the newest value to ``peers`` (at most ``MAX_AUDIENCE``) at once, outside
        :meth:`push_forever` (a node joining, before its tasks run); returns those that took it.
        ``hello``: the value carries ``"hello": True`` (we just started: receivers push theirs back)."""
        peers = [p for p in dict.fromkeys(peers) if p != self.swarm.peer_id and p not in self.swarm.bans]
        version, substance = self._version, self._substance
        value = {**(self._value or {}), **({"hello": True} if hello else {})}
        await asyncio.gather(*(self._push(p, value, version, substance, base=not hello) for p in peers[:MAX_AUDIENCE]))
        return {p for p in peers if self._held.get(p) == version}

    async def _sender(self, peer: str) -> None:
        """Push to ``peer`` until it holds the newest value, or a push fails."""
        try:
            sent = None
            while sent != self._version and peer not in self._skip and self._due(peer, swarm_clock.monotonic()):
                sent = self._version  # one try per version: a failure skips the peer (or, skips full, waits)
                await self._push(peer, self._value or {}, sent, self._substance)
        finally:
            self._sending.discard(peer)

    async def _push(self, peer: str, value: dict[str, Any], version: int, substance: int, *,
                    base: bool = True) -> None:
        """Push ``value`` (change ``version``) to ``peer``: a patch of the value it acknowledged
        last when there is one, the whole value when it asks (``net.records.patches``); ``base``: the
        value is one it may keep as a base (not a push_now ``hello``)."""
        base = base and keepable(value)  # a value the receiver would not keep goes whole, always
        try:
            acked = self._acked.get(peer) if base else None
            whole = dict(value, _v=version) if base else value
            header = whole if acked is None else {"_v": version, "_b": acked[0], "_p": patch_of(acked[1], value)}
            reply, _ = await self.swarm.call(peer, self.method, header, timeout=PUSH_TIMEOUT_S)
            if acked is not None and reply.get("resend") is True:  # it holds another base, or none
                self.stats["resent"] += 1
                await self.swarm.call(peer, self.method, whole, timeout=PUSH_TIMEOUT_S)
            if base:
                self._acked[peer] = (version, value)
            else:  # a value it does not keep (too large, or a hello): it holds no base of ours now
                self._acked.pop(peer, None)
            self.stats["sent"] += 1
            self._held[peer], self._pushed_at[peer] = version, swarm_clock.monotonic()
            self._held_substance[peer] = substance
            if version == self._version:
                self._defer.pop(peer, None)
        except (NetworkError, ProtocolError):  # skipped a while: a peer that stalls delays the others' pushes
            self.stats["failed"] += 1
            if len(self._skip) < 4 * MAX_AUDIENCE:
                self._skip[peer] = swarm_clock.monotonic() + SKIP_S
