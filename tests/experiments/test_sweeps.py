"""Sweeps: planned runs, skip / resume / start, failures, the report; the image workload."""

import csv
import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest

import localclip_lab as sweeps
from localclip_lab import runner
from localclip_lab.reports.link import BANDWIDTH, LATENCY
from localclip.cli import main
from localclip.errors import ConfigError, LocalclipError
from localclip.recipes import get_recipe
from localclip.train.run_folder import RunFolder
from localclip.algorithms import build

from helpers import SHARED, SMALL, needs_fmnist

PAIR = ["celgc-I4", "naive"]


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def small_sweep(root, only=PAIR, max_steps=4, **kwargs):
    return sweeps.run_sweep("isweep", root, data_root=str(SHARED), only=only, max_steps=max_steps, overrides=SMALL, echo=lambda _: None, **kwargs)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweeps")
    outcomes = small_sweep(root)
    return root, outcomes


def test_every_sweep_plans_distinct_valid_runs():
    for name in sweeps.SWEEPS:
        runs = sweeps.plan(name)
        assert len({run for run, _ in runs}) == len(runs) and runs
        for run, cfg in runs:
            resolved = build.resolved(cfg)
            if resolved.algorithm.name in ("celgc", "local-sgd") and resolved.algorithm.workers > 1:
                assert resolved.evaluation.eval_interval % resolved.round.period == 0, (name, run)  # validations see the averaged model
    isweep = dict(sweeps.plan("isweep", epochs=0.25))
    assert [c.round.period for r, c in isweep.items() if r.startswith("celgc")] == [2, 4, 8, 16, 32, 64]
    assert {c.run.seed for c in isweep.values()} == {get_recipe("ptb-small").run.seed} and {c.schedule.epochs for c in isweep.values()} == {0.25}
    assert isweep["naive"].algorithm.name == "naive" and build.resolved(isweep["local-sgd-I8"]).local.gamma == float("inf")
    assert [build.resolved(c).algorithm.workers for _, c in sweeps.plan("speedup")] == [1, 2, 4, 8]
    scen = dict(sweeps.plan("scenarios"))
    mom, mom_naive, base = scen["celgc-I4-mom0.9-lr0.1x"], scen["naive-mom0.9-lr0.1x"], get_recipe("ptb-small")
    assert (mom.local.lr, mom.local.gamma) == (mom_naive.local.lr, mom_naive.local.gamma) == pytest.approx((base.local.lr * 0.1, base.local.gamma * 0.1))
    assert scen["celgc-I8-hetero"].schedule.epochs == scen["naive"].schedule.epochs + 1 and scen["celgc-I8-K4"].round.participants == 4
    image = dict(sweeps.plan("image"))
    assert {(c.workload.dataset, c.workload.model, c.algorithm.workers, c.round.average_buffers) for c in image.values()} == {("fashion-mnist", "resnet8", 8, True)}
    assert [c.algorithm.name for c in image.values()] == ["celgc", "naive", "local-sgd"]


