"""The ``mm.join`` exchange of matchmaking, both sides (:class:`Joins`, a base of
``Matchmaker``): a joiner asks the leader of its key for a place in its group and checks the
group it answers with (:meth:`Joins._join`); a leader holds each joiner's long poll until its
gathering closes (:meth:`Joins._on_join`), ``JOIN_HOLD_S`` at most.

Trust (docs/trust.md):

* every ``mm.join`` carries the joiner's Ed25519 signature over (run, fragment, version,
  digest, leader) (``signing.join_fields``); a leader admits only joiners whose signature
  verifies against their peer ID (a bad one is dropped, counted, and bans its sender), and
  answers with every member's signature; a joiner accepts a group only if the leader and the
  joiner are in its member list and every other member's signature verifies, with no DHT
  read; a leader that sends anything else is banned (provable: a leader cannot make up a
  member's signature, nor use one given to another leader; honest leaders list only peers
  that asked them and themselves). What is not excluded: a leader that gathers twice at one
  key (a retry) may list a peer that joined it the first time;
* ``mm.join`` holds at most ``MAX_GROUP`` joiners per gathering;
* banned and avoided peers are not admitted, and a group that lists one is declined
  (``net.rounds.standing``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from p2pdiloco.errors import NetworkError, PeerTimeout, ProtocolError
from p2pdiloco.net.records import parse as rec
from p2pdiloco.net.rounds.groups import POLL_SECONDS, Group, GroupKey
from p2pdiloco.net.rounds.shares import max_share
from p2pdiloco.trust import signing

if TYPE_CHECKING:
    from p2pdiloco.net.rounds.matchmaking import _Gathering
    from p2pdiloco.net.transport.swarm import Header, Swarm

log = logging.getLogger(__name__)

JOIN_HOLD_S = 120.0  # seconds a leader holds a joiner's long poll at most


class Joins:
    """Both sides of ``mm.join``; a base of ``Matchmaker``, whose ``swarm``, ``run_id``,
    ``num_fragments``, gatherings and ``listed_in`` it reads, and whose standing
    (``_shunned``, ``_leader_failed``: ``net.rounds.standing``) it consults and updates."""

    swarm: Swarm
    run_id: str
    num_fragments: int
    _gatherings: dict[int, _Gathering]
    listed_in: Callable[[Group], object]

    def _join_fields(self, key: GroupKey, leader: str) -> list:
        return signing.join_fields(self.run_id, key.fragment, key.version, key.digest, leader)

    async def _join(self, leader: str, key: GroupKey, timeout: float) -> Group | str:
        rate = self.swarm.stats.link.estimate()
        signature = signing.sign(self.swarm.identity, "mm.join", self._join_fields(key, leader))
        request = {"f": key.fragment, "v": key.version, "d": rec.wire_digest(key.digest), "sig": signature,
                   "bw": min(rec.MAX_RATE_KIB, round(rate / 1024)) if rate else 0}
        try:
            reply, _ = await self.swarm.call(leader, "mm.join", request, timeout=timeout)
        except ProtocolError as e:
            log.debug("join refused by %s: %s", leader[-8:], e)
            return "gone"
        except NetworkError as e:
            log.debug("leader %s unreachable: %s", leader[-8:], e)
            if isinstance(e, PeerTimeout):  # it held us past the grace window without a group
                self._leader_failed(leader, "held a joiner past the grace window")
                return "held"
            return "gone"
        try:
            answer = rec.parse_join_answer(reply)
        except ProtocolError as e:  # it answered, authenticated, with what no honest leader sends
            self.swarm.drop(leader, "join_answer")
            self.swarm.ban(leader, f"answered a join with a malformed group: {e}")
            return "gone"
        if answer.status == "group":
            members, me = answer.members, self.swarm.peer_id
            if me not in members or leader not in members:
                self.swarm.ban(leader, "led a group without itself or without the joiner")
                return "gone"
            if answer.shares and max(answer.shares) > max_share(len(members)):
                self.swarm.ban(leader, f"gave one member {max(answer.shares)} of {rec.SHARE_GRID} of the all-reduce")
                return "gone"
            group = Group(answer.round, key, members, answer.formed_in, leader, answer.shares, answer.rates)
            self.listed_in(group)  # now: the others' slices may come while we check it (our reducer part serves them)
            if any(m not in self.swarm.bans and self._shunned(m) for m in members):
                return "gone"  # one whose merged part we refused: the leader may not know (not its failure)
            if any(m in self.swarm.bans for m in members):  # one we excluded (a revocation that reached us
                self._leader_failed(leader, "led a group with a member we excluded")  # first): not a ban, but
                return "gone"  # a leader that keeps doing it is passed over; we do not merge with that member
            fields = self._join_fields(key, leader)  # every member asked this leader: it cannot make one up
            ghosts = [m for m, sig in zip(members, answer.signatures)
                      if m != me and not signing.verify_by_peer(m, "mm.join", fields, sig)]
            if ghosts:
                self.swarm.ban(leader, f"led a group with {len(ghosts)} member(s) that never asked to join at its key")
                return "gone"
            return group
        if answer.status == "redirect":
            await asyncio.sleep(POLL_SECONDS)  # let the DHT show the other leader
            return "redirect"
        return "gone"  # closed, or not gathering at this key

    async def _on_join(self, peer: str, header: Header, _: bytes) -> tuple[Header, bytes]:
        try:
            request = rec.parse_join_request(header, self.num_fragments)
        except ProtocolError:
            self.swarm.drop(peer, "join_request")
            raise
        key = GroupKey(request.fragment, request.version, request.digest)
        if peer in self.swarm.bans:
            raise ProtocolError(f"excluded from this run: {self.swarm.bans[peer]}")
        if self._shunned(peer):
            raise ProtocolError("not grouping with this peer now: its merged part was refused")
        if not signing.verify_by_peer(peer, "mm.join", self._join_fields(key, self.swarm.peer_id), request.signature):
            self.swarm.drop(peer, "join_signature")  # an honest node signs its own joins
            self.swarm.ban(peer, "sent a join with a bad signature")
            raise ProtocolError("join signature does not verify")
        gathering = self._gatherings.get(key.fragment)
        if gathering is None or gathering.closed or gathering.key != key:
            return {"status": "closed"}, b""
        if gathering.following is not None:
            # we are joining another leader: a joiner held here until that join ends (the
            # grace window) would miss the group and, with another one held the same way,
            # form a second group at this version afterwards (a fork, found in tests/test_memory_net.py)
            return {"status": "redirect"}, b""
        if peer not in gathering.joiners and len(gathering.joiners) >= rec.MAX_GROUP - 1:
            return {"status": "closed"}, b""
        fut = asyncio.get_running_loop().create_future()
        old = gathering.joiners.pop(peer, None)
        if old is not None and not old.done():
            old.set_result("redirect")
        gathering.joiners[peer] = fut
        gathering.signatures[peer] = request.signature  # as many as joiners (MAX_GROUP - 1) and ours
        if request.bandwidth and (peer in gathering.rates or len(gathering.rates) < 4 * rec.MAX_GROUP):
            gathering.rates[peer] = request.bandwidth * 1024.0
        gathering.arrived.set()
        try:
            async with asyncio.timeout(JOIN_HOLD_S):
                result = await fut
        except TimeoutError:
            return {"status": "closed"}, b""
        finally:
            if gathering.joiners.get(peer) is fut:
                del gathering.joiners[peer]
                if not gathering.closed:  # left before the group closed: its signature goes too
                    gathering.signatures.pop(peer, None)
        if isinstance(result, Group):
            return {"members": rec.wire_members(result.members), "round": result.round_id, "t": result.formed_in,
                    "s": list(result.shares), "bw": list(result.rates),  # not the joiner's own signature:
                    "js": [b"" if m == peer else s for m, s in zip(result.members, gathering.member_signatures)]}, b""
        return {"status": "redirect"}, b""
