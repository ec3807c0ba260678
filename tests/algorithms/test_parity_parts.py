"""The parts the parity sweep screens beyond the paper: post-local SGD (``warmup_steps``) and an
outer lr that decays with the inner one (``outer_lr_decay``), each built by the one builder
exactly as the library composes it, and refused where it means nothing."""

import pytest
import torch

from localclip.algorithms import CELGC, build_algorithm
from localclip.cli import main, train_config
from localclip.comm import SimulatedWorld, current
from localclip.errors import ConfigError
from localclip.optim.schedule import StepDecay
from localclip.averaging import OuterSGD
from localclip.algorithms import build

from workers import fixed_batches, tiny_model

STEPS = 9


def _train(model, alg):
    for x, y in fixed_batches(current().rank, STEPS):
        alg.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        alg.step()
    return [t.clone() for t in model.state_dict().values()], alg.rounds


def _built_and_by_hand(config):
    model = tiny_model(seed=current().rank)
    built = _train(model, build_algorithm(config, model, current()))
    model = tiny_model(seed=current().rank)
    hand = _train(model, CELGC(model, config.local.lr, config.local.gamma, config.round.period, warmup_steps=config.round.warmup_steps,
                               participation_seed=config.run.seed, skip_nonfinite=True))
    return built, hand


def test_post_local_sgd_is_the_averagers_warmup_and_counts_its_rounds():
    config = train_config(["ptb-small", "--workers", "2", "--period", "4", "--lr", "0.05", "--gamma", "0.02",
                           "--set", "warmup_steps=4", "--set", "eval_interval=0"])
    assert config.round.warmup_steps == 4
    for built, hand in SimulatedWorld(2).run(_built_and_by_hand, config):
        assert all(torch.equal(a, b) for a, b in zip(built[0], hand[0]))
        # steps 1-4 each end a round, then steps 8 (= 4 + 4): 5 rounds in 9 steps
        assert built[1] == hand[1] == 5


@pytest.mark.parametrize("flags, match", [
    (["--algorithm", "naive", "--set", "warmup_steps=4"], "warmup_steps.*algorithm=naive"),
    (["--period", "4", "--fragments", "2", "--set", "warmup_steps=4"], "warmup_steps.*streaming rounds"),
    (["--period", "4", "--set", "warmup_steps=6", "--set", "eval_interval=8"], "warmup_steps.*multiple of period=4"),
    (["--set", "warmup_steps=-1"], "warmup_steps.*>= 0"),
    (["--set", "outer_lr_decay=true"], "outer_lr_decay.*outer_optimizer"),
])
def test_misplaced_warmups_and_outer_decays_are_refused_in_one_line(tmp_path, capsys, flags, match):
    out = tmp_path / "run"
    assert main(["train", "ptb-small", "--workers", "2", "--max-steps", "2", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    import re

    assert re.search(match, err), err
    assert not out.exists()


def test_the_outer_lr_takes_the_inner_decay_from_its_base_value():
    param = torch.nn.Parameter(torch.zeros(3))
    inner = torch.optim.SGD([param], lr=20.0)
    inner.param_groups[0]["gamma"] = 5.0
    outer = OuterSGD(0.7, 0.9, nesterov=True)
    decay = StepDecay(inner, 20.0, 5.0, [2, 3], 0.5, outer=outer)
    for epoch, factor in ((0, 1.0), (1, 1.0), (2, 0.5), (3, 0.25), (5, 0.25)):
        decay.apply(epoch, scale=0.9)  # the per-step bptt scale is the inner step's alone
        assert outer.lr == 0.7 * factor
        assert inner.param_groups[0]["lr"] == 20.0 * 0.9 * factor
    decay.apply(0)
    assert outer.lr == 0.7  # computed from the base value, so a resume at any epoch agrees


def test_a_run_with_a_decaying_outer_lr_hands_its_outer_optimizer_to_the_decay():
    import dataclasses

    from localclip.recipes import get_recipe
    from localclip.train import Trainer
    from helpers import CUSTOM, SHARED

    config = build.resolved(get_recipe("ptb-small").replace(
        workers=2, period=2, outer_optimizer="nesterov", outer_lr_decay=True,
        lr_decay_epochs=[1, 2], lr_decay=0.5, data_root=str(SHARED), allow_custom_corpus=CUSTOM, threads=1,
        eval_tokens=200, max_steps=2))

    def worker():
        trainer = Trainer(config, None, progress=False)
        outer = trainer.algorithm.averager.outer
        lrs = []
        for epoch in (0, 1, 2):
            trainer.epoch = epoch
            trainer._set_step_size(1.0)
            lrs.append(outer.lr)
        return lrs

    assert SimulatedWorld(2).run(worker) == [[0.7, 0.35, 0.175]] * 2
