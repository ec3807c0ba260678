"""Sweeps with --jobs: several runs at once in child processes, the same numbers whatever J."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

import localclip_lab as experiments
from localclip.cli import main
from localclip_lab import runner
from localclip.recipes import converge_schedule, get_recipe
from localclip.algorithms import build

from helpers import CUSTOM_OVERRIDES, SHARED, SMALL

TIMES = ("time/compute", "time/comm", "time/seconds")


def numbers(folder):
    """A run's metrics and summary without the wall-clock fields (which differ run to run)."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((folder / "summary.json").read_text())
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMES}  # noqa: E731
    return [strip(r) for r in records], strip(summary)


def test_jobs_1_and_2_give_identical_metrics(tmp_path):
    runs = ["celgc-I4", "naive"]
    # Dropout on, so that the workers' random streams matter too.
    overrides = SMALL + ["model_options.dropout=0.3"]
    kwargs = dict(data_root=str(SHARED), only=runs, max_steps=6, overrides=overrides)
    lines = []
    one = experiments.run_sweep("isweep", tmp_path / "j1", jobs=1, echo=lambda _: None, **kwargs)
    two = experiments.run_sweep("isweep", tmp_path / "j2", jobs=2, echo=lines.append, **kwargs)
    assert one == two == {run: "started" for run in runs}
    for run in runs:
        a, b = numbers(tmp_path / "j1" / "isweep" / run), numbers(tmp_path / "j2" / "isweep" / run)
        assert a == b, run
        assert a[1]["steps"] == 6 and any("train/loss" in r for r in a[0])
    status = json.loads((tmp_path / "j2" / "isweep" / "sweep.json").read_text())
    assert status["jobs"] == 2 and status["failed"] == []
    assert sum("starting" in line for line in lines) == 2 and sum("done" in line for line in lines) == 2
    # Run again with J=2: everything is finished, nothing is touched.
    assert experiments.run_sweep("isweep", tmp_path / "j2", jobs=2, echo=lambda _: None, **kwargs) == {run: "skipped" for run in runs}


@pytest.mark.full  # child processes
def test_a_failing_child_run_is_reported_and_the_others_finish(tmp_path):
    # A corpus folder that does not exist: every config is valid, and each run fails in its child.
    kwargs = dict(data_root=str(tmp_path / "no-corpora"), only=["celgc-I4", "naive"], max_steps=2, overrides=SMALL)
    with pytest.raises(experiments.SweepFailed) as info:
        experiments.run_sweep("isweep", tmp_path, jobs=2, echo=lambda _: None, **kwargs)
    assert set(info.value.failures) == {"celgc-I4", "naive"}
    assert all("no-corpora" in error for error in info.value.failures.values()), info.value.failures
    status = json.loads((tmp_path / "isweep" / "sweep.json").read_text())
    assert status["failed"] == ["celgc-I4", "naive"]


def test_jobs_must_be_a_positive_integer(tmp_path, capsys):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(experiments.SweepError, match=r"Invalid --jobs: .*expected an integer >= 1"):
            experiments.run_sweep("isweep", tmp_path, jobs=bad)
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as info:
            main(["sweep", "isweep", "--jobs", bad, "--root", str(tmp_path)])
        assert info.value.code == 2
        assert "--jobs" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_core_slots_split_the_cores_and_the_default_is_one_run_per_core():
    assert runner.core_slots(2, [0, 1]) == [[0], [1]]
    assert runner.core_slots(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3, 4]]
    assert runner.core_slots(1, [0, 1, 2]) == [[0, 1, 2]]
    assert runner.core_slots(3, [0, 1]) == [[0], [1], [0]]
    assert runner.default_jobs(14, cores=2) == 2 and runner.default_jobs(1, cores=16) == 1 and runner.default_jobs(0, cores=4) == 1


