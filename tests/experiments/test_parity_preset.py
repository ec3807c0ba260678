"""The ``ptb-converge-asgd`` preset is exactly the configuration of the parity sweep's
``celgc-I32-const-asgd`` run (the run its documentation quotes), and the builder makes from it
CELGC rounds every 32 steps with plain averaging, a constant lr and γ, and the epoch average."""

from localclip.recipes import GAMMA_CELGC_I32, get_recipe
from localclip.train.config import flat_view
from localclip_lab import plans
from localclip.algorithms import build


def test_the_preset_is_the_parity_runs_configuration_but_for_its_log_interval():
    preset = flat_view(get_recipe("ptb-converge-asgd").to_dict())
    run = flat_view(dict(plans.plan("parity"))["celgc-I32-const-asgd"].to_dict())
    differ = {k for k in preset.keys() | run.keys() if preset.get(k) != run.get(k)}
    assert differ == {"log_interval"}


def test_the_preset_resolves_to_celgc_at_period_32_with_a_constant_schedule_and_the_epoch_average():
    cfg = build.resolved(get_recipe("ptb-converge-asgd"))
    assert (cfg.algorithm.name, cfg.algorithm.workers, cfg.round.period) == ("celgc", 8, 32)
    assert (cfg.local.lr, cfg.local.gamma) == (20.0, GAMMA_CELGC_I32)
    assert (cfg.schedule.lr_decay_epochs, cfg.schedule.lr_decay, cfg.evaluation.asgd_patience) == ([], 1.0, 1)
    assert cfg.round.outer_optimizer == "none" and cfg.round.compression == "none"
    assert cfg.evaluation.eval_interval % cfg.round.period == 0


def test_naive_trained_the_same_way_is_the_parity_runs_naive_but_for_where_it_validates_inside_epochs():
    # The sweep validates naive every 290 steps (a quarter epoch) and CELGC every 288 (a whole
    # number of periods); the preset's naive keeps CELGC's points. Epoch ends and the final
    # evaluation are the same steps for both.
    naive = get_recipe("ptb-converge-asgd").replace(algorithm="naive", period=1, gamma=5.0)
    run = flat_view(dict(plans.plan("parity"))["naive-const-asgd"].to_dict())
    preset = flat_view(naive.to_dict())
    assert {k for k in preset.keys() | run.keys() if preset.get(k) != run.get(k)} == {"log_interval", "eval_interval"}
    assert (preset["eval_interval"], run["eval_interval"]) == (288, 290)
