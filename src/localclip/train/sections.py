"""The sections of a training config: one typed dataclass per part of a run, each checking its own values.

A :class:`~localclip.train.config.TrainConfig` is these seven sections, in the order a run uses
them: what is trained on which data (:class:`WorkloadConfig`), which algorithm with how many
workers (:class:`AlgorithmConfig`), each worker's local update (:class:`LocalUpdateConfig`), what a
round does and when (:class:`RoundConfig`), how long and at which step sizes
(:class:`ScheduleConfig`), how the model is scored (:class:`EvaluationConfig`), and how the run
is hosted and recorded (:class:`RunConfig`).

Each section's :meth:`validate` checks the values of that section alone, against the choices
defined where they are implemented (clip modes in :mod:`localclip.optim`, compressions in
:mod:`localclip.averaging`, ...). Rules that relate values of two sections are
:func:`localclip.algorithms.build.check`'s. A field keeps the name users know from ``--set``
(``period``, ``compression``); the one exception is the algorithm's name, ``algorithm`` on the
command line and ``algorithm.name`` here (:data:`localclip.train.config.FLAT_NAMES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from localclip.errors import ConfigError

__all__ = [
    "AlgorithmConfig", "EvaluationConfig", "LocalUpdateConfig", "NON_PARTICIPANTS", "RoundConfig", "RunConfig", "SECTIONS",
    "ScheduleConfig", "WorkloadConfig",
]


def _bad(name: str, value, why: str) -> None:
    raise ConfigError(f"Invalid {name}: {value!r} ({why})")


def _is_int(value, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _positive_ints(section, names) -> None:
    for name in names:
        if not _is_int(getattr(section, name), 1):
            _bad(name, getattr(section, name), "must be an integer >= 1")


@dataclass
class WorkloadConfig:
    """What is trained, on which data, and how each worker's data is drawn."""

    task: str = "lm"
    """``lm`` (word-level language model) or ``image`` (image classification)."""
    dataset: str = "ptb"
    """``ptb`` or ``wikitext2`` for ``lm``; ``fashion-mnist`` or ``cifar10`` for ``image``."""
    model: str = "lstm"
    """``lstm`` (small LSTM), ``awd_lstm``, ``gpt`` (small transformer), or ``resnetD`` (D in 8,
    14, 20, 32, 44, 56)."""
    model_options: dict = field(default_factory=dict)
    """Keyword arguments of the model constructor (sizes, dropouts, tying)."""
    batch_size: int = 5
    """b, the per-worker batch size (the global batch is N·b)."""
    bptt: int = 35
    """Base sequence length of truncated back-propagation through time."""
    variable_bptt: bool = False
    """AWD-LSTM's random sequence lengths, lr and γ scaled by seq_len / bptt."""
    ar_alpha: float = 0.0
    """Activation regularisation weight α (AWD-LSTM uses 2)."""
    tar_beta: float = 0.0
    """Temporal activation regularisation weight β (AWD-LSTM uses 1)."""
    heterogeneous: bool = False
    """Each worker keeps its own shard (no rotation) instead of rotating shards every epoch."""
    similarity: float = 0.0
    """Heterogeneous image data: fraction of each worker's data drawn iid, the rest label-sorted."""
    data_root: str | None = None
    allow_custom_corpus: bool = False

    def validate(self) -> None:
        if self.task not in ("lm", "image"):
            _bad("task", self.task, "expected lm or image")
        _positive_ints(self, ("batch_size", "bptt"))
        if not isinstance(self.model_options, dict):
            _bad("model_options", self.model_options, "must be a mapping of the model constructor's keyword arguments")


