"""The fragment ledger: the one owner of a node's committed fragment states.

A node holds, per fragment p, the committed global state Θ_p (``core.outer.FragmentState``:
parameters and outer momentum, fp32 on CPU, slot shapes; version; digest; the state's token
``Ledger``), the round that made it, whether a round of p is in flight, the round of p this node
lost (it may have committed elsewhere: ``Node._follow``), and the part of its last merged Δ_p
that lossy wire coding left out (error feedback). Rounds, follow/catch-up and publishing are
tasks over this object; none keeps its own copy. Each fragment has one ``asyncio.Lock``: a
commit and a follow of the same fragment never interleave across an ``await`` (a follow
chooses its target, downloads and installs under it; a commit checks its anchor and installs
under it), and every result that does not land is counted here and recorded by the caller.

States are compared by (version, digest), never by identity: a catch-up may install a state
equal to the anchor as another object (tests/test_commit.py). Event-loop only; the training
thread gets states by delivery (``node.training.TrainingLoop.deliver``), never from here.

Named "committed states" in code because ``Ledger`` is already the token ledger inside each
state (core.outer, docs/architecture.md "Partial rounds").
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable, Iterator, Sequence

import torch

from p2pdiloco.core.outer import FragmentState


def global_digest(states: Iterable[FragmentState]) -> str:
    """One hash over every fragment's (index, version, digest), in fragment order: 16 hex
    characters, equal iff all fragments are equal. What ``node status``, the report and
    ``p2pdiloco model export`` show as ``global_digest``."""
    h = hashlib.sha256()
    for s in states:
        h.update(f"{s.index}:{s.version}:{s.digest};".encode())
    return h.hexdigest()[:16]


class CommittedStates:
    """Per fragment: the committed state, the round that made it, the round in flight, the
    round lost, the wire-coding residual. ``len()``, indexing and iteration give the states.

    Args:
        states: the initial state of each fragment, index p at position p.

    Raises:
        ValueError: a state's ``index`` is not its position.
    """

    def __init__(self, states: Sequence[FragmentState]):
        if any(st.index != p for p, st in enumerate(states)):
            raise ValueError("states must be given in fragment order")
        self._states = list(states)
        self._round_ids = [""] * len(states)  # the round that made each state ("" unknown or initial)
        self._in_flight: set[int] = set()
        self._lost: dict[int, str] = {}  # fragment -> the round of ours we could not finish
        self._residual: dict[int, list[torch.Tensor] | None] = {}  # fp32, slot shapes
        self._locks = [asyncio.Lock() for _ in states]
        self.superseded = 0  # merged results not committed: the fragment had moved on meanwhile

    # ---- reading -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, p: int) -> FragmentState:
        return self._states[p]

    def __iter__(self) -> Iterator[FragmentState]:
        return iter(tuple(self._states))

    def states(self) -> list[FragmentState]:
        """A copy of the list of committed states (what a donor serves, what the report evaluates)."""
        return list(self._states)

    def round_ids(self) -> tuple[str, ...]:
        """The round that made each fragment's state, published in the node's record."""
        return tuple(self._round_ids)

    def in_flight(self) -> tuple[int, ...]:
        """Fragments with a round in flight, ascending."""
        return tuple(sorted(self._in_flight))

    def is_in_flight(self, p: int) -> bool:
        return p in self._in_flight

    def holds(self, p: int, state: FragmentState) -> bool:
        """Whether fragment p's committed state is ``state`` by (version, digest)."""
        mine = self._states[p]
        return (mine.version, mine.digest) == (state.version, state.digest)

    def lock(self, p: int) -> asyncio.Lock:
        """Fragment p's lock: held by a commit and by a follow, from choosing to installing."""
        return self._locks[p]

    def residual(self, p: int) -> list[torch.Tensor] | None:
        """What lossy wire coding left out of our last merged Δ_p (fp32, slot shapes), or None."""
        return self._residual.get(p)

    # ---- changes -----------------------------------------------------------------------------
    def begin_round(self, p: int) -> None:
        self._in_flight.add(p)

    def end_round(self, p: int) -> None:
        self._in_flight.discard(p)

    def commit(self, p: int, anchor: FragmentState, new: FragmentState, round_id: str,
               residual: list[torch.Tensor] | None = None) -> bool:
        """Commit ``new``, the outer step of round ``round_id`` on ``anchor``, unless fragment p
        moved off ``anchor`` meanwhile; then the result is dropped, counted in ``superseded``,
        and the round is remembered as lost (its result may hold our progress: ``pop_lost``).
        Call under ``lock(p)``. Returns whether it was committed."""
        if not self.holds(p, anchor):
            self.superseded += 1
            self._lost[p] = round_id
            return False
        self._states[p], self._round_ids[p] = new, round_id
        self._residual[p] = residual
        return True

    def install(self, p: int, state: FragmentState, round_id: str) -> FragmentState:
        """Install a followed state of fragment p (made by ``round_id``, "" if unknown); returns
        the state it replaces. Call under ``lock(p)``."""
        old = self._states[p]
        self._states[p], self._round_ids[p] = state, round_id
        return old

    def resume(self, states: Sequence[FragmentState]) -> None:
        """Replace every state with a checkpoint's (before any round or follow)."""
        if len(states) != len(self._states) or any(st.index != p for p, st in enumerate(states)):
            raise ValueError("a checkpoint's states must match the fragments")
        self._states = list(states)
        self._round_ids = [""] * len(states)

    def lose(self, p: int, round_id: str) -> None:
        """Remember round ``round_id`` of fragment p as lost by us (failed, or superseded)."""
        self._lost[p] = round_id

    def pop_lost(self, p: int) -> str | None:
        """The round of fragment p we last lost, forgotten once asked (a follow decides with it)."""
        return self._lost.pop(p, None)

    def lost(self, p: int) -> str | None:
        return self._lost.get(p)