def test_converge_sweeps_plan_what_the_issue_asks():
    base = get_recipe("ptb-converge")
    assert base.algorithm.workers == 8 and base.run.threads == 1 and base.schedule.epochs == 12 and base.workload.model_options["hidden_size"] == 200
    assert base.schedule.lr_decay_epochs == list(range(4, 12)) and base.schedule.lr_decay == pytest.approx(0.5)  # Zaremba et al.'s halving
    runs = dict(experiments.plan("converge"))
    main_runs = {"naive", "celgc-I8", "celgc-I32", "celgc-I256", "local-sgd-I8-lr20", "naive-s2", "celgc-I32-s2"}
    assert main_runs <= set(runs)
    for name in main_runs:
        assert runs[name].schedule.epochs == 12 and runs[name].schedule.lr_decay_epochs == base.schedule.lr_decay_epochs
    assert {name: runs[name].round.period for name in ("celgc-I8", "celgc-I32", "celgc-I256")} == {"celgc-I8": 8, "celgc-I32": 32, "celgc-I256": 256}
    assert build.resolved(runs["local-sgd-I8-lr20"]).local.gamma == float("inf") and runs["local-sgd-I8-lr20"].local.lr == base.local.lr
    stable = [c for n, c in runs.items() if n.startswith("local-sgd") and n != "local-sgd-I8-lr20"]
    assert len(stable) == 1 and stable[0].local.lr < base.local.lr and build.resolved(stable[0]).local.gamma == float("inf")
    assert runs["naive-s2"].run.seed == runs["celgc-I32-s2"].run.seed != base.run.seed
    scenarios = {"naive-short", "naive-hetero", "celgc-I32-hetero", "celgc-I16-K4", "naive-mom0.9", "celgc-I4-mom0.9"}
    assert scenarios <= set(runs) and all(runs[n].schedule.epochs >= 6 for n in scenarios)
    assert runs["celgc-I16-K4"].round.participants == 4 and runs["celgc-I16-K4"].round.period == 16
    assert runs["celgc-I32-hetero"].workload.heterogeneous and runs["naive-hetero"].workload.heterogeneous
    mom = (runs["naive-mom0.9"].local.lr, runs["naive-mom0.9"].local.gamma)
    assert mom == (runs["celgc-I4-mom0.9"].local.lr, runs["celgc-I4-mom0.9"].local.gamma) and runs["celgc-I4-mom0.9"].local.momentum == 0.9
    for cfg in runs.values():
        assert cfg.run.threads == 1 and cfg.algorithm.workers == 8 and cfg.workload.model_options == base.workload.model_options
    tune = dict(experiments.plan("converge-tune"))
    assert {c.algorithm.name for c in tune.values()} == {"naive"} and len(tune) == 5
    assert sorted({c.workload.model_options["dropout"] for c in tune.values()}) == [0.0, 0.2, 0.4]
    for epochs, start in ((12, 1 / 3), (6, 1 / 3), (6, 1 / 2), (3.5, 1 / 6)):
        decay_epochs, decay = converge_schedule(epochs, start)
        assert decay ** len(decay_epochs) == pytest.approx(1 / 256) and decay_epochs[0] >= 1 and decay_epochs[-1] < epochs
    assert converge_schedule(0.05, 1 / 3) == ([], 1.0)  # a smoke run too short to decay
    # At 6 epochs the scenarios are as long as the main runs: naive is their baseline, no copy of it.
    six = dict(experiments.plan("converge", epochs=6))
    assert "naive-short" not in six and all(c.schedule.epochs == 6 for c in six.values())
    beyond = {n: six[n] for n in ("celgc-I32-nesterov", "celgc-I256-nesterov", "celgc-I8-bf16", "episode-I32-hetero")}
    assert [c.round.outer_optimizer for c in beyond.values()] == ["nesterov", "nesterov", "none", "none"]
    assert beyond["celgc-I8-bf16"].round.compression == "bf16" and beyond["episode-I32-hetero"].workload.heterogeneous


def test_issue_14_sweeps_compare_like_with_like():
    image = dict(experiments.plan("episode-image"))
    assert {n: c.algorithm.name for n, c in image.items()} == {
        "naive-skew": "naive", "celgc-I8-skew": "celgc", "episode-I8-skew": "episode", "celgc-I8-iid": "celgc", "naive-skew-bn": "naive"}
    assert all(c.workload.heterogeneous and c.workload.similarity == 0 for n, c in image.items() if "-skew" in n)
    assert not image["celgc-I8-iid"].workload.heterogeneous and {c.round.period for n, c in image.items() if "naive" not in n} == {8}
    assert [n for n, c in image.items() if c.workload.model_options.get("norm") != "group"] == ["naive-skew-bn"]
    runs = dict(experiments.plan("compression"))
    assert [c.round.compression for c in runs.values()] == ["none", "bf16", "fp16"]
    assert len({(c.run.seed, c.round.period, c.local.lr, c.local.gamma, c.algorithm.workers) for c in runs.values()}) == 1


@pytest.mark.slow  # eight ptb-converge workers per run: about 40 s on a loaded 2-core machine
def test_converge_sweep_smoke_and_report(tmp_path):
    """Two converge runs for a few steps, then the converge report from their files."""
    kwargs = dict(data_root=str(SHARED), only=["naive", "celgc-I8"], max_steps=8, epochs=0.02,
                  overrides=["eval_tokens=2000", "log_interval=4", "eval_interval=0", "checkpoint_interval=8", *CUSTOM_OVERRIDES])
    assert experiments.run_sweep("converge", tmp_path, jobs=2, echo=lambda _: None, **kwargs) == {"naive": "started", "celgc-I8": "started"}
    result = experiments.report("converge", tmp_path)
    rows = {r["run"]: r for r in result["rows"]}
    assert set(rows) == {"naive", "celgc-I8"} and rows["celgc-I8"]["baseline"] == "naive"
    assert rows["naive"]["comm/rounds"] == 8  # one gradient all-reduce a step; the end-of-run average is a no-op
    assert rows["celgc-I8"]["comm/rounds"] == 1
    markdown = (tmp_path / "converge" / "summary.md").read_text()
    assert "## Time to the naive baseline's final perplexity" in markdown and "spread last 3 val" in markdown
    assert (tmp_path / "converge" / "curves.png").stat().st_size > 10_000


