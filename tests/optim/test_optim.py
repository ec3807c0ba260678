"""ClippedSGD: the update rule, its parity with PyTorch, its paths, statistics and contract."""

import copy
import math

import pytest
import torch

from localclip import ClippedSGD, GammaFollowsLR
from localclip.optim import clipped_sgd


def make_params(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (3,), (4, 2, 2), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]


def grads_for(params, step, scale=1.0):
    gen = torch.Generator().manual_seed(1000 + step)
    return [scale * torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def run(opt_factory, steps=6, scale=3.0, skip=None):
    params = make_params()
    opt = opt_factory(params)
    for t in range(steps):
        for i, (p, g) in enumerate(zip(params, grads_for(params, t, scale))):
            p.grad = None if (skip is not None and i == skip) else g
        opt.step()
    return params, opt


@pytest.mark.parametrize("momentum,dampening,nesterov,wd", [(0, 0, False, 0), (0.9, 0, False, 1e-2), (0.9, 0, True, 1e-3), (0.5, 0.3, False, 0)])
def test_gamma_inf_equals_torch_sgd(momentum, dampening, nesterov, wd):
    kw = dict(momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd)
    ours, _ = run(lambda p: ClippedSGD(p, lr=0.1, gamma=math.inf, **kw))
    ref, _ = run(lambda p: torch.optim.SGD(p, lr=0.1, **kw))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


def test_no_momentum_no_decay_equals_clip_grad_norm_then_sgd():
    lr, gamma = 0.3, 0.05
    ours, opt = run(lambda p: ClippedSGD(p, lr=lr, gamma=gamma))
    params = make_params()
    sgd = torch.optim.SGD(params, lr=lr)
    for t in range(6):
        for p, g in zip(params, grads_for(params, t, 3.0)):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, gamma / lr)
        sgd.step()
    for a, b in zip(ours, params):
        # clip_grad_norm_ adds 1e-6 to the norm; nothing else differs.
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    assert float(opt.clip_fraction) == 1.0


@pytest.mark.parametrize("momentum,dampening,nesterov,wd", [(0, 0, False, 0), (0, 0, False, 0.1), (0.9, 0, False, 0.01), (0.9, 0, True, 0.01), (0.8, 0.2, False, 0)])
@pytest.mark.parametrize("gamma", [0.02, 1e9, math.inf])
def test_loop_foreach_and_fused_paths_agree_in_float64(momentum, dampening, nesterov, wd, gamma):
    kw = dict(momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd)
    results = []
    for paths in (dict(foreach=False, fused=False), dict(foreach=True, fused=False), dict(fused=True)):
        # Two groups with their own lr and gamma; one parameter never gets a gradient.
        def factory(p):
            return ClippedSGD([{"params": p[:2]}, {"params": p[2:], "lr": 0.05, "gamma": gamma / 2}], lr=0.2, gamma=gamma, **kw, **paths)

        params, opt = run(factory, skip=3)
        results.append((params, opt))
    ref = results[0][0]
    for params, opt in results[1:]:
        for a, b in zip(params, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
        assert int(opt.clipped_steps) == int(results[0][1].clipped_steps)
    untouched = make_params()[3]
    torch.testing.assert_close(ref[3].detach(), untouched)


def test_norm_spans_all_groups_and_step_is_bounded_by_gamma():
    params = make_params()
    opt = ClippedSGD([{"params": params[:2]}, {"params": params[2:]}], lr=10.0, gamma=0.1)
    before = torch.cat([p.detach().flatten().clone() for p in params])
    grads = grads_for(params, 0, 5.0)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    after = torch.cat([p.detach().flatten() for p in params])
    full_norm = torch.cat([g.flatten() for g in grads]).norm()
    assert torch.isclose((after - before).norm(), torch.tensor(0.1, dtype=torch.float64))
    assert torch.isclose(opt.last_grad_norm.double(), full_norm, rtol=1e-6)
    assert float(opt.clip_fraction) == 1.0


def test_small_gradient_is_not_clipped():
    params = make_params()
    opt = ClippedSGD(params, lr=0.1, gamma=100.0)
    for p, g in zip(params, grads_for(params, 0, 1e-3)):
        p.grad = g
    opt.step()
    assert float(opt.clip_fraction) == 0.0 and int(opt.clipped_steps) == 0


@pytest.mark.parametrize("fused", [True, False])
def test_nonfinite_gradient_skips_step_and_counts_it(fused):
    params = make_params()
    opt = ClippedSGD(params, lr=0.1, gamma=1.0, momentum=0.9, fused=fused, foreach=None if fused else True)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    opt.step()
    snapshot = [p.detach().clone() for p in params]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in params]
    params[1].grad[0] = math.nan
    opt.step()
    for p, s, b in zip(params, snapshot, bufs):
        assert torch.equal(p.detach(), s) and torch.equal(opt.state[p]["momentum_buffer"], b)
    assert int(opt.skipped_steps) == 1


