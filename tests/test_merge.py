import math

import pytest
import torch

from p2pdiloco.core.merge import contribution_weight, is_finite_contribution, merge_pseudo_gradients, merge_tensor

t = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


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