def _fake_converge_run(folder, algorithm, period, vals, *, epochs=3, steps_per_epoch=40, bytes_per_round=1000, seed=1,
                       compute_per_step=0.01, **config_fields):
    """A finished converge run: 4 validations per epoch with the perplexities ``vals``."""
    folder.mkdir(parents=True)
    config = {"algorithm": algorithm, "workers": 8, "period": period, "task": "lm", "epochs": epochs, "seed": seed,
              "heterogeneous": False, "momentum": 0.0, "participants": None, "outer_optimizer": "none",
              "compression": "none", "model_options": {"dropout": 0.2}, **config_fields}
    (folder / "config.json").write_text(json.dumps(config))
    every = 1 if algorithm == "naive" else period
    lines = []
    for i, ppl in enumerate(vals, 1):
        step = i * steps_per_epoch // 4
        rounds = step // every
        lines.append({"step": step, "epoch": i / 4, "train/loss": 5.0, "time/compute": step * compute_per_step, "comm/rounds": rounds, "comm/bytes": rounds * bytes_per_round})
        lines.append({"step": step, "epoch": i / 4, "val/ppl": ppl, "comm/rounds": rounds, "comm/bytes": rounds * bytes_per_round})
    lines.append({**lines[-1], "final": True, "test/ppl": vals[-1]})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rounds = epochs * steps_per_epoch // every
    summary = {"steps": epochs * steps_per_epoch, "epochs": float(epochs), "val/ppl": vals[-1], "test/ppl": vals[-1],
               "comm/rounds": rounds, "comm/bytes": rounds * bytes_per_round}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_converge_report_numbers(tmp_path):
    from localclip_lab.reports.link import AWD_MESSAGE_BYTES, LATENCY

    folder = tmp_path / "converge"
    naive = [300, 250, 220, 200, 180, 170, 160, 150, 140, 135, 131, 130]
    celgc = [320, 260, 230, 210, 190, 175, 165, 150, 129, 128, 127, 126.0]
    _fake_converge_run(folder / "naive", "naive", 1, naive)
    _fake_converge_run(folder / "celgc-I8", "celgc", 8, celgc, compute_per_step=0.03)
    # One that never reaches naive's final perplexity, for the converse table.
    celgc32 = [330, 280, 250, 230, 210, 190, 175, 165, 160, 155, 152, 150]
    _fake_converge_run(folder / "celgc-I32", "celgc", 32, celgc32, compute_per_step=0.02)
    result = experiments.report("converge", tmp_path)
    rows = {r["run"]: r for r in result["rows"]}
    n, c = rows["naive"], rows["celgc-I8"]
    assert n["spread last 3 val"] == 5 and c["spread last 3 val"] == 2
    assert n["gain last 2 epochs %"] == pytest.approx(100 * (200 - 130) / 200)  # end of epoch 1 to end of epoch 3
    assert n["rounds/epoch"] == 40 and c["rounds/epoch"] == 5 and c["MB sent"] == pytest.approx(15 * 1000 / 1e6)
    assert n["baseline"] == c["baseline"] == "naive" and n["target val/ppl"] == 130
    # naive reaches 130 at its last validation (step 120); celgc-I8 at its 9th (step 90, 11 rounds).
    assert n["steps to target"] == 120 and c["steps to target"] == 90 and c["rounds to target"] == 11
    per_step = 0.02  # median of 0.01, 0.02 and 0.03
    assert result["targets"]["per_step_compute"] == pytest.approx(per_step)
    expect_n = 120 * per_step + 120 * LATENCY + 120 * AWD_MESSAGE_BYTES * 8 / 1e9
    expect_c = 90 * per_step + 11 * LATENCY + 11 * AWD_MESSAGE_BYTES * 8 / 1e9
    assert n["s to target 1 Gbit/s, 97 MB"] == pytest.approx(expect_n) and c["s to target 1 Gbit/s, 97 MB"] == pytest.approx(expect_c)
    assert c["s to target 10 Gbit/s"] == pytest.approx(90 * per_step + 11 * LATENCY + 11 * 1000 * 8 / 10e9)
    assert c["naive/this 1 Gbit/s, 97 MB"] == pytest.approx(expect_n / expect_c) and n["naive/this 1 Gbit/s, 97 MB"] == pytest.approx(1)
    # The converse: celgc-I32 never reaches 130; it reaches its own 150 at step 120 (3 rounds),
    # naive reaches 150 at its 8th validation (step 80, 80 rounds). Naive cannot reach celgc-I8's 126.
    c32 = rows["celgc-I32"]
    assert c32["steps to target"] is None and c32["own final val/ppl"] == 150
    assert c32["naive steps to it"] == 80 and c32["steps to it"] == 120
    mine = 120 * per_step + 3 * LATENCY + 3 * AWD_MESSAGE_BYTES * 8 / 10e9
    theirs = 80 * per_step + 80 * LATENCY + 80 * AWD_MESSAGE_BYTES * 8 / 10e9
    assert c32["s to it 10 Gbit/s, 97 MB"] == pytest.approx(mine) and c32["naive s to it 10 Gbit/s, 97 MB"] == pytest.approx(theirs)
    assert c32["naive/this to it 10 Gbit/s, 97 MB"] == pytest.approx(theirs / mine)
    assert c["naive steps to it"] is None and c["naive/this to it 1 Gbit/s, 97 MB"] is None
    assert "## Time to this run's final perplexity" in (folder / "summary.md").read_text()
    # Quality levels: within 20 % of naive's 130 is 156, which celgc-I32 first reaches at step 100
    # (3 rounds); within 10 % (143) it never gets. At +0 % a level is the target itself.
    assert c32["s to naive+20 % 1 Gbit/s"] == pytest.approx(100 * per_step + 3 * LATENCY + 3 * AWD_MESSAGE_BYTES * 8 / 1e9)
    assert c32["s to naive+10 % 1 Gbit/s"] is None and c["s to naive+0 % 1 Gbit/s"] == pytest.approx(expect_c)
    assert "## Time to each quality level, 97 MB rounds" in (folder / "summary.md").read_text()


