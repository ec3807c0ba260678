"""From a config to an algorithm: the one place that maps the names of a run's choices to objects.

A run is three independent choices, each implemented (and its allowed values kept) where it lives:

* the local update: ``inner_optimizer`` (:data:`localclip.optim.INNER_OPTIMIZERS`), built by
  :func:`local_update`;
* the communication schedule: ``algorithm`` (:data:`ALGORITHMS`, below): gradients every step
  (``naive``), models every ``period`` steps (``celgc``, ``local-sgd``), EPISODE's rounds, or
  none (``single``);
* what a round does with the average: ``outer_optimizer`` (:data:`localclip.averaging.OUTER_OPTIMIZERS`,
  built by :func:`outer_optimizer`), ``compression`` (:data:`localclip.averaging.COMPRESSIONS`, applied by the averager;
  ``error_feedback`` with int8/int4), ``participants``, and streaming rounds (``fragments``, ``overlap``, ``overlap_alpha``, ``overlap_merge``;
  every compression, int8/int4 included, takes both). They reach the averager by these names,
  which :func:`localclip.averaging.round_parts` turns into its parts (a codec, an outer optimizer,
  a participation policy, a streaming layout), as for a user who writes them by hand.

:func:`build_algorithm` composes them through the algorithms' public constructor
(:meth:`~localclip.algorithms.DistributedAlgorithm.from_optimizer`), so that a config and the
same composition written by hand with the library give the same bits. :func:`check` holds the rules
across a config's sections (each section checks its own values: :mod:`localclip.train.sections`):
it refuses the combinations that would mean nothing (each message names both fields), and :func:`resolve`
writes into a config the values its algorithm fixes (``naive``: period 1; ``single``: one
worker; ``local-sgd``: no clipping), so that ``config.json`` and the summary say what ran.
:func:`resolved` does both, once for each run (the CLI, :func:`localclip.train.run_training`,
a sweep's run): the builder reads a config, and a config never calls the builder. Every value
goes down from the resolved config to where it acts: the trainer reads the period there, not
from the algorithm built with it, and hands the outer optimizer it builds (:func:`outer_optimizer`)
to both the algorithm and the step decay. The values an algorithm fixes are its own where it
has a class attribute for them (naive's period: ``NaiveParallelClipping.fixed_period``).
Everything else that asks about an algorithm by name (the trainer, the sweeps, the report, the
runner, the Accelerate integration) asks :data:`ALGORITHMS`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from localclip.algorithms.base import DistributedAlgorithm
from localclip.algorithms.celgc import CELGC
from localclip.algorithms.episode import EPISODE
from localclip.algorithms.naive import NaiveParallelClipping
from localclip.errors import ConfigError
from localclip.averaging import OUTER_OPTIMIZERS, OuterSGD
from localclip.averaging.codecs import LOWBIT
from localclip.optim import CLIP_MODES, INNER_OPTIMIZERS, ClippedAdamW, ClippedSGD

__all__ = [
    "ALGORITHMS", "AlgorithmSpec", "adamw_param_groups", "build_algorithm", "check", "check_membership", "communication_period", "compose",
    "local_update", "outer_optimizer", "overridden", "resolve", "resolved", "spec", "streaming_rounds", "validate",
]


@dataclass(frozen=True)
class AlgorithmSpec:
    """What a config's ``algorithm`` name stands for.

    Attributes:
        name: the config's name.
        cls: the :class:`DistributedAlgorithm` that runs it.
        summary: one line for ``--help``.
        averages_models: whether a round averages the models (then a round's options, outer
            optimizer, compression and participants, apply).
        fixed: config fields the algorithm fixes, with their value and why (``resolve`` writes
            them; a user who sets another value explicitly is refused).
        clip_modes: the ``clip_mode`` values that mean something for it.
    """

    name: str
    cls: type[DistributedAlgorithm]
    summary: str
    averages_models: bool
    fixed: dict = field(default_factory=dict)
    clip_modes: tuple = ("local",)

    def workers(self, workers: int) -> int:
        """Workers a run trains when its config asks for ``workers`` (``single``: one)."""
        return self.fixed["workers"][0] if "workers" in self.fixed else workers

    def period(self, workers: int, period: int) -> int | None:
        """Local steps between two communications of a run of ``workers`` workers whose config
        asks for ``period``; None: it never communicates (one worker)."""
        if workers == 1 or "workers" in self.fixed:
            return None
        return self.fixed["period"][0] if "period" in self.fixed else period


_UNCLIPPED = "local SGD does not clip"
ALGORITHMS: dict[str, AlgorithmSpec] = {
    spec.name: spec
    for spec in (
        AlgorithmSpec("celgc", CELGC, "clipped local steps, models averaged every period (CELGC)", True, clip_modes=CLIP_MODES),
        AlgorithmSpec(
            "naive", NaiveParallelClipping, "gradients averaged every step, then clipped", False,
            fixed={"period": (NaiveParallelClipping.fixed_period, "naive parallel clipping communicates every step")},
        ),
        AlgorithmSpec(
            "local-sgd", CELGC, "local steps without clipping, models averaged every period", True,
            fixed={"gamma": (math.inf, _UNCLIPPED), "max_grad_norm": (math.inf, _UNCLIPPED)},
        ),
        AlgorithmSpec(
            "single", CELGC, "one worker, no communication", False,
            fixed={"workers": (1, "single trains one worker"), "period": (1, "single never communicates"),
                   "participants": (None, "single trains one worker")},
            clip_modes=("local", "none"),
        ),
        AlgorithmSpec("episode", EPISODE, "CELGC's rounds with corrected local gradients, one clip decision per round", True),
    )
}


def spec(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise ValueError(f"Invalid algorithm: {name!r} (expected one of {', '.join(ALGORITHMS)})")
    return ALGORITHMS[name]


# -- a config's combinations -------------------------------------------------------------------


def resolve(config):
    """``config`` with the values its algorithm fixes written in (a copy; ``config`` is unchanged)."""
    values = {name: value for name, (value, _) in spec(config.algorithm.name).fixed.items()}
    return config.replace(**values) if values else config


def resolved(config, explicit=()):
    """The config as it will run: a copy of ``config`` with the values its algorithm fixes
    written in (:func:`resolve`), each section's values checked, then the rules across sections
    (:func:`validate`). Every way into a run resolves its config once, here.

    ``explicit``: the fields the user set (flat names), as against a recipe's defaults; one whose
    value the algorithm would replace is refused rather than silently dropped, named in the same
    line as any other conflict.
    """
    known = config.algorithm.name in ALGORITHMS
    cfg = resolve(copy.deepcopy(config)) if known else copy.deepcopy(config)
    try:
        validate(cfg)
    except ConfigError as exc:
        problem = overridden(config, explicit) if known else None
        if problem:
            raise ConfigError(f"{exc}; {problem}") from None
        raise
    problem = overridden(config, explicit)
    if problem:
        raise ConfigError(problem)
    return cfg


def validate(config):
    """Check each section's values (:meth:`~localclip.train.config.TrainConfig.validate_sections`),
    then the rules across sections (:func:`check`, :func:`check_membership`); return ``config``.

    The settings that conflict with each other are named together, all in one line: a user who
    fixes one should not meet the next on the following try.
    """
    config.validate_sections()
    conflicts: dict[str, str] = {}
    check(config, lambda name, why: conflicts.setdefault(name, why))
    check_membership(config, lambda name, why: conflicts.setdefault(name, why))
    if len(conflicts) == 1:
        name, why = next(iter(conflicts.items()))
        raise ConfigError(f"Invalid {name}: {config.value(name)!r} ({why})")
    if conflicts:
        raise ConfigError(f"Invalid settings, {len(conflicts)} in conflict: " + "; ".join(f"{name}={config.value(name)!r} ({why})" for name, why in conflicts.items()))
    return config


def overridden(config, explicit) -> str | None:
    """A message if a field in ``explicit`` (what the user set, not a recipe's default) has a
    value that ``config``'s algorithm would replace; None when there is none."""
    s = spec(config.algorithm.name)
    problems = []
    for name in sorted(explicit):
        if name in s.fixed and config.value(name) != s.fixed[name][0]:
            value, why = s.fixed[name]
            problems.append(f"Invalid {name}={config.value(name)!r} with algorithm={config.algorithm.name}: {why} "
                            f"({name}={value!r}); leave {name} out")
    return "; ".join(problems) or None


def check(config, bad) -> None:
    """Refuse what the chosen algorithm, local update and round would not do as the config says:
    the rules that relate values of two sections (participants and workers, idle non-participants
    and what a worker would carry between its periods, a GPT's window and the sequence lengths, ...).

    ``bad(field, why)`` is called for each conflict (it may raise, or collect them all: every
    check here reads only values already checked on their own); each message names the other
    field involved.
    """
    s = spec(config.algorithm.name)
    if config.round.participants is not None and not 1 <= config.round.participants <= config.algorithm.workers:
        bad("participants", f"must be in [1, workers={config.algorithm.workers}]")
    _check_non_participants(config, bad)
    if config.workload.task == "lm" and config.workload.model == "gpt":
        from localclip.models.gpt import GPTConfig, check_windows

        block_size = config.workload.model_options.get("block_size", GPTConfig.block_size)
        check_windows(block_size, variable=config.workload.variable_bptt, bptt=config.workload.bptt, eval_bptt=config.evaluation.eval_bptt)
    if config.local.clip_mode not in s.clip_modes:
        bad("clip_mode", f"means nothing with algorithm={config.algorithm.name}; accepted there: {', '.join(s.clip_modes)}")
    if config.local.inner_optimizer == "adamw":
        if config.local.momentum:
            bad("momentum", "applies to inner_optimizer=clipped_sgd; AdamW's momentum is betas[0]")
        if config.local.clip_mode != "local":
            bad("clip_mode", "inner_optimizer=adamw clips each worker's own gradient (local); other modes need clipped_sgd")
    if not s.averages_models:
        periodic = ", ".join(n for n, o in ALGORITHMS.items() if o.averages_models)
        if config.round.participants is not None:
            bad("participants", f"partial participation applies to algorithm={periodic}, not {config.algorithm.name}")
        for name, off in (("outer_optimizer", "none"), ("compression", "none"), ("fragments", 1), ("overlap", 0), ("warmup_steps", 0)):
            if config.value(name) != off:
                bad(name, f"applies to the model-averaging algorithms ({periodic}), not algorithm={config.algorithm.name}")
    if not config.round.error_feedback and config.round.compression not in LOWBIT:
        bad("error_feedback", f"false applies to compression={'|'.join(LOWBIT)}, not compression={config.round.compression}")
    _check_streaming(config, bad)
    if config.round.warmup_steps and streaming_rounds(config):
        bad("warmup_steps", f"averages the whole model every step: streaming rounds (fragments={config.round.fragments}, overlap={config.round.overlap}) need 0")
    if config.round.warmup_steps % config.round.period and config.evaluation.eval_interval and s.averages_models:
        # After the warm-up, rounds end at warmup_steps + k·period: evaluations (multiples of
        # the period) fall on them only when the warm-up is a whole number of periods.
        bad("warmup_steps", f"must be a multiple of period={config.round.period} when eval_interval is set")
    if config.evaluation.eval_interval and s.averages_models and not streaming_rounds(config) and config.evaluation.eval_interval % config.round.period:
        # Evaluations score the averaged model, which exists only at the end of a period. With
        # streaming rounds no step holds it inside an epoch: they score the mean of the workers'
        # live models (localclip.train.live_mean), at any step.
        bad("eval_interval", f"must be a multiple of period={config.round.period}")


def _check_non_participants(config, bad) -> None:
    """``idle`` non-participants keep nothing of their own between their rounds, so a run whose
    workers carry state from one of their periods to the next (momentum kept per worker, an
    error-feedback residual, a fragment schedule, EPISODE's corrections) is refused with it."""
    if config.round.non_participants == "train":
        return
    why = None
    if config.round.participants is None or config.round.participants >= config.algorithm.workers:
        why = f"needs partial participation, participants K < workers={config.algorithm.workers}"
    elif config.workload.task != "lm":
        why = f"applies to the lm task, not task={config.workload.task}"
    elif config.algorithm.name not in ("celgc", "local-sgd"):
        why = f"applies to algorithm=celgc|local-sgd, not {config.algorithm.name}"
    elif config.round.optimizer_state == "local" and (config.local.momentum or config.local.inner_optimizer != "clipped_sgd"):
        why = "keeps no optimizer state per worker: use optimizer_state=average or reset"
    elif config.round.compression in ("int8", "int4") and config.round.error_feedback:
        why = f"keeps no error-feedback residual per worker: set error_feedback=false with compression={config.round.compression}"
    elif config.round.fragments != 1 or config.round.overlap:
        why = "applies to blocking whole-model rounds (fragments=1, overlap=0)"
    if why is not None:
        bad("non_participants", f"idle {why}")


# What a changing group of workers (failure plans, --runtime ft) refuses, each with its reason
# (docs/algorithm.md, "When workers leave and rejoin").
MEMBERSHIP_REFUSED = (
    ("fragments", 1, "a fragment's rounds and the model's other fragments would be averaged over different quorums"),
    ("overlap", 0, "a round in flight lands after local steps in which the group may change"),
    ("participants", None, "partial participation samples K of a fixed N; the quorum already decides who is averaged"),
    ("optimizer_state", "local", "averaging or resetting it needs every worker's state at every round"),
)


def check_membership(config, bad, what: str = "fail") -> None:
    """Refuse a failure plan (``config.algorithm.fail``) that names a bad worker or step, and the options a
    changing group of workers cannot run (``what``: the field or flag that asks for one)."""
    from localclip.comm.membership import check_plan, parse_plan

    if what == "fail" and not config.algorithm.fail:
        return
    if not isinstance(config.algorithm.fail, list):
        bad("fail", 'expected a list of "RANK@LEAVE:REJOIN" strings, e.g. ["3@200:400"]')
    try:
        check_plan(parse_plan(config.algorithm.fail), config.algorithm.workers, config.round.period)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    reason = f"with {what}" if what != "fail" else f"with fail={config.algorithm.fail}"
    if config.algorithm.name not in ("celgc", "local-sgd"):
        bad("algorithm", f"{reason}: a changing group needs rounds of whole models and local steps (celgc, local-sgd)")
    if config.local.clip_mode not in ("local", "none"):
        bad("clip_mode", f"{reason}: it all-reduces every worker's gradient each period, a departed worker's included")
    for name, off, why in MEMBERSHIP_REFUSED:
        if config.value(name) != off:
            bad(name, f"{reason}: {why}")
    if config.round.compression in LOWBIT:
        bad("compression", f"{reason}: an error-feedback residual is one worker's unsent change, lost with it")


def streaming_rounds(config) -> bool:
    """Whether ``config``'s rounds stream: fragments on staggered schedules or rounds in flight."""
    return config.round.fragments != 1 or config.round.overlap != 0


def _check_streaming(config, bad) -> None:
    """Streaming rounds (``fragments``, ``overlap``; :mod:`localclip.averaging.fragments`)."""
    if config.algorithm.name == "episode":
        for name, off in (("fragments", 1), ("overlap", 0)):
            if config.value(name) != off:
                bad(name, "algorithm=episode's correction needs every worker at the same whole model when a round starts")
    if config.round.overlap_alpha and not config.round.overlap:
        bad("overlap_alpha", "merges a round in flight into the local model: it needs overlap >= 1 (overlap=0: rounds block)")
    if config.round.overlap_merge == "carry" and not config.round.overlap:
        bad("overlap_merge", "carry merges a round in flight into the local model: it needs overlap >= 1 (overlap=0: rounds block)")
    if config.round.overlap_merge == "carry" and config.round.overlap_alpha:
        bad("overlap_merge", f"carry keeps the local progress whole: it needs overlap_alpha=0, not {config.round.overlap_alpha:g}")
    if not streaming_rounds(config):
        return
    if config.round.fragments > config.round.period and spec(config.algorithm.name).averages_models:
        bad("fragments", f"at most one fragment may start per step: fragments <= period={config.round.period}")
    if config.round.overlap >= config.round.period and spec(config.algorithm.name).averages_models:
        bad("overlap", f"a round must land before the fragment's next one: overlap < period={config.round.period}")
    if config.round.optimizer_state != "local":
        bad("optimizer_state", f"streaming rounds (fragments={config.round.fragments}, overlap={config.round.overlap}) keep it local")


def communication_period(config) -> int | None:
    """Local steps between two communications of a run with ``config`` (None: never); the same
    for ``config`` and for ``config`` resolved."""
    return spec(config.algorithm.name).period(config.algorithm.workers, config.round.period)


# -- the parts ---------------------------------------------------------------------------------


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only, as nanoGPT and GPT-2 do:
    decaying biases and LayerNorm gains towards zero only fights the normalisation."""
    seen, decay, no_decay = set(), [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def local_update(config, model: nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer over ``model``'s trainable parameters (``config`` resolved)."""
    if config.local.inner_optimizer == "clipped_sgd":
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"Invalid module: {type(model).__name__} has no trainable parameters")
        return ClippedSGD(params, config.local.lr, config.local.gamma, momentum=config.local.momentum, weight_decay=config.local.weight_decay,
                          clip_mode=config.local.clip_mode)
    if config.local.inner_optimizer == "adamw":
        return ClippedAdamW(adamw_param_groups(model, config.local.weight_decay), lr=config.local.lr, betas=tuple(config.local.betas),
                            weight_decay=config.local.weight_decay, max_grad_norm=config.local.max_grad_norm)
    raise ValueError(f"Invalid inner_optimizer: {config.local.inner_optimizer!r} (expected one of {', '.join(INNER_OPTIMIZERS)})")


