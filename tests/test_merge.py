import math

import pytest
import torch

from p2pdiloco.core.merge import (age_gate, contribution_weight, is_finite_contribution, merge_pseudo_gradients,
                                   merge_tensor)
from p2pdiloco.core.robust import robust_merge

t = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


def test_age_gate_hand_numbers():
    """σ(τ) = ½·(1 + cos(π·τ/cutoff))·e^(−ατ) (arXiv 2605.09126): α 0, cutoff 2: σ(0) = 1,
    σ(1) = ½·(1 + cos(π/2)) = 0.5, σ(2) = 0 (at the cutoff); α ln 2, cutoff 3: σ(1) = ½·(1 + ½)·½
    = 0.375."""
    assert age_gate(0, 0.0, 2) == 1.0 and age_gate(0, 3.0, 1) == 1.0
    assert age_gate(1, 0.0, 2) == pytest.approx(0.5, abs=1e-15) and age_gate(2, 0.0, 2) == 0.0
    assert age_gate(1, math.log(2), 3) == pytest.approx(0.375, abs=1e-15)
    for bad in ((-1, 0.5, 8), (1, -0.1, 8), (1, math.inf, 8), (1, 0.5, 0)):
        with pytest.raises(ValueError):
            age_gate(*bad)


def test_contribution_weight():
    assert contribution_weight(10, 4) == 25.0  # 10**2 / 4
    assert contribution_weight(8, 2) == 32.0
    assert contribution_weight(0, 3) == 0.0
    assert contribution_weight(5, 0) == 0.0
    with pytest.raises(ValueError):
        contribution_weight(-1, 2)
    with pytest.raises(ValueError):
        contribution_weight(1, -2)


# Two members: A took 2 steps over 8 tokens (w = 64/2 = 32), B 2 steps over 4 tokens (w = 8):
# normalised weights 0.8 and 0.2. ΔA = [3, 4] (norm 5), ΔB = [0, 2] (norm 2).
W = [contribution_weight(8, 2), contribution_weight(4, 2)]
A, B = t(3, 4), t(0, 2)


def test_embedding_weighted_mean():
    # 0.8·[3, 4] + 0.2·[0, 2] = [2.4, 3.6]
    assert torch.allclose(merge_tensor([A, B], W, is_embedding=True), t(2.4, 3.6), atol=1e-6)


def test_radial_directional():
    # magnitude = 0.8·5 + 0.2·2 = 4.4; direction = 0.8·[0.6, 0.8] + 0.2·[0, 1] = [0.48, 0.84],
    # |direction| = sqrt(0.936) = 0.967471; merged = 4.4·[0.48, 0.84]/0.967471 = [2.183011, 3.820270]
    out = merge_tensor([A, B], W, is_embedding=False)
    assert out.dtype == torch.float32
    assert torch.allclose(out, t(2.183011, 3.820270), atol=1e-5)
    assert math.isclose(out.norm().item(), 4.4, rel_tol=1e-6)


def test_orthogonal_contributions_keep_their_norm():
    # equal weights, Δ = e1, 2·e2, 3·e3: magnitude 2, direction (1,1,1)/3 -> 2/sqrt(3) each = 1.154701
    # (a plain mean would be [1/3, 2/3, 1], norm 1.247 < 2)
    out = merge_tensor([t(1, 0, 0), t(0, 2, 0), t(0, 0, 3)], [1.0, 1.0, 1.0], False)
    assert torch.allclose(out, t(1.154701, 1.154701, 1.154701), atol=1e-6)


def test_zero_delta_member_adds_no_direction():
    # equal weights, [3, 4] and [0, 0]: magnitude (5 + 0)/2 = 2.5 along [0.6, 0.8] -> [1.5, 2.0]
    out = merge_tensor([t(3, 4), t(0, 0)], [16.0, 16.0], False)
    assert torch.allclose(out, t(1.5, 2.0), atol=1e-6)


def test_fallback_to_mean_when_directions_cancel():
    # [2, 0] and [-1, 0], equal weights: unit directions cancel; weighted mean = [0.5, 0]
    w = contribution_weight(4, 1)
    out = merge_tensor([t(2, 0), t(-1, 0)], [w, w], False)
    assert torch.allclose(out, t(0.5, 0.0), atol=1e-7)


def test_zero_total_weight_gives_zeros():
    w = contribution_weight(0, 0)
    for emb in (True, False):
        out = merge_tensor([A, B], [w, w], emb)
        assert torch.equal(out, torch.zeros(2))


def test_single_member_is_exact_and_not_aliased():
    d = torch.randn(5, 7)
    for emb in (True, False):
        out = merge_tensor([d], [3.0], emb)
        assert torch.equal(out, d) and out.data_ptr() != d.data_ptr()
        out2 = merge_tensor([torch.randn(5, 7), d], [0.0, 2.0], emb)  # the only positive weight
        assert torch.equal(out2, d)


def test_inputs_converted_to_fp32_and_untouched():
    a, b = A.to(torch.bfloat16), B.to(torch.float64)
    out = merge_tensor([a, b], W, False)
    assert out.dtype == torch.float32
    assert torch.allclose(out, t(2.183011, 3.820270), atol=1e-5)
    assert torch.equal(b, t(0, 2).double())