@pytest.mark.full  # a small sweep and its report
def test_converge_report_says_where_a_stopped_run_diverged(tmp_path):
    """A run ended by stop_on_divergence has a 'diverged at step' column and a note; a sweep
    without one has neither."""
    folder = tmp_path / "converge"
    _fake_converge_run(folder / "naive", "naive", 1, [300, 250, 220, 200])
    experiments.report("converge", tmp_path)
    assert "diverged at step" not in (folder / "summary.md").read_text()
    inf = float("inf")
    _fake_converge_run(folder / "local-sgd-I8-lr20", "local-sgd", 8, [inf], epochs=12)
    summary = json.loads((folder / "local-sgd-I8-lr20" / "summary.json").read_text())
    summary.update(steps=10, epochs=0.25, diverged_at_step=10)
    (folder / "local-sgd-I8-lr20" / "summary.json").write_text(json.dumps(summary))
    result = experiments.report("converge", tmp_path)
    rows = {r["run"]: r for r in result["rows"]}
    assert rows["local-sgd-I8-lr20"]["diverged at step"] == 10 and "diverged at step" not in rows["naive"]
    text = (folder / "summary.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| run | group"))
    assert "| diverged at step |" in header and "stop_on_divergence" in text


@pytest.mark.full  # a small sweep and its report
def test_converge_report_groups_runs_with_their_baselines(tmp_path):
    """Scenario and beyond-the-paper runs are judged against their naive baseline and their plain
    CELGC counterpart, and each group gets its own figure beside them."""
    from localclip_lab.reports.link import AWD_MESSAGE_BYTES, LATENCY

    folder = tmp_path / "converge"
    flat = lambda last: [400, 300, 250, 220, 200, 190, 180, 170, 165, 162, 161, last]  # noqa: E731
    _fake_converge_run(folder / "naive", "naive", 1, flat(100.0))
    _fake_converge_run(folder / "celgc-I32", "celgc", 32, flat(120.0))
    _fake_converge_run(folder / "celgc-I32-nesterov", "celgc", 32, flat(114.0), outer_optimizer="nesterov")
    _fake_converge_run(folder / "celgc-I8-bf16", "celgc", 8, flat(160.0), compression="bf16")  # no plain I=8 run
    _fake_converge_run(folder / "naive-hetero", "naive", 1, flat(110.0), heterogeneous=True)
    _fake_converge_run(folder / "celgc-I32-hetero", "celgc", 32, flat(132.0), heterogeneous=True)
    _fake_converge_run(folder / "episode-I32-hetero", "episode", 32, flat(121.0), heterogeneous=True)
    # at another step size: the counterpart is the CELGC run at that step size, not the first match
    lr5 = dict(heterogeneous=True, lr=5.0, gamma=1.25)
    _fake_converge_run(folder / "episode-I32-hetero-lr5", "episode", 32, flat(125.0), **lr5)
    _fake_converge_run(folder / "celgc-I32-hetero-lr5", "celgc", 32, flat(150.0), **lr5)
    result = experiments.report("converge", tmp_path)
    rows = {r["run"]: r for r in result["rows"]}
    assert rows["celgc-I32"]["group"] == "main runs" and rows["celgc-I32"]["plain CELGC"] is None
    assert rows["celgc-I32"]["vs naive %"] == pytest.approx(20.0)
    nesterov = rows["celgc-I32-nesterov"]
    assert nesterov["group"] == "beyond the paper" and nesterov["baseline"] == "naive" and nesterov["plain CELGC"] == "celgc-I32"
    assert nesterov["vs naive %"] == pytest.approx(14.0) and nesterov["vs plain %"] == pytest.approx(100 * (114 - 120) / 120)
    assert rows["celgc-I8-bf16"]["plain CELGC"] is None and rows["celgc-I8-bf16"]["vs plain %"] is None
    episode = rows["episode-I32-hetero"]
    assert episode["baseline"] == "naive-hetero" and episode["plain CELGC"] == "celgc-I32-hetero"
    assert episode["vs naive %"] == pytest.approx(10.0) and rows["celgc-I32-hetero"]["group"] == "scenarios"
    assert rows["episode-I32-hetero-lr5"]["plain CELGC"] == "celgc-I32-hetero-lr5"
    assert rows["episode-I32-hetero-lr5"]["vs plain %"] == pytest.approx(100 * (125 - 150) / 150)
    # A bf16 round carries half of AWD-LSTM's message: celgc-I8-bf16 reaches its own 160 at its
    # last validation (step 120, 15 rounds).
    per_step = result["targets"]["per_step_compute"]
    assert rows["celgc-I8-bf16"]["steps to it"] == 120
    assert rows["celgc-I8-bf16"]["s to it 1 Gbit/s, 97 MB"] == pytest.approx(120 * per_step + 15 * LATENCY + 15 * AWD_MESSAGE_BYTES / 2 * 8 / 1e9)
    assert result["figures"] == {"main runs": "figure.png", "scenarios": "figure-scenarios.png", "beyond the paper": "figure-beyond.png"}
    from localclip_lab.reports.converge import converge_groups
    from localclip_lab.reports.runs import load_finished

    groups = converge_groups({run: load_finished(folder / run) for run in result["finished"]})
    # each run once (naive-hetero is its own baseline)
    assert groups["scenarios"] == ["naive-hetero", "celgc-I32-hetero", "celgc-I32-hetero-lr5"]
    assert groups["beyond the paper"] == ["naive", "celgc-I32", "celgc-I32-nesterov", "celgc-I8-bf16", "naive-hetero",
                                          "celgc-I32-hetero", "episode-I32-hetero", "celgc-I32-hetero-lr5",
                                          "episode-I32-hetero-lr5"]
    markdown = (folder / "summary.md").read_text()
    for name in result["figures"].values():
        assert (folder / name).stat().st_size > 10_000 and f"]({name})" in markdown
    assert "| vs naive % | best val/ppl | best at epoch | best vs naive best % | plain CELGC | vs plain % |" in markdown


