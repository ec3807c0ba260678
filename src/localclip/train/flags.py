"""From ``localclip train``'s flags to a config: the one table of which flag sets which section's field.

:data:`FLAGS` maps each flag (its argparse ``dest``) to the ``section.field`` it sets;
:func:`config_from_args` applies them to the recipe, then ``--set KEY=VALUE``
(:func:`localclip.train.config.apply_overrides`), then the recipe's settings for another inner
optimizer, and returns the resolved config. A value is checked by its section
(:mod:`localclip.train.sections`), and with the values of other sections it relates to by
:func:`localclip.algorithms.build.check`; the parser only turns the text into a value (refusing,
with the flag's name, a number out of its type's range).
"""

from __future__ import annotations

from localclip.errors import ConfigError
from localclip.train.config import TrainConfig, apply_overrides, override_name

__all__ = ["FLAGS", "config_from_args", "flag_changes"]

#: ``localclip train``'s flags that set a config field: argparse dest -> ``section.field``.
FLAGS: dict[str, str] = {
    "algorithm": "algorithm.name",
    "workers": "algorithm.workers",
    "fail": "algorithm.fail",
    "inner_optimizer": "local.inner_optimizer",
    "lr": "local.lr",
    "gamma": "local.gamma",
    "clip_mode": "local.clip_mode",
    "period": "round.period",
    "outer_optimizer": "round.outer_optimizer",
    "outer_lr": "round.outer_lr",
    "outer_momentum": "round.outer_momentum",
    "compression": "round.compression",
    "no_error_feedback": "round.error_feedback",
    "fragments": "round.fragments",
    "overlap": "round.overlap",
    "epochs": "schedule.epochs",
    "max_steps": "schedule.max_steps",
    "seed": "run.seed",
    "device": "run.device",
    "loggers": "run.loggers",
    "data_root": "workload.data_root",
    "allow_custom_corpus": "workload.allow_custom_corpus",
}

# Flags whose value is not the field's: a switch that turns a default off, or one that adds.
_NEGATED = {"no_error_feedback"}
_ADDED = {"loggers"}


def flag_changes(config: TrainConfig, args) -> dict:
    """The fields the flags in ``args`` set, by flat name, with the values they set on ``config``
    (a flag left out, or a switch left off, sets nothing)."""
    changes = {}
    for dest, target in FLAGS.items():
        value = getattr(args, dest, None)
        if value is None or value is False:
            continue
        section, field = target.split(".")
        name = override_name(target)
        if dest in _NEGATED:
            value = False
        elif dest in _ADDED:
            value = list(dict.fromkeys([*getattr(getattr(config, section), field), *value]))
        changes[name] = value
    return changes


def config_from_args(args) -> TrainConfig:
    """The resolved config of ``localclip train``'s parsed ``args``: the recipe, the flags,
    ``--set``; raises :class:`ConfigError` naming every value in conflict."""
    from localclip import devices
    from localclip.algorithms import build as algorithms
    from localclip.recipes import for_inner_optimizer, get_recipe

    config = get_recipe(args.recipe)
    changes = flag_changes(config, args)
    config = apply_overrides(config.replace(**changes), args.overrides)
    # What the user set, as against the recipe's own values, by flat name.
    explicit = set(changes) | {override_name(item.partition("=")[0].strip()) or item.partition("=")[0].strip() for item in args.overrides}
    try:
        resolved = config.resolved()  # each value checked on its own first
    except ConfigError as exc:
        # A value the algorithm would replace is a conflict too: named in the same line.
        problem = algorithms.overridden(config, explicit) if config.algorithm.name in algorithms.ALGORITHMS else None
        if problem:
            raise ConfigError(f"{exc}; {problem}") from None
        raise
    adjusted = for_inner_optimizer(args.recipe, config, explicit)
    if adjusted is not config:  # the recipe's settings for another inner optimizer, checked with the rest
        config, resolved = adjusted, adjusted.resolved()
    # A value the user gave that the algorithm would replace is refused, not silently dropped.
    problem = algorithms.overridden(config, explicit)
    if problem:
        raise ConfigError(problem)
    devices.check_available(resolved.run.device)
    return resolved

