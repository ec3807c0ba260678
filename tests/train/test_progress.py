"""What users see while training: the progress bar's total, ETA, loss and rounds; the final
summary line; the optional W&B logger (offline)."""

import importlib.util
import json
from pathlib import Path

import pytest

from localclip.cli import main
from localclip.train import trainer as trainer_module
from helpers import SMOKE_DATA, RecordingBar

SMOKE = [*SMOKE_DATA, "--set", "eval_tokens=2000", "--set", "log_interval=3", "--workers", "2", "--period", "2"]


@pytest.fixture
def recording_bar(monkeypatch):
    RecordingBar.instances = []

    def factory(self):
        return RecordingBar(total=self.config.schedule.max_steps, initial=self.step) if self.progress else None

    monkeypatch.setattr(trainer_module.Trainer, "_progress_bar", factory)
    return RecordingBar.instances


def test_the_bar_knows_the_total_and_shows_loss_epoch_and_rounds(tmp_path, recording_bar):
    # 0.004 epochs of ptb-small with 2 workers: the total comes from the epoch's batches, not max_steps.
    assert main(["train", "ptb-small", "--epochs", "0.004", "--out", str(tmp_path / "r"), *SMOKE]) == 0
    (bar,) = recording_bar
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert bar.total == summary["steps"] == bar.n and bar.closed
    # The bar stays up through the final evaluation, saying so and how far it is.
    final = bar.postfixes.index("final evaluation (valid, test)...")
    assert all(p.startswith("final evaluation: ") for p in bar.postfixes[final + 1:]) and bar.postfixes[-1] == "final evaluation: test 100%"
    last = bar.postfixes[final - 1]
    assert set(last) == {"epoch", "loss", "rounds"}
    # The last postfix comes from the last training record, before the end-of-epoch average.
    assert summary["comm/rounds"] - 1 <= last["rounds"] <= summary["comm/rounds"] and float(last["loss"]) > 0


def test_the_bar_total_is_max_steps_when_that_comes_first(tmp_path, recording_bar):
    assert main(["train", "ptb-small", "--max-steps", "4", "--out", str(tmp_path / "r"), *SMOKE]) == 0
    assert recording_bar[0].total == 4 == recording_bar[0].n


def test_the_real_tqdm_bar_has_a_total_and_an_eta(tmp_path, capsys):
    assert main(["train", "ptb-small", "--max-steps", "6", "--out", str(tmp_path / "r"), *SMOKE]) == 0
    err = capsys.readouterr().err
    assert "/6 [" in err and "<" in err  # "k/6 [elapsed<remaining, rate]": total and ETA


def test_the_final_line_names_the_run_folder_and_the_metrics(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", "ptb-small", "--max-steps", "4", "--no-progress", "--out", str(out), *SMOKE]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert line.startswith(f"finished {out}:")
    assert f"val/ppl={summary['val/ppl']:.6g}" in line and f"test/ppl={summary['test/ppl']:.6g}" in line


def test_unknown_logger_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "ptb-small", "--logger", "mlflow"])
    assert "invalid choice: 'mlflow'" in capsys.readouterr().err
    code = main(["train", "ptb-small", "--set", 'loggers=["neptune"]', "--out", str(tmp_path / "r"), *SMOKE])
    assert code == 2 and "Invalid logger 'neptune'" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_wandb_missing_is_a_clear_error(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code = main(["train", "ptb-small", "--logger", "wandb", "--out", str(tmp_path / "r"), *SMOKE])
    assert code == 2 and "pip install 'localclip[wandb]'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed (pip install 'localclip[wandb]')")
def test_wandb_offline_run_next_to_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "r"
    assert main(["train", "ptb-small", "--max-steps", "4", "--no-progress", "--logger", "wandb", "--out", str(out), *SMOKE]) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    assert json.loads((out / "config.json").read_text())["loggers"] == ["tensorboard", "wandb"]
