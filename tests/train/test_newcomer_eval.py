"""The final evaluation shows how far it is."""

from __future__ import annotations

import pytest

from localclip import data
from localclip.cli import main
from localclip.train import trainer as trainer_module
from helpers import RecordingBar, write_tiny_ptb


def test_the_final_evaluation_shows_each_split_in_percent(tmp_path, monkeypatch):
    bars = []

    def factory(self):  # rank 0's bar only: the simulated workers make their trainers in any order
        if not self.progress:
            return None
        bars.append(RecordingBar())
        return bars[-1]

    monkeypatch.setattr(trainer_module.Trainer, "_progress_bar", factory)
    root = tmp_path / "data"
    write_tiny_ptb(root / data.CORPORA["ptb"].folder, train_lines=600)
    assert main(["train", "ptb-small", "--workers", "2", "--max-steps", "2", "--allow-custom-corpus", "--data-root", str(root),
                 "--set", "eval_bptt=5", "--out", str(tmp_path / "run")]) == 0
    shown = [p for p in bars[0].postfixes if isinstance(p, str) and p.startswith("final evaluation: ")]
    for split in ("valid", "test"):
        percents = [int(p.rsplit(" ", 1)[1].rstrip("%")) for p in shown if p.startswith(f"final evaluation: {split} ")]
        assert percents == sorted(set(percents)) and percents[-1] == 100 and len(percents) > 10, shown
    assert shown[-1] == "final evaluation: test 100%"
    assert shown.index("final evaluation: valid 100%") < shown.index("final evaluation: test 100%")
