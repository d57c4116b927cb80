"""Pushing a node's newest small record to the learners it knows, instead of having them poll
the DHT for it (issue 13 of this project: the control plane). A DHT read is a Kademlia
traversal whose answers each carry every node's record (about 9 kB among 5 peers, measured in
docs/benchmarks/control_plane.md); a push is one RPC of about 100-400 bytes to each learner.

:class:`Pusher` holds the newest value and pushes it, whenever it changes, to the audience
(the live learners of the node's last records read; at most ``MAX_AUDIENCE``, a random sample
above that), each peer by a sender of its own, so that a peer that stalls delays nothing but
its own pushes. A learner that does not answer within ``PUSH_TIMEOUT_S`` gets no push for
``SKIP_S``, unless it pushes to us meanwhile (:meth:`Pusher.heard_from`: it restarted, say). What a receiver
does with a push is its owner's business (``net.gatherings``, ``net.statesync``): the
transport authenticates the pusher, so a pushed value is its author's own, like a DHT record
under the author's peer ID.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from p2pdiloco.errors import NetworkError, ProtocolError
from p2pdiloco.net import clock as swarm_clock
from p2pdiloco.net.transport import Swarm

__all__ = ["Pusher", "MAX_AUDIENCE", "MAX_PUSHED", "PUSH_TIMEOUT_S", "SKIP_S"]

MAX_AUDIENCE = 64  # learners a value is pushed to at most
MAX_PUSHED = 1024  # authors whose newest push a receiver keeps (the oldest go first)
PUSH_TIMEOUT_S = 1.0  # seconds for one push ...
SKIP_S = 30.0  # ... and a peer that failed one gets none for this long (seconds)


class Pusher:
    """Pushes the newest value given to :meth:`set` as RPC ``method`` (module docstring).

    Attributes:
        audience: the node sets it: the live learners it knows (peer IDs).
        stats: pushes "sent" and "failed" (the owner counts what it receives).
    """

    def __init__(self, swarm: Swarm, method: str):
        self.swarm, self.method = swarm, method
        self.audience: Callable[[], Iterable[str]] = tuple
        self.stats: Counter[str] = Counter()
        self._value: dict[str, Any] | None = None
        self._changed = asyncio.Event()
        self._skip: dict[str, float] = {}  # peer -> monotonic time until which it gets no push
        self._version = 0  # changes of the value so far
        self._sending: set[str] = set()  # peers with a push in flight

    def heard_from(self, peer: str) -> None:
        """``peer`` reached us (it pushed to us): if it was skipped after a failed push (it was
        down, and restarted since), it gets our pushes again from now on."""
        if self._skip.pop(peer, None) is not None:
            self._changed.set()  # and the newest value now, not at our next change

    def set(self, value: dict[str, Any]) -> None:
        """Push ``value`` (an RPC header) next; a value not pushed yet is replaced."""
        self._value = value
        self._changed.set()

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
                self._version += 1
                me, now = self.swarm.peer_id, swarm_clock.monotonic()
                self._skip = {p: t for p, t in self._skip.items() if t > now}
                peers = [p for p in dict.fromkeys(self.audience())
                         if p != me and p not in self.swarm.bans and p not in self._skip]
                if len(peers) > MAX_AUDIENCE:
                    peers = random.sample(peers, MAX_AUDIENCE)
                for peer in peers:
                    if peer not in self._sending:
                        self._sending.add(peer)
                        tg.create_task(self._sender(peer))

    async def _sender(self, peer: str) -> None:
        """Push to ``peer`` until it holds the newest value, or a push fails."""
        try:
            sent = None
            while sent != self._version and peer not in self._skip:
                sent = self._version
                await self._push(peer, self._value or {})
        finally:
            self._sending.discard(peer)

    async def _push(self, peer: str, value: dict[str, Any]) -> None:
        try:
            await self.swarm.call(peer, self.method, value, timeout=PUSH_TIMEOUT_S)
            self.stats["sent"] += 1
        except (NetworkError, ProtocolError):  # skipped a while: a peer that stalls delays the others' pushes
            self.stats["failed"] += 1
            if len(self._skip) < 4 * MAX_AUDIENCE:
                self._skip[peer] = swarm_clock.monotonic() + SKIP_S
