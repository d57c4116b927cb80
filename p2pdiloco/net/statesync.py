"""Swarm records and global-state transfer.

Records: every node publishes one DHT record under ``{run}/heads`` (subkey: its peer ID)
with, per fragment, the version and digest of the global state it holds, plus heartbeat
figures (inner step, tokens/s, loss). Readers pick, per fragment, the newest version; at a
version held with two digests (two groups merged the same version: split brain, invariant
I7) the digest held by more peers wins, ties to the smaller digest, so every node resolves
it the same way and the losers re-sync.

Transfer: ``state.get`` returns a fragment's Θ and outer momentum (fp32) with its version
and digest; the receiver recomputes the digest over the bytes it got and installs nothing
unless it matches the record it chose (a partial or stale download is discarded).

Trust: records are signed DHT records under their owner's peer ID (``transport.SignedRecords``):
nobody can write or overwrite another node's record, and entries under a subkey that is not
an Ed25519 peer ID are ignored, so every holder counted by :func:`newest_heads` is a peer that
signed its claim. A download is accepted only from a holder and only if the digest over the
received bytes equals the (version, digest) of those signed records. On start, a node asks a
few record owners whether they accept it (``trust.hello``): a node refused by a private swarm
stops with the members' reason instead of training alone.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from p2pdiloco.core.fragments import Fragment
from p2pdiloco.core.outer import FragmentState, fragment_digest
from p2pdiloco.errors import NetworkError, ProtocolError, StateSyncError
from p2pdiloco.net import wire
from p2pdiloco.net.transport import Header, Swarm
from p2pdiloco.trust.identity import is_peer_id

log = logging.getLogger(__name__)

HEAD_TTL = 60.0  # seconds a heartbeat record lives without refresh


@dataclass(frozen=True)
class Head:
    """The swarm's newest state of one fragment, and who holds it."""

    version: int
    digest: str
    holders: tuple[str, ...]


def newest_heads(records: dict[str, Any], num_fragments: int) -> list[Head | None]:
    """Per fragment, the winning (version, digest) among peers' records and its holders.

    Rule (invariant I7): highest version; at equal versions, most holders, then the smaller
    digest. Malformed records are ignored.
    """
    votes: list[dict[tuple[int, str], list[str]]] = [{} for _ in range(num_fragments)]
    for peer, rec in records.items():
        frags = rec.get("f") if isinstance(rec, dict) else None
        if not isinstance(frags, list) or len(frags) != num_fragments:
            continue
        for p, item in enumerate(frags):
            if isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], str) \
                    and len(item[1]) == 64:
                votes[p].setdefault((item[0], item[1]), []).append(peer)
    heads: list[Head | None] = []
    for v in votes:
        if not v:
            heads.append(None)
            continue
        (version, digest), holders = max(v.items(), key=lambda kv: (kv[0][0], len(kv[1]), _neg(kv[0][1])))
        heads.append(Head(version, digest, tuple(sorted(holders))))
    return heads


def _neg(digest: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in digest)


def is_behind(mine: FragmentState, head: Head | None) -> bool:
    """True when ``head`` should replace ``mine`` (newer version, or same version, other digest)."""
    if head is None:
        return False
    return head.version > mine.version or (head.version == mine.version and head.digest != mine.digest)


class StateSync:
    """Publishes this node's record and transfers fragment states. One per node.

    Args:
        swarm: the transport.
        run_id: the run's name.
        fragments: the model's fragments.
        current: callable returning this node's committed global states (one per fragment).
    """

    def __init__(self, swarm: Swarm, run_id: str, fragments: Sequence[Fragment],
                 current: Callable[[], Sequence[FragmentState]]):
        self.swarm, self.run_id, self.fragments, self.current = swarm, run_id, tuple(fragments), current
        self.downloads = 0
        self.failed_downloads = 0

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
        await self.swarm.add_handler("state.get", self._on_get)
        await self.swarm.check_admission(self.heads_key)

    async def publish(self, extra: dict[str, Any]) -> None:
        """Store this node's record: per-fragment [version, digest] plus ``extra`` figures."""
        record = {"f": [[s.version, s.digest] for s in self.current()], "t": time.time(), **extra}
        await self.swarm.store(self.heads_key, self.swarm.peer_id, record, HEAD_TTL)

    async def records(self) -> dict[str, Any]:
        """Every live node's record, {peer ID: record}: only records under a peer ID, which
        the DHT accepted only when signed by that peer (and, in a private swarm, a member)."""
        return {p: r for p, r in (await self.swarm.get(self.heads_key)).items() if is_peer_id(p)}

    async def download(self, fragment: int, head: Head, *, timeout: float) -> FragmentState:
        """Fetch ``fragment`` at ``head`` from one of its holders, trying them in random order.

        Raises:
            StateSyncError: no holder returned a state whose digest matches ``head``.
        """
        donors = [p for p in head.holders if p != self.swarm.peer_id]
        random.shuffle(donors)  # newcomers spread over donors instead of all hitting one
        last = "no other holder"
        for donor in donors:
            try:
                state = await self._fetch(donor, fragment, timeout)
            except (NetworkError, StateSyncError) as e:
                self.failed_downloads += 1
                last = str(e)
                log.info("state download of fragment %d from %s failed: %s", fragment, donor[-8:], e)
                continue
            if (state.version, state.digest) == (head.version, head.digest):
                self.downloads += 1
                return state
            last = f"{donor[-8:]} now holds v{state.version}, not v{head.version}"
        raise StateSyncError(f"fragment {fragment} v{head.version}: {last}")

    async def _fetch(self, donor: str, fragment: int, timeout: float) -> FragmentState:
        reply, body = await self.swarm.call(donor, "state.get", {"f": fragment}, timeout=timeout)
        try:
            version, digest = int(reply["v"]), str(reply["d"])
        except (KeyError, TypeError, ValueError):
            raise StateSyncError("malformed state reply") from None
        shapes = [s.shape for s in self.fragments[fragment].slots]
        try:
            tensors = wire.decode(body, shapes + shapes, "fp32")
        except ProtocolError as e:
            raise StateSyncError(f"partial or malformed state from {donor[-8:]}: {e}") from None
        n = len(shapes)
        theta, momentum = tensors[:n], tensors[n:]
        if fragment_digest(fragment, version, theta, momentum) != digest:
            raise StateSyncError(f"state from {donor[-8:]} does not match its digest")
        return FragmentState.create(fragment, version, theta, momentum)

    async def _on_get(self, _: str, header: Header, __: bytes) -> tuple[Header, bytes]:
        try:
            fragment = int(header["f"])
            state = self.current()[fragment]
        except (KeyError, TypeError, ValueError, IndexError):
            raise ProtocolError("malformed state request") from None
        body = wire.encode(list(state.theta) + list(state.momentum), "fp32")
        return {"v": state.version, "d": state.digest}, body
