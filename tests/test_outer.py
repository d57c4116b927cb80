import hashlib
import math
import struct

import numpy as np
import pytest
import torch

from p2pdiloco.core.outer import FragmentState, fragment_digest, nesterov_outer_step
from p2pdiloco.core.periods import Ledger, round_fraction, span_fraction


def _state(seed=0, version=0):
    g = torch.Generator().manual_seed(seed)
    theta = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    return FragmentState.create(2, version, theta, [torch.zeros_like(x) for x in theta])


@pytest.mark.parametrize("lr,mu", [(0.7, 0.9), (1.0, 0.0), (0.35, 0.5)])
def test_nesterov_is_float32_numpy_bit_for_bit_and_torch_sgd_to_rounding(lr, mu):
    """Bit for bit the float32 NumPy computation with one rounding per multiply and add (what
    every CPU kernel set computes); torch's SGD (Nesterov) to within rounding, since its
    ``add(alpha=)`` is fused on vectorised kernels."""
    state = _state()
    ref = [torch.nn.Parameter(x.clone()) for x in state.theta]
    opt = torch.optim.SGD(ref, lr=lr, momentum=mu, nesterov=mu > 0, foreach=False)
    th_np = [x.numpy().copy() for x in state.theta]
    b_np = [np.zeros_like(x) for x in th_np]
    lr32, mu32 = np.float32(lr), np.float32(mu)
    g = torch.Generator().manual_seed(1)
    for k in range(6):
        deltas = [torch.randn(x.shape, generator=g) * 0.1 for x in state.theta]
        for p, d in zip(ref, deltas):
            p.grad = d.clone()
        opt.step()
        state = nesterov_outer_step(state, deltas, lr, mu)
        assert state.version == k + 1
        for i, d in enumerate(deltas):
            d = d.numpy()
            b_np[i] = b_np[i] * mu32 + d
            th_np[i] = th_np[i] - (b_np[i] * mu32 + d) * lr32
            assert th_np[i].dtype == np.float32
            assert np.array_equal(state.theta[i].numpy(), th_np[i]) and np.array_equal(state.momentum[i].numpy(), b_np[i])
        for p, th in zip(ref, state.theta):
            assert torch.allclose(p.detach(), th, rtol=1e-6, atol=1e-7)


def test_nesterov_hand_numbers_and_no_mutation():
    # Θ = [1, 2], b = [0.5, -1], Δ = [0.2, 0.4], lr 0.5, μ 0.9:
    # b' = 0.9·b + Δ = [0.65, -0.5]; Θ' = Θ − 0.5·(Δ + 0.9·b') = [1 − 0.5·0.785, 2 − 0.5·(−0.05)] = [0.6075, 2.025]
    s = FragmentState.create(0, 3, [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, -1.0])])
    before = (s.theta[0].clone(), s.momentum[0].clone(), s.digest)
    d = torch.tensor([0.2, 0.4])
    n = nesterov_outer_step(s, [d], lr=0.5, momentum=0.9)
    assert n.version == 4 and n.index == 0
    assert torch.allclose(n.momentum[0], torch.tensor([0.65, -0.5]), atol=1e-7)
    assert torch.allclose(n.theta[0], torch.tensor([0.6075, 2.025]), atol=1e-6)
    assert torch.equal(s.theta[0], before[0]) and torch.equal(s.momentum[0], before[1])
    assert s.digest == before[2] == fragment_digest(0, 3, s.theta, s.momentum)
    assert torch.equal(d, torch.tensor([0.2, 0.4]))
    assert n.digest == fragment_digest(0, 4, n.theta, n.momentum)


