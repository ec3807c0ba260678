"""The parity sweep's second seed repeats its constant-lr pair exactly, with only the seed changed,
and leaves the runs already made (and their names) as they were."""

from localclip_lab import plans

RUNS = dict(plans.plan("parity"))


def test_the_const_asgd_pair_has_a_second_seed_that_differs_only_in_its_seed():
    for name in ("naive-const-asgd", "celgc-I32-const-asgd"):
        first, second = RUNS[name], RUNS[f"{name}-s{plans.PARITY_SECOND_SEED}"]
        assert first.run.seed != plans.PARITY_SECOND_SEED == second.run.seed
        assert second.replace(seed=first.run.seed) == first


def test_the_runs_before_the_second_seed_keep_their_order():
    names = list(RUNS)
    assert names[:3] == ["naive", "celgc-I32-nesterov", "celgc-I32"]
    assert names[11:13] == [f"naive-const-asgd-s{plans.PARITY_SECOND_SEED}", f"celgc-I32-const-asgd-s{plans.PARITY_SECOND_SEED}"]
    assert len(names) == len(set(names)) == 18


def test_the_dropout_runs_change_only_the_dropout_and_the_long_one_only_its_length():
    drop = f"drop{plans.PARITY_DROPOUT:g}"
    for name in ("naive-const-asgd", "celgc-I32-const-asgd"):
        dropped = RUNS[f"{name}-{drop}"]
        assert dropped.workload.model_options["dropout"] == plans.PARITY_DROPOUT
        assert dropped.replace(model_options=RUNS[name].workload.model_options) == RUNS[name]
    short, long = RUNS[f"celgc-I32-{drop}"], RUNS[f"celgc-I32-{drop}-24ep"]
    assert long.schedule.epochs == 2 * short.schedule.epochs
    assert long.schedule.lr_decay_epochs[0] == 2 * short.schedule.lr_decay_epochs[0] and long.schedule.lr_decay_epochs[-1] == 23
    assert long.replace(epochs=short.schedule.epochs, lr_decay_epochs=short.schedule.lr_decay_epochs, lr_decay=short.schedule.lr_decay) == short


def test_the_i256_constant_lr_runs_differ_from_the_i32_ones_in_the_period_and_its_evaluation_steps():
    for tag in ("", f"-s{plans.PARITY_SECOND_SEED}"):
        i32, i256 = RUNS[f"celgc-I32-const-asgd{tag}"], RUNS[f"celgc-I256-const-asgd{tag}"]
        assert i256.round.period == 256 and i256.evaluation.eval_interval % 256 == 0
        assert i256.replace(eval_interval=i32.evaluation.eval_interval, period=32) == i32
