"""A converge report judges each run against the naive run trained the same way: the same kind of
schedule (step-decayed or constant, with or without the end-of-epoch weight average) and the same
model options (dropout); a beyond-the-paper run's plain counterpart is matched the same way."""

from localclip_lab.reports.converge import _plain, baseline


def run(algorithm, **config):
    return {"config": {"algorithm": algorithm, "seed": 2020, "epochs": 12, **config}}


def test_a_constant_lr_run_is_judged_against_the_constant_lr_naive_and_a_decayed_one_against_the_decayed():
    decayed = dict(lr_decay_epochs=[4, 5, 6], lr_decay=0.5)
    constant = dict(lr_decay_epochs=[], asgd_patience=1)
    finished = {"naive": run("naive", **decayed), "naive-const": run("naive", **constant)}
    assert baseline("c", run("celgc", period=32, **constant), finished) == "naive-const"
    assert baseline("c", run("celgc", period=32, **decayed), finished) == "naive"


def test_a_longer_decayed_run_keeps_the_shorter_decayed_naive():
    finished = {"naive": run("naive", lr_decay_epochs=[4, 5], lr_decay=0.5)}
    longer = run("celgc", period=32, lr_decay_epochs=[8, 9, 10], lr_decay=0.5)
    longer["config"]["epochs"] = 24
    assert baseline("c", longer, finished) == "naive"
    assert baseline("c", run("celgc", period=32, lr_decay_epochs=[]), finished) is None


def test_a_run_with_dropout_is_judged_against_the_naive_with_the_same_dropout_and_its_plain_counterpart_too():
    lstm = dict(emb_size=200, hidden_size=200, num_layers=2, tie_weights=True)
    plain, dropped = dict(model_options={**lstm, "dropout": 0.0}), dict(model_options={**lstm, "dropout": 0.2})
    finished = {"naive": run("naive", **plain), "naive-drop": run("naive", **dropped),
                "celgc-drop": run("celgc", period=32, **dropped), "celgc": run("celgc", period=32, **plain)}
    assert baseline("celgc-drop", finished["celgc-drop"], finished) == "naive-drop"
    assert baseline("celgc", finished["celgc"], finished) == "naive"
    # a naive run is a tuning point: judged against the sweep's first naive, whatever its dropout
    assert baseline("naive-drop", finished["naive-drop"], finished) == "naive"
    nesterov = run("celgc", period=32, outer_optimizer="nesterov", **plain)
    assert _plain("n", nesterov, finished) == "celgc"