def test_unknown_sweep_or_run_names_them(tmp_path, capsys):
    with pytest.raises(sweeps.SweepError, match="'nope'.*isweep.*speedup.*scenarios.*image"):
        sweeps.run_sweep("nope", tmp_path)
    with pytest.raises(sweeps.SweepError, match="bogus.*celgc-I2"):
        sweeps.run_sweep("isweep", tmp_path, only=["bogus"])
    with pytest.raises(ConfigError, match="no_such_key"):
        sweeps.run_sweep("isweep", tmp_path, overrides=["no_such_key=1"])
    assert isinstance(sweeps.SweepError("x"), LocalclipError)
    for argv in (["sweep", "nope"], ["report", "nope"], ["sweep", "isweep", "--only", "bogus", "--root", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("localclip: error: ") and "Traceback" not in err and ("nope" in err or "bogus" in err)
    assert not any(tmp_path.iterdir())
    assert main(["sweep", "isweep", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 9 and lines[0].startswith("celgc-I2") and lines[-1].startswith("single")


def test_sweep_writes_its_runs_and_status(swept):
    root, outcomes = swept
    assert outcomes == {"celgc-I4": "started", "naive": "started"}
    for run in PAIR:
        summary = json.loads((root / "isweep" / run / "summary.json").read_text())
        assert summary["steps"] == 4 and summary["workers"] == 2
    status = json.loads((root / "isweep" / "sweep.json").read_text())
    assert [r["name"] for r in status["runs"]] == [run for run, _ in sweeps.plan("isweep")]
    by_name = {r["name"]: r for r in status["runs"]}
    assert all(by_name[run]["status"] == "finished" and by_name[run]["selected"] for run in PAIR)
    assert {r["status"] for n, r in by_name.items() if n not in PAIR} == {"pending"}
    assert by_name["naive"]["workers"] == 2 and status["overrides"] == SMALL  # what ran, overrides included
    assert status["failed"] == [] and not list((root / "isweep").glob(".*tmp"))


def test_rerun_skips_finished_runs_and_changes_none_of_their_files(swept):
    root, _ = swept
    before = {run: digest(root / "isweep" / run) for run in PAIR}
    lines = []
    outcomes = sweeps.run_sweep("isweep", root, data_root=str(SHARED), only=PAIR, max_steps=4, overrides=SMALL, echo=lines.append)
    assert outcomes == {"celgc-I4": "skipped", "naive": "skipped"}
    assert all("skipped" in line for line in lines) and len(lines) == 2
    assert {run: digest(root / "isweep" / run) for run in PAIR} == before


def test_a_run_that_died_after_a_checkpoint_is_resumed_not_restarted(tmp_path, monkeypatch):
    """A run dies right after its step-4 checkpoint (as a kill would leave it; kill-and-resume
    bit-identity is test_train's); the sweep reports it, and running the sweep again resumes it."""
    run = tmp_path / "isweep" / "celgc-I8"
    commit = RunFolder.commit_checkpoint

    def commit_then_die(self, step, world_size, **kwargs):
        commit(self, step, world_size, **kwargs)
        raise RuntimeError(f"died after the checkpoint of step {step}")

    monkeypatch.setattr(RunFolder, "commit_checkpoint", commit_then_die)
    with pytest.raises(sweeps.SweepFailed, match=r"celgc-I8: RuntimeError: (rank 0: )?died after the checkpoint of step 4"):
        small_sweep(tmp_path, only=["celgc-I8"], max_steps=16)
    monkeypatch.undo()
    assert not (run / "summary.json").exists() and json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 4
    assert {r["name"]: r for r in json.loads((tmp_path / "isweep" / "sweep.json").read_text())["runs"]}["celgc-I8"]["status"] == "failed"
    config_before = (run / "config.json").read_bytes()
    kept = (run / "metrics.jsonl").read_text().splitlines()  # training records of steps 2 and 4 (with timings)
    assert [json.loads(line)["step"] for line in kept] == [2, 4]

    calls = []
    train = runner.run_resolved
    monkeypatch.setattr(runner, "run_resolved", lambda *a, **k: calls.append(k["resume"]) or train(*a, **k))
    assert small_sweep(tmp_path, only=["celgc-I8"], max_steps=16) == {"celgc-I8": "resumed"}
    assert calls == [True] and (run / "config.json").read_bytes() == config_before
    after = (run / "metrics.jsonl").read_text().splitlines()
    assert after[: len(kept)] == kept  # a restart would have rewritten them (other timings)
    assert json.loads((run / "summary.json").read_text())["steps"] == 16
    assert [json.loads(line)["step"] for line in after if "train/loss" in line] == list(range(2, 17, 2))


def test_a_failing_run_is_reported_and_the_sweep_goes_on(tmp_path, monkeypatch):
    calls = []

    def fake_training(config, out, **kwargs):
        calls.append(Path(out).name)
        if Path(out).name == "celgc-I2":
            raise ConfigError("Invalid lr: 'boom'")
        raise RuntimeError("a bug")

    monkeypatch.setattr(runner, "run_resolved", fake_training)
    with pytest.raises(sweeps.SweepFailed) as info:
        sweeps.run_sweep("isweep", tmp_path, only=["celgc-I2", "celgc-I4", "naive"], echo=lambda _: None)
    assert calls == ["celgc-I2", "celgc-I4", "naive"]
    assert set(info.value.failures) == {"celgc-I2", "celgc-I4", "naive"} and "boom" in str(info.value)
    status = json.loads((tmp_path / "isweep" / "sweep.json").read_text())
    assert status["failed"] == ["celgc-I2", "celgc-I4", "naive"]
    assert "RuntimeError: a bug" in {r["name"]: r for r in status["runs"]}["naive"]["error"]


def test_report_holds_finished_runs_only(swept, tmp_path, capsys):
    root = tmp_path / "copy"
    shutil.copytree(swept[0], root)
    partial = root / "isweep" / "celgc-I8"  # a started run: config and metrics, no summary
    shutil.copytree(root / "isweep" / "celgc-I4", partial)
    (partial / "summary.json").unlink()
    before = {run: digest(root / "isweep" / run) for run in (*PAIR, "celgc-I8")}

    assert main(["report", "isweep", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "| naive |" in out and "| celgc-I4 |" in out and "| celgc-I8 |" not in out
    folder = root / "isweep"
    with open(folder / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == PAIR
    for key in ("algorithm", "N", "I", "val/ppl", "test/ppl", "comm/rounds", "comm/bytes", "steps", "modelled s to naive's val/ppl"):
        assert key in rows[0], key
    naive = next(r for r in rows if r["run"] == "naive")
    assert float(naive["modelled s to naive's val/ppl"]) > 0 and naive["I"] == "1" and naive["N"] == "2"
    markdown = (folder / "summary.md").read_text()
    assert markdown.count("\n| ") == 3 and "Not finished (left out): celgc-I2, celgc-I8," in markdown and "figure.png" in markdown
    assert (folder / "figure.png").stat().st_size > 10_000
    assert {run: digest(folder / run) for run in (*PAIR, "celgc-I8")} == before


def _fake_run(folder: Path, workers: int, losses: list[float], ppls: list[float], every: int):
    """A finished run folder with one training and one validation record per ``every`` steps."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"algorithm": "celgc" if workers > 1 else "single", "workers": workers, "period": 8, "task": "lm"}))
    lines = []
    for i, (loss, ppl) in enumerate(zip(losses, ppls), 1):
        lines.append({"step": i * every, "epoch": 0.1 * i, "train/loss": loss, "time/compute": float(i), "comm/rounds": i, "comm/bytes": 100 * i})
        lines.append({"step": i * every, "epoch": 0.1 * i, "val/ppl": ppl, "comm/rounds": i, "comm/bytes": 100 * i})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = {"steps": len(losses) * every, "epochs": 0.1 * len(losses), "val/ppl": ppls[-1], "test/ppl": ppls[-1], "comm/rounds": 1, "comm/bytes": 1}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_speedup_report_counts_steps_to_the_worst_final_value(tmp_path):
    sweep = tmp_path / "speedup"
    _fake_run(sweep / "single-N1", 1, [6.0, 5.0, 4.5, 4.0], [400, 300, 200, 150], every=100)
    _fake_run(sweep / "celgc-N2-I8", 2, [6.0, 5.2, 4.8, 4.6], [420, 330, 220, 190], every=50)
    result = sweeps.report("speedup", tmp_path, figure=False)
    assert result["targets"] == {"train/loss": 4.6, "val/ppl": 190}
    rows = {r["run"]: r for r in result["rows"]}
    assert rows["single-N1"]["steps to train/loss<=4.6"] == 300 and rows["celgc-N2-I8"]["steps to train/loss<=4.6"] == 200
    assert rows["single-N1"]["steps to val/ppl<=190"] == 400 and rows["celgc-N2-I8"]["steps to val/ppl<=190"] == 200
    assert rows["celgc-N2-I8"]["speedup (val)"] == 2.0 and rows["celgc-N2-I8"]["speedup (train)"] == 1.5
    assert result["unfinished"] == ["celgc-N4-I8", "celgc-N8-I8"]
    result = sweeps.report("speedup", tmp_path, loss_target=4.0, ppl_target=150, figure=False)
    rows = {r["run"]: r for r in result["rows"]}
    assert rows["single-N1"]["steps to val/ppl<=150"] == 400 and rows["celgc-N2-I8"]["steps to val/ppl<=150"] is None
    assert "| celgc-N2-I8 |" in Path(result["markdown"]).read_text()


@needs_fmnist
def test_image_workload_trains_and_reports_accuracy(tmp_path, monkeypatch):
    from localclip import data
    from localclip.train import run_training

    real = data.load_fashion_mnist

    def fewer_test_images(root=None):
        # Training on the real set, scoring 1,000 test images instead of 10,000 (twice: val and
        # test are both the test set) keeps this smoke test to seconds.
        splits = real(root)
        return dataclasses.replace(splits, test_x=splits.test_x[:1000], test_y=splits.test_y[:1000])

    monkeypatch.setattr(data, "load_fashion_mnist", fewer_test_images)
    config = get_recipe("fmnist-resnet").replace(max_steps=3, workers=2, log_interval=1, threads=1)
    summary = run_training(config, tmp_path / "run", progress=False)
    assert summary["steps"] == 3 and 0 <= summary["val/acc"] <= 1 and 0 <= summary["test/acc"] <= 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["test/acc"] == summary["test/acc"]


def test_isweep_time_to_target_with_one_compute_time_per_step(tmp_path):
    """The median compute per step replaces each run's own (load-dependent) compute time; the
    link's share stays each run's own."""
    folder = tmp_path / "isweep"
    # naive: 1 s of compute per record (10 steps); celgc-I8: 3 s per record, 1/8 of the rounds and bytes.
    _fake_run(folder / "naive", 8, [5.0, 4.0, 3.0], [300.0, 200.0, 100.0], every=10)
    config = json.loads((folder / "naive" / "config.json").read_text())
    (folder / "naive" / "config.json").write_text(json.dumps({**config, "algorithm": "naive", "period": 1}))
    _fake_run(folder / "celgc-I8", 8, [5.0, 4.0, 3.0], [250.0, 100.0, 90.0], every=10)
    records = [json.loads(line) for line in (folder / "celgc-I8" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r["comm/rounds"], r["comm/bytes"] = r["comm/rounds"] / 8, r["comm/bytes"] / 8
        if "time/compute" in r:
            r["time/compute"] *= 3
    (folder / "celgc-I8" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    rows = {r["run"]: r for r in sweeps.report("isweep", tmp_path, figure=False)["rows"]}
    link = lambda rounds, nbytes: rounds * LATENCY + nbytes * 8 / BANDWIDTH  # noqa: E731
    # Target: naive's final 100, reached by naive at step 30 and by celgc-I8 at step 20.
    assert rows["naive"]["modelled s to naive's val/ppl"] == pytest.approx(3.0 + link(3, 300), abs=1e-3)
    assert rows["celgc-I8"]["modelled s to naive's val/ppl"] == pytest.approx(6.0 + link(2 / 8, 200 / 8), abs=1e-3)
    per_step = (0.1 + 0.3) / 2  # median of the two runs' compute per step
    assert rows["naive"]["same as left, median compute/step"] == pytest.approx(30 * per_step + link(3, 300), abs=1e-3)
    assert rows["celgc-I8"]["same as left, median compute/step"] == pytest.approx(20 * per_step + link(2 / 8, 200 / 8), abs=1e-3)
    assert rows["celgc-I8"]["naive's time / this (median compute/step)"] == pytest.approx(
        (30 * per_step + link(3, 300)) / (20 * per_step + link(2 / 8, 200 / 8)), abs=1e-3)


def test_a_run_that_diverges_is_a_finished_result_of_the_sweep(tmp_path, capsys):
    """Local SGD at a huge η diverges: the sweep records it as finished (not failed) and goes on;
    the sweep command exits 0."""
    code = main(["sweep", "isweep", "--root", str(tmp_path), "--data-root", str(SHARED), "--only", "local-sgd-I8", "--max-steps", "2",
                 "--jobs", "1", *[a for o in [*SMALL, "lr=1e6"] for a in ("--set", o)]])
    assert code == 0, capsys.readouterr().err
    status = json.loads((tmp_path / "isweep" / "sweep.json").read_text())
    (entry,) = [e for e in status["runs"] if e["name"] == "local-sgd-I8"]
    assert entry["status"] == "finished" and status["failed"] == []
    summary = json.loads((tmp_path / "isweep" / "local-sgd-I8" / "summary.json").read_text())
    assert summary["diverged_at_step"] == 2 and summary["val/ppl"] in ("inf", "nan")
