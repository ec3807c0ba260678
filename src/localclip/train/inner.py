"""The inner (local) optimizer of a run: which update each worker takes between rounds.

``inner_optimizer="clipped_sgd"`` is CELGC's own update, built by the algorithm classes from
``lr``/``gamma``/``momentum``; this module owns the other choice, ``"adamw"``: a
:class:`~localclip.optim.ClippedAdamW` (clip the local gradient's norm to ``max_grad_norm``,
then AdamW), wrapped in the configured algorithm with
:meth:`~localclip.algorithm.DistributedAlgorithm.from_optimizer`.
"""

from __future__ import annotations

from torch import nn

from localclip.algorithms import CELGC, NaiveParallelClipping
from localclip.optim import ClippedAdamW
from localclip.train.config import TrainConfig

__all__ = ["adamw_param_groups", "build_inner_algorithm"]


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


def build_inner_algorithm(config: TrainConfig, model: nn.Module, comm, **averager_options):
    """The configured algorithm (celgc, naive, local-sgd, single) with the AdamW inner update."""
    if config.inner_optimizer != "adamw":
        raise ValueError(f"build_inner_algorithm builds the adamw inner optimizer, not {config.inner_optimizer!r}")
    # local-sgd already resolved max_grad_norm to inf (no clipping).
    optimizer = ClippedAdamW(
        adamw_param_groups(model, config.weight_decay), lr=config.lr, betas=tuple(config.betas),
        weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
    )
    if config.algorithm == "naive":
        return NaiveParallelClipping.from_optimizer(model, optimizer, group=comm, **averager_options)
    return CELGC.from_optimizer(
        model, optimizer, config.period, group=comm, participants=config.participants,
        participation_seed=config.seed, **averager_options,
    )
