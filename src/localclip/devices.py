"""Where a worker computes: the ``device`` setting, what it means in each runtime, and which
``torch.distributed`` backend goes with it.

``device`` is ``cpu``, ``cuda`` (this process's GPU), ``cuda:K`` (GPU K) or ``auto`` (``cuda``
where CUDA is available, else ``cpu``). "This process's GPU" is the launcher's choice: a spawned
or torchrun worker on CUDA is pinned to GPU ``LOCAL_RANK`` (spawn: its rank) modulo the GPUs
present, and talks over NCCL; on the CPU the backend is gloo. Simulated workers, threads of one
process, share that process's GPU. The model, its batches, the optimizer state and the
averager's flat buffers all live on the worker's device; checkpoints are written device-free
(every tensor on the CPU), so a run resumes on another device.
"""

from __future__ import annotations

import re

import torch

from localclip.errors import ConfigError

__all__ = ["DEVICES", "backend_for", "check", "check_available", "move", "resolve", "to_cpu", "uses_cuda"]

DEVICES = ("auto", "cpu", "cuda", "cuda:K")
_CUDA_K = re.compile(r"cuda:(\d+)")


def check(spec: str) -> None:
    """Refuse a ``device`` value that is none of :data:`DEVICES` (on any machine)."""
    if not isinstance(spec, str) or not (spec in ("auto", "cpu", "cuda") or _CUDA_K.fullmatch(spec)):
        raise ConfigError(f"Invalid device: {spec!r} (expected auto, cpu, cuda or cuda:K)")


def uses_cuda(spec: str) -> bool:
    """Whether ``spec`` puts the workers on a GPU on this machine."""
    return spec.startswith("cuda") or (spec == "auto" and torch.cuda.is_available())


def check_available(spec: str) -> None:
    """Refuse a CUDA device this machine does not have, in one line."""
    check(spec)
    if not spec.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"Invalid device: {spec!r} (CUDA is not available on this machine; use --device cpu or auto)")
    match = _CUDA_K.fullmatch(spec)
    if match and int(match.group(1)) >= torch.cuda.device_count():
        raise ConfigError(f"Invalid device: {spec!r} (this machine has {torch.cuda.device_count()} GPU(s): cuda:0..cuda:{torch.cuda.device_count() - 1})")


def backend_for(spec: str) -> str:
    """The ``torch.distributed`` backend of worker processes on ``spec``: NCCL on CUDA, else gloo."""
    return "nccl" if uses_cuda(spec) else "gloo"


def resolve(spec: str) -> torch.device:
    """The device of this process's worker (see the module docstring)."""
    if spec == "cpu" or not uses_cuda(spec):
        return torch.device("cpu")
    if spec in ("cuda", "auto"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(spec)


def move(obj, device: torch.device | str):
    """``obj`` (nested dicts, lists and tuples of tensors) with every tensor on ``device``;
    a tensor already there stays the same object."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == torch.device(device) else obj.to(device)
    if isinstance(obj, dict):
        return {k: move(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(move(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move(v, device) for v in obj)
    return obj


def to_cpu(obj):
    """``obj`` with every tensor on the CPU (checkpoints): a CPU run's state is returned as it is."""
    return move(obj, "cpu")