def test_fractional_step_hand_numbers():
    """Θ = [1, 2], b = [0.5, -1], Δ = [0.2, 0.4], lr 0.5, μ 0.9, f = 0.5, the period's first
    round (u = 0, d = 1): b' = (1 − 0.5·0.1)·b + 0.5·Δ = [0.575, −0.75];
    (1 + μ)·Δ + μ²·b = [0.38 + 0.405, 0.76 − 0.81] = [0.785, −0.05];
    Θ' = Θ − (0.5·0.5)·(…) = [0.80375, 2.0125]."""
    s = FragmentState.create(0, 3, [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, -1.0])])
    n = nesterov_outer_step(s, [torch.tensor([0.2, 0.4])], lr=0.5, momentum=0.9, fraction=0.5)
    assert torch.allclose(n.momentum[0], torch.tensor([0.575, -0.75]), atol=1e-7)
    assert torch.allclose(n.theta[0], torch.tensor([0.80375, 2.0125]), atol=1e-6)
    # f = 1 is the plain Nesterov step bit for bit; f = 0 changes nothing but the version
    full = nesterov_outer_step(s, [torch.tensor([0.2, 0.4])], lr=0.5, momentum=0.9)
    assert nesterov_outer_step(s, [torch.tensor([0.2, 0.4])], 0.5, 0.9, 1.0).digest == full.digest
    zero = nesterov_outer_step(s, [torch.tensor([0.2, 0.4])], 0.5, 0.9, 0.0)
    assert torch.equal(zero.theta[0], s.theta[0]) and torch.equal(zero.momentum[0], s.momentum[0])
    with pytest.raises(ValueError, match="multiple of 1/1024"):
        nesterov_outer_step(s, [torch.tensor([0.2, 0.4])], 0.5, 0.9, 0.3)


def test_second_round_of_a_period_uses_what_is_left_of_the_buffer_hand_numbers():
    """The period's second half round (the state's ledger shows u = 512/1024 applied in the same
    period), μ = 0.5, lr 0.5, f = 0.5: d = 1 − 0.5·0.5 = 0.75; b' = (1 − 0.5·0.5/0.75)·b + 0.5·Δ
    = ⅔·[0.5, −1] + [0.1, 0.2] = [13/30, −7/15]; (1 + μ)·Δ + (μ²/d)·b = [0.3, 0.6] + ⅓·[0.5, −1]
    = [7/15, 4/15]; Θ' = Θ − 0.25·(…) = [53/60, 29/15]. A ledger of another period counts as
    its first round (u = 0)."""
    before = Ledger(100, 10, 20.0, 512, 10)
    s = FragmentState.create(0, 3, [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, -1.0])], before)
    d = [torch.tensor([0.2, 0.4])]
    n = nesterov_outer_step(s, d, lr=0.5, momentum=0.5, fraction=0.5, ledger=Ledger(100, 20, 20.0, 1024, 20))
    assert torch.allclose(n.momentum[0], torch.tensor([13 / 30, -7 / 15]), atol=1e-7)
    assert torch.allclose(n.theta[0], torch.tensor([53 / 60, 29 / 15]), atol=1e-6)
    new_period = nesterov_outer_step(s, d, 0.5, 0.5, 0.5, Ledger(200, 10, 20.0, 512, 20))
    first = nesterov_outer_step(FragmentState.create(0, 3, s.theta, s.momentum), d, 0.5, 0.5, 0.5)
    assert torch.equal(new_period.theta[0], first.theta[0]) and torch.equal(new_period.momentum[0], first.momentum[0])


def test_period_carry_hand_numbers():
    """carry="period" (Delayed Nesterov, arXiv 2401.09135). The period's first round, Θ = [1, 2],
    b = [0.5, −1], Δ = [0.2, 0.4], lr 0.5, μ 0.9, f = 0.5: b' = 0.9·b + 0.5·Δ = [0.55, −0.7];
    f·(1 + μ)·Δ + μ²·b = [0.19, 0.38] + [0.405, −0.81] = [0.595, −0.43]; Θ' = Θ − 0.5·(…) =
    [0.7025, 2.215]. A later round of the same period (u = 512/1024 applied), μ 0.5: b' = b + 0.5·Δ
    = [0.6, −0.8]; Θ' = Θ − 0.5·(0.5·1.5·Δ) = [0.925, 1.85]. f = 1 and f = 0 are as under "share"."""
    s = FragmentState.create(0, 3, [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, -1.0])])
    d = [torch.tensor([0.2, 0.4])]
    n = nesterov_outer_step(s, d, lr=0.5, momentum=0.9, fraction=0.5, carry="period")
    assert torch.allclose(n.momentum[0], torch.tensor([0.55, -0.7]), atol=1e-7)
    assert torch.allclose(n.theta[0], torch.tensor([0.7025, 2.215]), atol=1e-6)
    mid = FragmentState.create(0, 3, s.theta, s.momentum, Ledger(100, 10, 20.0, 512, 10))
    n = nesterov_outer_step(mid, d, 0.5, 0.5, 0.5, Ledger(100, 20, 20.0, 1024, 20), carry="period")
    assert torch.allclose(n.momentum[0], torch.tensor([0.6, -0.8]), atol=1e-7)
    assert torch.allclose(n.theta[0], torch.tensor([0.925, 1.85]), atol=1e-6)
    for f in (0.0, 1.0):
        period, share = (nesterov_outer_step(s, d, 0.5, 0.9, f, carry=c) for c in ("period", "share"))
        assert period.digest == share.digest
    with pytest.raises(ValueError, match="carry"):
        nesterov_outer_step(s, d, 0.5, 0.9, 0.5, carry="rounds")