@dataclass
class AlgorithmConfig:
    """Which algorithm runs (:data:`localclip.algorithms.ALGORITHMS`), on how many workers, and
    which of them fail in the simulator."""

    name: str = "celgc"
    """``celgc``, ``naive`` (gradients averaged every step, then clipped), ``local-sgd`` (CELGC
    with γ = ∞), ``single`` (one worker) or ``episode`` (EPISODE: CELGC's rounds with corrected
    local gradients and one clip decision per round)."""
    workers: int = 4
    """N, the number of workers (``single`` forces 1)."""
    fail: list = field(default_factory=list)
    """Failure plans for the simulator, ``"R@A:B"`` each: worker R leaves right after its A-th
    local step and heals from a live peer at the first round at a step >= B (several allowed;
    see :mod:`localclip.comm.membership`); checked against the workers and the period by
    :func:`localclip.algorithms.build.check_membership`."""

    def validate(self) -> None:
        from localclip.algorithms.build import ALGORITHMS

        if self.name not in ALGORITHMS:
            _bad("algorithm", self.name, f"expected one of {', '.join(ALGORITHMS)}")
        _positive_ints(self, ("workers",))


@dataclass
class LocalUpdateConfig:
    """Each worker's local step: the inner optimizer and its settings (:mod:`localclip.optim`)."""

    inner_optimizer: str = "clipped_sgd"
    """The local update: ``clipped_sgd`` (CELGC's, with ``lr``/``gamma``/``momentum``) or
    ``adamw`` (clip the local gradient's norm to ``max_grad_norm``, then an AdamW step with
    ``lr``, ``betas``, ``weight_decay``); see :mod:`localclip.algorithms.build`."""
    lr: float = 20.0
    """η, the step size."""
    gamma: float = 5.0
    """γ, the clipping parameter: a step is at most γ long (``inf`` disables clipping);
    ``clipped_sgd`` only (``adamw`` clips with ``max_grad_norm``)."""
    clip_mode: str = "local"
    """``local`` (the paper's), ``global_average``, ``max`` or ``none``."""
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = math.inf
    """``adamw``: the bound on the local gradient's norm (``inf``: no clipping)."""
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    """``adamw``: Adam's (β1, β2)."""

    def validate(self) -> None:
        from localclip.optim import CLIP_MODES, INNER_OPTIMIZERS

        if not (self.lr > 0 and math.isfinite(self.lr)):
            _bad("lr", self.lr, "must be a positive number")
        if not self.gamma > 0:
            _bad("gamma", self.gamma, "must be > 0; inf disables clipping")
        if self.clip_mode not in CLIP_MODES:
            _bad("clip_mode", self.clip_mode, f"expected one of {', '.join(CLIP_MODES)}")
        if not 0 <= self.momentum < 1:
            _bad("momentum", self.momentum, "must be in [0, 1)")
        if not self.weight_decay >= 0:
            _bad("weight_decay", self.weight_decay, "must be >= 0")
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            _bad("inner_optimizer", self.inner_optimizer, f"expected one of {', '.join(INNER_OPTIMIZERS)}")
        if not _is_number(self.max_grad_norm) or not self.max_grad_norm > 0:
            _bad("max_grad_norm", self.max_grad_norm, "must be > 0; inf disables clipping")
        betas = self.betas
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            _bad("betas", betas, "expected two numbers in [0, 1), e.g. [0.9, 0.999]")


#: What a worker not sampled for a round does in its period (:attr:`RoundConfig.non_participants`).
NON_PARTICIPANTS = ("train", "idle")


