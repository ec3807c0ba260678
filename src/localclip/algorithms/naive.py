"""Naive parallel clipping, the paper's baseline: gradients averaged every step, then clipped
(single-machine clipped SGD with the global batch, communicating every step)."""

from __future__ import annotations

import math

import torch
from torch import nn

from localclip.algorithms.base import DistributedAlgorithm, flat_grads
from localclip.averaging import codecs
from localclip.averaging.outer import make_outer
from localclip.comm import Communicator

__all__ = ["NaiveParallelClipping"]


class NaiveParallelClipping(DistributedAlgorithm):
    r"""Naive parallel clipping: average the gradients every step, then take one clipped step.

    Equal to single-machine clipped SGD on the concatenated global batch (when every worker's
    loss is a mean over the same per-worker batch size). The models stay identical, so only the
    floating-point buffers differ between workers; :meth:`average` (called at the end of every
    epoch) averages those, and is no round at all for a model without them.
    """

    fixed_period = 1

    def __init__(
        self,
        module: nn.Module,
        lr: float,
        gamma: float = math.inf,
        *,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        group: Communicator | None = None,
        **averager_options,
    ):
        # Its fixed period, but the averager only serves the initial broadcast and the explicit
        # end-of-epoch average(): step() never calls it.
        self._compose(
            module, self.fixed_period, group, averager_options, lr=lr, gamma=gamma, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, clip_mode="local", foreach=foreach, fused=fused,
        )

    def _setup(self, module, optimizer, period, group, averager_options) -> None:
        for key, off in (("compression", "none"), ("outer_optimizer", None), ("participants", None)):
            if averager_options.get(key, off) != off:
                raise ValueError(f"Invalid {key}={averager_options[key]!r} for naive parallel clipping: it averages gradients, not models")
        if getattr(optimizer, "clip_mode", "local") != "local":
            raise ValueError(
                f"Invalid clip_mode={optimizer.clip_mode!r} for naive parallel clipping: it clips the averaged "
                "gradient, which every worker shares (clip_mode='local'; gamma=inf for no clipping)"
            )
        # The same parts given as objects (codec=, outer=, participation=) rather than by name:
        # refused as given, before the averager re-homes the module's parameters and broadcasts.
        codec, outer, participation = (averager_options.get(key) for key in ("codec", "outer", "participation"))
        for key, value, off in (("codec", codecs.get(codec).name if codec is not None else "none", "none"),
                                ("outer", make_outer(outer), None),
                                ("participation", participation.participants if participation is not None else None, None)):
            if value != off:
                raise ValueError(f"Invalid {key} {value!r} for naive parallel clipping: it averages gradients, not models")
        super()._setup(module, optimizer, period, group, averager_options)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._local_norm = None
        if self.comm.world_size > 1:
            params, flat = flat_grads(p for g in self.param_groups for p in g["params"])
            self._local_norm = torch.linalg.vector_norm(flat)  # statistics only: the step clips with the mean's
            self._reduce_mean([flat], "gradient averaging")
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self.optimizer.step()
        return loss

    @property
    def local_grad_norm(self) -> torch.Tensor:
        """The norm of this worker's own gradient at the last step, before the all-reduce."""
        local = getattr(self, "_local_norm", None)
        return local if local is not None else super().local_grad_norm

    def average(self) -> None:
        """Average the floating-point buffers (the parameters are identical already)."""
        self.averager.average_buffers_only()