def test_global_modes_use_the_reference_norm():
    lr, gamma = 1.0, 0.1
    for mode, ref, expect_norm in [("global_average", 100.0, 100.0), ("max", 0.001, None), ("max", 1e6, 1e6)]:
        params = make_params()
        opt = ClippedSGD(params, lr=lr, gamma=gamma, clip_mode=mode)
        opt.set_reference_norm(ref)
        grads = grads_for(params, 0)
        local = torch.cat([g.flatten() for g in grads]).norm().item()
        before = torch.cat([p.detach().flatten().clone() for p in params])
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        moved = (torch.cat([p.detach().flatten() for p in params]) - before).norm().item()
        norm_used = expect_norm if expect_norm is not None else local
        assert moved == pytest.approx(min(lr, gamma / norm_used) * local, rel=1e-6), mode


def test_clip_mode_none_never_clips():
    params, opt = run(lambda p: ClippedSGD(p, lr=0.1, gamma=1e-6, clip_mode="none"))
    ref, _ = run(lambda p: torch.optim.SGD(p, lr=0.1))
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-0.1), "learning rate: -0.1"),
        (dict(lr=0.1, gamma=-1.0), "gamma.*-1.0"),
        (dict(lr=0.1, gamma=0.0), "gamma.*0.0"),
        (dict(lr=0.1, momentum=1.0), "momentum value: 1.0"),
        (dict(lr=0.1, momentum=-0.1), "momentum value: -0.1"),
        (dict(lr=0.1, clip_mode="global"), "clip_mode: 'global'"),
        (dict(lr=0.1, nesterov=True), "nesterov"),
        (dict(lr=0.1, weight_decay=-1.0), "weight_decay value: -1.0"),
    ],
)
def test_invalid_hyperparameters_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClippedSGD(make_params(), **kwargs)


def test_state_dict_round_trip_continues_identically():
    kw = dict(lr=0.2, gamma=0.05, momentum=0.9, weight_decay=1e-3)
    params, opt = run(lambda p: ClippedSGD(p, **kw), steps=3)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = ClippedSGD(twin, **kw)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.steps == opt.steps and int(opt2.clipped_steps) == int(opt.clipped_steps)
    for t in range(3, 6):
        for ps, o in ((params, opt), (twin, opt2)):
            for p, g in zip(ps, grads_for(ps, t, 3.0)):
                p.grad = g
            o.step()
    for a, b in zip(params, twin):
        assert torch.equal(a, b)


