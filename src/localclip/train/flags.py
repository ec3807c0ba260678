"""From ``localclip train``'s flags to a config: the one table of which flag sets which section's field.

:data:`FLAGS` maps each flag (its argparse ``dest``) to the ``section.field`` it sets;
:func:`requested` applies them to the recipe's config it is handed, then ``--set KEY=VALUE``
(:func:`localclip.train.config.apply_overrides`), and says which fields the user set. What that
asks for is resolved by the builder (:func:`localclip.algorithms.build.resolved`), which the
CLI calls with it: a value is checked by its section (:mod:`localclip.train.sections`), and with
the values of other sections it relates to by :func:`localclip.algorithms.build.check`; the
parser only turns the text into a value (refusing, with the flag's name, a number out of its
type's range).
"""

from __future__ import annotations

from localclip.train.config import TrainConfig, apply_overrides, override_name

__all__ = ["FLAGS", "flag_changes", "requested"]

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


def requested(recipe: TrainConfig, args) -> tuple[TrainConfig, set[str]]:
    """What ``localclip train``'s parsed ``args`` ask for of ``recipe`` (the config of the recipe
    they name, which the CLI looks up: recipes are built on the config, not the other way round),
    before anything is resolved: the recipe with the flags and ``--set`` applied, and the fields
    the user set (flat names), as against the recipe's own values. The CLI hands both to the
    builder (:func:`localclip.algorithms.build.resolved`)."""
    changes = flag_changes(recipe, args)
    config = apply_overrides(recipe.replace(**changes), args.overrides)
    explicit = set(changes) | {override_name(item.partition("=")[0].strip()) or item.partition("=")[0].strip() for item in args.overrides}
    return config, explicit
