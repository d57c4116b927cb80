import io
import math

import pytest
import torch
import torch.nn.functional as F

from p2pdiloco.core import (FragmentState, InnerConfig, Learner, StaggeredSchedule, balanced_fragments,
                            contribution_weight, lr_at, merge_pseudo_gradients, nesterov_outer_step)
from p2pdiloco.model import ModelConfig, build_model

CFG = ModelConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
INNER = InnerConfig(lr=1e-2, warmup_steps=3, total_steps=10, min_lr_ratio=0.1, grad_clip=1.0)
B, T = 4, 16


def _learner(seed=0, P=3, inner=INNER):
    model = build_model(CFG, seed)
    frags = balanced_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], P, model.embedding_names())
    return Learner(model, frags, inner)


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w = torch.randint(0, 256, (B, T + 1), generator=g)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_lr_schedule_hand_numbers():
    c = InnerConfig(lr=1.0, warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    # warmup (s+1)/4; cosine: 0.1 + 0.9·0.5·(1 + cos(pi·(s−4)/8))
    expected = {0: 0.25, 3: 1.0, 4: 1.0, 6: 0.8681981, 8: 0.55, 12: 0.1, 20: 0.1}
    for s, v in expected.items():
        assert math.isclose(lr_at(s, c), v, rel_tol=1e-6), s
    assert lr_at(0, InnerConfig(lr=2.0, warmup_steps=0, total_steps=5)) == 2.0


@pytest.mark.parametrize("H,P", [(1, 3), (3, 3)])
def test_outer_lr1_momentum0_reproduces_plain_adamw(H, P):
    learner = _learner(P=P)
    ref = build_model(CFG, 0)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    no_decay = [p for p in ref.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=0.0, betas=(0.9, 0.95))
    schedule = StaggeredSchedule(H=H, P=P, tau=0)
    for k, (x, y) in enumerate(_batches(10)):
        loss = learner.inner_step(x, y)
        # reference: plain AdamW, same warmup + cosine schedule
        ref_loss = F.cross_entropy(ref(x).view(-1, 256), y.reshape(-1))
        opt.zero_grad()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(k, INNER)
        opt.step()
        assert math.isclose(loss, ref_loss.item(), rel_tol=1e-5)
        for p in schedule.due(learner.step, [learner.counters(q)[1] for q in range(P)]):
            delta = learner.pseudo_gradient(p)
            tokens, steps = learner.counters(p)
            assert steps in (H, H + p) and tokens == steps * B * T
            mask = learner.fragments[p].embedding_mask
            merged = merge_pseudo_gradients([delta], [contribution_weight(tokens, steps)], mask)
            assert all(torch.equal(m, d) for m, d in zip(merged, delta))  # single member: merge is Δ
            new = nesterov_outer_step(learner.global_states[p], merged, lr=1.0, momentum=0.0)
            learner.install(new)
            assert learner.counters(p) == (0, 0)
            assert learner.global_states[p].version == new.version
        got, want = _params(learner.model), _params(ref)
        for n in want:
            assert torch.allclose(got[n], want[n], atol=1e-6, rtol=0), (k, n)
    assert sum(s.version for s in learner.global_states) > 0


def test_counters_and_pseudo_gradient_sign():
    learner = _learner()
    init = _params(learner.model)
    for x, y in _batches(2):
        learner.inner_step(x, y)
    assert learner.step == 2
    assert all(learner.counters(p) == (2 * B * T, 2) for p in range(3))
    now = _params(learner.model)
    for p, f in enumerate(learner.fragments):
        delta = learner.pseudo_gradient(p)
        for s, d in zip(f.slots, delta):
            assert d.dtype == torch.float32 and tuple(d.shape) == s.shape
            assert torch.equal(d, init[s.name] - now[s.name])  # Δ = anchor − θ
    # a hand-made move: θ = anchor − 0.5 gives Δ = +0.5
    f0 = learner.fragments[0]
    with torch.no_grad():
        param = dict(learner.model.named_parameters())[f0.slots[0].name]
        param.copy_(learner.global_states[0].theta[0] - 0.5)
    assert torch.allclose(learner.pseudo_gradient(0)[0], torch.full(f0.slots[0].shape, 0.5), atol=1e-6)
    # progress_norm: the L2 norm over every slot of the fragment; by hand for the move above
    with torch.no_grad():
        for s, a in zip(f0.slots, learner.global_states[0].theta):
            dict(learner.model.named_parameters())[s.name].copy_(a - 0.5)
    count = sum(math.prod(s.shape) for s in f0.slots)
    assert learner.progress_norm(0) == pytest.approx(0.5 * math.sqrt(count), rel=1e-5)


def test_pseudo_gradient_does_not_alias():
    learner = _learner()
    learner.inner_step(*_batches(1)[0])
    before_params, before_anchor = _params(learner.model), [x.clone() for x in learner.global_states[1].theta]
    for d in learner.pseudo_gradient(1):
        d.add_(100.0)
    assert all(torch.equal(a, b) for a, b in zip(learner.global_states[1].theta, before_anchor))
    assert all(torch.equal(v, before_params[n]) for n, v in _params(learner.model).items())
    # the anchor is a copy of the initial weights, not a view of the (trained) parameters
    init = _params(build_model(CFG, 0))
    assert all(torch.equal(t, init[s.name]) for s, t in zip(learner.fragments[1].slots, learner.global_states[1].theta))


def test_install_and_rebase():
    learner = _learner()
    for x, y in _batches(2):
        learner.inner_step(x, y)
    exp_avg = {id(p): s["exp_avg"].clone() for p, s in learner.optimizer.state.items()}
    f = learner.fragments[2]
    g = torch.Generator().manual_seed(5)
    state = FragmentState.create(2, 7, [torch.randn(s.shape, generator=g) for s in f.slots],
                                 [torch.zeros(s.shape) for s in f.slots])
    learner.install(state)
    params = dict(learner.model.named_parameters())
    assert all(torch.equal(params[s.name].detach(), t) for s, t in zip(f.slots, state.theta))
    assert learner.counters(2) == (0, 0) and learner.counters(0) == (2 * B * T, 2)
    assert learner.global_states[2] is state
    assert all(torch.equal(s["exp_avg"], exp_avg[id(p)]) for p, s in learner.optimizer.state.items())
    with torch.no_grad():
        params[f.slots[0].name].add_(1.0)
    assert not torch.equal(params[f.slots[0].name].detach(), state.theta[0])  # install copied

    # rebase: local progress relative to the old anchor is kept on top of the new global value
    learner.inner_step(*_batches(1, seed=9)[0])
    local = learner.pseudo_gradient(0)
    counters = learner.counters(0)
    newer = FragmentState.create(0, 1, [t + 0.25 for t in learner.global_states[0].theta],
                                 [torch.zeros(s.shape) for s in learner.fragments[0].slots])
    learner.install(newer, rebase=True)
    for s, t, d in zip(learner.fragments[0].slots, newer.theta, local):
        assert torch.allclose(params[s.name].detach(), t - d, atol=1e-6)
    assert learner.counters(0) == counters and learner.global_states[0] is newer
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(learner.pseudo_gradient(0), local))


