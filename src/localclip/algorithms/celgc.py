"""CELGC (Liu et al., NeurIPS 2022, Algorithm 1) as an optimizer: clipped local steps, models
averaged every ``period`` steps; local SGD without clipping is ``CELGC(..., gamma=math.inf)``."""

from __future__ import annotations

import math

import torch
from torch import nn

from localclip.algorithms.base import DistributedAlgorithm, flat_grads
from localclip.comm import Communicator

__all__ = ["CELGC"]


class CELGC(DistributedAlgorithm):
    r"""Communication-efficient local gradient clipping (Liu et al., NeurIPS 2022, Algorithm 1).

    Every worker takes clipped steps :math:`x_i \leftarrow x_i - \min(\eta, \gamma/\|g_i\|) g_i`
    on its own data (see :class:`~localclip.optim.ClippedSGD` for momentum and weight decay);
    every ``period`` steps the models are replaced by their average (see
    :class:`~localclip.averaging.PeriodicAverager`). With ``gamma=math.inf`` this is local SGD.

    For ``clip_mode="global_average"`` (or ``"max"``) the first step of every period also
    all-reduces the gradients and clips with the norm of their average (or the larger of that and
    the local norm) until the next round, as the reference implementation's variants do.

    Args:
        module: the worker's model; all its trainable parameters are optimised.
        lr, gamma, momentum, dampening, weight_decay, nesterov, clip_mode, foreach, fused: as in
            :class:`~localclip.optim.ClippedSGD`.
        period: the communication period I.
        group: the communicator; default :func:`localclip.comm.current`.
        **averager_options: passed to :class:`~localclip.averaging.PeriodicAverager`
            (``average_buffers``, ``optimizer_state``, ``warmup_steps``, ``participants``, …).
    """

    def __init__(
        self,
        module: nn.Module,
        lr: float,
        gamma: float = math.inf,
        period: int = 1,
        *,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        clip_mode: str = "local",
        foreach: bool | None = None,
        fused: bool | None = None,
        group: Communicator | None = None,
        **averager_options,
    ):
        self._compose(
            module, period, group, averager_options, lr=lr, gamma=gamma, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, clip_mode=clip_mode, foreach=foreach, fused=fused,
        )

    def _setup(self, *args) -> None:
        super()._setup(*args)
        self._round_started = True  # iteration 0 starts a round (everyone holds rank 0's model)

    @torch.no_grad()
    def _refresh_reference_norm(self) -> None:
        params, flat = flat_grads(p for g in self.param_groups for p in g["params"])
        del params
        self._reduce_mean([flat], "gradient all-reduce for global clipping")
        self.optimizer.set_reference_norm(torch.linalg.vector_norm(flat))

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self.optimizer, "clip_mode", "local") in ("global_average", "max") and self._round_started:
            self._refresh_reference_norm()
        self.optimizer.step()
        self._round_started = self.averager.step()
        return loss

    def skip_step(self) -> bool:
        self._round_started = super().skip_step()
        return self._round_started

    def state_dict(self) -> dict:
        return {**super().state_dict(), "round_started": self._round_started}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._round_started = state_dict["round_started"]

