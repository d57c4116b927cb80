"""Gathering announcements: the fragments each learner is gathering a group for right now.

A learner that leads a gathering (``Matchmaker.form_group``: joiners do not announce, so a
round costs each node about one push sent and one received, whatever the swarm's size)
announces the (fragment, version, digest) keys it gathers at, and withdraws them when its
gathering ends or another learner leads it, so that learners at
the same version pull that fragment's round in and join (``node.runtime``'s gathering watch)
instead of arriving late. It also lists, per fragment, the last key where its author closed
a group, with the time (``l``): learners that reach that key later are late
(``Matchmaker.form_group``; with an audience these pushes are the whole of matchmaking's
declarations, :meth:`Gatherings.declarations`). The announcement, ``{"g": [[fragment,
version, digest], ...], "l": [[fragment, version, digest, time], ...], "t": swarm time}`` with
the run's name (``run``, with its protocol tag: a push of another run is refused), is pushed
(``mm.gather``, by a ``net.records.pushes.Pusher``) to the audience, the live learners of this
node's last records read (``audience``, at most ``MAX_AUDIENCE``), by
:meth:`Gatherings.push_forever` whenever it changes (the newest only; a closed group's
members and, for an outranked leader's withdrawal, everyone, get it with the author's next
announcement instead; a learner that does not answer within ``PUSH_TIMEOUT_S`` gets no push
for ``SKIP_S``, and every peer has a sender of
its own, so that a peer that stalls delays no other's pushes; above ``MAX_AUDIENCE``, a random
sample of the audience for each push). A receiver keeps each author's newest push
(``MAX_PUSHED`` authors) and wakes its watch (:meth:`Gatherings.watch`).

It used to be a DHT record under ``{run}/gathering`` that every learner polled twice a
second, and every DHT read is a Kademlia traversal whose answers each carry every learner's
announcement (docs/benchmarks/control_plane.md). A learner not yet in a peer's
records (it joined in the last few seconds) misses that peer's pushes and sends on its own
schedule meanwhile.

An announcement is its author's own (the transport authenticates the pusher), parsed at one
boundary (``records.parse_gathering``): a malformed one is dropped and counted, and its author
banned, as an honest node never sends one; a banned author's are ignored; an older push never
replaces a newer one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Collection, Iterable

from p2pdiloco.errors import ProtocolError
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.records.patches import Received
from p2pdiloco.net.records.pushes import MAX_AUDIENCE, MAX_PUSHED, PUSH_TIMEOUT_S, Pusher
from p2pdiloco.net.transport.swarm import Header, Swarm

__all__ = ["Gatherings", "MAX_AUDIENCE", "MAX_PUSHED", "PUSH_TIMEOUT_S"]

COALESCE_S = 0.1  # seconds the watch waits after a push for others arriving with it
DEFAULT_MAX_AGE_S = 60.0  # seconds an announcement stays current before this node's first gathering
FUTURE_SLACK_S = 5.0  # seconds a peer's time stamp (announcement, declaration) may be ahead of ours: net.transport.clock


class Gatherings:
    """The run's gathering announcements, ours and the other learners' (module docstring).
    One per node, owned by its ``Matchmaker``; serves ``mm.gather``.

    Args:
        swarm: the transport.
        run_id: the run's name (with its protocol tag).
        num_fragments: P, the run's fragment count (bounds what an announcement may name).
    """

    def __init__(self, swarm: Swarm, run_id: str, num_fragments: int):
        self.swarm, self.run_id, self.num_fragments = swarm, run_id, num_fragments
        self.max_age: float = DEFAULT_MAX_AGE_S  # seconds an announcement stays current (Matchmaker sets it)
        self.pusher = Pusher(swarm, "mm.gather")  # pushes ours; the node sets its audience
        self.pushed = asyncio.Event()  # set when a push arrives
        self.on_push: Callable[[list[tuple[int, int, str]]], object] = lambda keys: None  # the Matchmaker's
        self.on_heard: Callable[[str], object] = self.pusher.heard_from  # a peer pushed to us (the node widens it)
        self.received: Counter[str] = Counter()  # pushes "received" and "other_run" (refused)
        self._pushes: dict[str, rec.Gathering] = {}  # author -> its newest push, oldest author first
        self.patches = Received(swarm.drop)  # each author's last announcement: its next patch's base

    @property
    def audience(self) -> Callable[[], Iterable[str]]:
        return self.pusher.audience

    @audience.setter
    def audience(self, peers: Callable[[], Iterable[str]]) -> None:
        self.pusher.audience = peers

    @property
    def stats(self) -> Counter[str]:
        """Pushes "sent", "failed", "received" and "other_run" (refused)."""
        return self.pusher.stats + self.received

    async def start(self) -> None:
        await self.swarm.add_handler("mm.gather", self._on_push, max_payload=0)

    def announce(self, keys: list[list], left: list[list] = (), later: Collection[str] = (), *,
                 quiet: bool = False) -> None:
        """Announce that we lead a gathering at ``keys`` ([[fragment, version, digest], ...]; []
        withdraws) and closed groups at ``left`` ([[fragment, version, digest, swarm time], ...]):
        :meth:`push_forever` pushes it, to the ``later`` peers (the group just closed, who need
        not hear of it) with our next announcement they do not know, and to nobody now when
        ``quiet`` (``Pusher.set``)."""
        wire = {"g": [[p, v, rec.wire_digest(d)] for p, v, d in keys],
                "l": [[p, v, rec.wire_digest(d), t] for p, v, d, t in left], "t": self.swarm.clock.now(),
                "run": self.run_id}
        self.pusher.set(wire, later, quiet=quiet)

    def open(self) -> dict[int, set[tuple[int, str]]]:
        """Fragments other learners gather a group for now, by their pushes: {fragment: every
        (version, digest) announced for it}, all of them, so that no announcement (a hostile
        one, say) hides another. Announcements whose ``t`` (swarm time) is older than
        ``max_age`` are left out: their authors stopped announcing (crashed, or left)."""
        out: dict[int, set[tuple[int, str]]] = {}
        now = self.swarm.clock.now()
        for peer, gathering in self._pushes.items():
            if peer in self.swarm.bans or peer == self.swarm.peer_id:
                continue
            if now - gathering.t > self.max_age:
                continue
            for p, v, d in gathering.keys:
                out.setdefault(p, set()).add((v, d))
        return out

    def declarations(self, fragment: int, version: int, digest: str) -> dict[str, rec.Declaration]:
        """What the other learners' announcements say of this key, as matchmaking declarations
        (``Matchmaker.form_group``): open where a current announcement (as :meth:`open`) names
        it (its author leads a gathering there), in a group where its closed keys do (with the
        time it closed the group); banned authors left out."""
        now, me, key = self.swarm.clock.now(), self.swarm.peer_id, (fragment, version, digest)
        out = {}
        for peer, g in self._pushes.items():
            if peer == me or peer in self.swarm.bans:
                continue
            if key in g.keys and now - g.t <= self.max_age:
                out[peer] = rec.Declaration(True, False, g.t)
            for p, v, d, t in g.left:
                if (p, v, d) == key and peer not in out:
                    out[peer] = rec.Declaration(False, True, t)
        return out

    async def watch(self) -> None:
        """Wait until a push arrives (and ``COALESCE_S`` more, for pushes arriving with it)."""
        await self.pushed.wait()
        await asyncio.sleep(COALESCE_S)
        self.pushed.clear()

    async def push_forever(self) -> None:
        """Push our newest announcement to the audience each time it changes, for the node's
        life (``Pusher.push_forever``)."""
        await self.pusher.push_forever()

    async def _on_push(self, peer: str, header: Header, _: bytes) -> tuple[Header, bytes]:
        if peer in self.swarm.bans:
            raise ProtocolError(f"excluded from this run: {self.swarm.bans[peer]}")
        header = self.patches.expand(peer, header)  # a patch of its last announcement: the whole of it
        if header is None:
            return {"resend": True}, b""
        if header.get("run") != self.run_id:  # another run, or our run with other settings: not ours to read
            self.received["other_run"] += 1
            raise ProtocolError("a gathering of another run (or of other settings)")
        try:
            gathering = rec.parse_gathering(header, self.num_fragments)
        except ProtocolError:
            self.swarm.drop(peer, "gathering_push")
            self.swarm.ban(peer, "pushed a malformed gathering announcement")
            raise
        if gathering.t > self.swarm.clock.now() + FUTURE_SLACK_S:  # would never age out (clocks are corrected)
            self.swarm.drop(peer, "gathering_future")
            raise ProtocolError("a gathering announcement from the future")
        old = self._pushes.pop(peer, None)
        self._pushes[peer] = gathering if old is None or gathering.t >= old.t else old  # a late push: not newer
        while len(self._pushes) > MAX_PUSHED:
            del self._pushes[next(iter(self._pushes))]
        self.patches.keep(peer, header)
        self.received["received"] += 1
        self.on_heard(peer)
        self.pushed.set()
        self.on_push([*gathering.keys, *(k[:3] for k in gathering.left)])
        return {}, b""