def test_period_carry_rounds_of_a_period_make_exactly_one_step():
    """Under carry="period" two half rounds with Δ1 then Δ2 (the second continuing the first's
    ledger) give DiLoCo's one step with Δ = ½·Δ1 + ½·Δ2, to fp32 rounding."""
    g = torch.Generator().manual_seed(3)
    th, b, d1, d2 = (torch.randn(6, generator=g) for _ in range(4))
    s = FragmentState.create(0, 1, [th], [b], Ledger(0, 10, 10.0, 1024, 10))
    half = nesterov_outer_step(s, [d1], 0.7, 0.9, 0.5, Ledger(100, 5, 10.0, 512, 15), carry="period")
    two = nesterov_outer_step(half, [d2], 0.7, 0.9, 0.5, Ledger(100, 10, 10.0, 1024, 20), carry="period")
    one = nesterov_outer_step(s, [d1 * 0.5 + d2 * 0.5], 0.7, 0.9)
    assert torch.allclose(two.theta[0], one.theta[0], atol=1e-6)
    assert torch.allclose(two.momentum[0], one.momentum[0], atol=1e-6)


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_k_rounds_of_one_kth_move_like_one_full_round_per_period(k):
    """I9 in steady state: with a constant Δ, a period merged as one round and a period merged
    as k rounds of 1/k (each continuing the period's ledger) move Θ at rates within 0.3 % of
    each other after many periods (μ = 0.9); without the fraction, two rounds per period
    would move it twice as fast."""
    s = FragmentState.create(0, 0, [torch.zeros(1)], [torch.zeros(1)])
    one, many, twice = s, s, s
    d = [torch.ones(1)]
    units = round(1024 / k)
    for period in range(200):
        one = nesterov_outer_step(one, d, 0.1, 0.9)
        for j in range(k):
            led = Ledger(period * 100, 0, 1.0, min(1024, units * (j + 1)), 0)
            many = nesterov_outer_step(many, d, 0.1, 0.9, min(units, 1024 - units * j) / 1024, led)
        twice = nesterov_outer_step(nesterov_outer_step(twice, d, 0.1, 0.9), d, 0.1, 0.9)
    rate = lambda st: -float(st.theta[0])  # noqa: E731
    assert abs(rate(many) / rate(one) - 1) < 0.003
    assert rate(twice) / rate(one) > 1.99


def test_round_fraction_follows_the_ledger_over_periods():
    """H = 100, 1000 tokens per learner per period. Period 1 (no rate yet): the first round
    takes the span fraction it is given. Period 2 (positions 200): two learners merge one
    after the other, alone: the rate is period 1's 2000 tokens, so each carries 1000/2000.
    Period 3 (position 300): both together, 2000 tokens: one step; the completed period 2 had
    2000 tokens too (rate 0.5·2000 + 0.5·2000). A 1-step flush at position 301, in period 3:
    10/2000 -> 5/1024, but period 3 has used its whole step: one grid unit, 1/1024. A position
    under H/2 past the period start stays in it. total_tokens counts every round's tokens."""
    led = Ledger()
    f, led = round_fraction(led, 2000, 100, 100, first=1.0)
    assert (f, led) == (1.0, Ledger(100, 2000, 0.0, 1024, 2000))
    f, led = round_fraction(led, 1000, 200, 100, first=1.0)
    assert (f, led) == (0.5, Ledger(200, 1000, 2000.0, 512, 3000))
    f, led = round_fraction(led, 1000, 201, 100, first=0.5)
    assert (f, led) == (0.5, Ledger(200, 2000, 2000.0, 1024, 4000))
    f, led = round_fraction(led, 2000, 300, 100, first=1.0)
    assert (f, led) == (1.0, Ledger(300, 2000, 2000.0, 1024, 6000))
    f, flushed = round_fraction(led, 10, 301, 100, first=0.01)
    assert (f, flushed) == (1 / 1024, Ledger(300, 2010, 2000.0, 1024, 6010))
    f, flushed = round_fraction(Ledger(300, 2000, 2000.0, 1000), 10, 301, 100, first=0.01)
    assert (f, flushed) == (5 / 1024, Ledger(300, 2010, 2000.0, 1005, 10))
    # a period counts at most 4x the previous rate; a claimed position moves the start at most 2H
    f, led = round_fraction(Ledger(300, 10**9, 2000.0, 1024), 2000, 10**12, 100, first=1.0)
    assert (f, led) == (410 / 1024, Ledger(500, 2000, 0.5 * 2000 + 0.5 * 8000, 410, 2000))
    assert round_fraction(led, 0, 501, 100, first=0.0) == (0.0, Ledger(500, 2000, 5000.0, 410, 2000))


