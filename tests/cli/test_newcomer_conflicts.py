"""A contradictory invocation names every conflict in its one line."""

from __future__ import annotations

import pytest

from localclip.cli import main, train_config
from localclip.errors import ConfigError


def error_line(capsys, *argv) -> str:
    assert main(["train", "ptb-small", "--no-progress", "--max-steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("localclip: error: ") and "Traceback" not in err
    return err


def test_every_setting_that_a_baseline_does_not_take_is_named(capsys, tmp_path):
    out = tmp_path / "run"
    err = error_line(capsys, "--algorithm", "naive", "--compression", "int4", "--outer-optimizer", "nesterov", "--out", str(out))
    assert "compression='int4'" in err and "outer_optimizer='nesterov'" in err and "algorithm=naive" in err
    assert not out.exists()


def test_a_value_the_algorithm_replaces_is_named_beside_the_other_conflicts(capsys):
    err = error_line(capsys, "--algorithm", "naive", "--period", "8", "--compression", "int4", "--fragments", "2")
    for named in ("compression", "fragments", "period=8"):
        assert named in err, err


def test_a_single_conflict_keeps_its_message():
    with pytest.raises(ConfigError, match=r"^Invalid compression: 'int4' \(applies to the model-averaging algorithms"):
        train_config(["ptb-small", "--algorithm", "naive", "--compression", "int4"])
