"""Whom matchmaking passes over and avoids (docs/trust.md): the standing of leaders and of
peers this node refused, kept by :class:`Standing`, a base of ``Matchmaker``.

* a leader that keeps a joiner waiting past the grace window (when the joiner and the
  leader already make a quorum) is passed over for that round, and that counts as a failed
  group; a leader whose groups failed ``LEADER_FAILURES`` times in a row (rounds reported
  by the node through ``Matchmaker.group_failed``, and such waits) is passed over as a
  leader for ``PASS_OVER_S`` seconds, doubling with every further failure (at most
  ``PASS_OVER_MAX_S``); a committed group clears its leader. This is not a ban: a stopped
  (SIGSTOP) or overloaded honest leader fails the same way and must be able to come back.
* Peers on the swarm's ban list (``Swarm.bans``), and peers avoided for a while after this node
  refused a merged part they signed (:meth:`Standing.avoid`), are neither followed as leaders
  nor admitted by ``mm.join``, and a group that lists one is declined; their declarations, stored
  or pushed, count for nothing (a group of two avoided colluders at our key does not make us
  late: we would wait for a state we refuse to follow).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import TYPE_CHECKING

from p2pdiloco.net.rounds.groups import LEADER_FAILURES, PASS_OVER_MAX_S, PASS_OVER_S
from p2pdiloco.net.transport import clock as swarm_clock

if TYPE_CHECKING:
    from p2pdiloco.net.transport.swarm import Swarm

log = logging.getLogger(__name__)

AVOID_S = 120.0  # seconds a peer this node refused a merged part of is not grouped with (doubling)
AVOID_MAX_S = 3600.0


class Standing:
    """Leaders passed over and peers avoided; a base of ``Matchmaker``, whose ``swarm`` it reads."""

    swarm: Swarm

    def __init__(self) -> None:
        self.leader_failures: Counter[str] = Counter()  # leader -> its groups that failed in a row
        self.passed_over: dict[str, float] = {}  # leader -> passed over until (monotonic s)
        self.avoided: dict[str, float] = {}  # peer -> not grouped with until (monotonic s): see avoid
        self.avoidances: Counter[str] = Counter()  # peer -> times avoided
        super().__init__()

    def avoid(self, peer: str, why: str) -> None:
        """Form no group with ``peer`` for ``AVOID_S`` seconds, doubling with every further
        call (at most ``AVOID_MAX_S``): this node refused a merged part it signed
        (``core.audit``). Its declarations are not read (neither followed as a leader nor
        making us late), its joins are refused, and a group that lists it is declined. Not a
        ban: the check is evidence against this node's own Δ, not proof to others."""
        n = self.avoidances[peer] = self.avoidances[peer] + 1
        seconds = min(AVOID_MAX_S, AVOID_S * 2 ** (n - 1))
        self.avoided[peer] = swarm_clock.monotonic() + seconds
        log.info("not grouping with %s for %.0f s: %s", peer[-8:], seconds, why)
        if len(self.avoidances) > 4096:  # bounded: keep the worst offenders
            self.avoidances = Counter(dict(self.avoidances.most_common(1024)))
            self.avoided = {p: t for p, t in self.avoided.items() if p in self.avoidances}

    def avoiding(self) -> dict[str, float]:
        """Peers this node forms no group with now (:meth:`avoid`), {peer ID: seconds left}."""
        now = swarm_clock.monotonic()
        self.avoided = {p: t for p, t in self.avoided.items() if t > now}
        return {p: round(t - now, 1) for p, t in self.avoided.items()}

    def _shunned(self, peer: str) -> bool:
        """Banned, or avoided now."""
        return peer in self.swarm.bans or self.avoided.get(peer, -math.inf) > swarm_clock.monotonic()

    def _leader_failed(self, leader: str, why: str) -> None:
        if not leader or leader == self.swarm.peer_id:
            return
        n = self.leader_failures[leader] = self.leader_failures[leader] + 1
        if n >= LEADER_FAILURES:
            seconds = min(PASS_OVER_MAX_S, PASS_OVER_S * 2 ** (n - LEADER_FAILURES))
            self.passed_over[leader] = swarm_clock.monotonic() + seconds
            log.info("passing over %s as a leader for %.0f s: %d failed groups in a row (last: %s)",
                     leader[-8:], seconds, n, why)
        if len(self.leader_failures) > 4096:  # bounded: keep the worst offenders
            self.leader_failures = Counter(dict(self.leader_failures.most_common(1024)))

    def passing_over(self) -> dict[str, float]:
        """Leaders passed over now, {peer ID: seconds left}."""
        now = swarm_clock.monotonic()
        self.passed_over = {p: t for p, t in self.passed_over.items() if t > now}
        return {p: round(t - now, 1) for p, t in self.passed_over.items()}
