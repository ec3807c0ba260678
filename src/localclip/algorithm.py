"""CELGC and its baselines as optimizers: the user's loop stays ``zero_grad / backward / step``.

Each algorithm composes a :class:`~localclip.optim.ClippedSGD` (the local update) with the
communication it needs, and exposes the inner optimizer's ``param_groups`` so that PyTorch's lr
schedulers drive it unchanged:

* :class:`CELGC` — clipped local steps, models averaged every ``period`` steps (Algorithm 1);
  its ``global_average`` / ``max`` clip modes add one gradient all-reduce per round.
* :class:`NaiveParallelClipping` — gradients averaged every step, then clipped: single-machine
  clipped SGD with the global batch, communicating every step.
* local SGD without clipping is ``CELGC(..., gamma=math.inf)``; a single machine is any of them
  with a world of one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from localclip.averaging import PeriodicAverager
from localclip.comm import Communicator, current
from localclip.errors import CommunicationError
from localclip.optim import ClippedSGD

__all__ = ["CELGC", "NaiveParallelClipping", "DistributedAlgorithm"]


class DistributedAlgorithm(torch.optim.Optimizer):
    """Shared plumbing: an optimizer facade over ``self.optimizer`` plus communication counters.

    Like ``torch.distributed.optim.PostLocalSGDOptimizer`` it does not call
    ``Optimizer.__init__``: ``param_groups``, ``state`` and ``defaults`` are the inner
    optimizer's, so schedulers and ``GammaFollowsLR`` act on the real hyperparameters.
    """

    optimizer: ClippedSGD
    averager: PeriodicAverager
    comm: Communicator

    def _compose(self, module: nn.Module, period: int, group, averager_options: dict, **optimizer_options) -> None:
        """Build the ClippedSGD over ``module``'s trainable parameters and its averager."""
        self.comm = group if group is not None else current()
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"Invalid module: {type(module).__name__} has no trainable parameters")
        optimizer = ClippedSGD(params, **optimizer_options)
        # The averager re-homes the parameters into flat buffers; the optimizer holds the same
        # Parameter objects, so it follows.
        self.averager = PeriodicAverager(module, period, group=self.comm, optimizer=optimizer, **averager_options)
        self._init_facade(optimizer)

    def _init_facade(self, optimizer: ClippedSGD) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self._extra_bytes = 0
        self._extra_reductions = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} averages a fixed module; build it with all parameters")

    def average(self) -> None:
        """Average the models now (end of an epoch, before evaluation)."""
        self.averager.average()

    # -- statistics ----------------------------------------------------------------------------

    @property
    def rounds(self) -> int:
        """Communication rounds: collectives issued (model averages and gradient all-reduces)."""
        return self.averager.rounds + self._extra_reductions

    @property
    def bytes_communicated(self) -> int:
        """Payload bytes this worker has all-reduced (models, gradients, momentum)."""
        return self.averager.bytes_communicated + self._extra_bytes

    @property
    def clip_fraction(self) -> torch.Tensor:
        return self.optimizer.clip_fraction

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "averager": self.averager.state_dict(),
            "extra_bytes": self._extra_bytes,
            "extra_reductions": self._extra_reductions,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        # Optimizer.load_state_dict replaces the inner param_groups and state objects: follow
        # them, or later lr/gamma changes (decay, variable BPTT) would miss the real groups.
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        self.averager.load_state_dict(state_dict["averager"])
        self._extra_bytes = state_dict["extra_bytes"]
        self._extra_reductions = state_dict["extra_reductions"]

    def _reduce_mean(self, tensors: list[torch.Tensor], what: str) -> None:
        try:
            self.comm.all_reduce(tensors)
        except CommunicationError as exc:
            raise CommunicationError(f"{what} at step {self.optimizer.steps + 1}: {exc}") from exc
        torch._foreach_div_(tensors, self.comm.world_size)
        self._extra_reductions += 1
        self._extra_bytes += sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r}, {self.averager!r})"


def _flat_grads(params) -> tuple[list[torch.nn.Parameter], torch.Tensor]:
    with_grad = [p for p in params if p.grad is not None]
    return with_grad, torch.cat([p.grad.reshape(-1) for p in with_grad])


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
        self._round_started = True  # iteration 0 starts a round (everyone holds rank 0's model)

    @property
    def period(self) -> int:
        return self.averager.period

    @torch.no_grad()
    def _refresh_reference_norm(self) -> None:
        params, flat = _flat_grads(p for g in self.param_groups for p in g["params"])
        del params
        self._reduce_mean([flat], "gradient all-reduce for global clipping")
        self.optimizer.set_reference_norm(torch.linalg.vector_norm(flat))

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.optimizer.clip_mode in ("global_average", "max") and self._round_started:
            self._refresh_reference_norm()
        self.optimizer.step()
        self._round_started = self.averager.step()
        return loss

    def state_dict(self) -> dict:
        return {**super().state_dict(), "round_started": self._round_started}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._round_started = state_dict["round_started"]


class NaiveParallelClipping(DistributedAlgorithm):
    r"""Naive parallel clipping: average the gradients every step, then take one clipped step.

    Equal to single-machine clipped SGD on the concatenated global batch (when every worker's
    loss is a mean over the same per-worker batch size). The models stay identical, so only the
    floating-point buffers differ between workers; :meth:`average` (called at the end of every
    epoch) makes those agree as well.
    """

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
        # Period 1, but the averager only serves the initial broadcast and the explicit
        # end-of-epoch average(): step() never calls it.
        self._compose(
            module, 1, group, averager_options, lr=lr, gamma=gamma, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, clip_mode="local", foreach=foreach, fused=fused,
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.comm.world_size > 1:
            params, flat = _flat_grads(p for g in self.param_groups for p in g["params"])
            self._reduce_mean([flat], "gradient averaging")
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self.optimizer.step()
        return loss