def test_deterministic_and_order_given():
    xs = [torch.randn(64, 33) for _ in range(5)]
    ws = [1.0, 7.5, 3.0, 0.25, 2.0]
    assert torch.equal(merge_tensor(xs, ws, False), merge_tensor(xs, ws, False))


def test_merge_pseudo_gradients_per_slot():
    # member 1: slots ([3, 4], [1, 1]); member 2: slots ([0, 2], [0, 3]); slot 1 is an embedding
    out = merge_pseudo_gradients([[A, t(1, 1)], [B, t(0, 3)]], W, [False, True])
    assert len(out) == 2
    assert torch.allclose(out[0], t(2.183011, 3.820270), atol=1e-5)
    assert torch.allclose(out[1], t(0.8, 1.4), atol=1e-6)  # 0.8·[1, 1] + 0.2·[0, 3]


@pytest.mark.parametrize("call", [
    lambda: merge_tensor([], [], False),
    lambda: merge_tensor([A, B], [1.0], False),
    lambda: merge_tensor([A, B], [1.0, float("nan")], False),
    lambda: merge_tensor([A, B], [1.0, float("inf")], False),
    lambda: merge_tensor([A, B], [1.0, -1.0], False),
    lambda: merge_tensor([A, t(1, 2, 3)], [1.0, 1.0], False),
    lambda: merge_tensor([A, t(float("nan"), 0)], [1.0, 1.0], False),
    lambda: merge_pseudo_gradients([], [], []),
    lambda: merge_pseudo_gradients([[A], [B]], [1.0], [False]),
    lambda: merge_pseudo_gradients([[A], [B, B]], [1.0, 1.0], [False]),
])
def test_errors(call):
    with pytest.raises(ValueError):
        call()


def test_is_finite_contribution():
    assert is_finite_contribution([A, B])
    assert not is_finite_contribution([A, t(0, float("inf"))])
    assert not is_finite_contribution([t(float("nan"))])


# ---- robust_merge with the reducer's own Δ as reference (docs/trust.md §5) -------------------

# Four members of equal weight, member 0 the reducer: own Δ [2, 0]; [1.2, 1.6] has cosine 0.6
# with it, [0, 2] cosine 0, [-2, 0] cosine -1. All norms 2: bound 1.25 x 2, nothing clipped.
OWN = [[t(2, 0)], [t(1.2, 1.6)], [t(0, 2)], [t(-2, 0)]]


def test_own_reference_scores_each_member_by_its_cosine_with_the_reducers_delta():
    # full_trust_cosine 0.8: score min(1, max(0, cos)/0.8) = 0.75, 0, 0; weights 1, 0.75, 0, 0
    out = robust_merge(OWN, [1.0] * 4, [True], own=0, full_trust_cosine=0.8)
    # embedding: ([2, 0] + 0.75 [1.2, 1.6]) / 1.75 = [2.9, 1.2] / 1.75 = [1.657143, 0.685714]
    assert torch.allclose(out.merged[0], t(1.657143, 0.685714), atol=1e-6)
    assert out.reference == 0 and out.misaligned == ((2, 0), (3, 0)) and out.kept == (0, 1, 2, 3)
    assert [(m, i) for m, i, _ in out.scores] == [(1, 0)] and math.isclose(out.scores[0][2], 0.75, rel_tol=1e-6)
    # the default full_trust_cosine 0.2: cosine 0.6 is whole; ([2, 0] + [1.2, 1.6]) / 2 = [1.6, 0.8]
    assert torch.allclose(robust_merge(OWN, [1.0] * 4, [True], own=0).merged[0], t(1.6, 0.8), atol=1e-6)


def test_own_reference_radial_directional():
    # weights 1, 0.75, 0 -> 4/7, 3/7; magnitude 2; direction 4/7 [1, 0] + 3/7 [0.6, 0.8] = [5.8, 2.4] / 7,
    # norm sqrt(39.4) / 7; merged = 2 [5.8, 2.4] / sqrt(39.4) = [1.848034, 0.764704]
    out = robust_merge([OWN[0], OWN[1], OWN[3]], [1.0] * 3, [False], own=0, full_trust_cosine=0.8)
    assert torch.allclose(out.merged[0], t(1.848034, 0.764704), atol=1e-5)
    assert out.misaligned == ((2, 0),)


def test_own_reference_drop_policy_mutes_members_against_it_and_drops_none_for_direction():
    # the same Δ repeated 450 times (numel 900), cosines unchanged: member 3 (cosine -1) and
    # member 2 (cosine 0) get weight 0 in the slot (score clamp(cos / 0.8, 0, 1) = 0), as with
    # clip; one learner's Δ does not drop a member (honest ones were dropped for it)
    big = [[d[0].repeat(450)] for d in OWN]
    out = robust_merge(big, [1.0] * 4, [True], policy="drop", own=0, full_trust_cosine=0.8)
    assert out.dropped == {} and out.kept == (0, 1, 2, 3) and out.misaligned == ((2, 0), (3, 0))
    assert torch.allclose(out.merged[0][:2], t(1.657143, 0.685714), atol=1e-6)  # as if 3 were dropped
    # without an own reference the median direction flags nobody here (no strict minority against)
    assert robust_merge(big, [1.0] * 4, [True], policy="drop").dropped == {}