def test_claimed_token_counts_saturate_so_the_state_stays_sendable():
    """A round claiming 2^53 tokens on a ledger already at 2^53: the counts stay at 2^53 (what a
    state answer may carry), and the state seals and packs (<qqdqq)."""
    f, led = round_fraction(Ledger(0, 2**53, 1.0, 0, 2**53), 2**53, 1, 24, first=1.0)
    assert (led.period_tokens, led.total_tokens) == (2**53, 2**53) and f == 1.0
    assert FragmentState.create(0, 1, [torch.zeros(1)], [torch.zeros(1)], led).ledger == led
    with pytest.raises(ValueError, match="ledger"):
        FragmentState.create(0, 1, [torch.zeros(1)], [torch.zeros(1)], Ledger(0, 0, 1.0, 0, 2**53 + 1))


def test_the_rounds_of_one_period_add_up_to_at_most_one_step():
    """First period, four learners merging one after the other, each alone (1000 tokens, span
    shares 1, 1/2, 1/3, 1/4 as span_fraction gives them): the first takes the whole step, the
    others one grid unit each (before the budget: 1 + 1/2 + 1/3 + 1/4 = 2.08 steps). A swarm
    that doubled (rate 2000, four rounds of 1000 tokens in one period) takes 1/2 + 1/2 + 1/1024
    + 1/1024, not 2."""
    led, fs = Ledger(), []
    for k in range(1, 5):
        f, led = round_fraction(led, 1000, 100, 100, first=round(1024 / k) / 1024)
        fs.append(f)
    assert fs == [1.0, 1 / 1024, 1 / 1024, 1 / 1024] and led == Ledger(100, 4000, 0.0, 1024, 4000)
    led, fs = Ledger(200, 2000, 2000.0, 1024), []
    for _ in range(4):
        f, led = round_fraction(led, 1000, 300, 100, first=1.0)
        fs.append(f)
    assert fs == [0.5, 0.5, 1 / 1024, 1 / 1024] and led == Ledger(300, 4000, 2000.0, 1024, 4000)
    with pytest.raises(ValueError):
        round_fraction(Ledger(), -1, 501, 100, first=0.5)


def test_span_fraction_hand_numbers():
    """Shares min(1, steps/(H·span)) averaged with the merge weights tokens²/steps (H = 100)."""
    assert span_fraction([(1000, 100, 1)], 100) == 1.0  # a whole period, one round
    assert span_fraction([(1000, 100, 2)], 100) == 0.5  # the same progress, another round merged meanwhile
    assert span_fraction([(1000, 100, 1), (1000, 100, 1)], 100) == 1.0
    assert span_fraction([(30, 3, 1)], 100) == 31 / 1024  # a 3-step flush: 0.03 -> 30.72/1024 -> 31/1024
    assert span_fraction([(1000, 250, 1)], 100) == 1.0  # more than a period: capped at one step
    assert span_fraction([(2000, 200, 2)], 100) == 1.0  # left out of one round, offered at the next
    # weights 1000²/100 = 10000 and 500²/50 = 5000; shares 1 and 0.5 -> 12500/15000
    assert span_fraction([(1000, 100, 1), (500, 50, 1)], 100) == round(12500 / 15000 * 1024) / 1024
    assert span_fraction([(1000, 1, 1000)], 100) == 1 / 1024  # any progress: at least one grid step
    assert span_fraction([(0, 0, 1)], 100) == 0.0  # nothing to merge, nothing to move
    assert span_fraction([(1000, 100, 10**9)], 100) == round(1024 / 64) / 1024  # span capped at MAX_SPAN
    for bad in ([(1, 1, 0)], [(-1, 1, 1)]):
        with pytest.raises(ValueError):
            span_fraction(bad, 100)


