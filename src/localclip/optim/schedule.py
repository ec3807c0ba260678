"""Schedules for the step size and the clipping parameter: keep γ tied to the learning rate.

The paper's step decay multiplies lr and γ by the same factor, so the clip threshold on the
gradient, γ/η, stays fixed. PyTorch's lr schedulers only know ``lr``; :class:`GammaFollowsLR`
restores the coupling after any of them.
"""

from __future__ import annotations

import math

import torch

__all__ = ["GammaFollowsLR", "StepDecay"]


class StepDecay:
    """The paper's step decay: lr and γ both multiplied by ``factor`` at each epoch of
    ``milestones``, and by a per-step ``scale`` (variable BPTT), computed from the base values
    each time (no drift from repeated multiplication). Groups without a ``gamma`` (AdamW, whose
    ``max_grad_norm`` bounds a norm, not a step) keep theirs. ``outer``: an outer optimizer (any
    object with an ``lr``) whose lr takes the same decay, without the per-step scale."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float, gamma: float, milestones, factor: float, outer=None):
        self.optimizer, self.lr, self.gamma = optimizer, lr, gamma
        self.milestones, self.factor = list(milestones), factor
        self.outer, self.outer_lr = outer, None if outer is None else outer.lr

    def apply(self, epoch: int, scale: float = 1.0) -> None:
        decays = sum(1 for e in self.milestones if epoch >= e)
        factor = scale * self.factor**decays
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * factor
            if "gamma" in group:
                group["gamma"] = self.gamma * factor
        if self.outer is not None:
            self.outer.lr = self.outer_lr * self.factor**decays


class GammaFollowsLR:
    """Keep each group's ``gamma / lr`` at its value when this object was made.

    Call :meth:`step` after the lr scheduler's ``step()``::

        scheduler = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[80, 120], gamma=0.1)
        coupling = GammaFollowsLR(opt)
        for epoch in ...:
            train(...)
            scheduler.step()
            coupling.step()  # gamma ← (gamma0 / lr0) · lr, the paper's step decay

    Groups with ``gamma = inf`` stay unclipped. The ratios are part of :meth:`state_dict`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.ratios = []
        for group in optimizer.param_groups:
            if "gamma" not in group:
                raise ValueError("GammaFollowsLR needs an optimizer whose groups have a 'gamma' (e.g. ClippedSGD)")
            lr, gamma = group["lr"], group["gamma"]
            if lr <= 0 and math.isfinite(gamma):
                raise ValueError(f"Invalid learning rate for GammaFollowsLR: {lr} (gamma/lr undefined)")
            self.ratios.append(math.inf if math.isinf(gamma) else gamma / lr)

    def step(self) -> None:
        for group, ratio in zip(self.optimizer.param_groups, self.ratios):
            group["gamma"] = ratio * group["lr"] if math.isfinite(ratio) else math.inf

    def state_dict(self) -> dict:
        return {"ratios": list(self.ratios)}

    def load_state_dict(self, state: dict) -> None:
        self.ratios = list(state["ratios"])