@pytest.mark.full  # a small sweep and its report
def test_converge_report_tells_how_far_seeds_move_a_run(tmp_path):
    """Runs that differ only in their seed (and in how they were hosted) form a family; its range
    and each seed's gap to the naive run of the same seed are reported, and a run with a different
    setting is not a member."""
    folder = tmp_path / "converge"
    flat = lambda last: [400, 300, 250, 220, 200, 190, 180, 170, 165, 162, 161, last]  # noqa: E731
    _fake_converge_run(folder / "naive", "naive", 1, flat(100.0))
    _fake_converge_run(folder / "celgc-I32", "celgc", 32, flat(120.0))
    _fake_converge_run(folder / "naive-s2", "naive", 1, flat(104.0), seed=2)
    # written by a newer version: a field that says how the run is hosted, not what it computes
    _fake_converge_run(folder / "celgc-I32-s2", "celgc", 32, flat(130.0), seed=2, stop_check_interval=32)
    _fake_converge_run(folder / "celgc-I8", "celgc", 8, flat(110.0))  # one seed only: no family
    result = experiments.report("converge", tmp_path)
    seeds = {tuple(f["runs"]): f for f in result["targets"]["seeds"]}
    assert set(seeds) == {("naive", "naive-s2"), ("celgc-I32", "celgc-I32-s2")}
    celgc = seeds[("celgc-I32", "celgc-I32-s2")]
    assert celgc["seeds"] == [1, 2] and celgc["val/ppl"] == [120.0, 130.0] and celgc["mean val/ppl"] == 125.0
    assert celgc["range % of mean"] == pytest.approx(8.0)
    assert celgc["vs naive %"] == pytest.approx([20.0, 100 * 26 / 104])  # each against its own seed's naive
    assert seeds[("naive", "naive-s2")]["vs naive %"] == [0.0, 0.0]
    markdown = (folder / "summary.md").read_text()
    assert "## Seeds" in markdown and "| celgc-I32, celgc-I32-s2 | 1, 2 | 120, 130 | 125 | 8 | 20, 25 |" in markdown


