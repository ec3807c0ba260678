"""Experiment recipes: plain functions returning a :class:`~localclip.train.config.TrainConfig`.

Each recipe is documented by its docstring (its first line is what ``localclip recipes``
prints); recipes derive from each other with :meth:`~localclip.train.config.TrainConfig.replace`
(fields by their flat names: ``period=32``). A recipe's step size is for its own inner optimizer;
a recipe may also carry settings for another one (``@recipe(name, adamw={...})``), which
:func:`for_inner_optimizer` applies when the user switches to it. The paper's settings are in
docs/algorithm.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from localclip.errors import ConfigError
from localclip.train.config import TrainConfig

__all__ = ["RECIPES", "converge_schedule", "for_inner_optimizer", "get_recipe", "recipe"]

RECIPES: dict[str, Callable[[], TrainConfig]] = {}
# recipe name -> inner optimizer -> the fields that optimizer needs (lr, betas, ...)
INNER_SETTINGS: dict[str, dict[str, dict]] = {}

# ptb-gpt-small's clipped-SGD step, chosen by the one-worker scan of benchmarks/gpt_lr_scan.py (docs/results.md, appendix G).
LR_GPT_SMALL, GAMMA_GPT_SMALL = 3.0, 0.5


def recipe(name: str, **inner_settings: dict):
    """Register a recipe; ``inner_settings`` maps another inner optimizer to its settings."""

    def register(fn):
        RECIPES[name] = fn
        if inner_settings:
            INNER_SETTINGS[name] = inner_settings
        return fn

    return register


def for_inner_optimizer(name: str, config: TrainConfig, explicit: set[str]) -> TrainConfig:
    """``config`` (recipe ``name`` with the user's changes, ``explicit`` the fields the user set)
    with the recipe's settings for the chosen inner optimizer, where the user switched to another.

    Refused when the recipe has no settings for it and the user gave no ``lr``: the recipe's step
    size is for its own optimizer (clipped SGD's 3.0 diverges as an AdamW lr).
    """
    own = get_recipe(name)
    if config.local.inner_optimizer == own.local.inner_optimizer:
        return config
    settings = INNER_SETTINGS.get(name, {}).get(config.local.inner_optimizer)
    if settings is None:
        if "lr" not in explicit:
            raise ConfigError(
                f"Invalid inner_optimizer={config.local.inner_optimizer!r} without lr: recipe {name}'s lr={own.local.lr!r} is for "
                f"{own.local.inner_optimizer} and it has no {config.local.inner_optimizer} settings; give --lr"
            )
        return config
    return config.replace(**{k: v for k, v in settings.items() if k not in explicit})


def get_recipe(name: str) -> TrainConfig:
    if name not in RECIPES:
        raise ConfigError(f"Unknown recipe {name!r}; available: {', '.join(sorted(RECIPES))} (see `localclip recipes`)")
    return RECIPES[name]()


@recipe("ptb-small")
def ptb_small() -> TrainConfig:
    """PTB, 2-layer 200-unit tied LSTM, 4 workers, I=8: a CELGC run that fits a 2-core CPU."""
    return TrainConfig().replace(
        task="lm", dataset="ptb", model="lstm",
        model_options=dict(emb_size=200, hidden_size=200, num_layers=2, dropout=0.0, tie_weights=True),
        algorithm="celgc", workers=4, period=8, lr=20.0, gamma=5.0, batch_size=5,
        epochs=1.0, bptt=20, eval_bptt=35, eval_batch_size=10, test_batch_size=2,
        seed=2020, log_interval=50, checkpoint_interval=200,
    )


@recipe("ptb-quick")
def ptb_quick() -> TrainConfig:
    """ptb-small for a first try: 116 steps per worker (5 % of an epoch), val and test on their first 20,000 tokens.

    The first command of the README's quick start: a few minutes on a 2-core CPU, ending in one
    line with the perplexities and the communication counted. Its evaluation is cut short and
    batched (test batch 10, not the reference's 2), so its numbers are for this recipe only, not
    comparable with ptb-small's full-split ones.
    """
    return ptb_small().replace(epochs=0.05, eval_tokens=20_000, test_batch_size=10, log_interval=20)


# The total decay of ptb-converge's lr and γ over the run: Zaremba et al.'s (2014) small-LSTM
# schedule halves the lr every epoch from epoch 4 of 13; 8 halvings over 12 epochs is 1/256.
CONVERGE_TOTAL_DECAY = 1 / 256


def converge_schedule(epochs: float, start: float) -> tuple[list[int], float]:
    """``(lr_decay_epochs, lr_decay)`` of a step decay that starts ``start`` (a fraction) of the
    way into ``epochs`` epochs and multiplies lr and γ once per epoch until the last, down to
    :data:`CONVERGE_TOTAL_DECAY` in all. Never decays in epoch 0 (no decay for runs under two epochs)."""
    if not 0 <= start <= 1:
        raise ConfigError(f"Invalid decay start: {start!r} (expected a fraction of the run in [0, 1])")
    first = max(1, round(start * epochs))
    decay_epochs = list(range(first, math.ceil(epochs)))
    if not decay_epochs:
        return [], 1.0
    return decay_epochs, CONVERGE_TOTAL_DECAY ** (1 / len(decay_epochs))


@recipe("ptb-converge")
def ptb_converge() -> TrainConfig:
    """PTB, ptb-small's 2x200 LSTM with dropout, N=8, 12 epochs, lr and γ step-decayed together: a CPU run to a plateau.

    ptb-small is Zaremba et al.'s (2014) small LSTM at η = 20 on the mean token loss and clip
    norm γ/η = 0.25 (their lr 1 and norm 5 on the loss summed over 20 steps); this recipe adds
    their schedule: constant for the first third, then lr and γ multiplied by 0.5 every epoch
    (:func:`converge_schedule`), so the clip norm γ/η stays fixed (as ``GammaFollowsLR`` keeps
    it). Dropout 0 is what the ``converge-tune`` sweep found best on naive parallel clipping at
    3 epochs (final val ppl 159.1, 168.6 and 185.3 at dropout 0, 0.2 and 0.4; docs/results.md);
    the decay start is the reference's third. One intra-op thread per worker, 4 validations per
    epoch in sweeps.
    """
    base = ptb_small()
    decay_epochs, decay = converge_schedule(12.0, 1 / 3)
    return base.replace(
        model_options={**base.workload.model_options, "dropout": 0.0}, workers=8, period=32, epochs=12.0,
        lr_decay_epochs=decay_epochs, lr_decay=decay, threads=1, checkpoint_interval=500,
    )


# CELGC's own γ at I = 32 on ptb-converge's grid (the `tune-gamma` sweep; naive's is the recipe's 5).
GAMMA_CELGC_I32 = 10.0


@recipe("ptb-converge-asgd")
def ptb_converge_asgd() -> TrainConfig:
    """ptb-converge with the paper's kind of schedule: lr and γ constant, the end-of-epoch weight average; CELGC at I=32 and its own γ.

    The configuration that gives CELGC naive parallel clipping's quality at 32x fewer rounds
    when naive trains the same way (docs/results.md, verdict (a), with the command that
    reproduces it): lr 20 and γ 10 for all 12 epochs, no step decay; from the first epoch whose
    validation does not improve (``asgd_patience`` 1), evaluations score the average of the
    end-of-epoch weights while training goes on from the raw ones. Validation four times an
    epoch, at steps that end a period. Naive trained the same way:
    ``--algorithm naive --period 1 --gamma 5``.
    """
    return ptb_converge().replace(
        gamma=GAMMA_CELGC_I32, lr_decay_epochs=[], lr_decay=1.0, asgd_patience=1, eval_interval=288,
    )


@recipe("wt2-converge")
def wt2_converge() -> TrainConfig:
    """WikiText-2, ptb-converge's 2x200 tied LSTM, N=8, b=10, 6 epochs, lr and γ step-decayed together: a CPU run to the end of its schedule.

    ptb-converge adapted to WikiText-2's size: the same model, η, clip norm γ/η = 0.25 and
    schedule shape (constant for the first third, then lr and γ multiplied by one factor per epoch
    down to 1/256), over 6 epochs instead of 12 because an epoch holds 2.2x PTB's tokens over a
    3.3x larger vocabulary (about 45-50 minutes of one core for 8 simulated workers), and the
    paper's WikiText-2 batch of 10 sequences per worker (its PTB runs use 3). Seed 1882, the
    paper's WikiText-2 seed.
    """
    base = ptb_converge()
    decay_epochs, decay = converge_schedule(6.0, 1 / 3)
    return base.replace(dataset="wikitext2", batch_size=10, epochs=6.0, lr_decay_epochs=decay_epochs, lr_decay=decay, seed=1882)


@recipe("ptb-awd")
def ptb_awd() -> TrainConfig:
    """PTB, AWD-LSTM (24M params), N=8, b=3, η=30, γ=7.5, I=2, 250 epochs: the paper's setting (GPUs)."""
    return TrainConfig().replace(
        task="lm", dataset="ptb", model="awd_lstm",
        model_options=dict(emb_size=400, hidden_size=1150, num_layers=3, dropout=0.4, dropout_h=0.25,
                           dropout_i=0.4, dropout_e=0.1, weight_drop=0.5, tie_weights=True),
        algorithm="celgc", workers=8, period=2, lr=30.0, gamma=7.5, weight_decay=1.2e-6, batch_size=3,
        epochs=250.0, bptt=70, variable_bptt=True, eval_bptt=70, ar_alpha=2.0, tar_beta=1.0,
        eval_batch_size=10, test_batch_size=2, asgd_patience=5, seed=2020, log_interval=200,
        checkpoint_interval=1000,
    )


@recipe("wt2-awd")
def wt2_awd() -> TrainConfig:
    """WikiText-2, AWD-LSTM, N=8, b=10, η=30, γ=7.5, I=2, 300 epochs: the paper's setting (GPUs)."""
    cfg = ptb_awd()
    return cfg.replace(
        dataset="wikitext2", batch_size=10, epochs=300.0, seed=1882,
        model_options={**cfg.workload.model_options, "dropout_h": 0.2},
    )


# AdamW for ptb-gpt-small: nanoGPT's betas, decay and clip norm, with the step size of a model this small.
@recipe("ptb-gpt-small", adamw=dict(lr=2e-3, betas=[0.9, 0.95], weight_decay=0.1, max_grad_norm=1.0, gamma=math.inf))
def ptb_gpt_small() -> TrainConfig:
    """PTB, 2-layer 128-wide GPT (1.7M params, context 64), 4 workers, I=8, clipped SGD (or AdamW): fits a 2-core CPU."""
    return TrainConfig().replace(
        task="lm", dataset="ptb", model="gpt",
        model_options=dict(n_layer=2, n_head=4, n_embd=128, block_size=64, dropout=0.1),
        algorithm="celgc", workers=4, period=8, lr=LR_GPT_SMALL, gamma=GAMMA_GPT_SMALL, batch_size=8,
        epochs=1.0, bptt=64, eval_bptt=64, eval_batch_size=10, test_batch_size=2,
        seed=2020, log_interval=25, checkpoint_interval=200,
    )


@recipe("wt2-gpt")
def wt2_gpt() -> TrainConfig:
    """WikiText-2, 6-layer 512-wide GPT (36M params, context 256), N=8, AdamW clipped at 1.0, I=8, 20 epochs: GPU-sized."""
    return TrainConfig().replace(
        task="lm", dataset="wikitext2", model="gpt",
        model_options=dict(n_layer=6, n_head=8, n_embd=512, block_size=256, dropout=0.2),
        algorithm="celgc", workers=8, period=8, inner_optimizer="adamw", lr=6e-4, betas=[0.9, 0.95],
        weight_decay=0.1, max_grad_norm=1.0, batch_size=16, epochs=20.0, bptt=256, eval_bptt=256,
        eval_batch_size=10, test_batch_size=10, seed=1882, log_interval=50, checkpoint_interval=1000,
    )


@recipe("fmnist-resnet")
def fmnist_resnet() -> TrainConfig:
    """Fashion-MNIST, ResNet-8 with BatchNorm, N=8, b=16, η=0.1, γ=1 (the paper's CIFAR-10 step), I=8."""
    return TrainConfig().replace(
        task="image", dataset="fashion-mnist", model="resnet8", algorithm="celgc", workers=8, period=8,
        lr=0.1, gamma=1.0, weight_decay=5e-4, batch_size=16, epochs=2.0, seed=2020,
        log_interval=50, checkpoint_interval=500,
    )


@recipe("cifar10-resnet32")
def cifar10_resnet32() -> TrainConfig:
    """CIFAR-10, ResNet-32, N=8, b=16, η=0.1, γ=1, wd 5e-4, decay ×0.1 at 80/120 of 160 epochs (needs torchvision)."""
    return fmnist_resnet().replace(
        dataset="cifar10", model="resnet32", epochs=160.0, lr_decay_epochs=[80, 120],
    )


def describe() -> list[str]:
    return [f"{name:18s} {(fn.__doc__ or '').strip().splitlines()[0]}" for name, fn in sorted(RECIPES.items())]


