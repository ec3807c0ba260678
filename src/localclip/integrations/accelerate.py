"""CELGC inside Hugging Face Accelerate: :func:`prepare`, used in place of ``accelerator.prepare``.

Accelerate's own ``prepare`` wraps a model in DistributedDataParallel, which averages the
gradients at every step: the communication CELGC exists to avoid. :func:`prepare` keeps the rest
of Accelerate (the launcher and its process group, device placement, data loader sharding,
``accelerator.backward``, gradient accumulation, bf16 autocast) and replaces that wrapper by a
localclip algorithm around the user's optimizer, which averages the models every ``period``
steps over Accelerate's process group::

    from accelerate import Accelerator
    from localclip.integrations.accelerate import prepare
    from localclip.optim import ClippedSGD

    accelerator = Accelerator()
    model = MyModel()
    optimizer = ClippedSGD(model.parameters(), lr=0.5, gamma=0.5)   # or ClippedAdamW, AdamW, ...
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader, period=8)
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step()          # local step; every 8th also averages the models
    optimizer.average()           # before evaluating or saving

Launch with ``accelerate launch`` or ``torchrun`` as usual (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from localclip.algorithms import ALGORITHMS, DistributedAlgorithm, compose
from localclip.comm import current
from localclip.errors import ConfigError

__all__ = ["prepare"]

_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU")
# The algorithms that can wrap the user's own optimizer: the others fix a hyperparameter of the
# local update (local-sgd: no clipping) or the world (single: one worker), which belong to the user here.
_WRAPPABLE = tuple(name for name, spec in ALGORITHMS.items() if set(spec.fixed) <= {"period"})


def prepare(accelerator, model: nn.Module, optimizer: Optimizer, *objects, period: int = 8, algorithm: str = "celgc",
            **averager_options):
    """``(model, algorithm, *objects)``: the model on ``accelerator.device`` (not wrapped), the
    localclip ``algorithm`` (``"celgc"``, ``"naive"`` or ``"episode"``) around ``optimizer``, and every other
    object (data loaders, schedulers) through ``accelerator.prepare``.

    ``optimizer`` must have been built over ``model``'s parameters. ``averager_options`` go to
    :class:`~localclip.averaging.PeriodicAverager` (``optimizer_state``, ``warmup_steps``, …).
    The returned algorithm is a ``torch.optim.Optimizer``, so lr schedulers drive it.
    """
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in _SUPPORTED:
        raise ConfigError(f"localclip's Accelerate integration supports {', '.join(_SUPPORTED)} (plain data parallel), not {kind}")
    if getattr(accelerator, "scaler", None) is not None:
        raise ConfigError("fp16 loss scaling is not supported with CELGC's clipped steps; use mixed_precision='bf16' or 'no'")
    if algorithm not in _WRAPPABLE:
        raise ConfigError(f"Invalid algorithm: {algorithm!r} (expected one of {', '.join(_WRAPPABLE)})")
    if isinstance(optimizer, DistributedAlgorithm):
        raise ConfigError("pass the inner optimizer (e.g. ClippedSGD); prepare builds the algorithm around it")
    # Moving a module keeps its Parameter objects, so the optimizer built before still holds them.
    model = model.to(accelerator.device)
    alg = compose(algorithm, model, optimizer, period, group=current(), **averager_options)
    prepared = accelerator.prepare(*objects) if objects else ()
    if len(objects) == 1:
        prepared = (prepared,)
    return (model, alg, *prepared)
