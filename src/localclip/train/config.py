"""The training configuration: the typed sections together, their names, ``config.json`` and ``--set``.

A :class:`TrainConfig` holds one dataclass per section (:mod:`localclip.train.sections`): code
reads ``config.round.period``, ``config.local.lr``. Recipes (:mod:`localclip.recipes`) return
one; the CLI maps its flags onto sections (:mod:`localclip.train.flags`) and applies ``--set
KEY=VALUE`` overrides; the resolved config is written to the run's ``config.json`` in sections.

A config is data: each section checks its own values (:meth:`TrainConfig.validate_sections`).
The values an algorithm fixes and the rules across sections are the builder's: whoever needs a
config as it will run calls :func:`localclip.algorithms.build.resolved` with it (the builder reads
configs; no module of the config imports it). :meth:`TrainConfig.resolved` and
:meth:`TrainConfig.validate` are deprecated aliases of the builder's functions for library users,
importing it only when called.

Users name a field by its flat name (``period``, ``compression``: :data:`FLAT_NAMES`) or as
``section.field`` (``round.period``). The runs committed under ``results/`` hold flat
``config.json`` files (every field at the top level, by its flat name); :func:`sections_from_flat`
is the one converter that reads them, and :func:`config_from_dict` loads either form.
"""

from __future__ import annotations

import dataclasses
import json
import typing
import warnings
from dataclasses import dataclass, field

from localclip.errors import ConfigError
from localclip.train.sections import (
    SECTIONS, AlgorithmConfig, EvaluationConfig, LocalUpdateConfig, RoundConfig, RunConfig, ScheduleConfig, WorkloadConfig,
)

__all__ = ["FLAT_NAMES", "TrainConfig", "apply_overrides", "config_from_dict", "flat_view", "sections_from_flat"]

#: Flat name -> (section, field): every field by the name ``--set`` and the flat ``config.json``
#: files know it by. Only the algorithm's name differs from its field (``algorithm.name``).
FLAT_NAMES: dict[str, tuple[str, str]] = {
    ("algorithm" if (section, f.name) == ("algorithm", "name") else f.name): (section, f.name)
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
}
_DOTTED = {f"{section}.{name}": flat for flat, (section, name) in FLAT_NAMES.items()}


@dataclass
class TrainConfig:
    """Everything a run depends on, in sections, in the order a run uses them."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    local: LocalUpdateConfig = field(default_factory=LocalUpdateConfig)
    round: RoundConfig = field(default_factory=RoundConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate_sections(self) -> "TrainConfig":
        """Check each section's own values (:mod:`localclip.train.sections`); return ``self``."""
        for section in SECTIONS:
            getattr(self, section).validate()
        return self

    def validate(self) -> "TrainConfig":
        """Deprecated: call :func:`localclip.algorithms.build.validate` (``build.validate(config)``),
        which holds the rules across sections; :meth:`validate_sections` is the config's own check."""
        warnings.warn("TrainConfig.validate() is deprecated: use localclip.algorithms.build.validate(config)", DeprecationWarning, stacklevel=2)
        from localclip.algorithms import build  # the builder reads configs; a config never needs it

        return build.validate(self)

    def resolved(self) -> "TrainConfig":
        """Deprecated: call :func:`localclip.algorithms.build.resolved` (``build.resolved(config)``),
        which writes in the values the config's algorithm fixes and checks the result."""
        warnings.warn("TrainConfig.resolved() is deprecated: use localclip.algorithms.build.resolved(config)", DeprecationWarning, stacklevel=2)
        from localclip.algorithms import build  # the builder reads configs; a config never needs it

        return build.resolved(self)

    def value(self, name: str):
        """The value of the field ``name``: a flat name (``period``) or ``section.field``."""
        section, key = _locate(name)
        return getattr(getattr(self, section), key)

    def replace(self, **changes) -> "TrainConfig":
        """A copy with ``changes``: fields by their flat names (``period=32``, ``algorithm="naive"``),
        or whole sections (``round=RoundConfig(...)``). Unknown names raise :class:`ConfigError`."""
        sections = {name: dataclasses.replace(getattr(self, name)) for name in SECTIONS}
        by_section: dict[str, dict] = {}
        for name, value in changes.items():
            if name in SECTIONS and isinstance(value, SECTIONS[name]):
                sections[name] = value
                continue
            section, key = _locate(name)
            by_section.setdefault(section, {})[key] = value
        for section, values in by_section.items():
            sections[section] = dataclasses.replace(sections[section], **values)
        return TrainConfig(**sections)

    def to_dict(self) -> dict:
        """The sections as nested dicts (the form ``config.json`` holds)."""
        return dataclasses.asdict(self)

    def to_flat(self) -> dict:
        """Every field under its flat name (:data:`FLAT_NAMES`)."""
        return flat_view(self.to_dict())

    def to_json(self) -> str:
        # Standard JSON: gamma = inf is written "inf" (localclip.jsonio).
        from localclip import jsonio

        return jsonio.dumps(self.to_dict(), indent=2, sort_keys=True)