@dataclass
class RoundConfig:
    """When the workers communicate and what a round does with their models
    (:class:`localclip.averaging.PeriodicAverager`'s options)."""

    period: int = 8
    """I, the communication period in local steps (``celgc``, ``local-sgd``, ``episode``)."""
    warmup_steps: int = 0
    """Post-local SGD (Lin et al., 2020): average after every one of the first N local steps,
    then every ``period`` steps counted from there; each of these rounds counts in ``comm/rounds``."""
    average_buffers: bool = True
    """Average floating-point buffers (BatchNorm statistics) with the parameters."""
    optimizer_state: str = "local"
    """What happens to the inner optimizer's state (SGD momentum, Adam moments) at a round:
    ``local`` (kept per worker, the paper's and DiLoCo's default), ``average`` or ``reset``."""
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
    compression: str = "none"
    """How a round sends the models: ``none`` (float32), or the change since the last round as
    ``bf16`` or ``fp16`` (half the bytes), or ``int8`` or ``int4`` codes with a float32 scale per
    256 elements (about 1/4 and 1/8 of the bytes)."""
    error_feedback: bool = True
    """``int8``/``int4``: each worker adds what its last round's encodings left out to its next
    round's change (false: drop it)."""
    participants: int | None = None
    """Partial participation: K of N workers are averaged each round."""
    non_participants: str = "train"
    """What a worker not sampled for a round does in that round's period: ``train`` (it trains
    from the last average like every worker, and the average then replaces its model) or
    ``idle`` (it does nothing, as in FedAvg: only the K sampled train, so the simulator holds K
    workers, not N; see docs/algorithm.md, "Partial participation")."""
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

    def validate(self) -> None:
        from localclip.averaging import COMPRESSIONS, OPTIMIZER_STATE_MODES, OUTER_OPTIMIZERS, OVERLAP_MERGES

        _positive_ints(self, ("period",))
        if self.participants is not None and (isinstance(self.participants, bool) or not isinstance(self.participants, int)):
            # Its range, [1, workers], is a rule across sections (localclip.algorithms.build.check).
            _bad("participants", self.participants, "must be an integer, or none for all workers")
        if self.non_participants not in NON_PARTICIPANTS:
            _bad("non_participants", self.non_participants, f"expected one of {', '.join(NON_PARTICIPANTS)}")
        if self.optimizer_state not in OPTIMIZER_STATE_MODES:
            _bad("optimizer_state", self.optimizer_state, f"expected one of {', '.join(OPTIMIZER_STATE_MODES)}")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            _bad("outer_optimizer", self.outer_optimizer, f"expected one of {', '.join(OUTER_OPTIMIZERS)}")
        if not _is_number(self.outer_lr) or not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            _bad("outer_lr", self.outer_lr, "must be a positive number")
        if not _is_number(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            _bad("outer_momentum", self.outer_momentum, "must be in [0, 1)")
        if self.outer_optimizer == "nesterov" and self.outer_momentum == 0:
            _bad("outer_momentum", self.outer_momentum, "outer_optimizer=nesterov needs outer_momentum > 0")
        if not isinstance(self.outer_lr_decay, bool):
            _bad("outer_lr_decay", self.outer_lr_decay, "expected true or false")
        if self.outer_lr_decay and self.outer_optimizer == "none":
            _bad("outer_lr_decay", self.outer_lr_decay, "decays an outer lr: it needs outer_optimizer sgd or nesterov")
        if not _is_int(self.warmup_steps, 0):
            _bad("warmup_steps", self.warmup_steps, "must be an integer >= 0 local steps")
        if self.compression not in COMPRESSIONS:
            _bad("compression", self.compression, f"expected one of {', '.join(COMPRESSIONS)}")
        if not isinstance(self.error_feedback, bool):
            _bad("error_feedback", self.error_feedback, "expected true or false")
        if not _is_int(self.fragments, 1):
            _bad("fragments", self.fragments, "must be an integer >= 1")
        if not _is_int(self.overlap, 0):
            _bad("overlap", self.overlap, "must be an integer >= 0 local steps")
        if not _is_number(self.overlap_alpha) or not 0 <= self.overlap_alpha <= 1:
            _bad("overlap_alpha", self.overlap_alpha, "must be in [0, 1]")
        if self.overlap_merge not in OVERLAP_MERGES:
            _bad("overlap_merge", self.overlap_merge, f"expected one of {', '.join(OVERLAP_MERGES)}")


@dataclass
class ScheduleConfig:
    """How long the run trains, and the step decay of lr and γ."""

    epochs: float = 1.0
    """Passes of the whole system over the training set (fractions allowed)."""
    max_steps: int | None = None
    """Stop after this many local steps per worker (then evaluate as at the end of training)."""
    lr_decay_epochs: list = field(default_factory=list)
    """Epochs at which lr and γ are multiplied by ``lr_decay`` (the paper's step decay)."""
    lr_decay: float = 0.1

    def validate(self) -> None:
        if not self.epochs > 0:
            _bad("epochs", self.epochs, "must be > 0")
        if self.max_steps is not None and self.max_steps < 1:
            _bad("max_steps", self.max_steps, "must be >= 1")
        decays = self.lr_decay_epochs
        if not isinstance(decays, list) or not all(isinstance(e, (int, float)) and not isinstance(e, bool) and e >= 0 for e in decays):
            _bad("lr_decay_epochs", decays, "must be a list of epochs >= 0")
        if decays != sorted(decays):
            _bad("lr_decay_epochs", decays, f"must be in increasing order, e.g. {sorted(decays)}")


@dataclass
class EvaluationConfig:
    """How and when the model is scored, and what a diverged score ends."""

    eval_interval: int = 0
    """Steps between mid-epoch validations (0: at the end of each epoch only). They score the
    averaged model, so for model-averaging runs a multiple of ``period``; with streaming rounds
    (``fragments > 1`` or ``overlap >= 1``) any number of steps: they score the mean of the
    workers' live models (:mod:`localclip.train.live_mean`) and leave the training untouched."""
    eval_batch_size: int = 10
    test_batch_size: int = 2
    eval_bptt: int | None = None
    """Sequence length for evaluation (default: bptt)."""
    eval_tokens: int | None = None
    """Evaluate on only the first N tokens of each split (smoke tests); default all."""
    asgd_patience: int = 0
    """After validation has not improved for this many epochs, evaluate the running average of
    end-of-epoch weights (AWD-LSTM's NT-ASGD-like average, 5 in the paper); 0 disables."""
    stop_on_divergence: bool = True
    """End the run at the first validation whose loss is NaN/Inf or whose perplexity overflows to
    infinity (a diverged model: training on only spends the budget). The summary records the step
    in ``diverged_at_step``; the run ends with its final evaluation, like any other."""

    def validate(self) -> None:
        _positive_ints(self, ("eval_batch_size", "test_batch_size"))
        if not isinstance(self.stop_on_divergence, bool):
            _bad("stop_on_divergence", self.stop_on_divergence, "expected true or false")
        if self.eval_interval < 0:
            _bad("eval_interval", self.eval_interval, "must be >= 0")
        if self.asgd_patience < 0:
            _bad("asgd_patience", self.asgd_patience, "must be >= 0")


@dataclass
class RunConfig:
    """How the run is seeded, hosted, checkpointed and recorded; results depend on ``seed`` alone
    of these (and on ``on_nonfinite`` where a step goes non-finite)."""

    seed: int = 2020
    log_interval: int = 50
    """Steps between ``metrics.jsonl`` training records."""
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
    timeout: float = 300.0
    """Seconds a collective may wait for peers before the run fails."""
    on_nonfinite: str = "skip"
    """``skip``: a NaN/Inf gradient skips the step and a worker with NaN/Inf parameters is left
    out of the average; ``raise``: stop with an error."""
    loggers: list = field(default_factory=lambda: ["tensorboard"])
    """Sinks beside ``metrics.jsonl``: ``tensorboard`` (when installed), ``wandb`` (offline)."""
    device: str = "auto"
    """Where each worker computes: ``cpu``, ``cuda`` (its process's GPU), ``cuda:K`` or ``auto``
    (``cuda`` where available); see :mod:`localclip.devices`."""
    threads: int | None = None
    """Torch intra-op threads per process (default: the machine's cores, split among spawned
    workers)."""

    def validate(self) -> None:
        from localclip import devices
        from localclip.train.loggers import check_loggers

        _positive_ints(self, ("log_interval", "checkpoint_interval", "keep_checkpoints"))
        if not _is_int(self.stop_check_interval, 0):
            _bad("stop_check_interval", self.stop_check_interval, "must be an integer >= 0")
        if self.on_nonfinite not in ("skip", "raise"):
            _bad("on_nonfinite", self.on_nonfinite, "expected skip or raise")
        if not self.timeout > 0:
            _bad("timeout", self.timeout, "must be > 0 seconds")
        check_loggers(self.loggers)
        if self.threads is not None and not _is_int(self.threads, 1):
            _bad("threads", self.threads, "must be an integer >= 1, or none for the default")
        devices.check(self.device)


#: The sections of a :class:`~localclip.train.config.TrainConfig`: attribute name -> class.
SECTIONS: dict[str, type] = {
    "workload": WorkloadConfig,
    "algorithm": AlgorithmConfig,
    "local": LocalUpdateConfig,
    "round": RoundConfig,
    "schedule": ScheduleConfig,
    "evaluation": EvaluationConfig,
    "run": RunConfig,
}
