"""The config's sections: each checks its own values, config.json is written in sections, and every
committed flat config.json loads through the one converter, to the same config and back."""

import json
import math

import pytest

from localclip import jsonio
from localclip.algorithms import build as algorithms
from localclip.errors import ConfigError, RunFolderError
from localclip.recipes import RECIPES, get_recipe
from localclip.train import run_config_json
from localclip.train.config import FLAT_NAMES, TrainConfig, apply_overrides, config_from_dict, flat_view, sections_from_flat
from localclip.train.run_folder import RunFolder
from localclip.train.sections import SECTIONS, LocalUpdateConfig, RoundConfig

from helpers import REPO

def _committed(path):
    data = json.loads(path.read_text())
    data.pop("provenance", None)
    return data


# Runs made before config.json was written in sections hold flat files; later runs hold sections.
COMMITTED = sorted((REPO / "results").rglob("config.json"))
FLAT = [p for p in COMMITTED if "period" in _committed(p)]
IN_SECTIONS = [p for p in COMMITTED if p not in FLAT]
_ids = lambda p: str(p.parent.relative_to(REPO / "results"))


def test_results_hold_committed_flat_configs():
    # The walk below means something only if there are flat files to walk.
    assert len(FLAT) >= 100
    assert all(set(_committed(p)) == set(SECTIONS) for p in IN_SECTIONS)


@pytest.mark.parametrize("path", IN_SECTIONS, ids=_ids)
def test_every_committed_config_in_sections_loads_and_round_trips(path):
    data = _committed(path)
    config = config_from_dict(data)
    assert jsonio.loads(config.to_json()) == jsonio.decode(data)
    assert config_from_dict(json.loads(config.to_json())) == config


@pytest.mark.parametrize("path", FLAT, ids=_ids)
def test_every_committed_flat_config_loads_and_round_trips(path):
    flat = _committed(path)
    config = config_from_dict(flat)
    # Nothing lost: the sections hold every value the flat file held, under the same name.
    assert flat_view(sections_from_flat(flat)) == flat
    written = flat_view(jsonio.loads(config.to_json()))
    assert {k: v for k, v in written.items() if k in flat} == jsonio.decode(flat)
    # flat -> sections -> json -> sections is the same config.
    again = config_from_dict(json.loads(config.to_json()))
    assert again == config
    assert config.round.period == flat["period"] and config.algorithm.name == flat["algorithm"]


def test_config_json_is_written_in_sections():
    written = json.loads(run_config_json(algorithms.resolved(get_recipe("ptb-small"))))
    assert set(written) == {*SECTIONS, "provenance"}
    assert written["round"]["period"] == 8 and written["algorithm"]["name"] == "celgc" and written["local"]["gamma"] == 5.0


def test_every_field_has_one_flat_name_and_one_place():
    places = list(FLAT_NAMES.values())
    assert len(places) == len(set(places)) == sum(len(cls.__dataclass_fields__) for cls in SECTIONS.values())
    assert FLAT_NAMES["algorithm"] == ("algorithm", "name") and FLAT_NAMES["period"] == ("round", "period")
    assert FLAT_NAMES["compression"] == ("round", "compression")


def test_set_accepts_flat_names_and_section_keys():
    flat = apply_overrides(TrainConfig(), ["period=32", "compression=int8", "algorithm=local-sgd"])
    dotted = apply_overrides(TrainConfig(), ["round.period=32", "round.compression=int8", "algorithm.name=local-sgd"])
    assert flat == dotted
    assert (flat.round.period, flat.round.compression, flat.algorithm.name) == (32, "int8", "local-sgd")
    assert apply_overrides(TrainConfig(), ["workload.model_options.dropout=0.5"]).workload.model_options["dropout"] == 0.5
    with pytest.raises(ConfigError, match="Unknown config key in --set: 'round.lr'"):
        apply_overrides(TrainConfig(), ["round.lr=1"])


def test_set_model_options_whole_and_by_key_together():
    # Each model_options.KEY applies over the whole dict, in either order (a traceback before).
    for overrides in (['model_options={"a": 1}', "model_options.b=2"], ["model_options.b=2", 'model_options={"a": 1}']):
        assert apply_overrides(TrainConfig(), overrides).workload.model_options == {"a": 1, "b": 2}


def test_recipes_keep_their_values():
    for name in RECIPES:
        config = get_recipe(name)
        assert config_from_dict(config.to_flat()) == config, name
    small = get_recipe("ptb-small")
    assert (small.algorithm.workers, small.round.period, small.local.lr, small.local.gamma, small.workload.bptt) == (4, 8, 20.0, 5.0, 20)


def test_a_config_key_given_twice_or_unknown_is_refused():
    sectioned = json.loads(TrainConfig().to_json())
    with pytest.raises(ConfigError, match="both flat and in their section: period"):
        config_from_dict({**sectioned, "period": 4})
    with pytest.raises(ConfigError, match=r"Unknown config key\(s\): nope, round.bogus"):
        config_from_dict({"round": {"bogus": 1}, "nope": 2})


def test_each_section_checks_its_own_values():
    with pytest.raises(ConfigError, match=r"Invalid period: 0 \(must be an integer >= 1\)"):
        RoundConfig(period=0).validate()
    with pytest.raises(ConfigError, match="Invalid compression: 'int3'"):
        RoundConfig(compression="int3").validate()
    with pytest.raises(ConfigError, match="Invalid gamma: 0"):
        LocalUpdateConfig(gamma=0).validate()
    RoundConfig(period=3, participants=99).validate()  # its range is a rule across sections


def test_rules_across_sections_are_the_builders():
    config = TrainConfig().replace(workers=4, participants=5)
    found = []
    algorithms.check(config, lambda name, why: found.append((name, why)))
    assert found == [("participants", "must be in [1, workers=4]")]
    with pytest.raises(ConfigError, match=r"Invalid participants: 5 \(must be in \[1, workers=4\]\)"):
        algorithms.validate(config)


def test_replace_takes_flat_names_and_sections():
    config = TrainConfig().replace(period=3, algorithm="naive", round=RoundConfig(period=5))
    assert config.round.period == 3 and config.algorithm.name == "naive"  # a field wins over its section given whole
    assert TrainConfig().replace(round=RoundConfig(period=5)).round.period == 5
    with pytest.raises(ConfigError, match="Unknown config key: 'nope'"):
        TrainConfig().replace(nope=1)
    assert math.isinf(algorithms.resolved(TrainConfig().replace(algorithm="local-sgd")).local.gamma)


def _flat_run(tmp_path, config):
    """A run folder whose config.json is flat, as the committed runs' are."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(flat_view(json.loads(run_config_json(config)))))
    return folder


def test_a_resume_compares_a_flat_run_with_the_sectioned_config(tmp_path):
    config = algorithms.resolved(get_recipe("ptb-small"))
    folder = _flat_run(tmp_path, config)
    run = RunFolder(folder)
    try:
        assert run.prepare(run_config_json(config), resume=True) == []
        with pytest.raises(RunFolderError, match=r"differs from the run in .*: period: 8 in the run, 4 now$"):
            run.prepare(run_config_json(config.replace(period=4)), resume=True)
    finally:
        run.release()
    assert RunFolder(folder).read_config()[0] == config
