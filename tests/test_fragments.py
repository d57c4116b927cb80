import math

import pytest

from p2pdiloco.core.fragments import Fragment, StaggeredSchedule, TensorSlot, assign_parts, balanced_fragments
from p2pdiloco.model import ModelConfig, build_model


def test_hand_packed_example():
    # sizes a10 b6 c5 d4 -> a:0 [10,0]; b:1 [10,6]; c:1 [10,11]; d:0 [14,11]
    params = [("d", (2, 2)), ("a", (10,)), ("c", (5,)), ("b", (2, 3))]
    frags = balanced_fragments(params, 2, embedding_names=("b",))
    assert [f.index for f in frags] == [0, 1]
    assert [[s.name for s in f.slots] for f in frags] == [["d", "a"], ["c", "b"]]  # model order kept
    assert [f.numel for f in frags] == [14, 11]
    assert frags[1].slots[1] == TensorSlot("b", (2, 3), 6, True)
    assert frags[1].embedding_mask == [False, True]


def test_size_ties_broken_by_name_and_bucket_index():
    # all size 4: by name x, y, z, w -> order w, x, y, z -> buckets 0,1,2,0
    params = [("z", (4,)), ("y", (4,)), ("x", (4,)), ("w", (4,))]
    frags = balanced_fragments(params, 3)
    assert [[s.name for s in f.slots] for f in frags] == [["z", "w"], ["x"], ["y"]]
    assert balanced_fragments(params, 3) == frags  # deterministic


def test_scalar_and_errors():
    frags = balanced_fragments([("s", ()), ("v", (3,))], 2)
    assert [f.numel for f in frags] == [3, 1]
    with pytest.raises(ValueError, match="exceeds the number of tensors"):
        balanced_fragments([("a", (1,))], 2)
    with pytest.raises(ValueError):
        balanced_fragments([("a", (1,))], 0)
    with pytest.raises(ValueError):
        balanced_fragments([("a", (1,)), ("a", (2,))], 1)
    with pytest.raises(ValueError):
        balanced_fragments([("a", (1,))], 1, embedding_names=("nope",))


@pytest.mark.parametrize("P", [1, 3, 4, 8])
def test_real_model_cover_and_balance(P):
    model = build_model(ModelConfig(n_layer=4), seed=0)
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    frags = balanced_fragments(params, P, model.embedding_names())
    names = [s.name for f in frags for s in f.slots]
    assert sorted(names) == sorted(n for n, _ in params) and len(names) == len(set(names))
    order = {n: i for i, (n, _) in enumerate(params)}
    for f in frags:
        assert [order[s.name] for s in f.slots] == sorted(order[s.name] for s in f.slots)
        assert all(s.is_embedding == (s.name in ("wte.weight", "wpe.weight")) for s in f.slots)
    sizes = [f.numel for f in frags]
    total, largest = sum(sizes), max(math.prod(s) for _, s in params)
    assert sum(sizes) == sum(p.numel() for p in model.parameters())
    # greedy largest-first: the last tensor put in the heaviest bucket went to the lightest one
    assert max(sizes) - min(sizes) <= largest
    assert max(sizes) <= total / P + largest
    assert max(sizes) / min(sizes) < 1.5


def test_assign_parts():
    # sizes 5,9,1,5 -> order 9(1),5(0),5(3),1(2); members 2: 1->0 [9,0]; 0->1 [9,5]; 3->1 [9,10]; 2->0 [10,10]
    assert assign_parts([5, 9, 1, 5], 2) == ((1, 2), (0, 3))
    assert assign_parts([7, 3], 4) == ((0,), (1,), (), ())
    assert assign_parts([], 2) == ((), ())
    parts = assign_parts([100, 30, 30, 30, 10, 200, 50], 3)
    assert sorted(i for p in parts for i in p) == list(range(7))
    with pytest.raises(ValueError):
        assign_parts([1], 0)


def _sends(s: StaggeredSchedule, steps: range, delay: int = 0, requested: dict[int, set[int]] | None = None):
    """Drive the schedule as the training loop does: a sent fragment's merge is installed
    ``delay`` steps later (its progress counter restarts then); returns {step: fragments sent}."""
    since, in_flight, out = [0] * s.P, {}, {}
    for step in steps:
        for p, at in list(in_flight.items()):
            if step >= at:
                since[p] = step - at  # installed at step `at`: progress counts from there
                del in_flight[p]
        due = [p for p in s.due(step, since, (requested or {}).get(step, set())) if p not in in_flight]
        if due:
            out[step] = due
        for p in due:
            in_flight[p] = step + delay
        since = [n + 1 for n in since]
    return out


