"""The flags are applied to the recipe's config the CLI hands them: the flag table
(:mod:`localclip.train.flags`) is part of the config and imports no recipe, since the recipes
are built on the config."""

import ast
from pathlib import Path

import localclip.train.flags as flags
from localclip.cli import _parser
from localclip.recipes import get_recipe


def test_the_flag_table_imports_no_recipe_anywhere_in_its_module():
    tree = ast.parse(Path(flags.__file__).read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert "localclip.train.config" in imported and not [name for name in imported if name.startswith("localclip.recipes")]


def test_the_flags_apply_to_the_recipe_they_are_handed():
    args = _parser(["train"]).parse_args(["train", "ptb-small", "--period", "16", "--set", "round.warmup_steps=32"])
    handed = get_recipe("ptb-small").replace(lr=3.0)
    config, explicit = flags.requested(handed, args)
    assert (config.round.period, config.round.warmup_steps, config.local.lr) == (16, 32, 3.0)
    assert explicit == {"period", "warmup_steps"}
    assert handed == get_recipe("ptb-small").replace(lr=3.0)  # the recipe handed in is left as it was