@pytest.mark.full  # a small sweep and its report
def test_runs_that_would_share_a_label_are_told_apart_in_the_figure(tmp_path):
    """Two local SGD runs at different η read the same from their configs; only the one that
    diverged may be marked so."""
    from localclip.plot import load_run, plot_runs

    _fake_converge_run(tmp_path / "lsgd-lr5", "local-sgd", 8, [300.0] * 12)
    _fake_converge_run(tmp_path / "lsgd-lr20", "local-sgd", 8, [math.inf] * 12)
    assert load_run(tmp_path / "lsgd-lr5")["label"] == load_run(tmp_path / "lsgd-lr20")["label"]
    import matplotlib.legend

    seen = []
    real = matplotlib.legend.Legend.__init__

    def spy(self, parent, handles, labels, *args, **kwargs):
        seen.extend(labels)
        real(self, parent, handles, labels, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.legend.Legend, "__init__", spy)
        plot_runs([str(tmp_path / "lsgd-lr5"), str(tmp_path / "lsgd-lr20")], tmp_path / "f.png")
    assert seen == ["local-sgd N=8 I=8 (lsgd-lr5)", "local-sgd N=8 I=8 (lsgd-lr20) (diverged at step 10: above the top)"]


def _start_sweep(root, tmp):
    """A two-run sweep with --jobs 2 that would run for minutes; its temporary files (and so
    its children's command lines) under ``tmp``."""
    overrides = [arg for o in SMALL + ["checkpoint_interval=2"] for arg in ("--set", o)]
    cmd = [sys.executable, "-m", "localclip.cli", "sweep", "isweep", "--root", str(root), "--only", "celgc-I4", "naive",
           "--jobs", "2", "--max-steps", "100000", "--data-root", str(SHARED), *overrides]
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def _wait_for_checkpoints(proc, root, timeout=180):
    deadline = time.monotonic() + timeout
    folders = [root / "isweep" / run / "checkpoints" / "latest.json" for run in ("celgc-I4", "naive")]
    while not all(f.exists() for f in folders):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the sweep's runs never checkpointed"
        time.sleep(0.5)


def _children(tmp) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"localclip_lab.runner {tmp}"], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def _wait_gone(tmp, timeout=90):
    deadline = time.monotonic() + timeout
    while _children(tmp):
        assert time.monotonic() < deadline, f"child runs still alive: {_children(tmp)}"
        time.sleep(0.5)


