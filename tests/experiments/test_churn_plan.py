"""The ``churn`` sweep: no churn against one worker of 8 away about 10 % of the time, the same
run otherwise; its failure plan is valid for the simulator; a smoke run of both."""

import json

import pytest
from helpers import CUSTOM_OVERRIDES, SHARED, records

import localclip_lab as sweeps
from localclip.cli import main
from localclip.comm.membership import check_plan, parse_plan
from localclip_lab import plans
from localclip.algorithms import build


def test_churn_pairs_a_run_with_a_copy_that_has_one_worker_of_8_away_a_tenth_of_the_time():
    runs = dict(sweeps.plan("churn"))
    assert list(runs) == ["celgc-I32", "celgc-I32-churn"]
    calm, churn = runs["celgc-I32"], runs["celgc-I32-churn"]
    assert calm == dict(sweeps.plan("fair"))["celgc-I32"]  # the no-churn run is fair's CELGC I = 32
    assert churn.replace(fail=[]) == calm and not calm.algorithm.fail
    resolved = build.resolved(churn)
    assert (resolved.algorithm.workers, resolved.round.period, resolved.schedule.epochs) == (8, 32, 12)
    plan = parse_plan(churn.algorithm.fail)
    check_plan(plan, resolved.algorithm.workers, resolved.round.period)  # the simulator accepts it
    per_epoch = plans.WORKER_STEPS_PER_EPOCH["ptb-converge"] // 8
    assert [a.rank for a in plan] == [e % 8 for e in range(12)]
    for e, a in enumerate(plan):  # one absence inside each epoch, a whole number of periods long
        assert e * per_epoch < a.leave < a.rejoin <= (e + 1) * per_epoch
        assert (a.rejoin - a.leave) % 32 == 0
    away = sum(a.rejoin - a.leave for a in plan) / (12 * per_epoch)
    assert 0.09 <= away <= 0.12


@pytest.mark.full  # 2 runs of 8 simulated workers
def test_churn_sweep_lists_and_runs_with_max_steps(tmp_path, capsys):
    assert main(["sweep", "churn", "--list"]) == 0
    assert "celgc-I32-churn" in capsys.readouterr().out
    overrides = ["eval_tokens=2000", "log_interval=32", "eval_interval=0", "threads=1", *CUSTOM_OVERRIDES]
    outcomes = sweeps.run_sweep("churn", tmp_path, data_root=str(SHARED), max_steps=32, overrides=overrides, echo=lambda _: None)
    assert outcomes == {"celgc-I32": "started", "celgc-I32-churn": "started"}
    folders = [tmp_path / "churn" / run for run in outcomes]
    summaries = [json.loads((f / "summary.json").read_text()) for f in folders]
    assert [s["steps"] for s in summaries] == [32, 32]
    quorums = [[q for r in records(f) for q in r.get("comm/quorums", [])] for f in folders]
    assert quorums == [[], [[32, 8, 8]]]  # the plan's membership runs the churn run's rounds
    # Before its first absence the churn run is the calm one, to the bit.
    assert summaries[0]["model/sha256"] == summaries[1]["model/sha256"]
