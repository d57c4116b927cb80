"""Lateness: whether a group at our key closed without us (``Matchmaker.form_group`` returns
"late" then), and what forged "in a group" declarations may cost.

A learner that arrives after a group already closed at its version does not form a competing
group (that would split the swarm's history, invariant I7, docs/architecture.md); it defers to
that group's members and follows their state. :class:`LateGroups`, a base of ``Matchmaker``,
keeps the record: whose declarations make us late at a key (``_grouped``), whom we deferred to
(``_late``), whose groups are set aside (failed, or delivered nothing) and whose declarations
are ignored everywhere for a while (``_struck``, docs/trust.md).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Literal

from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.rounds.gatherings import FUTURE_SLACK_S
from p2pdiloco.net.rounds.groups import LEADER_FAILURES, PASS_OVER_MAX_S, PASS_OVER_S, Group, GroupKey
from p2pdiloco.net.transport import clock as swarm_clock

if TYPE_CHECKING:
    from p2pdiloco.net.transport.swarm import Swarm


class LateGroups:
    """The groups that made this learner late, by key; a base of ``Matchmaker``, whose
    ``swarm``, ``undeliverable`` and ``listed_in`` it reads."""

    swarm: Swarm
    undeliverable: Callable[[], Container[str]]
    listed_in: Callable[[Group], object]

    def __init__(self) -> None:
        # key -> {peer: (swarm time, from when: monotonic s)}: from then on, its "in a group"
        # declarations at the key stamped no later than that time do not count (a group of its
        # there failed, or delivered nothing to us)
        self._set_aside: dict[GroupKey, dict[str, tuple[float, float]]] = {}
        # key -> ({peer: its declaration's t}, when we were first late there: monotonic s)
        self._deferred: dict[GroupKey, tuple[dict[str, float], float]] = {}
        self._exhausted: dict[GroupKey, None] = {}  # keys where we were late for round_time already
        self.empty_groups: Counter[str] = Counter()  # peer -> groups we deferred to that delivered nothing, in a row
        self.ignored_groups: dict[str, float] = {}  # peer -> its "left in a group" ignored until (monotonic s)

    def _put_aside(self, key: GroupKey, peers: dict[str, float], after: float = 0.0) -> None:
        """Set ``peers``' "in a group" declarations at ``key`` stamped up to their time aside,
        ``after`` seconds from now (bounded: 64 keys, the oldest go first; 256 peers a key)."""
        aside, start = self._set_aside.setdefault(key, {}), swarm_clock.monotonic() + after
        for peer, t in list(peers.items())[:256]:
            old_t, old_start = aside.get(peer, (t, start))
            aside[peer] = (max(t, old_t), min(start, old_start))
        while len(aside) > 256:
            del aside[next(iter(aside))]
        while len(self._set_aside) > 64:
            del self._set_aside[next(iter(self._set_aside))]

    def _settle_deferrals(self, key: GroupKey, round_time: float) -> None:
        """Before gathering at ``key``: a deferral (we were late) at another key of the fragment
        is settled (we moved on); one at this key ``round_time`` seconds old or more is not:
        nothing we deferred to moved us, so we are late at the key no more (``_exhausted``: a
        bound on what fresh forged identities can cost at one key) and strike its peers
        (``_struck``)."""
        now = swarm_clock.monotonic()
        for k in [k for k in self._deferred if k.fragment == key.fragment and k != key]:
            del self._deferred[k]
        if key in self._deferred and now - self._deferred[key][1] >= round_time:
            self._exhausted[key] = None
            while len(self._exhausted) > 64:
                del self._exhausted[next(iter(self._exhausted))]
            self._struck(key)
        self.ignored_groups = {p: t for p, t in self.ignored_groups.items() if t > now}

    def _struck(self, key: GroupKey) -> None:
        """The peers we deferred to at ``key`` delivered nothing (we formed our own group there,
        or waited ``round_time``): set aside at the key, and a peer in ``LEADER_FAILURES`` such
        groups with no group merged with it in between has its "in a group" declarations
        ignored everywhere for ``PASS_OVER_S`` seconds, doubling (as a failing leader's;
        ``group_succeeded`` clears both)."""
        peers, _ = self._deferred.pop(key, ({}, 0.0))
        self._put_aside(key, peers)
        now = swarm_clock.monotonic()
        for peer in peers:
            n = self.empty_groups[peer] = self.empty_groups[peer] + 1
            if n >= LEADER_FAILURES:
                self.ignored_groups[peer] = now + min(PASS_OVER_MAX_S, PASS_OVER_S * 2 ** (n - LEADER_FAILURES))
        if len(self.empty_groups) > 4096:  # bounded: keep the worst offenders
            self.empty_groups = Counter(dict(self.empty_groups.most_common(1024)))

    def _late(self, key: GroupKey, grouped: dict[str, float]) -> tuple[Literal["late"], None]:
        """Return "late", remembering whose group we deferred to (``_settle_deferrals``)."""
        peers, since = self._deferred.pop(key, ({}, swarm_clock.monotonic()))
        self._deferred[key] = ({**peers, **dict(list(grouped.items())[:max(0, 256 - len(peers))])}, since)
        while len(self._deferred) > 64:
            del self._deferred[next(iter(self._deferred))]
        return "late", None

    def ignoring_groups(self) -> dict[str, float]:
        """Peers whose declarations of being in a group are ignored now, {peer ID: seconds left}."""
        now = swarm_clock.monotonic()
        return {p: round(t - now, 1) for p, t in self.ignored_groups.items() if t > now}

    def _grouped(self, key: GroupKey, entries: dict[str, rec.Declaration], fresh_for: float) -> dict[str, float]:
        """{peer: t} of the declarations at ``key`` that make us late (``form_group``): "in a
        group", stamped within ``fresh_for`` seconds of now (and not ahead of it by more than
        the clock slack), not set aside, not by an ignored peer nor one whose state we cannot
        fetch; none once we have been late at the key for ``round_time``.

        Late: a learner, leader or joiner, that sees a peer which already left in a group at
        its key (a declaration that says so, stamped within ``round_time`` seconds, default the
        declarations' lifetime) returns ("late", None) from ``form_group`` at once, whatever its
        own group's size, and a leader's joiners are sent away to find the same: a second group
        at one version is a fork that one side loses with the progress merged into it (invariant
        I7), whereas a late learner follows the group's state with its progress rebased and
        contributes it to the next round. Declarations of peers that left without a group
        (late, no quorum) do not count, nor those of a group this node saw fail, stamped before
        it failed. Forged declarations (a group that does not exist) cost a learner at most
        ``round_time`` at a key, whoever makes them: after that it is not late there again, and
        the peers it deferred to are struck (``_settle_deferrals``, ``_struck``, docs/trust.md)."""
        if key in self._exhausted:
            return {}
        now, cannot_fetch, mono = self.swarm.clock.now(), self.undeliverable(), swarm_clock.monotonic()
        aside = {p: t for p, (t, start) in self._set_aside.get(key, {}).items() if mono >= start}
        return {p: d.t for p, d in entries.items()
                if d.grouped and p != self.swarm.peer_id and -FUTURE_SLACK_S <= now - d.t <= fresh_for
                and d.t > aside.get(p, -math.inf) and p not in self.ignored_groups and p not in cannot_fetch}

    def _formed(self, key: GroupKey, group: Group) -> Group:
        """We are in ``group`` at ``key``: whoever we deferred to there delivered nothing."""
        self.listed_in(group)
        if key in self._deferred:
            self._struck(key)
        return group
