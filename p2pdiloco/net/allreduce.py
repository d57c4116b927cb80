"""Butterfly all-reduce of one fragment's pseudo-gradients within a closed group.

The fragment's tensors are split among the members with the same greedy balanced packing
as fragments (``assign_parts``); member r reduces the tensors it owns. Every member sends
each reducer its slice of the pseudo-gradient with its token and step counts, in one
``ar.reduce`` request that the reducer answers, once it holds every member's slice, with
the merged slice (token-weighted, radial-directional merge, brief section 1). Whole tensors
per reducer mean every norm of the radial-directional merge is computed by exactly one
peer, and everyone receives the same bytes.

All or nothing (invariant I2): a reducer answers only when it holds all contributions; if
any is missing at its deadline it answers an error, and a member commits only when every
reducer answered. A member that got no answer cannot know whether others committed, so the
caller re-syncs from the swarm's records instead of guessing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from p2pdiloco.core.fragments import Fragment, assign_parts
from p2pdiloco.core.merge import contribution_weight, is_finite_contribution, merge_tensor
from p2pdiloco.errors import NetworkError, ProtocolError, RoundFailed
from p2pdiloco.net import wire
from p2pdiloco.net.matchmaking import Group
from p2pdiloco.net.transport import Header, Swarm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Contribution:
    """One learner's input to a fragment round.

    Attributes:
        delta: pseudo-gradient Θ_p(anchor) − θ_p, fp32, one tensor per fragment slot.
        tokens: tokens processed since the fragment was last received.
        steps: inner steps since the fragment was last received.
    """

    delta: tuple[torch.Tensor, ...]
    tokens: int
    steps: int


@dataclass
class _Accumulator:
    members: tuple[str, ...]
    slots: tuple[int, ...]
    created: float = field(default_factory=time.monotonic)
    parts: dict[str, tuple[list[torch.Tensor], int, int]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: bytes | None = None
    error: str | None = None


@dataclass
class AllReduceStats:
    rounds: int = 0
    failed: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class AllReducer:
    """Runs fragment all-reduces; serves ``ar.reduce``. One per node.

    Args:
        swarm: the transport.
        fragments: the model's fragments (identical on every member).
        precision: wire precision of pseudo-gradient slices and merged slices.
        timeout: liveness timeout (seconds): how long a reducer waits for a missing member.
    """

    def __init__(self, swarm: Swarm, fragments: Sequence[Fragment], precision: str, timeout: float):
        wire.wire_dtype(precision)
        self.swarm, self.fragments, self.precision, self.timeout = swarm, tuple(fragments), precision, timeout
        self._rounds: dict[str, _Accumulator] = {}
        self.stats = AllReduceStats()

    async def start(self) -> None:
        await self.swarm.add_handler("ar.reduce", self._on_reduce)

    def _shapes(self, fragment: int, slots: Sequence[int]) -> list[tuple[int, ...]]:
        frag = self.fragments[fragment]
        return [frag.slots[i].shape for i in slots]

    def _parts(self, fragment: int, n: int) -> tuple[tuple[int, ...], ...]:
        return assign_parts([s.numel for s in self.fragments[fragment].slots], n)

    async def run(self, group: Group, contrib: Contribution) -> list[torch.Tensor]:
        """Merge ``contrib`` with the other members' and return the merged pseudo-gradient.

        Returns:
            fp32 tensors, one per fragment slot, bit-identical on every member.
        Raises:
            RoundFailed: some reducer did not answer with a complete merge in time.
        """
        frag, me = group.key.fragment, self.swarm.peer_id
        parts = self._parts(frag, len(group.members))
        head = {
            "round": group.round_id, "f": frag, "v": group.key.version, "d": group.key.digest,
            "members": list(group.members), "tokens": contrib.tokens, "steps": contrib.steps,
        }

        async def one(r: int, reducer: str) -> tuple[int, bytes]:
            if not parts[r]:
                return r, b""
            slice_ = [contrib.delta[i] for i in parts[r]]
            payload = wire.encode(slice_, self.precision)
            if reducer == me:  # same rounding as every other member's slice
                own = wire.decode(payload, self._shapes(frag, parts[r]), self.precision)
                return r, await self._accept(me, head, own)
            _, body = await self.swarm.call(reducer, "ar.reduce", head, payload, timeout=self.timeout + 5)
            return r, body

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(r, m)) for r, m in enumerate(group.members)]
        except* (NetworkError, RoundFailed) as eg:
            self.stats.failed += 1
            raise RoundFailed(f"round {group.round_id} of fragment {frag} failed: {eg.exceptions[0]}") from None
        merged: list[torch.Tensor | None] = [None] * len(self.fragments[frag].slots)
        for task in tasks:
            r, body = task.result()
            for i, t in zip(parts[r], wire.decode(body, self._shapes(frag, parts[r]), self.precision)):
                merged[i] = t
        self.stats.rounds += 1
        return [t for t in merged if t is not None]

    async def _accept(self, peer: str, head: Header, tensors: list[torch.Tensor]) -> bytes:
        """Add one member's slice to the round's accumulator; wait for and return the result."""
        round_id, members = str(head["round"]), tuple(str(m) for m in head["members"])
        frag = int(head["f"])
        me = self.swarm.peer_id
        if me not in members or peer not in members or tuple(sorted(members)) != members:
            raise ProtocolError("not a member of that round")
        acc = self._rounds.get(round_id)
        if acc is None:
            slots = self._parts(frag, len(members))[members.index(me)]
            acc = self._rounds[round_id] = _Accumulator(members, slots)
            asyncio.get_running_loop().call_later(self.timeout, self._expire, round_id)
        elif acc.members != members:
            raise ProtocolError("member list differs from the round's")
        tokens, steps = int(head["tokens"]), int(head["steps"])
        if tokens < 0 or steps < 0:
            raise ProtocolError("negative counters")
        if not is_finite_contribution(tensors):
            self.stats.rejected["non_finite"] = self.stats.rejected.get("non_finite", 0) + 1
            raise ProtocolError("non-finite pseudo-gradient")
        acc.parts[peer] = (tensors, tokens, steps)
        if len(acc.parts) == len(acc.members) and acc.result is None and acc.error is None:
            acc.result = self._reduce(frag, acc)
            acc.done.set()
        await acc.done.wait()
        if acc.error is not None:
            raise RoundFailed(acc.error)
        return acc.result

    def _reduce(self, frag: int, acc: _Accumulator) -> bytes:
        order = [acc.parts[m] for m in acc.members]  # fixed order: sorted peer IDs
        weights = [contribution_weight(tok, st) for _, tok, st in order]
        slots = self.fragments[frag].slots
        merged = [
            merge_tensor([ts[k] for ts, _, _ in order], weights, slots[i].is_embedding)
            for k, i in enumerate(acc.slots)
        ]
        return wire.encode(merged, self.precision)

    def _expire(self, round_id: str) -> None:
        acc = self._rounds.pop(round_id, None)
        if acc is not None and not acc.done.is_set():
            missing = [m[-8:] for m in acc.members if m not in acc.parts]
            acc.error = f"no contribution from {', '.join(missing)} within {self.timeout:.1f} s"
            acc.done.set()

    async def _on_reduce(self, peer: str, head: Header, payload: bytes) -> tuple[Header, bytes]:
        try:
            frag = int(head["f"])
            if not 0 <= frag < len(self.fragments):
                raise ValueError
            members = tuple(str(m) for m in head["members"])
            slots = self._parts(frag, len(members))[members.index(self.swarm.peer_id)]
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("malformed reduce request") from None
        tensors = wire.decode(payload, self._shapes(frag, slots), self.precision)
        try:
            return {}, await self._accept(peer, head, tensors)
        except RoundFailed as e:
            return {"error": str(e)}, b""
