"""The AdamW inner optimizer: ClippedAdamW against torch's AdamW, optimizer_state at a round,
the algorithms built around any optimizer, and the config/CLI checks."""

import copy
import math

import pytest
import torch

import localclip
from localclip.algorithms import CELGC, NaiveParallelClipping
from localclip.cli import main
from localclip.comm import SimulatedWorld, current
from localclip.errors import ConfigError
from localclip.optim import ClippedAdamW
from localclip.train import TrainConfig
from localclip.algorithms import build

from workers import fixed_batches, tiny_model


def mlp(seed=0):
    with localclip.rng.seeded(seed):  # simulated workers run concurrently: no bare global draws
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x.double()), y)


@pytest.mark.parametrize("fused", [True, False])
def test_without_clipping_it_is_exactly_torch_adamw(fused):
    a, b = mlp(), mlp()
    kw = dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, fused=fused or None, foreach=None if fused else True)
    ours = ClippedAdamW(a.parameters(), max_grad_norm=math.inf, **kw)
    ref = torch.optim.AdamW(b.parameters(), **kw)
    for x, y in fixed_batches(0, 12):
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert int(ours.clipped_steps) == 0 and ours.steps == 12


@pytest.mark.parametrize("fused", [True, False])
def test_clipping_then_adamw_equals_scaling_the_gradient_by_c_over_norm(fused):
    """The practitioner's recipe, written out: g ← g·min(1, c/‖g‖), then AdamW (float64)."""
    c = 0.3
    a, b = mlp(), mlp()
    ours = ClippedAdamW(a.parameters(), lr=1e-2, weight_decay=0.05, max_grad_norm=c, fused=fused or None, foreach=None if fused else True)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.05, foreach=True)
    clipped = 0
    for i, (x, y) in enumerate(fixed_batches(0, 15)):
        scale = 1.0 if i % 3 else 25.0  # every third step has a large gradient
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            (scale * loss_of(model, x, y)).backward()
            if opt is ref:
                norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
                if norm > c:
                    clipped += 1
                    for p in model.parameters():
                        p.grad.mul_(c / norm)
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert clipped > 0 and int(ours.clipped_steps) == clipped
    assert float(ours.clip_fraction) == pytest.approx(clipped / 15)


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_gradient_skips_the_whole_step(fused):
    model = mlp()
    opt = ClippedAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, fused=fused or None, foreach=None if fused else True)
    x, y = fixed_batches(0, 1)[0]
    opt.zero_grad()
    loss_of(model, x, y).backward()
    opt.step()
    before = copy.deepcopy((list(model.parameters()), opt.state_dict()))
    opt.zero_grad()
    loss_of(model, x, y).backward()
    next(model.parameters()).grad[0, 0] = math.nan
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[0]))
    after = opt.state_dict()["state"]
    for key, s in before[1]["state"].items():
        for name, t in s.items():
            assert torch.equal(after[key][name], t), name
    assert int(opt.skipped_steps) == 1


def test_checkpoint_round_trip_restores_the_counters():
    model = mlp()
    opt = ClippedAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.01)
    for x, y in fixed_batches(0, 3):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    other = ClippedAdamW(mlp().parameters(), lr=1e-2, max_grad_norm=0.01)
    other.load_state_dict(opt.state_dict())
    assert other.steps == 3 and int(other.clipped_steps) == 3


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, True])
def test_max_grad_norm_must_be_positive(bad):
    with pytest.raises(ValueError, match="Invalid max_grad_norm"):
        ClippedAdamW(mlp().parameters(), max_grad_norm=bad)


# -- optimizer_state at a round, through the library path: PeriodicAverager + any optimizer ------


def _adam_worker(mode):
    """Two AdamW steps with clip_grad_norm_ and a round after the second (float64: mlp() is double)."""
    comm = current()
    model = mlp(seed=comm.rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    averager = localclip.PeriodicAverager(model, period=2, optimizer=opt, optimizer_state=mode)
    snapshots = []
    for x, y in fixed_batches(comm.rank, 2):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        snapshots.append({i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())})
        synced = averager.step()
    after = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    return synced, snapshots[-1], after, averager.bytes_communicated, averager.numel


@pytest.mark.parametrize("mode", ["local", "average", "reset"])
def test_adam_moments_at_a_round(mode):
    (s0, pre0, post0, bytes0, numel), (s1, pre1, post1, _, _) = SimulatedWorld(2).run(_adam_worker, mode)
    assert s0 and s1  # the second step ended a round
    one_round = numel * 8 + 4  # the float64 model and the float32 participation weight (initial broadcast not counted)
    moments = sum(t.numel() for s in pre0.values() for k, t in s.items() if k != "step")
    if mode == "local":
        assert post0[0]["exp_avg"].ne(post1[0]["exp_avg"]).any()  # different data, kept apart
        assert all(torch.equal(post0[i][k], pre0[i][k]) for i in pre0 for k in pre0[i])
        assert bytes0 == one_round
    elif mode == "average":
        for i in pre0:
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(post0[i][k], (pre0[i][k] + pre1[i][k]) / 2, rtol=0, atol=1e-15)
                assert torch.equal(post0[i][k], post1[i][k])
            assert torch.equal(post0[i]["step"], pre0[i]["step"])  # a scalar, not averaged
        assert bytes0 == one_round + moments * 8
    else:
        assert post0 == {} and post1 == {}  # the next step starts Adam afresh (step 1)
        assert bytes0 == one_round


