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
    assert names[-2:] == [f"naive-const-asgd-s{plans.PARITY_SECOND_SEED}", f"celgc-I32-const-asgd-s{plans.PARITY_SECOND_SEED}"]
    assert len(names) == len(set(names)) == 13