def test_schedule_staggered():
    s = StaggeredSchedule(H=4, P=2, tau=1)
    assert [s.offset(p) for p in range(2)] == [0, 2]
    # merges that land at once: the grid H + offset(p) + kH
    assert _sends(s, range(0, 13)) == {4: [0], 6: [1], 8: [0], 10: [1], 12: [0]}
    s = StaggeredSchedule(H=24, P=24, tau=2)
    sends = _sends(s, range(0, 124))
    for start in (24, 100):  # every fragment exactly once in any window of H steps
        assert sorted(p for step in range(start, start + 24) for p in sends.get(step, [])) == list(range(24))
    assert not any(step < 24 for step in sends)
    assert StaggeredSchedule(H=2, P=4, tau=0).due(2, [2] * 4) == [0, 1]
    assert StaggeredSchedule(H=2, P=4, tau=0).due(3, [3] * 4) == [0, 1, 2, 3]
    assert StaggeredSchedule(H=1, P=3, tau=0).due(1, [1, 1, 1]) == [0, 1, 2]


def test_schedule_counts_from_the_last_install_and_pulls_in_early_on_request():
    s = StaggeredSchedule(H=4, P=2, tau=1)
    # a merge that takes 3 steps to land: the next send is H steps after the install, not on the grid
    assert _sends(s, range(0, 16), delay=3) == {4: [0], 6: [1], 11: [0], 13: [1]}
    assert s.due(9, [3, 3]) == []  # 3 < H steps of progress
    assert s.due(9, [3, 3], requested={0}) == [0]  # peers gathering: from H // 2 = 2 steps
    assert s.due(9, [1, 3], requested={0, 1}) == [1]
    assert s.due(5, [5, 5]) == [0]  # before H + offset(1) = 6 nothing of fragment 1 ...
    assert s.due(5, [5, 5], requested={1}) == [0, 1]  # ... unless a faster peer gathers for it
    assert s.due(1, [1, 1], requested={0, 1}) == []  # and still from H // 2 = 2 steps only
    assert s.due(2, [2, 2], requested={1}) == [1]
    with pytest.raises(ValueError, match="3 progress counters for 2 fragments"):
        s.due(9, [1, 2, 3])


def test_a_joiners_first_sends_fall_on_the_grid_spread_over_a_period():
    """A learner that joined at the swarm's step 1000 and downloaded all 4 fragments there
    (steps_since 0 for all), H = 20, offsets 0, 5, 10, 15: without aligning all 4 fall due
    together at 1020; aligning, each at its first grid point with H/2 = 10 steps of progress:
    fragment 2 at 1010, 3 at 1015, 0 at 1020, 1 at 1025 (1005 had only 5 steps), one every
    H/P = 5 steps as the swarm sends them. A fragment whose grid point was skipped is due at
    H + H/2 steps."""
    s = StaggeredSchedule(H=20, P=4, tau=2)
    sends_plain, sends_aligned, aligning = {}, {}, {0, 1, 2, 3}
    for step in range(1001, 1041):
        since = [step - 1000] * 4
        plain = [p for p in s.due(step, since) if p not in sum(sends_plain.values(), [])]
        aligned = [p for p in s.due(step, since, aligning=aligning) if p not in sum(sends_aligned.values(), [])]
        aligning -= set(aligned)
        if plain:
            sends_plain[step] = plain
        if aligned:
            sends_aligned[step] = aligned
    assert sends_plain == {1020: [0, 1, 2, 3]}
    assert sends_aligned == {1010: [2], 1015: [3], 1020: [0], 1025: [1]}
    assert s.due(1029, [29] * 4, aligning={1}) == [0, 2, 3]  # 29 < 30 steps, off the grid
    assert s.due(1030, [30] * 4, aligning={1}) == [0, 1, 2, 3]  # the latest: H + H/2
    assert s.due(1012, [12] * 4, requested={0}, aligning={0}) == [0]  # requested: from H/2 as before


@pytest.mark.parametrize("H,P,tau", [(0, 1, 0), (1, 0, 0), (1, 1, -1)])
def test_schedule_validation(H, P, tau):
    with pytest.raises(ValueError):
        StaggeredSchedule(H=H, P=P, tau=tau)


def test_fragment_numel():
    f = Fragment(0, (TensorSlot("a", (2, 3), 6, False), TensorSlot("b", (4,), 4, True)))
    assert f.numel == 10
