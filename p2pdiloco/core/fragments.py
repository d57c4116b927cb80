"""Balanced tensor fragmentation and the staggered fragment schedule.

Source: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), balanced tensor fragmentation:
whole tensors are packed greedily (largest first, into the currently lightest bucket) into P
buckets of near-equal size, and the fragments are synced on a staggered schedule so that one
fragment goes out every H/P inner steps (Streaming DiLoCo, arXiv 2501.18512, introduced the
staggering).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["TensorSlot", "Fragment", "balanced_fragments", "assign_parts", "StaggeredSchedule"]


@dataclass(frozen=True)
class TensorSlot:
    """One parameter inside a fragment.

    name: parameter name as in ``model.named_parameters()``; shape: its shape; numel: its
    element count; is_embedding: merged with the plain weighted mean instead of the
    radial-directional merge (see ``p2pdiloco.core.merge``).
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    is_embedding: bool


@dataclass(frozen=True)
class Fragment:
    """A group of whole tensors synced together; ``slots`` are in model parameter order."""

    index: int
    slots: tuple[TensorSlot, ...]

    @property
    def numel(self) -> int:
        """Total number of elements (sum of the slots' numels)."""
        return sum(s.numel for s in self.slots)

    @property
    def embedding_mask(self) -> list[bool]:
        """``is_embedding`` of every slot, in slot order (the merge's ``embedding_mask``)."""
        return [s.is_embedding for s in self.slots]


def _greedy_pack(sizes: Sequence[int], num_buckets: int, weights: Sequence[int] | None = None) -> list[list[int]]:
    """Largest-first greedy packing of items (by position) into buckets.

    Items are taken by decreasing size, ties by position; each goes into the bucket whose load
    after taking it, divided by the bucket's weight, is smallest (exact rational comparison),
    ties to the lowest bucket index; a bucket of weight 0 takes nothing. Without ``weights``
    (all 1) that is the currently lightest bucket. Returns sorted item positions per bucket.
    """
    w = [1] * num_buckets if weights is None else list(weights)
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    load = [0] * num_buckets
    buckets: list[list[int]] = [[] for _ in range(num_buckets)]
    open_ = [k for k in range(num_buckets) if w[k] > 0]
    for i in order:
        b = min(open_, key=lambda k: (Fraction(load[k] + sizes[i], w[k]), k))
        buckets[b].append(i)
        load[b] += sizes[i]
    return [sorted(b) for b in buckets]


def balanced_fragments(
    params: Sequence[tuple[str, tuple[int, ...]]],
    num_fragments: int,
    embedding_names: Collection[str] = (),
) -> tuple[Fragment, ...]:
    """Split parameters into ``num_fragments`` fragments of near-equal element count.

    params: ``(name, shape)`` per parameter, in model order (e.g. from ``named_parameters``).
    Whole tensors, largest first (ties by name), each into the currently lightest fragment
    (ties: lowest index); slots inside a fragment keep the original parameter order.
    Deterministic: every node computes the same fragments from the same parameter list.
    Source: arXiv 2604.21428, "balanced tensor fragmentation".

    Raises ValueError if num_fragments < 1 or exceeds the number of tensors, on duplicate
    names, or on an embedding name that is not a parameter.
    """
    names = [n for n, _ in params]
    if len(set(names)) != len(names):
        raise ValueError("duplicate parameter names")
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if num_fragments > len(params):
        raise ValueError(
            f"num_fragments={num_fragments} exceeds the number of tensors ({len(params)}); "
            "fragments hold whole tensors, so use at most that many"
        )
    unknown = set(embedding_names) - set(names)
    if unknown:
        raise ValueError(f"embedding names not among the parameters: {sorted(unknown)}")
    slots = [TensorSlot(n, tuple(int(d) for d in s), math.prod(s), n in embedding_names) for n, s in params]
    by_name = sorted(range(len(slots)), key=lambda i: slots[i].name)  # size ties broken by name
    packed = _greedy_pack([slots[i].numel for i in by_name], num_fragments)
    return tuple(
        Fragment(k, tuple(slots[i] for i in sorted(by_name[r] for r in bucket)))
        for k, bucket in enumerate(packed)
    )


