"""The transformer parity sweep (``gpt-parity``) builds what its docstring says: every run AdamW
with the recipe's settings, the same tokens, schedule and evaluation steps; the DiLoCo runs an
outer Nesterov step at their period; naive a round every step."""

import math

from localclip_lab import plans, runner
from localclip.recipes import get_recipe, INNER_SETTINGS
from localclip.algorithms import build

RUNS = dict(plans.plan("gpt-parity"))


def test_every_run_trains_the_same_tokens_with_the_recipes_adamw():
    recipe = get_recipe("ptb-gpt-small")
    adamw = INNER_SETTINGS["ptb-gpt-small"]["adamw"]
    shared = {(c.algorithm.workers, c.workload.batch_size, c.workload.bptt, c.schedule.epochs, tuple(c.schedule.lr_decay_epochs), c.schedule.lr_decay, c.evaluation.eval_interval)
              for c in RUNS.values()}
    assert len(shared) == 1
    for name, cfg in RUNS.items():
        assert cfg.local.inner_optimizer == "adamw", name
        lr = adamw["lr"] * {"lr2x": 2, "lr0.5x": 0.5}.get(name.rsplit("-", 1)[-1], 1)  # the lr grid
        assert (cfg.local.lr, list(cfg.local.betas), cfg.local.weight_decay, cfg.local.max_grad_norm) == (lr, adamw["betas"], adamw["weight_decay"], adamw["max_grad_norm"]), name
        assert math.isinf(cfg.local.gamma) and cfg.workload.model_options == recipe.workload.model_options, name
        assert cfg.evaluation.eval_interval % (build.resolved(cfg).round.period or 1) == 0, name


def test_diloco_runs_step_outside_with_nesterov_and_naive_rounds_every_step():
    for seed, tag in zip(plans.GPT_PARITY_SEEDS, ("", "-s2021")):
        assert RUNS[f"naive{tag}"].algorithm.name == "naive" and RUNS[f"naive{tag}"].run.seed == seed
        for period in plans.GPT_PARITY_PERIODS:
            cfg = RUNS[f"diloco-I{period}{tag}"]
            assert (cfg.algorithm.name, cfg.round.period, cfg.run.seed) == ("celgc", period, seed)
            assert (cfg.round.outer_optimizer, cfg.round.outer_lr, cfg.round.outer_momentum) == ("nesterov", 0.7, 0.9)
    assert RUNS["avg-I32"].round.outer_optimizer == "none" and RUNS["avg-I32"].round.period == 32


def test_the_step_length_probes_change_one_knob_of_plain_averaging_each():
    avg = RUNS["avg-I32"]
    olr2, lr2x = RUNS["avg-I32-olr2"], RUNS["avg-I32-lr2x"]
    assert (olr2.round.outer_optimizer, olr2.round.outer_lr, olr2.round.outer_momentum) == ("sgd", 2.0, 0.0)
    assert olr2.replace(outer_optimizer="none", outer_lr=avg.round.outer_lr, outer_momentum=avg.round.outer_momentum) == avg
    assert lr2x.local.lr == 2 * avg.local.lr and lr2x.replace(lr=avg.local.lr) == avg


def test_the_runs_description_names_the_inner_optimizer_and_its_clip():
    assert "adamw(clip=1)" in runner._short(RUNS["naive"])


def test_the_lr_grid_is_the_same_for_both_sides_and_changes_only_the_lr():
    for name, factor in (("avg-I32-lr0.5x", 0.5), ("avg-I32-lr2x", 2), ("naive-lr0.5x", 0.5), ("naive-lr2x", 2)):
        plain = RUNS[name.rsplit("-", 1)[0]]
        assert RUNS[name].local.lr == factor * plain.local.lr and RUNS[name].replace(lr=plain.local.lr) == plain, name