def test_install_errors():
    learner = _learner()
    with pytest.raises(ValueError):
        learner.install(FragmentState.create(5, 1, [], []))
    with pytest.raises(ValueError):
        learner.install(FragmentState.create(0, 1, [torch.zeros(1)], [torch.zeros(1)]))


def test_non_finite_loss_skips_step():
    learner = _learner()
    with torch.no_grad():
        learner.model.ln_f.weight.fill_(float("nan"))
    before = _params(learner.model)
    loss = learner.inner_step(*_batches(1)[0])
    assert math.isnan(loss) and learner.step == 0 and learner.counters(0) == (0, 0)
    after = _params(learner.model)
    assert all(torch.equal(after[n], before[n]) for n in before if n != "ln_f.weight")


def test_state_dict_roundtrip_resumes_identically():
    a = _learner(seed=0)
    batches = _batches(5)
    for x, y in batches[:3]:
        a.inner_step(x, y)
    a.install(nesterov_outer_step(a.global_states[1], a.pseudo_gradient(1), 0.7, 0.9))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = _learner(seed=123)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.step == 3 and b.current_lr() == a.current_lr()
    assert [s.digest for s in b.global_states] == [s.digest for s in a.global_states]
    for x, y in batches[3:]:
        assert a.inner_step(x, y) == b.inner_step(x, y)
    pa, pb = _params(a.model), _params(b.model)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert [a.counters(p) for p in range(3)] == [b.counters(p) for p in range(3)]
    assert [a.span(p) for p in range(3)] == [b.span(p) for p in range(3)]

    sd = a.state_dict()
    sd["global_states"][0]["theta"][0] += 1.0
    with pytest.raises(ValueError, match="corrupt"):
        b.load_state_dict(sd)


