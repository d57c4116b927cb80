"""Groups as matchmaking closes them: the key every member shares (:class:`GroupKey`), the
closed group (:class:`Group`, the same object on every member) and who leads at a key
(:func:`leader_rank`). ``net.rounds.matchmaking`` forms them; ``net.rounds.allreduce`` and ``net.rounds.results``
take them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["LEADER_FAILURES", "PASS_OVER_MAX_S", "PASS_OVER_S", "POLL_SECONDS", "Group", "GroupKey", "leader_rank"]

LEADER_FAILURES = 3  # failed groups in a row under one leader before it is passed over
PASS_OVER_S = 60.0  # seconds a leader with LEADER_FAILURES failures in a row is passed over (doubling)
PASS_OVER_MAX_S = 900.0
POLL_SECONDS = 0.2  # seconds between a leader's checks of its gathering (and DHT reads, without an audience)


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
    leader: str = ""  # the peer that closed it
    shares: tuple[int, ...] = ()  # all-reduce share per member (core.fragments.assign_parts); () = equal
    rates: tuple[int, ...] = ()  # link rate per member as the leader had it (KiB/s, 0 = unknown); () = none known

    def share_of(self, peer: str) -> float:
        """The part of the fragment's elements ``peer`` was given to reduce, in [0, 1] (its
        share over their sum; 1/len(members) with equal shares). Raises ValueError for a
        peer that is not a member."""
        i = self.members.index(peer)
        return self.shares[i] / sum(self.shares) if self.shares else 1 / len(self.members)


def leader_rank(dht_key: str, peer: str) -> bytes:
    """The order in which open peers lead at ``dht_key``: sha256(key, 0x00, peer ID); lowest leads."""
    return hashlib.sha256(f"{dht_key}\x00{peer}".encode()).digest()
