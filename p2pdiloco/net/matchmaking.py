"""DHT-matched group formation for one fragment's outer round.

Only learners at the same fragment version *and* the same global-state digest can be
grouped (invariant I3 of the design brief): the DHT key they declare under contains both.
Among the learners declared open under a key, the one with the smallest peer ID leads: the
others send it a long-poll ``mm.join`` request; the leader closes the group once the
minimum quorum K is reached and the grace window has passed (or everyone declared has
joined), then answers every joiner with the same member list and round ID
(Decoupled DiLoCo, arXiv 2604.21428, sec. 3: minimum quorum and grace window).

A learner that arrives after a group already closed at its version does not form a
competing group (that would split the swarm's history); it reports ``late`` and the caller
catches up with the group's result instead.

Trust: declarations and gathering announcements are DHT records under the declaring peer's
own ID, so only that peer can write or overwrite them (``transport.SignedRecords``); entries
under any other subkey are ignored. Peers on the swarm's ban list (``Swarm.bans``: a contribution of theirs failed
verification) are neither followed as leaders nor admitted by ``mm.join``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from p2pdiloco.errors import NetworkError, ProtocolError
from p2pdiloco.net.transport import Header, Swarm
from p2pdiloco.trust.identity import is_peer_id

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
Outcome = Literal["group", "late", "no_quorum"]


@dataclass(frozen=True)
class GroupKey:
    """What members of one group must share: fragment index, version and state digest."""

    fragment: int
    version: int
    digest: str

    def dht_key(self, run_id: str) -> str:
        return f"{run_id}/mm/{self.fragment}/{self.version}/{self.digest[:16]}"


@dataclass(frozen=True)
class Group:
    """A closed group: members sorted by peer ID; the same object on every member."""

    round_id: str
    key: GroupKey
    members: tuple[str, ...]
    formed_in: float  # seconds from declaring to the group closing, on this member


@dataclass
class _Gathering:
    key: GroupKey
    joiners: dict[str, asyncio.Future] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False


class Matchmaker:
    """Forms groups for fragment rounds. One per node; serves ``mm.join``.

    Args:
        swarm: the transport.
        run_id: the run's name, part of every DHT key.
        min_quorum: K, the smallest group that may merge (K = 1: a lone learner merges alone).
    """

    def __init__(self, swarm: Swarm, run_id: str, min_quorum: int):
        if min_quorum < 1:
            raise ValueError(f"min_quorum must be >= 1, got {min_quorum}")
        self.swarm, self.run_id, self.min_quorum = swarm, run_id, min_quorum
        self._gatherings: dict[int, _Gathering] = {}

    async def start(self) -> None:
        await self.swarm.add_handler("mm.join", self._on_join)

    @property
    def gathering_key(self) -> str:
        """DHT key where every learner announces, under its own peer ID, the fragments it is
        gathering a group for: ``{"g": [[fragment, version, digest], ...], "t": time}``."""
        return f"{self.run_id}/gathering"

    async def open_gatherings(self) -> dict[int, GroupKey]:
        """Fragments other learners are gathering a group for right now (fragment -> key).

        Each learner's announcement is its own owner-only record, so nobody can hide or replace
        another's; banned peers' announcements are ignored. Where learners gather at different
        keys for one fragment, the key announced by the most learners is returned (ties: the
        higher version, then the smaller digest).
        """
        votes: dict[int, Counter[tuple[int, str]]] = {}
        for peer, val in (await self.swarm.get(self.gathering_key)).items():
            if not is_peer_id(peer) or peer in self.swarm.bans or peer == self.swarm.peer_id:
                continue
            items = val.get("g") if isinstance(val, dict) else None
            for item in items if isinstance(items, list) else ():
                try:
                    p, v, d = int(item[0]), int(item[1]), str(item[2])
                except (IndexError, TypeError, ValueError):
                    continue
                votes.setdefault(p, Counter())[(v, d)] += 1
        out = {}
        for p, counter in votes.items():
            (v, d), _ = max(counter.items(), key=lambda kv: (kv[1], kv[0][0], tuple(-ord(c) for c in kv[0][1])))
            out[p] = GroupKey(p, v, d)
        return out

    async def _announce(self, ttl: float) -> None:
        """Store the fragments this learner is gathering for (owner-only record)."""
        keys = [[g.key.fragment, g.key.version, g.key.digest] for g in self._gatherings.values() if not g.closed]
        await self.swarm.store(self.gathering_key, self.swarm.peer_id, {"g": keys, "t": time.time()}, ttl)

    async def form_group(
        self, key: GroupKey, *, grace: float, quorum_timeout: float, expected: int = 0
    ) -> tuple[Outcome, Group | None]:
        """Declare readiness under ``key`` and return the group this learner ends up in.

        Waits at most ``quorum_timeout`` seconds for K members, then at most ``grace`` more
        seconds for others, closing early once ``expected`` members (the live learners this
        node knows of; 0 = unknown) have joined. Returns ("group", Group), ("late", None) when a group at this
        version closed without us, or ("no_quorum", None).

        Raises:
            NetworkError: the DHT could not be reached.
        """
        me, t0 = self.swarm.peer_id, time.monotonic()
        deadline = t0 + quorum_timeout
        dht_key, ttl = key.dht_key(self.run_id), quorum_timeout + grace + 30
        await self.swarm.store(dht_key, me, {"open": True, "t": time.time()}, ttl)
        gathering = _Gathering(key)
        self._gatherings[key.fragment] = gathering
        await self._announce(quorum_timeout + grace)
        excluded: set[str] = set()
        quorum_at: float | None = None
        try:
            while True:
                entries = {p: v for p, v in (await self.swarm.get(dht_key)).items()
                           if is_peer_id(p) and p not in self.swarm.bans}
                open_peers = {p for p, v in entries.items() if isinstance(v, dict) and v.get("open")}
                open_peers = (open_peers - excluded) | {me}
                someone_closed = any(isinstance(v, dict) and not v.get("open") for v in entries.values())
                leader = min(open_peers)
                now = time.monotonic()
                if leader != me:
                    self._abdicate(gathering)
                    outcome = await self._join(leader, key, timeout=max(0.5, deadline + grace + 2 - now))
                    if isinstance(outcome, Group):
                        return "group", outcome
                    if outcome == "gone":
                        excluded.add(leader)
                    elif now > deadline:
                        return ("late" if someone_closed else "no_quorum"), None
                    continue
                size = 1 + len(gathering.joiners)
                if size >= self.min_quorum and quorum_at is None:
                    quorum_at = now
                everyone = size >= max(expected, 2)  # a lone learner still waits its grace
                if quorum_at is not None and (everyone or now >= quorum_at + grace):
                    if size == 1 and someone_closed:
                        return "late", None  # a group at this version exists: don't fork it
                    return "group", self._close(gathering, t0)
                if quorum_at is None and now > deadline:
                    return ("late" if someone_closed else "no_quorum"), None
                gathering.arrived.clear()
                try:
                    async with asyncio.timeout(POLL_SECONDS):
                        await gathering.arrived.wait()
                except TimeoutError:
                    pass
        finally:
            self._abdicate(gathering)
            if self._gatherings.get(key.fragment) is gathering:
                del self._gatherings[key.fragment]
            try:
                await self.swarm.store(dht_key, me, {"open": False, "t": time.time()}, ttl)
                await self._announce(quorum_timeout + grace)
            except NetworkError as e:
                log.debug("could not mark %s closed: %s", dht_key, e)

    def _close(self, gathering: _Gathering, t0: float) -> Group:
        gathering.closed = True
        members = tuple(sorted({self.swarm.peer_id, *gathering.joiners}))
        group = Group(secrets.token_hex(8), gathering.key, members, time.monotonic() - t0)
        for fut in gathering.joiners.values():
            if not fut.done():
                fut.set_result(group)
        return group

    @staticmethod
    def _abdicate(gathering: _Gathering) -> None:
        """Send every waiting joiner elsewhere (a lower peer ID leads, or we stopped)."""
        for fut in gathering.joiners.values():
            if not fut.done():
                fut.set_result("redirect")
        gathering.joiners.clear()

    async def _join(self, leader: str, key: GroupKey, timeout: float) -> Group | str:
        request = {"f": key.fragment, "v": key.version, "d": key.digest}
        try:
            reply, _ = await self.swarm.call(leader, "mm.join", request, timeout=timeout)
        except ProtocolError as e:
            log.debug("join refused by %s: %s", leader[-8:], e)
            return "gone"
        except NetworkError as e:
            log.debug("leader %s unreachable: %s", leader[-8:], e)
            return "gone"
        if "members" in reply:
            members = tuple(str(m) for m in reply["members"])
            if self.swarm.peer_id not in members or tuple(sorted(members)) != members:
                log.warning("leader %s sent a malformed group; ignoring it", leader[-8:])
                return "gone"
            return Group(str(reply["round"]), key, members, float(reply.get("t", 0.0)))
        if reply.get("status") == "redirect":
            await asyncio.sleep(POLL_SECONDS)  # let the DHT show the lower leader
            return "redirect"
        return "gone"  # closed, or not gathering at this key

    async def _on_join(self, peer: str, header: Header, _: bytes) -> tuple[Header, bytes]:
        try:
            key = GroupKey(int(header["f"]), int(header["v"]), str(header["d"]))
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("malformed join request") from None
        if peer in self.swarm.bans:
            raise ProtocolError(f"excluded from this run: {self.swarm.bans[peer]}")
        gathering = self._gatherings.get(key.fragment)
        if gathering is None or gathering.closed or gathering.key != key:
            return {"status": "closed"}, b""
        fut = asyncio.get_running_loop().create_future()
        old = gathering.joiners.pop(peer, None)
        if old is not None and not old.done():
            old.set_result("redirect")
        gathering.joiners[peer] = fut
        gathering.arrived.set()
        try:
            async with asyncio.timeout(120):
                result = await fut
        except TimeoutError:
            return {"status": "closed"}, b""
        finally:
            if gathering.joiners.get(peer) is fut:
                del gathering.joiners[peer]
        if isinstance(result, Group):
            return {"members": list(result.members), "round": result.round_id, "t": result.formed_in}, b""
        return {"status": "redirect"}, b""