def test_reset_then_a_step_is_a_fresh_adam_step():
    def worker():
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        averager = localclip.PeriodicAverager(model, period=1, optimizer=opt, optimizer_state="reset")
        for x, y in fixed_batches(0, 3):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
            averager.step()
        opt.zero_grad()
        loss_of(model, *fixed_batches(0, 4)[3]).backward()
        opt.step()
        return [float(s["step"]) for s in opt.state.values()]

    assert SimulatedWorld(2).run(worker)[0] == [1.0] * 4


# -- the algorithms around any optimizer --------------------------------------------------------


def _celgc_adamw_worker(algorithm, steps=6):
    comm = current()
    model = mlp(seed=comm.rank)
    opt = ClippedAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
    cls = NaiveParallelClipping if algorithm == "naive" else CELGC
    alg = cls.from_optimizer(model, opt, period=3)
    params_after_round = []
    for i, (x, y) in enumerate(fixed_batches(comm.rank, steps)):
        alg.zero_grad()
        loss_of(model, x, y).backward()
        alg.step()
        if (i + 1) % 3 == 0:
            params_after_round.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return params_after_round, alg.rounds, float(alg.clip_fraction)


@pytest.mark.parametrize("algorithm", ["celgc", "naive"])
def test_celgc_and_naive_with_clipped_adamw_keep_the_workers_identical_after_rounds(algorithm):
    (p0, rounds0, clip0), (p1, _, _) = SimulatedWorld(2).run(_celgc_adamw_worker, algorithm)
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    assert rounds0 == (2 if algorithm == "celgc" else 6)  # naive: one gradient all-reduce a step
    assert 0 <= clip0 <= 1


def test_from_optimizer_rejects_an_optimizer_over_other_parameters():
    model = tiny_model()
    other = torch.optim.AdamW(mlp().parameters())
    with pytest.raises(ValueError, match="must hold exactly the module's"):
        CELGC.from_optimizer(model, other, period=2, group=localclip.comm.SingleProcess())


# -- config and CLI -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(inner_optimizer="adam"), "Invalid inner_optimizer: 'adam'"),
        (dict(inner_optimizer="adamw", max_grad_norm=0.0), "Invalid max_grad_norm: 0.0"),
        (dict(inner_optimizer="adamw", max_grad_norm=-1.0), "Invalid max_grad_norm: -1.0"),
        (dict(inner_optimizer="adamw", momentum=0.9), "Invalid momentum"),
        (dict(inner_optimizer="adamw", clip_mode="max"), "Invalid clip_mode"),
        (dict(betas=[0.9]), "Invalid betas"),
    ],
)
def test_bad_inner_optimizer_settings_are_named(changes, match):
    with pytest.raises(ConfigError, match=match):
        build.resolved(TrainConfig().replace(**changes))


def test_local_sgd_with_adamw_means_no_clipping():
    cfg = build.resolved(TrainConfig().replace(algorithm="local-sgd", inner_optimizer="adamw", max_grad_norm=1.0, lr=1e-3))
    assert cfg.local.max_grad_norm == math.inf and cfg.local.gamma == math.inf


def test_cli_unknown_inner_optimizer_flag_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "ptb-small", "--inner-optimizer", "sgd"])
    assert exc.value.code == 2
    assert "invalid choice: 'sgd'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--inner-optimizer", "adamw", "--set", "max_grad_norm=0"], "Invalid max_grad_norm: 0.0"),
        (["--set", "inner_optimizer=lion"], "Invalid inner_optimizer: 'lion'"),
    ],
)
def test_cli_bad_inner_optimizer_settings_are_one_line_and_exit_2(tmp_path, capsys, argv, match):
    out = tmp_path / "run"
    code = main(["train", "ptb-small", "--out", str(out), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2 and match in err and "Traceback" not in err
    assert not out.exists()


def test_a_run_started_before_the_new_fields_existed_still_resumes(tmp_path):
    """config.json written before inner_optimizer/max_grad_norm/betas/loggers existed."""
    import json

    from localclip.train import RunFolder

    cfg = build.resolved(TrainConfig())
    old = {k: v for k, v in json.loads(cfg.to_json()).items() if k not in ("inner_optimizer", "max_grad_norm", "betas", "loggers")}
    run = RunFolder(tmp_path / "r")
    run.path.mkdir()
    run.config_path.write_text(json.dumps(old))
    assert not run.prepare(cfg.to_json(), resume=True)  # accepted, no checkpoint yet
    changed = build.resolved(TrainConfig().replace(inner_optimizer="adamw", lr=1e-3))
    with pytest.raises(localclip.errors.RunFolderError, match="inner_optimizer: 'clipped_sgd' in the run, 'adamw' now"):
        run.prepare(changed.to_json(), resume=True)