def _locate(name: str) -> tuple[str, str]:
    flat = _DOTTED.get(name, name)
    if flat not in FLAT_NAMES:
        raise ConfigError(f"Unknown config key: {name!r}")
    return FLAT_NAMES[flat]


def sections_from_flat(data: dict) -> dict:
    """``data`` (a config as a dict, flat or in sections or both) in sections: each top-level
    flat name (:data:`FLAT_NAMES`) moved into its section. The one converter of the flat
    ``config.json`` files; raises :class:`ConfigError` naming every unknown key."""
    out: dict[str, dict] = {}
    unknown, twice = [], []
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            places = [(key, sub, f"{key}.{sub}") for sub in value]
        else:
            places = [(*FLAT_NAMES[key], key)] if key in FLAT_NAMES else []
            value = {places[0][1]: value} if places else value
            if not places:
                unknown.append(key)
        for section, name, given in places:
            if given in FLAT_NAMES or given in _DOTTED:
                target = out.setdefault(section, {})
                if name in target:
                    twice.append(_DOTTED.get(f"{section}.{name}", given))
                target[name] = value[name]
            else:
                unknown.append(given)
    if unknown:
        raise ConfigError(f"Unknown config key(s): {', '.join(sorted(unknown))}")
    if twice:
        raise ConfigError(f"Config key(s) given both flat and in their section: {', '.join(sorted(twice))}")
    return out


def flat_view(data: dict) -> dict:
    """``data`` (a config as a dict, in sections or flat) under the flat names, the way runs
    are compared and reported; keys it does not know (``provenance``) pass through."""
    out = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub, item in value.items():
                out[_DOTTED.get(f"{key}.{sub}", f"{key}.{sub}")] = item
        else:
            out[key] = value
    return out


def config_from_dict(data: dict) -> TrainConfig:
    """The config a ``config.json`` holds (without its ``provenance``), flat or in sections;
    a field it leaves out takes its default."""
    from localclip import jsonio

    sections = sections_from_flat(jsonio.decode(data))  # "inf" in a config.json is gamma = inf
    return TrainConfig(**{name: SECTIONS[name](**values) for name, values in sections.items()})


def _coerce(name: str, text: str) -> object:
    """Parse ``text`` as the type of config field ``name`` (``X | None`` accepts ``none``)."""
    section, key = FLAT_NAMES[name]
    hint = typing.get_type_hints(SECTIONS[section])[key]
    args = typing.get_args(hint)
    if type(None) in args:
        if text.strip().lower() in ("none", "null", ""):
            return None
        hint = next(a for a in args if a is not type(None))
    try:
        if hint is bool:
            if text.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if text.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if hint in (int, float, str):
            return hint(text)
        value = json.loads(text)
        if not isinstance(value, hint):
            raise ValueError(f"expected a JSON {hint.__name__}")
        return value
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"Invalid value for {name}: {text!r} ({exc})") from None


def override_name(key: str) -> str | None:
    """The flat name a ``--set`` key stands for (``period`` or ``round.period``), None if none."""
    key = _DOTTED.get(key, key)
    return key if key in FLAT_NAMES else None


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Apply ``KEY=VALUE`` strings (``--set``): KEY a flat name (``period``) or ``section.field``
    (``round.period``); ``model_options.KEY=VALUE`` sets one model option."""
    changes: dict = {}
    model_options: dict = {}  # model_options.KEY=VALUE, applied over the whole dict (given or not)
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"Invalid --set {item!r}: expected KEY=VALUE")
        for prefix in ("model_options.", "workload.model_options."):
            if key.startswith(prefix):
                sub = key[len(prefix):]
                try:
                    model_options[sub] = json.loads(value)
                except json.JSONDecodeError:
                    model_options[sub] = value
                break
        else:
            name = override_name(key)
            if name is None:
                close = [f for f in FLAT_NAMES if key.replace("-", "_") == f]
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigError(f"Unknown config key in --set: {key!r}{hint} (see `localclip recipes --fields`)")
            changes[name] = _coerce(name, value)
    changes["model_options"] = {**changes.get("model_options", config.workload.model_options), **model_options}
    return config.replace(**changes)
