"""What every algorithm shares: the optimizer facade over a ClippedSGD and its averager.

:class:`DistributedAlgorithm` composes a :class:`~localclip.optim.ClippedSGD` (the local update)
with a :class:`~localclip.averaging.PeriodicAverager`, exposes the inner optimizer's
``param_groups`` (so PyTorch's lr schedulers drive it unchanged), counts the communication the
algorithm adds beyond the averager, and checkpoints both. The algorithms themselves live one per
module beside this one (:mod:`.celgc`, :mod:`.naive`, :mod:`.episode`); :mod:`.build` turns a
config into one of them.
"""

from __future__ import annotations

import torch
from torch import nn

from localclip.averaging import PeriodicAverager
from localclip.comm import Communicator, current
from localclip.errors import CommunicationError
from localclip.optim import ClippedSGD

__all__ = ["DistributedAlgorithm", "flat_grads"]


class DistributedAlgorithm(torch.optim.Optimizer):
    """Shared plumbing: an optimizer facade over ``self.optimizer`` plus communication counters.

    Like ``torch.distributed.optim.PostLocalSGDOptimizer`` it does not call
    ``Optimizer.__init__``: ``param_groups``, ``state`` and ``defaults`` are the inner
    optimizer's, so schedulers and ``GammaFollowsLR`` act on the real hyperparameters.
    """

    optimizer: torch.optim.Optimizer  # a ClippedSGD unless built with from_optimizer
    averager: PeriodicAverager
    comm: Communicator

    def _compose(self, module: nn.Module, period: int, group, averager_options: dict, **optimizer_options) -> None:
        """Build the ClippedSGD over ``module``'s trainable parameters, then :meth:`_setup`."""
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"Invalid module: {type(module).__name__} has no trainable parameters")
        self._setup(module, ClippedSGD(params, **optimizer_options), period, group, averager_options)

    #: The communication period an algorithm always runs with, whatever period it is given
    #: (naive parallel clipping's 1: it averages gradients every step); None: the one given.
    #: The builder's table (:data:`localclip.algorithms.build.ALGORITHMS`) reads it from here.
    fixed_period: int | None = None

    def _setup(self, module: nn.Module, optimizer: torch.optim.Optimizer, period: int, group, averager_options: dict) -> None:
        """Everything both constructors share; subclasses add their own state after it.

        The averager re-homes the parameters into flat buffers; the optimizer holds the same
        Parameter objects, so it follows.
        """
        self.comm = group if group is not None else current()
        self.averager = PeriodicAverager(module, period if self.fixed_period is None else self.fixed_period, group=self.comm, optimizer=optimizer, **averager_options)
        self._init_facade(optimizer)

    @classmethod
    def from_optimizer(cls, module: nn.Module, optimizer: torch.optim.Optimizer, period: int = 1, *, group: Communicator | None = None, **averager_options):
        """The algorithm with ``optimizer`` (e.g. :class:`~localclip.optim.ClippedAdamW`) as the
        local update instead of a :class:`~localclip.optim.ClippedSGD`.

        ``optimizer`` must hold ``module``'s trainable parameters. Its own clipping, if any, is
        the clipping: ``CELGC.from_optimizer(model, ClippedAdamW(..., max_grad_norm=1.0), 8)`` is
        CELGC with a clipped AdamW step, local AdamW with ``max_grad_norm=inf``.
        ``NaiveParallelClipping.from_optimizer`` averages the gradients before it (``period``
        is ignored: it communicates every step). Statistics the optimizer does not keep (``clip_fraction``) are unavailable.
        """
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not trainable:
            raise ValueError(f"Invalid module: {type(module).__name__} has no trainable parameters")
        if held != trainable:
            raise ValueError(f"Invalid optimizer: it must hold exactly the module's {len(trainable)} trainable parameters (it holds {len(held)}, {len(held & trainable)} of them the module's)")
        self = cls.__new__(cls)
        self._setup(module, optimizer, period, group, averager_options)
        return self

    # -- the schedule --------------------------------------------------------------------------

    @property
    def period(self) -> int:
        """Local steps between two communications (1: every step)."""
        return self.averager.period

    def communicates(self, step: int) -> bool:
        """Whether the ``step``-th call of :meth:`step` (1-based) communicates (with more than one worker)."""
        return self.comm.world_size > 1 and self.averager.is_sync_step(step)

    def _init_facade(self, optimizer: torch.optim.Optimizer) -> None:
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
        """Average the models now (end of an epoch, before evaluation).

        Only a round that communicates something the workers do not already share is taken and
        counted: right after a round (the last step ended a period) this does nothing.
        """
        if not self.averager.in_sync:
            self.averager.average()

    def skip_step(self) -> bool:
        """Count a step this worker does not compute (it is away: :mod:`localclip.comm.membership`):
        the averager's schedule moves on, and rounds run with this worker out of them; the model
        and the optimizer do not move. Returns whether a round ran."""
        return self.averager.step()

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

    @property
    def local_grad_norm(self) -> torch.Tensor:
        """The norm of this worker's gradient at the last step, as the local update saw it
        (CELGC: the worker's own gradient; EPISODE: its corrected gradient g − G_i + G); a 0-dim
        tensor, NaN where the optimizer keeps no norm. Naive parallel clipping overrides it with
        the norm before the all-reduce."""
        norm = getattr(self.optimizer, "last_grad_norm", None)
        return norm if norm is not None else torch.tensor(float("nan"))

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
            raise CommunicationError(f"{what} at step {getattr(self.optimizer, 'steps', -1) + 1}: {exc}") from exc
        torch._foreach_div_(tensors, self.comm.world_size)
        self._extra_reductions += 1
        self._extra_bytes += sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r}, {self.averager!r})"


def flat_grads(params) -> tuple[list[torch.nn.Parameter], torch.Tensor]:
    """The parameters that have a gradient, and their gradients concatenated into one new tensor."""
    with_grad = [p for p in params if p.grad is not None]
    return with_grad, torch.cat([p.grad.reshape(-1) for p in with_grad])
