"""One ``localclip train`` resolves its config once: the builder writes in what the algorithm
fixes and checks the rules across sections (:func:`localclip.algorithms.build.resolved`) on the
way down, and nothing after it (the run, its workers) resolves or checks the config again."""

import pytest

from localclip.algorithms import build
from localclip.cli import main, train_config
from helpers import SMOKE_DATA

# A small LSTM and a small evaluation: a run of one step takes a second or two.
TINY = [*SMOKE_DATA, "--no-progress", "--set", "eval_tokens=500", "--set", "loggers=[]", "--set", "threads=1",
        "--set", "model_options.emb_size=16", "--set", "model_options.hidden_size=16", "--set", "model_options.num_layers=1"]


@pytest.fixture
def checks(monkeypatch) -> list[str]:
    """The algorithm of every config whose rules across sections are checked (one per resolution)."""
    seen: list[str] = []
    real = build.check

    def counting(config, bad):
        seen.append(config.algorithm.name)
        return real(config, bad)

    monkeypatch.setattr(build, "check", counting)
    return seen


def test_a_cli_run_resolves_its_config_once(tmp_path, checks):
    out = tmp_path / "run"
    assert main(["train", "ptb-small", "--algorithm", "naive", "--workers", "2", "--max-steps", "1", "--out", str(out), *TINY]) == 0
    assert (out / "summary.json").is_file()
    assert checks == ["naive"]


def test_the_recipes_settings_for_another_inner_optimizer_are_resolved_with_the_rest_once(checks):
    config = train_config(["ptb-gpt-small", "--inner-optimizer", "adamw"])
    assert (config.local.inner_optimizer, config.local.lr) == ("adamw", 2e-3)  # the recipe's AdamW settings
    assert checks == ["celgc"]