def test_digest_layout_reference():
    theta = [torch.tensor([[1.0, -2.0]]), torch.tensor(3.5)]
    mom = [torch.tensor([[0.0, 0.25]]), torch.tensor(-1.0)]
    h = hashlib.sha256(struct.pack("<qqII", 7, 11, 2, 2))
    for shape, vals in [((1, 2), [1.0, -2.0]), ((), [3.5]), ((1, 2), [0.0, 0.25]), ((), [-1.0])]:
        h.update(struct.pack("<I", len(shape)) + b"".join(struct.pack("<q", d) for d in shape))
        h.update(b"".join(struct.pack("<f", v) for v in vals))
    h.update(struct.pack("<qqdqq", 300, 4096, 8192.5, 700, 123456))  # the ledger (Ledger.pack)
    ledger = Ledger(300, 4096, 8192.5, 700, 123456)
    assert fragment_digest(7, 11, theta, mom, ledger) == h.hexdigest()
    s = FragmentState.create(7, 11, theta, mom, ledger)
    assert s.digest == h.hexdigest() and s.short() == h.hexdigest()[:12] and s.ledger == ledger
    assert FragmentState.create(7, 11, theta, mom).digest != s.digest  # the ledger is part of the state
    with pytest.raises(ValueError, match="ledger"):
        FragmentState.create(7, 11, theta, mom, Ledger(0, 0, math.inf))
    with pytest.raises(ValueError, match="ledger"):
        FragmentState.create(7, 11, theta, mom, Ledger(0, 0, 1.0, 1025))


def test_digest_sensitivity_and_equality():
    a, b = _state(0), _state(0)
    assert a == b and hash(a) == hash(b) and a.digest == b.digest
    assert _state(0, version=1).digest != a.digest
    assert _state(1).digest != a.digest
    other_mom = FragmentState.create(2, 0, a.theta, [torch.ones_like(x) for x in a.theta])
    assert other_mom.digest != a.digest
    assert FragmentState.create(3, 0, a.theta, a.momentum).digest != a.digest


def test_create_copies_to_fp32_contiguous():
    src = torch.arange(6, dtype=torch.float64).view(2, 3).t()  # non-contiguous fp64
    s = FragmentState.create(0, 0, [src], [torch.zeros(3, 2)])
    assert s.theta[0].dtype == torch.float32 and s.theta[0].is_contiguous()
    assert torch.equal(s.theta[0], src.float())
    src.add_(1)
    assert torch.equal(s.theta[0], (src - 1).float())  # not aliased


@pytest.mark.parametrize("call", [
    lambda s: nesterov_outer_step(s, [torch.zeros(4, 3)], 0.7, 0.9),
    lambda s: nesterov_outer_step(s, [torch.zeros(4, 3), torch.zeros(6)], 0.7, 0.9),
    lambda s: nesterov_outer_step(s, [torch.zeros(4, 3), torch.zeros(5)], -1.0, 0.9),
    lambda s: nesterov_outer_step(s, [torch.zeros(4, 3), torch.zeros(5)], 0.7, 1.0),
    lambda s: FragmentState.create(0, 0, [torch.zeros(2)], [torch.zeros(3)]),
    lambda s: FragmentState.create(0, 0, [torch.zeros(2)], []),
    lambda s: FragmentState.create(-1, 0, [], []),
])
def test_errors(call):
    with pytest.raises(ValueError):
        call(_state())