def test_bad_configs_and_covers():
    for kw in [dict(lr=0.0), dict(weight_decay=-1.0), dict(betas=(0.9, 1.0)), dict(warmup_steps=20, total_steps=10),
               dict(min_lr_ratio=1.5), dict(grad_clip=-1.0), dict(total_steps=0, warmup_steps=0)]:
        with pytest.raises(ValueError):
            InnerConfig(**kw)
    model = build_model(CFG, 0)
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    with pytest.raises(ValueError):
        Learner(model, balanced_fragments(params[1:], 2), INNER)
    frags = balanced_fragments(params, 2)
    with pytest.raises(ValueError):
        Learner(model, frags[::-1], INNER)


def test_install_keeping_flight_keeps_only_post_send_progress():
    """θ_p ← Θ_new + (θ_now − θ_sent); counters keep only what ran after sending."""
    from p2pdiloco.core.outer import FragmentState as _FS

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False)
    frags = balanced_fragments([("weight", (2, 3))], 1)
    learner = Learner(model, frags, InnerConfig(warmup_steps=0, total_steps=10))
    anchor = learner.global_states[0].theta[0].clone()
    with torch.no_grad():
        model.weight.sub_(0.5)  # progress before sending: θ_sent = anchor − 0.5
    learner._tokens[0], learner._steps[0] = 40, 4
    sent = learner.pseudo_gradient(0)  # Δ = 0.5 everywhere
    assert torch.allclose(sent[0], torch.full((2, 3), 0.5))
    with torch.no_grad():
        model.weight.sub_(0.25)  # progress while the round is in flight
    learner._tokens[0], learner._steps[0] = 60, 6
    new = _FS.create(0, 1, [anchor + 1.0], [torch.zeros(2, 3)])
    learner.install_keeping_flight(new, sent, 40, 4)
    assert torch.allclose(model.weight, anchor + 1.0 - 0.25)  # Θ_new plus the in-flight progress only
    assert learner.counters(0) == (20, 2)
    assert learner.global_states[0] is new
    assert torch.allclose(learner.pseudo_gradient(0)[0], torch.full((2, 3), 0.25))


def test_span_counts_the_rounds_the_progress_was_made_over():
    """span = anchor version − version the counters started at + 1: 1 after an own round;
    2 after following one other round with the progress rebased on top; back to 1 when a
    result is installed (counters reset) or with the flight kept."""
    a = _learner(seed=0)
    x, y = _batches(1)[0]
    a.inner_step(x, y)
    assert a.span(0) == 1
    v1 = nesterov_outer_step(a.global_states[0], a.pseudo_gradient(0), 0.7, 0.9)
    a.install(v1)  # our own round: counters start at v1
    a.inner_step(x, y)
    v2 = nesterov_outer_step(v1, [torch.zeros_like(t) for t in v1.theta], 0.7, 0.9)  # someone else's round
    a.install(v2, rebase=True)
    assert a.span(0) == 2 and a.counters(0)[1] == 1
    v3 = nesterov_outer_step(v2, a.pseudo_gradient(0), 0.7, 0.9)
    a.install_keeping_flight(v3, a.pseudo_gradient(0), *a.counters(0))
    assert a.span(0) == 1 and a.counters(0) == (0, 0)


def test_a_joiner_warms_up_again_at_the_swarms_step():
    """join_at(step): the swarm's place in the schedule, and lr·(k+1)/warmup for the k-th step
    after it, up to lr_at(step) after warmup_steps; a learner that trained warmup_steps of its
    own keeps its rate; never backwards."""
    a = _learner(seed=0)
    warm = a.inner.warmup_steps
    a.join_at(500)
    assert a.step == 500 and a.current_lr() == lr_at(500, a.inner) / warm
    a.step = 500 + warm - 1
    assert a.current_lr() == lr_at(a.step, a.inner)  # the ramp's last step: (warm-1+1)/warm = 1
    a.step = 500 + warm
    assert a.current_lr() == lr_at(a.step, a.inner)
    b = _learner(seed=0)
    b.step = warm
    b.join_at(400)
    assert b.step == 400 and b.current_lr() == lr_at(400, b.inner)
    b.join_at(10)
    assert b.step == 400
