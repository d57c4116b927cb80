"""DHT-matched group formation for one fragment's outer round.

Only learners at the same fragment version *and* the same global-state digest can be
grouped (invariant I3, docs/architecture.md): the key they gather at contains both.
Among the learners open at a key, the one whose peer ID hashes lowest with the key
(``leader_rank``: sha256 of the key and the peer ID) leads: the others send it a
long-poll ``mm.join`` request; the leader closes the group once the
minimum quorum K is reached and the grace window has passed (or everyone declared has
joined), then answers every joiner with the same member list, round ID and all-reduce
shares (Decoupled DiLoCo, arXiv 2604.21428, sec. 3: minimum quorum and grace window).

Declarations travel two ways (docs/benchmarks/control_plane.md: every DHT read is a Kademlia
traversal whose answers carry every declaration, about 9 kB among 5 peers):

* **pushed**, when the node knows other learners (its records name some: the audience of
  ``Gatherings``): a learner that leads a gathering announces the key (``mm.gather``), and
  when it closes a group there it announces that key as closed, with the time
  (``LEFT_KEEP_S``), to the group's members with its next announcement only; joiners announce
  nothing, the DHT is neither read nor written. A learner is open to the others while its
  announcement names the key, in a group once its closed keys do (``Gatherings.declarations``).
  A learner that outranks every leader it has heard of leads and announces, so the lowest-ranked
  ready learner leads; an outranked leader's withdrawal travels with its next announcement
  (the new leader outranks it wherever both are heard).
* **in the DHT**, by a node that knows no other learner yet: a record under the key (subkey:
  its peer ID) while open, and another when it leaves, saying whether in a group; a leader
  reads them at a wake-up (a join, a push, or ``POLL_SECONDS``) at most every
  ``POLL_SECONDS``, a joiner once per leader it tries; pushed announcements count too.

Bandwidth-aware shares (:func:`bandwidth_shares`): every joiner reports its measured link
rate (``drops.LinkMeter``, KiB/s) in its ``mm.join``; the leader splits the fragment among
the members with hivemind's load balancing (``hivemind.averaging.load_balancing``: the split
that minimises the slowest member's traffic over its rate, as hivemind's butterfly
all-reduce does), so a member on a slow link reduces less or nothing and only sends its
slices and receives the result. Rates count at most at the group's lower median, so with an
honest majority a report can lower its author's share but not raise it above a median
member's; and a joiner refuses (and bans) a leader whose shares give any member more than
``max_share`` (about 2/n of the fragment), more than an honest split ever does.

A learner that arrives after a group already closed at its version does not form a
competing group (that would split the swarm's history); it reports ``late`` and the caller
catches up with the group's result instead (unless it cannot fetch their state at all: a node
behind NAT without a relay slot, ``Matchmaker.undeliverable``; it then goes on with its own).
The record of who made us late, and when that stops: ``net.rounds.lateness``.

Trust (docs/trust.md): declarations are pushed by their authors (``net.rounds.gatherings``, the
transport authenticates the pusher) or are DHT records under the declaring peer's own ID, so
only that peer can write or overwrite them
(``transport.SignedRecords``); entries under any other subkey, and values that do not parse
(:mod:`p2pdiloco.net.records.parse`), are ignored and counted. No single peer can capture groups:

* the leader of a key is the open peer with the lowest sha256(DHT key, peer ID): the key
  holds the fragment's version and state digest, which change every round, so no identity
  leads more often than chance, and grinding one that would needs a fresh identity per round;
* every ``mm.join`` is signed, and a group's members' signatures are checked: the exchange,
  both sides, is ``net.rounds.joins``;
* leaders whose groups fail, or that keep joiners waiting, are passed over for a while, and
  banned peers and peers this node refused a merged part of are avoided: ``net.rounds.standing``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Callable, Collection, Container
from dataclasses import dataclass, field
from typing import Literal

from p2pdiloco.net.transport import clock as swarm_clock
from p2pdiloco.errors import NetworkError
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.rounds.gatherings import Gatherings
from p2pdiloco.net.rounds.groups import POLL_SECONDS, Group, GroupKey, leader_rank
from p2pdiloco.net.rounds.joins import Joins
from p2pdiloco.net.rounds.lateness import LateGroups
from p2pdiloco.net.rounds.shares import bandwidth_shares
from p2pdiloco.net.rounds.standing import Standing
from p2pdiloco.net.transport.swarm import Swarm
from p2pdiloco.trust import signing

log = logging.getLogger(__name__)

JOIN_SLACK_S = 3.0  # seconds past the grace window a joiner waits for a leader that has its quorum
FAILED_GROUP_WAIT_S = 10.0  # seconds a failed group's members still make us late (they may have committed)
LEFT_KEEP_S = 120.0  # seconds a leader keeps announcing a key where it closed a group
Outcome = Literal["group", "late", "no_quorum"]


@dataclass
class _Gathering:
    key: GroupKey
    joiners: dict[str, asyncio.Future] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)  # joiner -> its reported link rate (bytes/s)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    following: str | None = None  # the leader this peer is joining now: joins sent to us are redirected
    leading: bool = False  # we lead it now: announced to the audience (net.rounds.gatherings)
    signatures: dict[str, bytes] = field(default_factory=dict)  # joiner -> its mm.join signature (ours too)
    member_signatures: tuple[bytes, ...] = ()  # the closed group's, in member order
    members: tuple[str, ...] = ()  # the closed group's
    quorum_at: float | None = None  # when we, leading, had our quorum (monotonic s)
    first_joiner_at: float | None = None  # when our first joiner came (monotonic s)
    stored: dict[str, rec.Declaration] = field(default_factory=dict)  # the DHT's declarations, as last read
    read_at: float = -math.inf  # when we last read the DHT (monotonic s)


class Matchmaker(Joins, Standing, LateGroups):
    """Forms groups for fragment rounds. One per node; serves ``mm.join``.

    Args:
        swarm: the transport.
        run_id: the run's name, part of every DHT key.
        min_quorum: K, the smallest group that may merge (K = 1: a lone learner merges alone).
        num_fragments: P, the run's fragment count (bounds what a peer may name).
    """

    def __init__(self, swarm: Swarm, run_id: str, min_quorum: int, num_fragments: int = rec.MAX_FRAGMENTS):
        if min_quorum < 1:
            raise ValueError(f"min_quorum must be >= 1, got {min_quorum}")
        self.swarm, self.run_id, self.min_quorum, self.num_fragments = swarm, run_id, min_quorum, num_fragments
        self._gatherings: dict[int, _Gathering] = {}
        super().__init__()  # Standing: leaders passed over, peers avoided; LateGroups: the groups that made us late
        self.gatherings = Gatherings(swarm, run_id, num_fragments)  # the run's gathering announcements
        self.gatherings.on_push = self.on_push
        self._left: dict[int, tuple[GroupKey, float]] = {}  # fragment -> (key, swarm time) of our last group closed
        # peers whose states this node cannot fetch now (the node sets it: StateSync.ignoring while
        # it is behind NAT without a relay slot): a group of theirs at our version does not make us "late"
        self.undeliverable: Callable[[], Container[str]] = frozenset
        # called with every group a leader (or we) listed us in, also one we decline: the node
        # passes AllReducer.expect, so that our reducer part serves the other members
        self.listed_in: Callable[[Group], object] = lambda group: None

    async def start(self) -> None:
        await self.swarm.add_handler("mm.join", self._on_join, max_payload=0)
        await self.gatherings.start()

    def open_gatherings(self) -> dict[int, set[GroupKey]]:
        """Fragments other learners are gathering a group for right now (fragment -> every key
        announced for it), from their pushed announcements (``Gatherings.open``)."""
        return {p: {GroupKey(p, v, d) for v, d in keys} for p, keys in self.gatherings.open().items()}

    def _announce(self, later: Collection[str] = (), *, quiet: bool = False) -> None:
        """Announce the fragments this learner leads an open gathering for, and the keys where
        it closed its last group of each fragment, ``LEFT_KEEP_S`` at most
        (``Gatherings.announce``; ``later``, ``quiet``: who hears of it with our next change)."""
        now = self.swarm.clock.now()
        self._left = {p: (k, t) for p, (k, t) in self._left.items() if now - t <= LEFT_KEEP_S}
        self.gatherings.announce([[g.key.fragment, g.key.version, g.key.digest] for g in self._gatherings.values()
                                  if g.leading and not g.closed],
                                 [[k.fragment, k.version, k.digest, t] for k, t in self._left.values()], later,
                                 quiet=quiet)

    async def _declarations(self, dht_key: str) -> dict[str, rec.Declaration]:
        """The parsed declarations under ``dht_key`` of peers not banned nor avoided, by author."""
        values = {p: v for p, v in (await self.swarm.get(dht_key)).items() if not self._shunned(p)}
        good, bad = rec.parse_many(values, rec.parse_declaration)
        for peer in bad:
            self.swarm.drop(peer, "declaration")
            self.swarm.ban(peer, "signed a malformed matchmaking declaration")
        return good

    def group_failed(self, group: Group) -> None:
        """The node reports that ``group``'s round failed (module docstring: leaders whose
        groups fail repeatedly are passed over). ``FAILED_GROUP_WAIT_S`` later, its members'
        declarations of that group no longer make us late at its key (the survivors retry
        there); until then they do: the others may have committed the round (a failure seen by
        one member only), and their state, published as they commit, is the one to follow."""
        self._leader_failed(group.leader, f"round {group.round_id} failed")
        now = self.swarm.clock.now()
        self._put_aside(group.key, {m: now for m in group.members}, after=FAILED_GROUP_WAIT_S)

    def group_succeeded(self, group: Group) -> None:
        """The node reports that ``group``'s round committed: its leader's failures are cleared."""
        self.leader_failures.pop(group.leader, None)
        self.passed_over.pop(group.leader, None)
        for member in group.members:  # a peer we merged with is a real group member
            self.empty_groups.pop(member, None), self.ignored_groups.pop(member, None)

    async def form_group(self, key: GroupKey, *, grace: float, quorum_timeout: float, expected: int = 0,
                         max_grace: float | None = None, lone_wait: bool = True,
                         round_time: float | None = None) -> tuple[Outcome, Group | None]:
        """Declare readiness under ``key`` and return the group this learner ends up in.

        Waits at most ``quorum_timeout`` seconds for K members, then at most ``grace`` more
        seconds for others, closing early once ``expected`` members (the live learners this
        node knows of; 0 = unknown) have joined. Returns ("group", Group), ("late", None) when a group at this
        version closed without us, or ("no_quorum", None). ``max_grace`` (seconds; default
        ``grace``): the longest grace window any leader of the run may use; a leader that has
        its quorum and keeps us waiting longer than that (plus ``JOIN_SLACK_S``) is passed over.
        A leader still alone while other learners are expected waits up to ``max_grace``
        instead of ``grace`` (``_closes_at``); ``lone_wait`` False: no longer wait.
        ``round_time`` (seconds; default the declarations' lifetime): how long a group at our
        key makes us late (``_grouped``).

        Raises:
            NetworkError: the DHT could not be reached.
        """
        me, t0 = self.swarm.peer_id, swarm_clock.monotonic()
        deadline = t0 + quorum_timeout
        dht_key, ttl, pushed, gathering = await self._open(key, quorum_timeout, max(grace, max_grace or 0.0))
        excluded: set[str] = set()
        lone_grace = max(grace, max_grace or 0.0) if expected > 1 and lone_wait else grace
        fresh_for = ttl if round_time is None else round_time
        self._settle_deferrals(key, fresh_for)
        grouped = False  # whether we leave in a group (our last declaration says so)
        try:
            while True:
                entries = await self._entries(gathering, dht_key, pushed)
                open_peers = {p for p, d in entries.items() if d.open}
                open_peers = (open_peers - excluded - self.passing_over().keys()) | {me}
                grouped_peers = self._grouped(key, entries, fresh_for)
                if grouped_peers:  # a group at this version exists: don't fork it (leaders and joiners alike)
                    return self._late(key, grouped_peers)
                leader = min(open_peers, key=lambda p: leader_rank(dht_key, p))
                self._take_role(gathering, leader == me)
                now = swarm_clock.monotonic()
                if leader != me:
                    outcome = await self._follow(gathering, leader, deadline + grace + 2 - now,
                                                 max(grace, max_grace or 0.0))
                    if isinstance(outcome, Group):
                        grouped = True
                        return "group", self._formed(key, outcome)
                    if outcome in ("gone", "held"):
                        excluded.add(leader)
                    elif swarm_clock.monotonic() > deadline:
                        return "no_quorum", None
                    continue
                joined = self._closing(gathering, now, expected, grace, lone_grace)
                if joined is not None:
                    grouped = True
                    return "group", self._formed(key, self._close(gathering, t0, joined))
                if gathering.quorum_at is None and now > deadline:
                    return "no_quorum", None
                await self._wait_for_news(gathering)
        finally:
            await self._leave(gathering, grouped, pushed, dht_key, ttl)

    async def _open(self, key: GroupKey, quorum_timeout: float, longest_grace: float
                    ) -> tuple[str, float, bool, _Gathering]:
        """Open our gathering at ``key``: declared in the DHT when no learner is known to push
        to us, signed (our own ``mm.join`` signature) and registered. ``longest_grace``: the
        longest grace window of the run (seconds). Returns (DHT key, declarations' lifetime in
        seconds, whether declarations are pushed, the gathering). Raises NetworkError (the DHT)."""
        me = self.swarm.peer_id
        # one lifetime whatever this round's grace: a DHT keeps the value that expires last, so a
        # retry at this key with a shorter lifetime would not replace our closed declaration
        dht_key, ttl = key.dht_key(self.run_id), quorum_timeout + longest_grace + 30
        self.gatherings.max_age = quorum_timeout + longest_grace + JOIN_SLACK_S
        pushed = any(True for _ in self.gatherings.audience())  # other learners known: declarations are pushed
        if not pushed:
            await self.swarm.store(dht_key, me, {"open": True, "t": self.swarm.clock.now()}, ttl)
        gathering = _Gathering(key)
        gathering.signatures[me] = signing.sign(self.swarm.identity, "mm.join", self._join_fields(key, me))
        self._gatherings[key.fragment] = gathering
        return dht_key, ttl, pushed, gathering

    async def _entries(self, gathering: _Gathering, dht_key: str, pushed: bool) -> dict[str, rec.Declaration]:
        """The declarations at the gathering's key, by author: the DHT's (read at a wake-up
        ``POLL_SECONDS`` after the last, only while no learner is known to push to us), and the
        pushed ones of peers neither banned nor avoided, which win."""
        if not pushed and swarm_clock.monotonic() - gathering.read_at >= POLL_SECONDS:
            gathering.read_at = swarm_clock.monotonic()
            gathering.stored = await self._declarations(dht_key)
        key = gathering.key
        pushed_here = self.gatherings.declarations(key.fragment, key.version, key.digest)
        return {**gathering.stored, **{p: d for p, d in pushed_here.items() if not self._shunned(p)}}

    def _take_role(self, gathering: _Gathering, leading: bool) -> None:
        """Lead or join at the gathering's key. Leaders announce, joiners do not: about two
        pushes a round for each node, whatever the swarm's size; a withdrawal goes quietly
        (the new leader outranks us anyway)."""
        if leading != gathering.leading:
            gathering.leading = leading
            self._announce(quiet=not gathering.leading)

    async def _follow(self, gathering: _Gathering, leader: str, until_deadline: float,
                      longest_grace: float) -> Group | str:
        """Join ``leader`` (``_join``), our own joiners sent away meanwhile; wait at most
        ``until_deadline`` seconds (0.5 at least), or, when the leader and we make a quorum
        (it owes us a group soon), the run's longest grace window plus ``JOIN_SLACK_S``."""
        gathering.following = leader
        self._abdicate(gathering)
        wait = max(0.5, until_deadline)
        if self.min_quorum <= 2:  # the leader and we make a quorum: it owes us a group soon
            wait = min(wait, longest_grace + JOIN_SLACK_S)
        outcome = await self._join(leader, gathering.key, timeout=wait)
        gathering.following = None
        return outcome

    def _closing(self, gathering: _Gathering, now: float, expected: int, grace: float,
                 lone_grace: float) -> list[str] | None:
        """As the gathering's leader at ``now`` (monotonic seconds): the joiners to close the
        group with if it closes now (quorum reached, and everyone ``expected`` joined or the
        wait is over: ``_closes_at``), else None. Notes when the quorum and the first joiner came."""
        # every joiner signed its join at the key (_on_join), which the other members check
        joined = [j for j in gathering.joiners if j in gathering.signatures]
        size = 1 + len(joined)
        if size >= self.min_quorum and gathering.quorum_at is None:
            gathering.quorum_at = now
        if size > 1 and gathering.first_joiner_at is None:
            gathering.first_joiner_at = now
        everyone = size >= max(expected, 2)  # a lone learner still waits its grace
        quorum_at = gathering.quorum_at
        if quorum_at is not None and (
                everyone or now >= self._closes_at(quorum_at, gathering.first_joiner_at, grace, lone_grace)):
            return joined
        return None

    @staticmethod
    async def _wait_for_news(gathering: _Gathering) -> None:
        """Until a joiner or a pushed announcement arrives, ``POLL_SECONDS`` at most."""
        gathering.arrived.clear()
        try:
            async with asyncio.timeout(POLL_SECONDS):
                await gathering.arrived.wait()
        except TimeoutError:
            pass

    async def _leave(self, gathering: _Gathering, grouped: bool, pushed: bool, dht_key: str, ttl: float) -> None:
        """The gathering ends: its joiners redirected, unregistered, withdrawn from our
        announcements (a leader that closed a group announces the key as left, so learners
        arriving later are late), and our DHT declaration marked closed (``grouped``: in a group)."""
        me = self.swarm.peer_id
        self._abdicate(gathering)
        if self._gatherings.get(gathering.key.fragment) is gathering:
            del self._gatherings[gathering.key.fragment]
        if gathering.leading and grouped:  # learners arriving at the key later are late
            self._left[gathering.key.fragment] = (gathering.key, self.swarm.clock.now())
        if gathering.leading:  # withdrawn; the group's members need not hear of it until our next change
            self._announce(gathering.members if grouped else ())
        if not pushed:
            try:
                await self.swarm.store(dht_key, me, {"open": False, "t": self.swarm.clock.now(), "g": grouped}, ttl)
            except NetworkError as e:
                log.debug("could not mark %s closed: %s", dht_key, e)

    @staticmethod
    def _closes_at(quorum_at: float, first_joiner_at: float | None, grace: float, lone_grace: float) -> float:
        """When a leader with its quorum since ``quorum_at`` closes (monotonic seconds): after
        ``grace``; a leader that expects others (``lone_grace`` > ``grace``) waits alone up to
        ``lone_grace``, and ``grace`` after its first joiner, never past ``lone_grace``.

        A leader still alone while other learners are expected waits up to ``max_grace``
        (``form_group``) instead of ``grace``: the paper's synchronizer folds a lone learner's
        late update into the one global state (arXiv 2604.21428, sec. 3), but here a lone round
        makes a version that any other group at the same version forks, and the loser downloads
        its state again (invariant I7). Training goes on meanwhile (the round is in flight), so
        the wait costs staleness, not compute; a peer expected but absent stops being expected
        after a few groups (``node.expected.NO_SHOWS_MAX``). ``form_group``'s ``lone_wait``
        False: no longer wait (a node's end-of-budget flush, when the peers it expects are
        finishing too and may leave before a late result reaches them)."""
        if first_joiner_at is None:
            return quorum_at + lone_grace
        return min(quorum_at + lone_grace, max(quorum_at, first_joiner_at) + grace)

    def _close(self, gathering: _Gathering, t0: float, joined: list[str]) -> Group:
        """Close ``gathering`` with this leader and the ``joined`` peers (declared joiners); the
        other joiners are redirected when the gathering ends (``_abdicate``)."""
        gathering.closed = True
        members = tuple(sorted({self.swarm.peer_id, *joined}))
        me, own = self.swarm.peer_id, self.swarm.stats.link.estimate()
        rates = [own if m == me else gathering.rates.get(m) for m in members]
        kib = tuple(min(rec.MAX_RATE_KIB, round(r / 1024)) if r else 0 for r in rates)
        group = Group(secrets.token_hex(8), gathering.key, members, swarm_clock.monotonic() - t0, me,
                      bandwidth_shares(rates), kib if any(kib) else ())
        gathering.member_signatures = tuple(gathering.signatures[m] for m in members)
        gathering.members = members
        for peer in joined:
            fut = gathering.joiners[peer]
            if not fut.done():
                fut.set_result(group)
        return group

    @staticmethod
    def _abdicate(gathering: _Gathering) -> None:
        """Send every waiting joiner elsewhere (another peer leads, or we stopped)."""
        for fut in gathering.joiners.values():
            if not fut.done():
                fut.set_result("redirect")
        gathering.joiners.clear()

    def on_push(self, keys: list[tuple[int, int, str]]) -> None:
        """A gathering announcement naming ``keys`` (fragment, version, digest) arrived
        (``Gatherings``): a gathering of ours at one of them looks at the declarations now
        (another learner leads there, or closed a group there), not at its next poll."""
        for p, v, d in keys:
            gathering = self._gatherings.get(p)
            if gathering is not None and (gathering.key.version, gathering.key.digest) == (v, d):
                gathering.arrived.set()
