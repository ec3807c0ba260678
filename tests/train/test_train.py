"""End-to-end training runs: every algorithm and runtime, resume, and the run folder."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localclip import jsonio
from localclip.cli import EXIT_DIVERGED, main
from localclip.train.config import flat_view
from helpers import SMOKE, kill_after_first_checkpoint, records, train

REQUIRED_TRAIN_KEYS = {"step", "epoch", "train/loss", "clip/fraction", "comm/rounds", "comm/bytes", "time/compute", "time/comm", "lr", "gamma"}
REQUIRED_SUMMARY_KEYS = {"val/ppl", "test/ppl", "comm/rounds", "comm/bytes", "time/seconds", "steps"}


@pytest.mark.parametrize(
    "algorithm,expected_rounds,flags",
    [
        # 6 steps, period 2: rounds after steps 2, 4, 6; the end-of-training average is a no-op then
        ("celgc", 6 // 2, ()),
        ("naive", 6, ()),  # one gradient all-reduce per step; the LSTM has no buffers to average
        ("local-sgd", 6 // 2, ()),
        ("single", 0, ()),
        ("episode", 6 // 2 * 2, ()),  # and one gradient all-reduce at the start of every round
        ("celgc", 6 // 2, ("--outer-optimizer", "nesterov", "--compression", "bf16")),
    ],
)
def test_each_algorithm_trains_and_writes_a_complete_run_folder(tmp_path, algorithm, expected_rounds, flags):
    # naive fixes the period (1) and single the workers (1): giving them is refused
    shape = {"naive": ["--workers", "2"], "single": []}.get(algorithm, ["--workers", "2", "--period", "2"])
    code, out = train(tmp_path, "--algorithm", algorithm, *shape, "--max-steps", "6", *flags)
    summary = jsonio.loads((out / "summary.json").read_text())
    # The exit status says whether the run diverged (local SGD at η = 20 may, in 6 steps), as its summary does.
    assert code == (EXIT_DIVERGED if "diverged_at_step" in summary else 0)
    if algorithm != "local-sgd":
        assert "diverged_at_step" not in summary
    assert REQUIRED_SUMMARY_KEYS <= set(summary)
    assert summary["steps"] == 6
    if algorithm != "local-sgd":  # without clipping, η = 20 blows up: the paper's point
        assert math.isfinite(summary["val/ppl"]) and summary["val/ppl"] > 1
    assert summary["comm/rounds"] == expected_rounds
    config = flat_view(jsonio.loads((out / "config.json").read_text()))
    assert config["algorithm"] == algorithm and config["workers"] == (1 if algorithm == "single" else 2)
    if algorithm == "local-sgd":
        assert config["gamma"] == math.inf
    train_records = [r for r in records(out) if "train/loss" in r]
    assert len(train_records) == 2 and all(REQUIRED_TRAIN_KEYS <= set(r) for r in train_records)
    if algorithm == "local-sgd":
        assert all(r["clip/fraction"] == 0 for r in train_records)
    final = [r for r in records(out) if r.get("final")]
    assert final and final[0]["val/ppl"] == summary["val/ppl"]


@pytest.mark.full  # torchrun
def test_torchrun_runtime(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this Python")
    out = tmp_path / "tr"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "localclip.cli", "train", "ptb-small", "--runtime", "torchrun",
           "--workers", "2", "--max-steps", "4", "--out", str(out), *SMOKE]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["workers"] == 2


@pytest.mark.full  # a killed process
def test_resume_after_a_kill_is_bit_identical(tmp_path):
    """K steps straight == killed after a checkpoint, then --resume to K."""
    args = ["--workers", "2", "--period", "3", "--max-steps", "24", "--set", "checkpoint_interval=4", "--set", "lr_decay_epochs=[0]"]
    assert train(tmp_path, *args, name="straight")[0] == 0
    out = tmp_path / "killed"
    latest = kill_after_first_checkpoint(["ptb-small", *args, *SMOKE], out)
    assert json.loads(latest.read_text())["step"] < 24
    assert train(tmp_path, *args, "--resume", name="killed")[0] == 0
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    resumed = json.loads((out / "summary.json").read_text())
    for key in ("val/ppl", "test/ppl", "val/loss", "comm/rounds", "comm/bytes", "steps"):
        assert resumed[key] == straight[key], key
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]  # noqa: E731
    assert strip(records(out)) == strip(records(tmp_path / "straight"))


def test_a_diverged_run_reports_infinite_perplexity(tmp_path):
    """Local SGD without clipping at a huge η blows up; the run still ends with a summary."""
    code, out = train(tmp_path, "--algorithm", "local-sgd", "--workers", "2", "--period", "2", "--max-steps", "6", "--lr", "1e6")
    assert code == EXIT_DIVERGED
    summary = jsonio.loads((out / "summary.json").read_text())
    assert summary["val/ppl"] == math.inf or math.isnan(summary["val/ppl"])
    assert summary["diverged_at_step"] == 6  # the final validation found it


@pytest.mark.parametrize("stop", [True, False])
def test_a_diverged_run_stops_at_the_validation_that_finds_it(tmp_path, stop):
    """stop_on_divergence (the default) ends the run at the first validation with an infinite
    perplexity, writing no checkpoint of the diverged state; off, the run spends its budget."""
    code, out = train(tmp_path, "--algorithm", "local-sgd", "--workers", "2", "--period", "2", "--max-steps", "24", "--lr", "1e6",
                      "--set", "eval_interval=4", "--set", "checkpoint_interval=2", "--set", f"stop_on_divergence={str(stop).lower()}")
    assert code == EXIT_DIVERGED
    summary = jsonio.loads((out / "summary.json").read_text())
    assert summary["val/ppl"] == math.inf
    evals = [r for r in records(out) if "val/ppl" in r and not r.get("final")]
    first_bad = next(r["step"] for r in evals if r["val/ppl"] == math.inf)
    if stop:
        assert summary["steps"] == first_bad == summary["diverged_at_step"] < 24
        assert max(r["step"] for r in records(out)) == first_bad  # nothing trained after it
        saved = [int(d.name.split("-")[1]) for d in (out / "checkpoints").glob("step-*")]
        assert saved and all(step < first_bad for step in saved)  # none of the diverged state
    else:
        assert summary["steps"] == 24 and "diverged_at_step" not in summary
    config = flat_view(json.loads((out / "config.json").read_text()))
    assert config["stop_on_divergence"] is stop