def assign_parts(slots_numel: Sequence[int], num_members: int,
                 shares: Sequence[int] = ()) -> tuple[tuple[int, ...], ...]:
    """Split a fragment's tensors among the ``num_members`` reducers of an all-reduce group.

    slots_numel: element count per slot. Same greedy packing as ``balanced_fragments`` (ties by
    slot index); reducer r owns the sorted slot indices of tuple r, which may be empty when
    there are fewer tensors than members. ``shares``: one non-negative integer per member, the
    part of the fragment each should reduce (bandwidth-aware rounds: the group leader's
    ``net.rounds.shares.bandwidth_shares``, after hivemind's load balancing); each tensor goes to the
    reducer whose load per share is then smallest, a member of share 0 reduces nothing (only
    sends and receives, as hivemind's client mode). Empty: equal shares. Integers and exact
    rationals only, so every member computes the same split.

    Raises ValueError if num_members < 1, a numel < 0, or ``shares`` is not empty and not
    ``num_members`` non-negative integers with a positive sum.
    """
    if num_members < 1:
        raise ValueError(f"num_members must be >= 1, got {num_members}")
    if any(n < 0 for n in slots_numel):
        raise ValueError("slot numels must be >= 0")
    if shares and (len(shares) != num_members or min(shares) < 0 or sum(shares) <= 0):
        raise ValueError(f"shares must be {num_members} non-negative integers with a positive sum, got {shares}")
    return tuple(tuple(b) for b in _greedy_pack(list(slots_numel), num_members, shares or None))


@dataclass(frozen=True)
class StaggeredSchedule:
    """When each fragment is sent and merged (Streaming DiLoCo staggering, arXiv 2501.18512;
    Decoupled DiLoCo, arXiv 2604.21428, defaults P = 24, H = 24, tau = 2).

    H: inner steps between two syncs of the same fragment; P: number of fragments;
    tau: the overlap, inner steps a fragment's round may take while the learner trains on:
    the grace window is sized to it (``core.grace.GraceWindow``), and the training loop
    applies the merge at the first inner-step boundary after it arrives (it never waits for
    it; a round slower than tau steps lands later). Choose tau < H so that a merge lands
    before the fragment's next send.
    Fragment p is first sent after inner step H + offset(p), offset(p) = (p * H) // P in
    [0, H): the first sends spread over steps H .. 2H - 1, about one every H/P steps (several
    at once if P > H); after that, H steps after its last install (:meth:`due`). Raises
    ValueError unless H >= 1, P >= 1, tau >= 0.
    """

    H: int
    P: int
    tau: int

    def __post_init__(self) -> None:
        if self.H < 1 or self.P < 1 or self.tau < 0:
            raise ValueError(f"need H >= 1, P >= 1, tau >= 0; got H={self.H} P={self.P} tau={self.tau}")

    def offset(self, p: int) -> int:
        """Phase of fragment p within a period of H steps: (p * H) // P."""
        if not 0 <= p < self.P:
            raise ValueError(f"fragment {p} out of range [0, {self.P})")
        return (p * self.H) // self.P

    def due(self, step: int, steps_since: Sequence[int], requested: Collection[int] = (),
            aligning: Collection[int] = ()) -> list[int]:
        """Fragments to send after inner step ``step`` (1-based count of completed steps),
        ascending. ``steps_since[p]``: inner steps since fragment p was last installed (a
        merge or a download); ``requested``: fragments peers are gathering for now;
        ``aligning``: fragments whose next send should fall on their place in the swarm's
        grid (a learner that just joined: all its fragments were downloaded together).

        p is due once ``step >= H + offset(p)`` (the first sends staggered over H .. 2H - 1)
        and it carries H steps of progress (``steps_since[p] >= H``), or at least
        ``early = max(1, H // 2)`` when it is requested, also before its first send point (a
        faster learner gathering for p's first round pulls the slower ones in; without it each
        first round on CPUs of different speeds merged alone and forked). While aligning, p is due instead at
        its grid point (``(step - offset(p)) % H == 0``) or when requested, from ``early``
        steps of progress, and at the latest from H + early (a step jump may skip its grid
        point). Counting from the last install instead of a fixed
        step grid keeps H steps of progress in every contribution however long the previous
        round took (with rounds that land at once it is the grid: sends at H + offset(p) + kH);
        the early pull lets learners whose clocks drifted apart meet in one group instead of
        merging one by one; aligning spreads a joiner's first sends over a period, one
        fragment every H/P steps as the others send them, instead of all P at once H steps
        after its downloads (joiners take the swarm's inner step, so grids agree). Source:
        Streaming DiLoCo staggering (arXiv 2501.18512, sec. 2), Decoupled DiLoCo (arXiv
        2604.21428). Raises ValueError on a negative step or a ``steps_since`` of another
        length than P."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if len(steps_since) != self.P:
            raise ValueError(f"{len(steps_since)} progress counters for {self.P} fragments")
        early = max(1, self.H // 2)
        out = []
        for p in range(self.P):
            n = steps_since[p]
            if step < self.H + self.offset(p) and p not in requested:
                continue
            if p in aligning:  # on its grid point (or requested) from H/2 steps; at the latest from 3H/2
                ok = n >= self.H + early or (n >= early and (p in requested or (step - self.offset(p)) % self.H == 0))
            else:
                ok = n >= self.H or (p in requested and n >= early)
            if ok:
                out.append(p)
        return out
