"""The training configuration: one typed dataclass, its validation, and ``--set`` overrides.

Recipes (:mod:`localclip.recipes`) return a :class:`TrainConfig`; the CLI applies flags and
``--set KEY=VALUE`` overrides to it; the resolved config is written to ``config.json`` of the run.
Each field's allowed values live in the module that implements the choice (clip modes in
:mod:`localclip.optim`, compressions in :mod:`localclip.averaging`, ...); which combinations
mean something, and what an algorithm fixes, is :mod:`localclip.algorithms.build`'s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field

from localclip.algorithms import build as algorithms
from localclip import devices
from localclip.averaging import COMPRESSIONS, OPTIMIZER_STATE_MODES, OUTER_OPTIMIZERS, OVERLAP_MERGES
from localclip.errors import ConfigError
from localclip.optim import CLIP_MODES, INNER_OPTIMIZERS

__all__ = ["TrainConfig", "apply_overrides", "config_from_dict"]


@dataclass
class TrainConfig:
    """Everything a run depends on. Fields are grouped as the training loop uses them."""

    # -- workload --
    task: str = "lm"
    """``lm`` (word-level language model) or ``image`` (image classification)."""
    dataset: str = "ptb"
    """``ptb`` or ``wikitext2`` for ``lm``; ``fashion-mnist`` or ``cifar10`` for ``image``."""
    model: str = "lstm"
    """``lstm`` (small LSTM), ``awd_lstm``, ``gpt`` (small transformer), or ``resnetD`` (D in 8,
    14, 20, 32, 44, 56)."""
    model_options: dict = field(default_factory=dict)
    """Keyword arguments of the model constructor (sizes, dropouts, tying)."""

    # -- algorithm --
    algorithm: str = "celgc"
    """``celgc``, ``naive`` (gradients averaged every step, then clipped), ``local-sgd`` (CELGC
    with γ = ∞), ``single`` (one worker) or ``episode`` (EPISODE: CELGC's rounds with corrected
    local gradients and one clip decision per round)."""
    workers: int = 4
    """N, the number of workers (``single`` forces 1)."""
    period: int = 8
    """I, the communication period in local steps (``celgc``, ``local-sgd``, ``episode``)."""
    lr: float = 20.0
    """η, the step size."""
    gamma: float = 5.0
    """γ, the clipping parameter: a step is at most γ long (``inf`` disables clipping);
    ``clipped_sgd`` only (``adamw`` clips with ``max_grad_norm``)."""
    clip_mode: str = "local"
    """``local`` (the paper's), ``global_average``, ``max`` or ``none``."""
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 5
    """b, the per-worker batch size (the global batch is N·b)."""
    optimizer_state: str = "local"
    """What happens to the inner optimizer's state (SGD momentum, Adam moments) at a round:
    ``local`` (kept per worker, the paper's and DiLoCo's default), ``average`` or ``reset``."""
    inner_optimizer: str = "clipped_sgd"
    """The local update: ``clipped_sgd`` (CELGC's, with ``lr``/``gamma``/``momentum``) or
    ``adamw`` (clip the local gradient's norm to ``max_grad_norm``, then an AdamW step with
    ``lr``, ``betas``, ``weight_decay``); see :mod:`localclip.algorithms.build`."""
    max_grad_norm: float = math.inf
    """``adamw``: the bound on the local gradient's norm (``inf``: no clipping)."""
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    """``adamw``: Adam's (β1, β2)."""
    average_buffers: bool = True
    """Average floating-point buffers (BatchNorm statistics) with the parameters."""
    outer_optimizer: str = "none"
    """What a round does with the average: ``none`` (take it), or an outer step on the model as
    of the last round with pseudo-gradient (anchor − average): ``sgd`` or ``nesterov`` (DiLoCo)."""
    outer_lr: float = 0.7
    """The outer step size (with ``outer_optimizer`` sgd/nesterov; DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """The outer momentum in [0, 1) (DiLoCo's 0.9; ``nesterov`` needs > 0)."""
    outer_lr_decay: bool = False
    """Multiply the outer lr by the inner lr's step decay (``lr_decay`` at each of
    ``lr_decay_epochs``), so that the outer step shrinks with the local ones; false: constant."""
    warmup_steps: int = 0
    """Post-local SGD (Lin et al., 2020): average after every one of the first N local steps,
    then every ``period`` steps counted from there; each of these rounds counts in ``comm/rounds``."""
    compression: str = "none"
    """How a round sends the models: ``none`` (float32), or the change since the last round as
    ``bf16`` or ``fp16`` (half the bytes), or ``int8`` or ``int4`` codes with a float32 scale per
    256 elements (about 1/4 and 1/8 of the bytes)."""
    error_feedback: bool = True
    """``int8``/``int4``: each worker adds what its last round's encodings left out to its next
    round's change (false: drop it)."""
    fragments: int = 1
    """Streaming rounds: split the model into this many fragments of about equal bytes, each
    synced once per period on a staggered schedule (1: the whole model every period)."""
    overlap: int = 0
    """Streaming rounds: start each round without waiting and apply it this many local steps
    later (0: rounds block; else < period)."""
    overlap_alpha: float = 0.0
    """The merge of a round in flight: alpha·local + (1 − alpha)·average (0: take the average)."""
    overlap_merge: str = "mix"
    """How a round in flight is merged: ``mix`` (with ``overlap_alpha``, above) or ``carry``:
    average + (local − snapshot), each worker keeping its steps taken while the round flew."""

    # -- schedule --
    epochs: float = 1.0
    """Passes of the whole system over the training set (fractions allowed)."""
    max_steps: int | None = None
    """Stop after this many local steps per worker (then evaluate as at the end of training)."""
    lr_decay_epochs: list = field(default_factory=list)
    """Epochs at which lr and γ are multiplied by ``lr_decay`` (the paper's step decay)."""
    lr_decay: float = 0.1

    # -- language models --
    bptt: int = 35
    """Base sequence length of truncated back-propagation through time."""
    variable_bptt: bool = False
    """AWD-LSTM's random sequence lengths, lr and γ scaled by seq_len / bptt."""
    ar_alpha: float = 0.0
    """Activation regularisation weight α (AWD-LSTM uses 2)."""
    tar_beta: float = 0.0
    """Temporal activation regularisation weight β (AWD-LSTM uses 1)."""
    eval_batch_size: int = 10
    test_batch_size: int = 2
    eval_bptt: int | None = None
    """Sequence length for evaluation (default: bptt)."""
    eval_tokens: int | None = None
    """Evaluate on only the first N tokens of each split (smoke tests); default all."""
    asgd_patience: int = 0
    """After validation has not improved for this many epochs, evaluate the running average of
    end-of-epoch weights (AWD-LSTM's NT-ASGD-like average, 5 in the paper); 0 disables."""

    # -- scenarios --
    heterogeneous: bool = False
    """Each worker keeps its own shard (no rotation) instead of rotating shards every epoch."""
    participants: int | None = None
    """Partial participation: K of N workers are averaged each round."""
    non_participants: str = "train"
    """What a worker not sampled for a round does in that round's period: ``train`` (it trains
    from the last average like every worker, and the average then replaces its model) or
    ``idle`` (it does nothing, as in FedAvg: only the K sampled train, so the simulator holds K
    workers, not N; see docs/algorithm.md, "Partial participation")."""
    fail: list = field(default_factory=list)
    """Failure plans for the simulator, ``"R@A:B"`` each: worker R leaves right after its A-th
    local step and heals from a live peer at the first round at a step >= B (several allowed;
    see :mod:`localclip.comm.membership`)."""
    similarity: float = 0.0
    """Heterogeneous image data: fraction of each worker's data drawn iid, the rest label-sorted."""

    # -- bookkeeping --
    seed: int = 2020
    log_interval: int = 50
    """Steps between ``metrics.jsonl`` training records."""
    eval_interval: int = 0
    """Steps between mid-epoch validations (0: at the end of each epoch only). They score the
    averaged model, so for model-averaging runs a multiple of ``period``; with streaming rounds
    (``fragments > 1`` or ``overlap >= 1``) any number of steps: they score the mean of the
    workers' live models (:mod:`localclip.train.live_mean`) and leave the training untouched."""
    checkpoint_interval: int = 200
    """Steps between checkpoints (also one at the end of every epoch and one when the budget
    runs out, before the final averaging, so that a larger budget can continue the run)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep: a resume falls back to an older one when the
    newest does not load on every worker."""
    stop_check_interval: int = 32
    """Local steps at most between two checks for a stop request (SIGTERM/SIGINT; one 4-byte
    all-reduce each) besides every round; 0: at rounds and epoch starts only. Results do not
    depend on it."""
    stop_on_divergence: bool = True
    """End the run at the first validation whose loss is NaN/Inf or whose perplexity overflows to
    infinity (a diverged model: training on only spends the budget). The summary records the step
    in ``diverged_at_step``; the run ends with its final evaluation, like any other."""
    timeout: float = 300.0
    """Seconds a collective may wait for peers before the run fails."""
    on_nonfinite: str = "skip"
    """``skip``: a NaN/Inf gradient skips the step and a worker with NaN/Inf parameters is left
    out of the average; ``raise``: stop with an error."""
    loggers: list = field(default_factory=lambda: ["tensorboard"])
    """Sinks beside ``metrics.jsonl``: ``tensorboard`` (when installed), ``wandb`` (offline)."""
    data_root: str | None = None
    allow_custom_corpus: bool = False
    device: str = "auto"
    """Where each worker computes: ``cpu``, ``cuda`` (its process's GPU), ``cuda:K`` or ``auto``
    (``cuda`` where available); see :mod:`localclip.devices`."""
    threads: int | None = None
    """Torch intra-op threads per process (default: the machine's cores, split among spawned
    workers)."""

    def validate(self) -> "TrainConfig":
        def bad(name, why):
            raise ConfigError(f"Invalid {name}: {getattr(self, name)!r} ({why})")

        if self.task not in ("lm", "image"):
            bad("task", "expected lm or image")
        if self.algorithm not in algorithms.ALGORITHMS:
            bad("algorithm", f"expected one of {', '.join(algorithms.ALGORITHMS)}")
        for name in ("workers", "period", "batch_size", "bptt", "eval_batch_size", "test_batch_size", "log_interval", "checkpoint_interval", "keep_checkpoints"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(name, "must be an integer >= 1")
        if isinstance(self.stop_check_interval, bool) or not isinstance(self.stop_check_interval, int) or self.stop_check_interval < 0:
            bad("stop_check_interval", "must be an integer >= 0")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            bad("lr", "must be a positive number")
        if not self.gamma > 0:
            bad("gamma", "must be > 0; inf disables clipping")
        if self.clip_mode not in CLIP_MODES:
            bad("clip_mode", f"expected one of {', '.join(CLIP_MODES)}")
        if not 0 <= self.momentum < 1:
            bad("momentum", "must be in [0, 1)")
        if not self.weight_decay >= 0:
            bad("weight_decay", "must be >= 0")
        if not self.epochs > 0:
            bad("epochs", "must be > 0")
        if self.max_steps is not None and self.max_steps < 1:
            bad("max_steps", "must be >= 1")
        if self.participants is not None and not 1 <= self.participants <= self.workers:
            bad("participants", f"must be in [1, workers={self.workers}]")
        _validate_non_participants(self, bad)
        if not isinstance(self.stop_on_divergence, bool):
            bad("stop_on_divergence", "expected true or false")
        if self.on_nonfinite not in ("skip", "raise"):
            bad("on_nonfinite", "expected skip or raise")
        if not self.timeout > 0:
            bad("timeout", "must be > 0 seconds")
        _validate_inner_optimizer(self, bad)
        from localclip.train.loggers import check_loggers

        check_loggers(self.loggers)
        if self.task == "lm" and self.model == "gpt":
            from localclip.models.gpt import GPTConfig, check_windows

            block_size = self.model_options.get("block_size", GPTConfig.block_size)
            check_windows(block_size, variable=self.variable_bptt, bptt=self.bptt, eval_bptt=self.eval_bptt)
        if self.optimizer_state not in OPTIMIZER_STATE_MODES:
            bad("optimizer_state", f"expected one of {', '.join(OPTIMIZER_STATE_MODES)}")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            bad("outer_optimizer", f"expected one of {', '.join(OUTER_OPTIMIZERS)}")
        if isinstance(self.outer_lr, bool) or not isinstance(self.outer_lr, (int, float)) or not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            bad("outer_lr", "must be a positive number")
        if isinstance(self.outer_momentum, bool) or not isinstance(self.outer_momentum, (int, float)) or not 0 <= self.outer_momentum < 1:
            bad("outer_momentum", "must be in [0, 1)")
        if self.outer_optimizer == "nesterov" and self.outer_momentum == 0:
            bad("outer_momentum", "outer_optimizer=nesterov needs outer_momentum > 0")
        if not isinstance(self.outer_lr_decay, bool):
            bad("outer_lr_decay", "expected true or false")
        if self.outer_lr_decay and self.outer_optimizer == "none":
            bad("outer_lr_decay", "decays an outer lr: it needs outer_optimizer sgd or nesterov")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            bad("warmup_steps", "must be an integer >= 0 local steps")
        if self.compression not in COMPRESSIONS:
            bad("compression", f"expected one of {', '.join(COMPRESSIONS)}")
        if not isinstance(self.error_feedback, bool):
            bad("error_feedback", "expected true or false")
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1:
            bad("fragments", "must be an integer >= 1")
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, int) or self.overlap < 0:
            bad("overlap", "must be an integer >= 0 local steps")
        if isinstance(self.overlap_alpha, bool) or not isinstance(self.overlap_alpha, (int, float)) or not 0 <= self.overlap_alpha <= 1:
            bad("overlap_alpha", "must be in [0, 1]")
        if self.overlap_merge not in OVERLAP_MERGES:
            bad("overlap_merge", f"expected one of {', '.join(OVERLAP_MERGES)}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1):
            bad("threads", "must be an integer >= 1, or none for the default")
        if not isinstance(self.model_options, dict):
            bad("model_options", "must be a mapping of the model constructor's keyword arguments")
        decays = self.lr_decay_epochs
        if not isinstance(decays, list) or not all(isinstance(e, (int, float)) and not isinstance(e, bool) and e >= 0 for e in decays):
            bad("lr_decay_epochs", "must be a list of epochs >= 0")
        if decays != sorted(decays):
            bad("lr_decay_epochs", f"must be in increasing order, e.g. {sorted(decays)}")
        if self.eval_interval < 0 or self.asgd_patience < 0:
            bad("eval_interval" if self.eval_interval < 0 else "asgd_patience", "must be >= 0")
        devices.check(self.device)
        # The settings that conflict with each other are named together, all in one line: a
        # user who fixes one should not meet the next on the following try.
        conflicts: dict[str, str] = {}
        algorithms.check(self, lambda name, why: conflicts.setdefault(name, why))
        algorithms.check_membership(self, lambda name, why: conflicts.setdefault(name, why))
        if len(conflicts) == 1:
            bad(*next(iter(conflicts.items())))
        if conflicts:
            raise ConfigError(f"Invalid settings, {len(conflicts)} in conflict: " + "; ".join(f"{name}={getattr(self, name)!r} ({why})" for name, why in conflicts.items()))
        return self

    def resolved(self) -> "TrainConfig":
        """The config as it will run, with the values its algorithm fixes written in
        (``single``: one worker; ``naive``: period 1; ``local-sgd``: γ = ∞ and no AdamW
        clipping; see :mod:`localclip.algorithms.build`)."""
        cfg = dataclasses.replace(self, model_options=dict(self.model_options), lr_decay_epochs=list(self.lr_decay_epochs), betas=list(self.betas), loggers=list(self.loggers))
        if self.algorithm in algorithms.ALGORITHMS:
            cfg = algorithms.resolve(cfg)
        return cfg.validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        # Standard JSON: gamma = inf is written "inf" (localclip.jsonio).
        from localclip import jsonio

        return jsonio.dumps(self.to_dict(), indent=2, sort_keys=True)


NON_PARTICIPANTS = ("train", "idle")


def _validate_non_participants(cfg: TrainConfig, bad) -> None:
    """``idle`` non-participants keep nothing of their own between their rounds, so a run whose
    workers carry state from one of their periods to the next (momentum kept per worker, an
    error-feedback residual, a fragment schedule, EPISODE's corrections) is refused with it."""
    if cfg.non_participants not in NON_PARTICIPANTS:
        bad("non_participants", f"expected one of {', '.join(NON_PARTICIPANTS)}")
    if cfg.non_participants == "train":
        return
    why = None
    if cfg.participants is None or cfg.participants >= cfg.workers:
        why = f"needs partial participation, participants K < workers={cfg.workers}"
    elif cfg.task != "lm":
        why = f"applies to the lm task, not task={cfg.task}"
    elif cfg.algorithm not in ("celgc", "local-sgd"):
        why = f"applies to algorithm=celgc|local-sgd, not {cfg.algorithm}"
    elif cfg.optimizer_state == "local" and (cfg.momentum or cfg.inner_optimizer != "clipped_sgd"):
        why = "keeps no optimizer state per worker: use optimizer_state=average or reset"
    elif cfg.compression in ("int8", "int4") and cfg.error_feedback:
        why = f"keeps no error-feedback residual per worker: set error_feedback=false with compression={cfg.compression}"
    elif cfg.fragments != 1 or cfg.overlap:
        why = "applies to blocking whole-model rounds (fragments=1, overlap=0)"
    if why is not None:
        bad("non_participants", f"idle {why}")


def _validate_inner_optimizer(cfg: TrainConfig, bad) -> None:
    if cfg.inner_optimizer not in INNER_OPTIMIZERS:
        bad("inner_optimizer", f"expected one of {', '.join(INNER_OPTIMIZERS)}")
    if isinstance(cfg.max_grad_norm, bool) or not isinstance(cfg.max_grad_norm, (int, float)) or not cfg.max_grad_norm > 0:
        bad("max_grad_norm", "must be > 0; inf disables clipping")
    if not (isinstance(cfg.betas, (list, tuple)) and len(cfg.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in cfg.betas)):
        bad("betas", "expected two numbers in [0, 1), e.g. [0.9, 0.999]")


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def config_from_dict(data: dict) -> TrainConfig:
    from localclip import jsonio

    data = jsonio.decode(data)  # "inf" in a config.json is gamma = inf
    fields = _fields()
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"Unknown config key(s): {', '.join(unknown)}")
    return TrainConfig(**data)


def _coerce(name: str, text: str) -> object:
    """Parse ``text`` as the type of config field ``name`` (``X | None`` accepts ``none``)."""
    hint = typing.get_type_hints(TrainConfig)[name]
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


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Apply ``KEY=VALUE`` strings (``--set``); ``model_options.KEY=VALUE`` sets one model option."""
    fields = _fields()
    changes: dict = {}
    model_options = dict(config.model_options)
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"Invalid --set {item!r}: expected KEY=VALUE")
        if key.startswith("model_options."):
            sub = key.split(".", 1)[1]
            try:
                model_options[sub] = json.loads(value)
            except json.JSONDecodeError:
                model_options[sub] = value
            continue
        if key not in fields:
            close = [f for f in fields if key.replace("-", "_") == f]
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"Unknown config key in --set: {key!r}{hint} (see `localclip recipes --fields`)")
        changes[key] = _coerce(key, value)
    return dataclasses.replace(config, model_options=model_options, **changes)