def test_a_ledger_whose_period_starts_far_ahead_restarts_the_period_at_the_round():
    """A state answer may carry any ledger in range: one claiming its period began at step
    2^53 (a peer republishing honest Θ under it) would otherwise put every later round in that
    period with its step budget spent, f = 1/1024 forever. A round more than 2H before the
    period's start begins a new period at its own position; one within 2H (a slow learner
    behind the schedule) still counts in the current period."""
    forged = Ledger(2**53, 0, 1000.0, 1024, 0)
    f, led = round_fraction(forged, 1000, 500, 100, first=1.0)
    assert (f, led.period_start, led.period_fraction) == (1.0, 500, 1024)
    assert led.rate == 0.5 * 1000.0 + 0.5 * 0  # the forged period is closed with its 0 tokens
    f, led = round_fraction(Ledger(600, 500, 1000.0, 512, 0), 500, 450, 100, first=1.0)  # 150 behind: same period
    assert (f, led.period_start, led.period_fraction) == (0.5, 600, 1024)


def test_the_first_period_counts_the_progress_since_step_0_as_that_many_periods():
    """Fragment 3 of 4 with H = 100 is first sent at step 175 (H + offset 75) with 175 steps of
    progress (1750 tokens). Its next round, 100 steps later, carries one period's progress (1000
    tokens) and takes a whole step: the first period's rate is 1750 x 100 / 175 = 1000 tokens
    per period, not 1750 (which gave 1000 / 1750 = 0.57 of a step)."""
    f, led = round_fraction(Ledger(), 1750, 175, 100, first=1.0)
    assert (f, led.period_start, led.period_tokens, led.rate) == (1.0, 175, 1750, 0.0)
    f, led = round_fraction(led, 1000, 275, 100, first=1.0)
    assert (f, led.rate) == (1.0, 1000.0)
    f, led = round_fraction(Ledger(), 1000, 100, 100, first=1.0)  # fragment 0: position H, unchanged
    assert round_fraction(led, 1000, 200, 100, first=1.0)[1].rate == 1000.0


def test_error_feedback_adds_the_decayed_residual_to_the_pseudo_gradient() -> None:
    """Δ + β·e, hand-computed in binary fractions (exact in fp32): β = 0.75 of e = (4, -8)
    is (3, -6); with Δ = (0.5, 0.25): (3.5, -5.75). β = 1 carries e whole, β = 0 drops it,
    no residual returns Δ."""
    from p2pdiloco.core.outer import with_error_feedback

    delta, residual = [torch.tensor([0.5, 0.25])], [torch.tensor([4.0, -8.0])]
    assert torch.equal(with_error_feedback(delta, residual, 0.75)[0], torch.tensor([3.5, -5.75]))
    assert torch.equal(with_error_feedback(delta, residual, 1.0)[0], torch.tensor([4.5, -7.75]))
    assert torch.equal(with_error_feedback(delta, residual, 0.0)[0], torch.tensor([0.5, 0.25]))
    assert with_error_feedback(delta, None, 0.5)[0] is delta[0]
    with pytest.raises(ValueError, match="decay"):
        with_error_feedback(delta, residual, 1.5)
    with pytest.raises(ValueError, match="shape"):
        with_error_feedback(delta, [torch.zeros(3)], 1.0)
    with pytest.raises(ValueError, match="residual tensors"):
        with_error_feedback(delta, [], 1.0)


def test_a_swarm_that_shrank_takes_whole_steps_from_the_next_period_and_one_that_grew_averages():
    """H = 100, rate 1000 tokens a period (four learners of 250). Two leave for good: the period
    at position 300 merged 500 tokens (f = 0.5, its budget's half). The next period's round, 500
    tokens again, is a whole step: the completed period set the rate to 500 (a moving average
    gave 750 and f = 0.67, for periods). A period that merged more tokens than the rate is
    averaged in (RATE_DECAY 0.5): 1000 then 1500 gives 1250."""
    f, led = round_fraction(Ledger(200, 1000, 1000.0, 1024, 0), 500, 300, 100, first=1.0)
    assert (f, led.period_start, led.period_tokens, led.rate) == (0.5, 300, 500, 1000.0)
    f, led = round_fraction(Ledger(300, 500, 1000.0, 512, 0), 500, 400, 100, first=1.0)
    assert (f, led.rate) == (1.0, 500.0)
    assert type(led.rate) is float  # the state answer's parser takes a float rate only (net/records/messages.py)
    f, led = round_fraction(Ledger(300, 1500, 1000.0, 1024, 0), 1500, 400, 100, first=1.0)
    assert (f, led.rate) == (1.0, 1250.0)
