"""The README's first command is quick, and the help's time claims are the measured ones."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from localclip.cli import main, train_config

README = Path(__file__).resolve().parents[2] / "README.md"
# ptb-small's steps per worker in one epoch of PTB at 4 workers (docs/language-models.md).
PTB_SMALL_EPOCH_STEPS = 2324


def quick_start_train_argv() -> list[str]:
    """The arguments of the `localclip train` in the quick start's first command."""
    block = README.read_text(encoding="utf-8").split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    first = next(line for line in block.splitlines() if "localclip train" in line)
    return shlex.split(first.split("localclip train", 1)[1])


def test_the_first_command_is_a_few_percent_of_an_epoch_with_a_bounded_evaluation():
    argv = quick_start_train_argv()
    config = train_config(argv)
    assert config.algorithm.workers == 4 and config.schedule.epochs * PTB_SMALL_EPOCH_STEPS <= 120, config.schedule.epochs
    assert config.evaluation.eval_tokens is not None and config.evaluation.eval_tokens <= 20_000
    assert config.evaluation.test_batch_size >= config.algorithm.workers  # every worker takes part in the test evaluation
    readme = README.read_text(encoding="utf-8")
    assert f"{round(config.schedule.epochs * PTB_SMALL_EPOCH_STEPS)} local steps per worker" in readme


def test_ptb_small_keeps_the_reference_evaluation():
    """The committed ptb-small numbers mean full splits at test batch 2: the quick recipe is another one."""
    config = train_config(["ptb-small"])
    assert config.evaluation.test_batch_size == 2 and config.evaluation.eval_tokens is None and config.schedule.epochs == 1.0


def test_theory_help_states_the_measured_time(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    claim = re.search(r"theory the theory check: .*?smooth problem \(([^)]*)\)", text)
    assert claim is not None and "about a minute" not in claim[1] and re.search(r"\d+(\.\d+)? on a", claim[1]), text
