"""A config is data: its module imports nothing of the builder, which reads configs; the old
``TrainConfig.resolved()`` and ``validate()`` are deprecated aliases of the builder's functions."""

import ast
import warnings
from pathlib import Path

import pytest

import localclip.train.config as config_module
import localclip.train.sections as sections_module
from localclip.algorithms import build
from localclip.errors import ConfigError
from localclip.train import TrainConfig


@pytest.mark.parametrize("module", [config_module, sections_module])
def test_the_configs_modules_import_nothing_of_the_algorithms_at_module_level(module):
    tree = ast.parse(Path(module.__file__).read_text())
    imported = [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    assert imported and not [name for name in imported if name.startswith("localclip.algorithms")]


def test_the_old_methods_warn_and_give_what_the_builder_gives():
    config = TrainConfig().replace(algorithm="naive", workers=2, period=8)
    with pytest.warns(DeprecationWarning, match=r"build\.resolved\(config\)"):
        assert config.resolved() == build.resolved(config)
    with pytest.warns(DeprecationWarning, match=r"build\.validate\(config\)"):
        assert config.validate() is config
    bad = TrainConfig().replace(workers=4, participants=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError, match="participants"):
            bad.resolved()