def test_weights_capped_at_the_lower_median_then_trust_then_norms():
    # weights 1, 4, 9, 16: lower median 4 -> 1, 4, 4, 4; trust 1, 1, 0.5, 0 -> 1, 4, 2, 0.
    # norms of the members of positive weight 1, 1, sqrt(2): lower median 1, bound 1.25:
    # [1, 1] scaled to 1.25/sqrt(2) [1, 1] = [0.883883, 0.883883] (member 3 takes no part).
    # mean: ([1, 0] + 4 [0, 1] + 2 [0.883883, 0.883883]) / 7 = [0.395395, 0.823967]
    members = [[t(1, 0)], [t(0, 1)], [t(1, 1)], [t(5, 5)]]
    out = robust_merge(members, [1.0, 4.0, 9.0, 16.0], [True], trust=[1.0, 1.0, 0.5, 0.0])
    assert out.weights == (1.0, 4.0, 2.0, 0.0) and out.clipped == ((2, 0),)
    assert torch.allclose(out.merged[0], t(0.395395, 0.823967), atol=1e-6)


def test_own_norm_keeps_tiny_colluders_from_shrinking_the_merge():
    # norms 4, 0.01, 0.01, 5: lower median 0.01, upper median 4. Without a reference the bound is
    # 1.25 x 0.01: [4, 0] and [5, 0] clipped to 0.0125, mean 0.01125. With own = 0 the base is
    # max(0.01, min(4, 4)) = 4, bound 5: nothing clipped, mean (4 + 0.01 + 0.01 + 5) / 4 = 2.255
    members = [[t(4, 0)], [t(0.01, 0)], [t(0.01, 0)], [t(5, 0)]]
    shrunk = robust_merge(members, [1.0] * 4, [True])
    assert shrunk.clipped == ((0, 0), (3, 0)) and torch.allclose(shrunk.merged[0], t(0.01125, 0), atol=1e-7)
    kept = robust_merge(members, [1.0] * 4, [True], own=0)
    assert kept.clipped == () and torch.allclose(kept.merged[0], t(2.255, 0), atol=1e-6)
    # an honest reducer still bounds its own Δ: three members, own [400, 0], median 0.01
    out = robust_merge([[t(400, 0)], members[1], members[2]], [1.0] * 3, [True], own=0)
    assert out.clipped == ((0, 0),)


def test_own_reference_falls_back_to_the_median_when_the_own_delta_is_unusable():
    nan = [[t(float("nan"), 0)], *OWN[1:]]
    out = robust_merge(nan, [1.0] * 4, [True], own=0)
    assert out.reference is None and out.dropped == {0: "non_finite"}
    zero = robust_merge([[t(0, 0)], *OWN[1:]], [1.0] * 4, [True], own=0)  # no direction: no score in that slot
    assert zero.scores == () and zero.misaligned == ()


@pytest.mark.parametrize("kw", [dict(own=4), dict(own=-1), dict(trust=[1.0] * 3), dict(trust=[1.0, 1.0, 1.0, 1.5]),
                                dict(trust=[1.0, 1.0, 1.0, float("nan")]), dict(full_trust_cosine=0.0),
                                dict(full_trust_cosine=1.5)])
def test_robust_merge_argument_errors(kw):
    with pytest.raises(ValueError):
        robust_merge(OWN, [1.0] * 4, [True], **kw)


def test_trust_applies_with_policy_off_too():
    # off: no cap, no bound, no scores; weights x trust: 1, 1, 1, 0 -> mean of the first three
    out = robust_merge(OWN, [1.0] * 4, [True], policy="off", own=0, trust=[1.0, 1.0, 1.0, 0.0])
    assert out.weights == (1.0, 1.0, 1.0, 0.0) and out.misaligned == ()
    assert torch.allclose(out.merged[0], t(3.2 / 3, 3.6 / 3), atol=1e-6)


def test_the_reducers_own_weight_picks_the_cap_between_the_two_medians():
    # weights 4 (a faster learner) and 1: lower median 1, upper 4. Without a reference the cap is
    # 1; reducer 0 (weight 4) caps at max(1, min(4, 4)) = 4, reducer 1 at max(1, min(1, 4)) = 1
    members = [[t(1, 0)], [t(1, 0.5)]]
    assert robust_merge(members, [4.0, 1.0], [True]).weights == (1.0, 1.0)
    assert robust_merge(members, [4.0, 1.0], [True], own=0).weights == (4.0, 1.0)
    assert robust_merge(members, [4.0, 1.0], [True], own=1).weights == (1.0, 1.0)
    # two colluders of 4 claiming 10**6: upper median 10**6, but never above the own weight 1
    four = [[t(1, 0)]] * 4
    assert robust_merge(four, [1.0, 1.0, 1e6, 1e6], [True], own=0).weights == (1.0,) * 4