def test_lr_scheduler_and_gamma_follows_lr_keep_the_clip_threshold():
    params = make_params()
    opt = ClippedSGD(params, lr=30.0, gamma=7.5)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.1)
    coupling = GammaFollowsLR(opt)
    seen = []
    for t in range(5):
        for p, g in zip(params, grads_for(params, t)):
            p.grad = g
        opt.step()
        sched.step()
        coupling.step()
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["gamma"]))
    assert seen[-1][0] == pytest.approx(0.3) and seen[-1][1] == pytest.approx(0.075)
    assert all(g / lr == pytest.approx(0.25) for lr, g in seen)
    restored = GammaFollowsLR(ClippedSGD(make_params(), lr=1.0, gamma=1.0))
    restored.load_state_dict(coupling.state_dict())
    assert restored.ratios == coupling.ratios


def test_step_does_not_synchronise_with_the_host(monkeypatch):
    """No .item(), bool() or float() of a tensor inside a (fused, default) step."""
    params = make_params(dtype=torch.float32)
    opt = ClippedSGD(params, lr=0.1, gamma=0.5, momentum=0.9, weight_decay=1e-4)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    opt.step()  # first step creates buffers

    def forbidden(*_a, **_k):
        raise AssertionError("host synchronisation inside ClippedSGD.step")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for _ in range(3):
        opt.step()
    monkeypatch.undo()
    assert opt.steps == 4


def test_closure_is_called_with_grad_enabled():
    params = make_params()
    opt = ClippedSGD(params, lr=0.1, gamma=1.0)

    def closure():
        opt.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() > 0 and opt.steps == 1


def test_functional_core_matches_class_with_float_step():
    params = make_params()
    grads = grads_for(params, 0)
    expect = [p.detach() - 0.1 * g for p, g in zip(params, grads)]
    with torch.no_grad():
        clipped_sgd(params, grads, [None] * 4, 0.1, weight_decay=0, momentum=0, dampening=0, nesterov=False)
    for p, e in zip(params, expect):
        torch.testing.assert_close(p.detach(), e)


@pytest.mark.parametrize("path", [dict(fused=True), dict(foreach=True), dict(foreach=False)])
@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 1e-2)])
def test_float64_matches_the_exact_formula_to_1e_12(path, momentum, wd):
    """Norm and step in float64 for float64 parameters: no float32 rounding anywhere."""
    lr, gamma = 0.3, 0.05
    params, opt = run(lambda p: ClippedSGD(p, lr=lr, gamma=gamma, momentum=momentum, weight_decay=wd, **path))
    ref = [p.detach().clone() for p in make_params()]
    bufs = [None] * len(ref)
    for t in range(6):
        grads = grads_for(ref, t, 3.0)
        norm = math.sqrt(math.fsum(float(v) ** 2 for g in grads for v in g.reshape(-1)))
        step = min(lr, gamma / norm)
        for i, (x, g) in enumerate(zip(ref, grads)):
            d = g + wd * x
            if momentum:
                bufs[i] = d.clone() if bufs[i] is None else momentum * bufs[i] + d
                d = bufs[i]
            x -= step * d
    assert opt.last_grad_norm.dtype == torch.float64
    assert float(opt.last_grad_norm) == pytest.approx(norm, rel=1e-14)
    for a, b in zip(params, ref):
        assert a.dtype == torch.float64
        assert ((a.detach() - b).abs().max() / b.abs().max()).item() <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_norm_is_accumulated_in_float32(dtype):
    params = [torch.nn.Parameter(torch.full((4096,), 1.0, dtype=dtype))]
    params[0].grad = torch.full((4096,), 300.0, dtype=dtype)  # the sum of squares overflows float16
    opt = ClippedSGD(params, lr=0.01, gamma=0.5)
    opt.step()
    exact = 300.0 * 64.0
    assert opt.last_grad_norm.dtype == torch.float32
    assert float(opt.last_grad_norm) == pytest.approx(exact, rel=1e-6)
    step = min(0.01, 0.5 / exact)
    expected = torch.tensor(1.0 - step * 300.0, dtype=torch.float32).to(dtype)
    assert torch.equal(params[0].detach(), torch.full((4096,), float(expected), dtype=dtype))
