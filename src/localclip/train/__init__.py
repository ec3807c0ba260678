"""Training: the config, the loop, the run folder, and :func:`run_training`, which ties them
to a runtime (simulate, spawn or torchrun)."""

from __future__ import annotations

import os
from pathlib import Path

from localclip.errors import ConfigError, LocalclipError, RunFolderError
from localclip.train.config import ALGORITHMS, TrainConfig, apply_overrides, config_from_dict
from localclip.train.run_folder import RunFolder
from localclip.train.trainer import Trainer, run_worker

__all__ = ["ALGORITHMS", "RunFolder", "TrainConfig", "Trainer", "apply_overrides", "config_from_dict", "run_training"]


def run_training(
    config: TrainConfig,
    out: str | os.PathLike,
    *,
    runtime: str = "simulate",
    resume: bool = False,
    progress: bool = True,
) -> dict | None:
    """Train ``config`` into the run folder ``out``; return the summary (rank 0's under torchrun)."""
    from localclip import launch

    config = config.resolved()
    out = str(Path(out).resolve())
    config_json = config.to_json()
    if runtime == "torchrun":
        return launch.torchrun(_torchrun_worker, config, out, resume, progress, timeout=config.timeout)
    if runtime not in launch.RUNTIMES:
        raise ConfigError(f"Invalid --runtime: {runtime!r} (expected one of {', '.join(launch.RUNTIMES)})")
    run = RunFolder(out)
    checkpoint = run.prepare(config_json, resume=resume, world_size=config.workers)
    run.begin(config_json, checkpoint)
    results = launch.run_workers(runtime, run_worker, config.workers, config, out, checkpoint, progress, timeout=config.timeout)
    return results[0]


def _torchrun_worker(config: TrainConfig, out: str, resume: bool, progress: bool):
    """Under torchrun every process runs the CLI: rank 0 alone prepares the folder, and the
    others learn the outcome from one all-reduce instead of racing it."""
    import torch

    from localclip.comm import current

    comm = current()
    failed = torch.zeros(1)
    error = None
    if comm.rank == 0:
        run = RunFolder(out)
        try:
            checkpoint = run.prepare(config.to_json(), resume=resume, world_size=config.workers)
            run.begin(config.to_json(), checkpoint)
        except LocalclipError as exc:
            failed.fill_(1)
            error = exc
    comm.all_reduce([failed], op="max")
    if error is not None:
        raise error
    if failed.item():
        raise RunFolderError(f"rank {comm.rank}: rank 0 could not prepare the run folder {out}")
    checkpoint = RunFolder(out).latest_checkpoint()
    return run_worker(config, out, checkpoint, progress)