def outer_optimizer(config) -> OuterSGD | None:
    """What a round does with the average: None (take it) or a fresh outer step (one per worker)."""
    if config.round.outer_optimizer == "none":
        return None
    if config.round.outer_optimizer in ("sgd", "nesterov"):
        return OuterSGD(config.round.outer_lr, config.round.outer_momentum, nesterov=config.round.outer_optimizer == "nesterov")
    raise ValueError(f"Invalid outer_optimizer: {config.round.outer_optimizer!r} (expected one of {', '.join(OUTER_OPTIMIZERS)})")


def compose(algorithm: str, model: nn.Module, optimizer: torch.optim.Optimizer, period: int = 1, *, group=None,
          **round_options) -> DistributedAlgorithm:
    """``algorithm`` (a name of :data:`ALGORITHMS`) around ``optimizer``; ``round_options`` go to
    :class:`~localclip.averaging.PeriodicAverager` (compression, outer_optimizer, participants, …)."""
    return spec(algorithm).cls.from_optimizer(model, optimizer, period, group=group, **round_options)


def build_algorithm(config, model: nn.Module, comm, *, outer: OuterSGD | None = None) -> DistributedAlgorithm:
    """The algorithm a (resolved) config describes, over ``model``, talking through ``comm``.

    ``outer``: the round's outer optimizer, when the caller built it from ``config`` with
    :func:`outer_optimizer` to hold it too (the trainer decays its lr with the inner one:
    ``outer_lr_decay``); None: built here, as ``config`` says."""
    s = spec(config.algorithm.name)
    options = dict(average_buffers=config.round.average_buffers, optimizer_state=config.round.optimizer_state,
                   skip_nonfinite=config.run.on_nonfinite == "skip")
    if s.averages_models:
        options.update(participants=config.round.participants, participation_seed=config.run.seed,
                       outer_optimizer=outer_optimizer(config) if outer is None else outer, compression=config.round.compression)
        if config.round.warmup_steps:
            options.update(warmup_steps=config.round.warmup_steps)
        if config.round.compression in LOWBIT:
            options.update(error_feedback=config.round.error_feedback)
        if streaming_rounds(config):
            options.update(fragments=config.round.fragments, overlap=config.round.overlap, overlap_alpha=config.round.overlap_alpha,
                           overlap_merge=config.round.overlap_merge)
    return compose(config.algorithm.name, model, local_update(config, model), config.round.period, group=comm, **options)

