"""The trainer takes the period on the way down, from the resolved config whose value the builder
handed to the algorithm, and never reads it back up from the algorithm it built."""

import json

import pytest

from localclip.algorithms.base import DistributedAlgorithm
from localclip.recipes import get_recipe
from localclip.train import run_training
from helpers import CUSTOM, SHARED


def _read_back(self):
    raise AssertionError("the period was read back from the algorithm built from the config")


@pytest.mark.parametrize("algorithm, asked, runs_with", [("naive", 8, 1), ("celgc", 2, 2)])
def test_the_run_stops_and_reports_at_the_configs_period(tmp_path, monkeypatch, algorithm, asked, runs_with):
    monkeypatch.setattr(DistributedAlgorithm, "period", property(_read_back))
    config = get_recipe("ptb-small").replace(
        algorithm=algorithm, workers=2, period=asked, max_steps=2, eval_tokens=500, loggers=[], threads=1,
        model_options=dict(emb_size=16, hidden_size=16, num_layers=1, dropout=0.0, tie_weights=True),
        data_root=str(SHARED), allow_custom_corpus=CUSTOM)
    summary = run_training(config, tmp_path / "run", progress=False)
    # naive's period is 1 whatever was asked: the resolution writes it into the config.
    assert summary["period"] == runs_with
    assert json.loads((tmp_path / "run" / "config.json").read_text())["round"]["period"] == runs_with