@pytest.mark.full  # child processes
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_a_stopped_sweep_leaves_no_run_behind_and_resumes(tmp_path, signum):
    """SIGTERM to the sweep stops its children (checkpoint, marked interrupted); SIGKILL, which
    the sweep cannot catch, stops them too (the kernel tells each child its parent died)."""
    root, tmp = tmp_path / "sweeps", tmp_path / "tmp"
    tmp.mkdir()
    proc = _start_sweep(root, tmp)
    try:
        _wait_for_checkpoints(proc, root)
        assert len(_children(tmp)) == 2
        proc.send_signal(getattr(signal, signum))
        output = proc.communicate(timeout=90)[0]
        _wait_gone(tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _children(tmp):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0, output
    for run in ("celgc-I4", "naive"):
        folder = root / "isweep" / run
        assert not (folder / "summary.json").exists()
        assert (folder / "checkpoints" / "latest.json").exists()
    if signum == "SIGTERM":
        status = json.loads((root / "isweep" / "sweep.json").read_text())
        assert {r["name"]: r.get("status") for r in status["runs"] if r["selected"]} == {"celgc-I4": "interrupted", "naive": "interrupted"}
    # The next invocation resumes both (a budget a few steps past the furthest checkpoint: how
    # far the runs got before the signal depends on the machine's load) and finishes them.
    done = max(json.loads((root / "isweep" / run / "checkpoints" / "latest.json").read_text())["step"]
               for run in ("celgc-I4", "naive"))
    outcome = experiments.run_sweep("isweep", root, jobs=2, data_root=str(SHARED), only=["celgc-I4", "naive"],
                                    max_steps=done + 4, overrides=SMALL + ["checkpoint_interval=2"], echo=lambda _: None)
    assert outcome == {"celgc-I4": "resumed", "naive": "resumed"}


def test_fair_and_wt2_sweeps_run_each_side_at_its_tuned_gamma():
    from localclip_lab.plans import CELGC_BEST_GAMMA, NAIVE_BEST_GAMMA, TUNE_GAMMAS, report_kind

    assert NAIVE_BEST_GAMMA in TUNE_GAMMAS and CELGC_BEST_GAMMA in TUNE_GAMMAS
    fair = dict(experiments.plan("fair"))
    converge = dict(experiments.plan("converge"))
    # naive at its best γ is the converge sweep's naive run, so that run's folder counts for both
    assert fair["naive"].to_dict() == converge["naive"].to_dict() and fair["naive"].local.gamma == NAIVE_BEST_GAMMA
    periods = {n: c.round.period for n, c in fair.items() if c.algorithm.name == "celgc" and not c.local.momentum and not c.round.participants}
    assert {periods[n] for n in ("celgc-I8", "celgc-I32", "celgc-I256", "celgc-I1024")} == {8, 32, 256, 1024}
    assert all(fair[n].local.gamma == CELGC_BEST_GAMMA for n in periods)
    assert fair["naive-s2"].run.seed == fair["celgc-I32-s2"].run.seed != fair["naive"].run.seed
    assert fair["celgc-I16-K4"].round.participants == 4 and fair["celgc-I32-24ep"].schedule.epochs == 2 * fair["naive"].schedule.epochs
    mom = [(fair[n].local.lr, fair[n].local.gamma, fair[n].local.momentum) for n in ("naive-mom0.9", "celgc-I4-mom0.9")]
    assert mom[0] == mom[1] == (2.0, 0.5, 0.9)
    wt2 = dict(experiments.plan("wt2"))
    assert {c.workload.dataset for c in wt2.values()} == {"wikitext2"} and [c.local.gamma for c in wt2.values()] == [NAIVE_BEST_GAMMA, CELGC_BEST_GAMMA]
    assert {report_kind(n) for n in ("converge", "fair", "wt2")} == {"converge"} and report_kind("image") == "image"


def test_a_longer_run_is_judged_against_the_longest_shorter_naive_run():
    from localclip_lab.reports.converge import baseline

    def run(algorithm, epochs, seed=1):
        return {"config": {"algorithm": algorithm, "epochs": epochs, "seed": seed}}

    finished = {"naive-6": run("naive", 6), "naive": run("naive", 12), "naive-s2": run("naive", 12, seed=2),
                "celgc": run("celgc", 12), "celgc-24": run("celgc", 24), "celgc-3": run("celgc", 3)}
    assert baseline("celgc", finished["celgc"], finished) == "naive"
    assert baseline("celgc-24", finished["celgc-24"], finished) == "naive"  # equal time: the longest shorter one
    assert baseline("celgc-3", finished["celgc-3"], finished) is None  # never against a longer one


@pytest.mark.full  # a small sweep and its report
def test_speedup_converge_report_counts_steps_to_each_target(tmp_path):
    from localclip_lab.plans import SPEEDUP_TARGETS

    assert SPEEDUP_TARGETS == (125.0, 120.0)
    runs = dict(experiments.plan("speedup-converge"))
    assert runs["celgc-I8-N8"].to_dict() == dict(experiments.plan("fair"))["celgc-I8"].to_dict()
    assert [c.algorithm.workers for c in runs.values()] == [1, 2, 4, 8] and runs["single-N1"].algorithm.name == "single"
    folder = tmp_path / "speedup-converge"
    vals = [400, 300, 250, 200, 180, 160, 140, 130, 126, 124, 121, 119]
    _fake_converge_run(folder / "single-N1", "single", 1, vals, steps_per_epoch=80, workers=1)
    _fake_converge_run(folder / "celgc-I8-N2", "celgc", 8, vals, steps_per_epoch=40, workers=2)
    _fake_converge_run(folder / "celgc-I8-N4", "celgc", 8, vals[:10] + [124.5, 122], steps_per_epoch=20, workers=4)
    result = experiments.report("speedup-converge", tmp_path)
    rows = {r["run"]: r for r in result["rows"]}
    one, two, four = rows["single-N1"], rows["celgc-I8-N2"], rows["celgc-I8-N4"]
    assert (one["steps to 125"], one["steps to 120"]) == (200, 240)
    assert (two["steps to 125"], two["speed-up to 125"], two["of linear to 120"]) == (100, 2.0, 1.0)
    assert four["steps to 125"] == 50 and four["speed-up to 125"] == 4.0 and four["steps to 120"] is None
    assert four["speed-up to 120"] is None and four["val/ppl epoch 3"] == 122 and one["val/ppl epoch 1"] == 200
    assert "| speed-up to 125 |" in (folder / "summary.md").read_text()
    if result["figure_note"] is None:  # matplotlib is there: the steps figure is drawn and linked
        assert (folder / "speedup.png").stat().st_size > 0 and "](speedup.png)" in (folder / "summary.md").read_text()


def test_streaming_sweep_judges_each_round_kind_against_plain_celgc_i8():
    runs = dict(experiments.plan("streaming"))
    fair = dict(experiments.plan("fair"))
    assert runs["celgc-I8"].to_dict() == fair["celgc-I8"].to_dict() and runs["naive"].to_dict() == fair["naive"].to_dict()
    assert runs["celgc-I32"].to_dict() == fair["celgc-I32"].to_dict()
    long = runs["celgc-I32-P4-tau1"]
    assert {k for k, v in long.to_flat().items() if v != runs["celgc-I32"].to_flat()[k]} == {"fragments", "overlap", "eval_interval"}
    p4 = runs["celgc-I8-P4-tau1"]
    assert (p4.round.fragments, p4.round.overlap, p4.round.overlap_alpha, p4.evaluation.eval_interval) == (4, 1, 0.0, 0)
    lowbit = ("celgc-I8-int4", "celgc-I8-int4-noef", "celgc-I8-bf16")
    assert [(runs[n].round.compression, runs[n].round.error_feedback) for n in lowbit] == [("int4", True), ("int4", False), ("bf16", True)]
    assert (runs["celgc-I8-P4"].round.fragments, runs["celgc-I8-P4"].round.overlap) == (4, 0)
    assert runs["celgc-I8-P4-tau1-a0.5"].round.overlap_alpha == 0.5
    carry = runs["celgc-I8-P4-tau1-carry"]
    assert (carry.round.fragments, carry.round.overlap, carry.round.overlap_alpha, carry.round.overlap_merge, carry.evaluation.eval_interval) == (4, 1, 0.0, "carry", 0)
    assert {n: r.round.overlap_merge for n, r in runs.items() if r.round.overlap_merge != "mix"} == {"celgc-I8-P4-tau1-carry": "carry"}
    for name in ("celgc-I8-P4-tau1", "celgc-I8-P4", "celgc-I8-P4-tau1-a0.5", "celgc-I8-P4-tau1-carry", *lowbit):  # the same run but for its rounds
        changed = {k for k, v in runs[name].to_flat().items() if v != runs["celgc-I8"].to_flat()[k]}
        assert changed <= {"fragments", "overlap", "overlap_alpha", "overlap_merge", "eval_interval", "compression", "error_feedback"}, (name, changed)


def test_regime_report_says_how_often_naive_clips_the_mean_gradient(tmp_path):
    from localclip_lab.plans import report_kind

    assert report_kind("awd-regime") == "regime"
    folder = tmp_path / "awd-regime" / "naive"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"algorithm": "naive", "workers": 8, "period": 1, "epochs": 1.0}))
    # Variable BPTT scales lr and γ together: the clip norm γ/η stays 0.25. The mean gradient
    # exceeds it in 3 of 4 intervals (norms 0.5, 0.3, 0.2, 1.0); every worker's own always does.
    lines = [{"step": 10 * i, "epoch": i / 100, "train/loss": 6.0, "lr": lr, "gamma": 0.25 * lr, "clip/fraction": frac,
              "clip/local_fraction": 1.0, "grad/mean_norm": mean, "grad/local_norm": 1.5}
             for i, (lr, frac, mean) in enumerate([(30, 1.0, 0.5), (28, 0.9, 0.3), (32, 0.5, 0.2), (30, 1.0, 1.0)], 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "summary.json").write_text(json.dumps({"steps": 40, "epochs": 0.04, "comm/rounds": 40, "comm/bytes": 4000}))
    result = experiments.report("awd-regime", tmp_path, figure=False)
    row = result["rows"][0]
    assert row["clip norm γ/η"] == 0.25 and row["clipped by the algorithm"] == pytest.approx(0.85)
    assert row["own gradient > γ/η"] == 1.0 and row["intervals with the mean gradient > γ/η"] == 0.75
    assert row["mean gradient / γ/η (median)"] == pytest.approx(1.6) and row["own gradient / γ/η (median)"] == pytest.approx(6.0)
    assert result["targets"] == {"clipped": {"naive": pytest.approx(0.85)}}
    assert "Naive clipped 85.0% of its steps." in (tmp_path / "awd-regime" / "summary.md").read_text()


def test_a_round_in_flight_costs_only_what_exceeds_its_overlap():
    from localclip_lab.reports.link import LATENCY, seconds_to

    hit = {"step": 100, "comm/rounds": 10, "comm/bytes": 1000}
    wire = 1.25e6 * 8 / 1e9 + LATENCY  # one round: 10 ms on the link plus the latency
    assert seconds_to(hit, 0.01, 1e9, 1.25e6) == pytest.approx(1.0 + 10 * wire)
    assert seconds_to(hit, 0.01, 1e9, 1.25e6, overlap=1) == pytest.approx(1.0 + 10 * (wire - 0.01))
    assert seconds_to(hit, 0.01, 1e9, 1.25e6, overlap=2) == pytest.approx(1.0)  # hidden behind 2 steps
