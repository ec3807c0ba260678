"""Config overrides (``--set``) and recipes, including property tests of the override parser."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localclip.errors import ConfigError
from localclip.recipes import RECIPES, get_recipe
from localclip.train.config import TrainConfig, apply_overrides, config_from_dict
from localclip.algorithms import build

INT_FIELDS = ["workers", "period", "batch_size", "bptt", "log_interval", "checkpoint_interval", "seed"]
FLOAT_FIELDS = ["lr", "gamma", "momentum", "weight_decay", "lr_decay", "timeout"]
BOOL_FIELDS = ["variable_bptt", "heterogeneous", "average_buffers", "allow_custom_corpus", "stop_on_divergence"]


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(INT_FIELDS), value=st.integers(min_value=-(10**12), max_value=10**12))
def test_int_overrides_round_trip(field, value):
    assert apply_overrides(TrainConfig(), [f"{field}={value}"]).value(field) == value


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(FLOAT_FIELDS), value=st.floats(allow_nan=False))
def test_float_overrides_round_trip(field, value):
    assert apply_overrides(TrainConfig(), [f"{field}={value!r}"]).value(field) == value


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(BOOL_FIELDS), value=st.booleans(), spelling=st.sampled_from(["true/false", "yes/no", "1/0"]))
def test_bool_overrides_accept_common_spellings(field, value, spelling):
    yes, no = spelling.split("/")
    text = yes if value else no
    assert apply_overrides(TrainConfig(), [f"{field}={text}"]).value(field) is value


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40))
def test_arbitrary_override_text_is_accepted_or_a_config_error(text):
    """Whatever the user types, --set either applies or raises ConfigError naming the problem."""
    try:
        cfg = apply_overrides(TrainConfig(), [text])
    except ConfigError as exc:
        assert str(exc)
    else:
        assert isinstance(cfg, TrainConfig)
        try:
            build.validate(cfg)
        except ConfigError as exc:
            assert str(exc).startswith("Invalid ")


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(INT_FIELDS), junk=st.text(alphabet="abcxyz.-_ ", min_size=1, max_size=8))
def test_non_numbers_for_int_fields_are_config_errors_naming_the_field(field, junk):
    with pytest.raises(ConfigError, match=field):
        apply_overrides(TrainConfig(), [f"{field}=x{junk}"])


def test_model_options_and_optional_fields():
    cfg = apply_overrides(TrainConfig(), ["model_options.dropout=0.3", "max_steps=none", "participants=4", "lr_decay_epochs=[80, 120]"])
    assert cfg.workload.model_options["dropout"] == 0.3 and cfg.schedule.max_steps is None and cfg.round.participants == 4
    assert cfg.schedule.lr_decay_epochs == [80, 120]
    with pytest.raises(ConfigError, match="lr_decay_epochs"):
        apply_overrides(TrainConfig(), ["lr_decay_epochs={}"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides(TrainConfig(), ["lr"])


def test_every_recipe_resolves_and_round_trips_through_json():
    import json

    for name in RECIPES:
        cfg = build.resolved(get_recipe(name))
        again = config_from_dict(json.loads(cfg.to_json()))
        assert again == cfg, name


def test_resolved_applies_the_algorithm_conventions():
    assert build.resolved(TrainConfig().replace(algorithm="single", workers=8)).algorithm.workers == 1
    assert math.isinf(build.resolved(TrainConfig().replace(algorithm="local-sgd")).local.gamma)
    with pytest.raises(ConfigError, match="Invalid participants: 9"):
        build.resolved(TrainConfig().replace(workers=8, participants=9))


def test_unknown_recipe_lists_recipes():
    with pytest.raises(ConfigError, match="ptb-small"):
        get_recipe("nope")
