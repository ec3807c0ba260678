"""``localclip train``'s flags map onto the config's sections through one table (train/flags.py)."""

import pytest

from localclip.cli import _parser, train_config
from localclip.errors import ConfigError
from localclip.train.config import override_name
from localclip.train.flags import FLAGS

# train's flags that set no config field: what to run, where, and how it is shown.
NOT_CONFIG = {"recipe", "runtime", "out", "resume", "overrides", "no_progress", "help"}


def _train_dests():
    sub = _parser()._subparsers._group_actions[0].choices["train"]
    return {action.dest for action in sub._actions}


def test_every_config_flag_is_in_the_table_and_names_a_field():
    assert _train_dests() - NOT_CONFIG == set(FLAGS)
    assert all(override_name(target) is not None for target in FLAGS.values())


@pytest.mark.parametrize("argv, where, value", [
    (["--period", "16"], ("round", "period"), 16),
    (["--compression", "int8"], ("round", "compression"), "int8"),
    (["--no-error-feedback", "--compression", "int4"], ("round", "error_feedback"), False),
    (["--algorithm", "local-sgd"], ("algorithm", "name"), "local-sgd"),
    (["--workers", "2"], ("algorithm", "workers"), 2),
    (["--lr", "3.5"], ("local", "lr"), 3.5),
    (["--max-steps", "7"], ("schedule", "max_steps"), 7),
    (["--seed", "0"], ("run", "seed"), 0),
    (["--allow-custom-corpus"], ("workload", "allow_custom_corpus"), True),
])
def test_a_flag_reaches_its_section(argv, where, value):
    config = train_config(["ptb-small", *argv])
    assert getattr(getattr(config, where[0]), where[1]) == value
    assert getattr(getattr(train_config(["ptb-small"]), where[0]), where[1]) != value


def test_a_flag_and_its_set_key_are_the_same_config():
    by_flag = train_config(["ptb-small", "--period", "16", "--compression", "bf16"])
    assert train_config(["ptb-small", "--set", "round.period=16", "--set", "compression=bf16"]) == by_flag
    assert train_config(["ptb-small", "--set", "period=16", "--set", "round.compression=bf16"]) == by_flag


def test_a_section_key_the_algorithm_fixes_is_refused_like_its_flag():
    with pytest.raises(ConfigError, match=r"Invalid period=3 with algorithm=naive") as flag:
        train_config(["ptb-small", "--algorithm", "naive", "--period", "3"])
    with pytest.raises(ConfigError) as dotted:
        train_config(["ptb-small", "--algorithm", "naive", "--set", "round.period=3"])
    assert str(dotted.value) == str(flag.value)
