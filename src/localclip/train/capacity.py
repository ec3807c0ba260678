"""How many workers a run holds in memory at once, about how much memory that takes, and the
check that refuses a run the machine cannot hold, before anything is written.

The estimate of one worker is ten float32 copies of its model's parameters (the parameters,
their gradients, the averaging round's flat buffers and anchor, optimizer state, the NT-ASGD
average, with slack for the evaluation's copies) plus four copies of one batch's logits (the
forward and backward of the loss) plus its copy of the training tokens. On ptb-small (2.6 M
parameters, 10,000 words) that is 124 MiB; measured: 105 MiB more peak memory per added worker
(8 simulated workers against 1, 2-core AMD EPYC, torch 2.13). A simulated run adds one process,
a spawned run one process per worker (:data:`PROCESS_BYTES`, ``import torch`` and localclip).
"""

from __future__ import annotations

import os

import torch

from localclip.errors import ConfigError
from localclip.train.config import TrainConfig

__all__ = ["PROCESS_BYTES", "available_memory", "check_memory", "group_size", "worker_bytes"]

PROCESS_BYTES = 300 << 20  # a Python process that has imported torch and localclip (measured: 266 MiB)
_MIB, _GIB = 1 << 20, 1 << 30


def group_size(config: TrainConfig) -> int:
    """The workers a run keeps in memory at once: N, or K slots with idle non-participants
    (:mod:`localclip.train.roster`)."""
    return config.round.participants if config.round.non_participants == "idle" else config.algorithm.workers


def worker_bytes(config: TrainConfig) -> int:
    """About how many bytes one worker of ``config`` holds (see the module docstring)."""
    from localclip.models import build_model

    if config.workload.task == "lm":
        from localclip import data
        from localclip.train.workloads import _LM_MODELS

        corpus = data.load_corpus(config.workload.dataset, config.workload.data_root, allow_custom=config.workload.allow_custom_corpus, warn=False)
        ntoken, tokens = len(corpus.vocab), corpus.train.numel()
        with torch.device("meta"):
            model = build_model(_LM_MODELS[config.workload.model], ntoken=ntoken, **config.workload.model_options)
        batch = config.workload.batch_size * config.workload.bptt * ntoken * 4
        data_bytes = tokens * 8
    else:
        channels = 1 if config.workload.dataset == "fashion-mnist" else 3
        with torch.device("meta"):
            model = build_model(config.workload.model, num_classes=10, in_channels=channels, **config.workload.model_options)
        batch, data_bytes = 0, 0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 10 * params + 4 * batch + data_bytes


def available_memory() -> int | None:
    """Bytes this process may still take: the kernel's MemAvailable, less where a cgroup limit
    leaves less; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_memory(config: TrainConfig, runtime: str) -> None:
    """Refuse, in one line, a run whose memory estimate exceeds what the machine has available."""
    if runtime == "torchrun":
        return  # one worker per process, on machines this one cannot see
    limit = available_memory()
    if limit is None:
        return
    n = group_size(config)
    each = worker_bytes(config) + (PROCESS_BYTES if runtime == "spawn" else 0)
    need = n * each + PROCESS_BYTES
    if need <= limit:
        return
    held = f"{n} workers in memory" if n == config.algorithm.workers else f"{n} of {config.algorithm.workers} workers in memory"
    hint = ""
    if config.round.non_participants == "train" and config.round.participants is not None and config.round.participants < config.algorithm.workers:
        hint = f"; with --set non_participants=idle only the {config.round.participants} sampled workers would be held"
    elif n == config.algorithm.workers and config.algorithm.name in ("celgc", "local-sgd"):
        hint = "; fewer workers, or --set participants=K --set non_participants=idle to hold only K"
    raise ConfigError(
        f"Invalid workers: {config.algorithm.workers} (the run needs about {need / _GIB:.1f} GiB, {held} x {each / _MIB:.0f} MiB, "
        f"more than the {limit / _GIB:.1f} GiB this machine has available{hint})"
    )
