"""core.audit.check_parts: a member's check of its reducers' merged parts, computed by hand."""

from __future__ import annotations

import pytest
import torch

from p2pdiloco.core.audit import NO_REFERENCE_FACTOR, NORM_FACTOR, check_parts


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_an_honest_round_passes():
    # part 0: own (1, 0), merged (1, 1): cosine 1/sqrt(2); part 1: own (2,), merged (1,)
    own = [[t(1, 0)], [t(2)]]
    merged = [[t(1, 1)], [t(1)]]
    assert check_parts(own, merged, reference=None) == {}


def test_a_part_pointing_against_our_own_is_refused_with_its_cosine():
    # own (3, 4) (norm 5), merged (-3, -4) * 0.2 (norm 1): cosine -1, ratio 0.2
    own = [[t(1.0)], [t(3, 4)]]
    merged = [[t(1.0)], [t(-0.6, -0.8)]]  # cosine -1 < MIN_ALIGNMENT = -0.5
    refused = check_parts(own, merged, reference=0)
    assert set(refused) == {1}
    assert refused[1].reason == "misaligned_result"
    assert refused[1].cosine == pytest.approx(-1.0) and refused[1].ratio == pytest.approx(0.2)


def test_an_orthogonal_or_somewhat_opposed_part_passes_and_a_clearly_opposed_one_is_suspect():
    own = [[t(1, 0)], [t(1, 0)], [t(1, 0)], [t(1, 0)]]
    # cosines: 0 and -0.5 / sqrt(1.25) = -0.447 (pass); -0.6 / sqrt(1.36) = -0.514 (suspect: MIN_ALIGNMENT -0.5)
    merged = [[t(1, 0)], [t(0, 1)], [t(-0.5, 1)], [t(-0.6, 1)]]
    refused = check_parts(own, merged, reference=0)
    assert set(refused) == {3} and refused[3].reason == "misaligned_result"
    assert refused[3].cosine == pytest.approx(-0.6 / 1.36 ** 0.5)


def test_the_size_bound_scales_with_our_own_merge_of_our_part():
    # reference part 0: own norm 1, merged norm 2 -> rho 2, bound NORM_FACTOR * 2 = 8 x own
    own = [[t(1, 0)], [t(0, 1)], [t(0, 1)]]
    merged = [[t(2, 0)], [t(0, 7.9)], [t(0, 8.1)]]
    refused = check_parts(own, merged, reference=0)
    assert NORM_FACTOR == 4.0 and set(refused) == {2} and refused[2].reason == "oversized_result"
    assert refused[2].ratio == pytest.approx(8.1)
    # rho below 1 never tightens the bound under NORM_FACTOR x own
    merged = [[t(0.1, 0)], [t(0, NORM_FACTOR - 0.01)], [t(0, 1)]]
    assert check_parts(own, merged, reference=0) == {}


def test_without_a_part_of_our_own_the_wider_bound_applies():
    own = [[t(1.0)], [t(1.0)]]
    merged = [[t(NO_REFERENCE_FACTOR - 0.5)], [t(NO_REFERENCE_FACTOR + 0.5)]]
    refused = check_parts(own, merged, reference=None)
    assert set(refused) == {1} and refused[1].reason == "oversized_result"


def test_our_own_part_and_parts_where_our_delta_is_zero_are_not_judged():
    own = [[t(1, 0)], [t(0, 0)]]
    merged = [[t(-1, 0)], [t(-5, 7)]]  # our own merge (reference) is ours: never refused
    assert check_parts(own, merged, reference=0) == {}


def test_a_zero_merged_part_is_a_stall_not_a_refusal_and_tensors_of_a_part_are_judged_together():
    own = [[t(1, 0), t(1.0)], [t(1.0)]]
    # part 0: (1, 0, 1) . (-0.5, 0, 1) = 0.5 > 0: passes though its first tensor points against ours
    merged = [[t(-0.5, 0), t(1.0)], [t(0.0)]]
    assert check_parts(own, merged, reference=None) == {}


def test_mismatched_parts_raise():
    with pytest.raises(ValueError):
        check_parts([[t(1.0)]], [], reference=None)
