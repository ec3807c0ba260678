"""Training: the config, the loop, the run folder, and :func:`run_training`, which ties them
to a runtime (simulate, spawn, torchrun or ft)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from localclip.errors import ConfigError, LocalclipError, RunFolderError
from localclip.algorithms import ALGORITHMS
from localclip.provenance import code_version
from localclip.train.capacity import check_memory, group_size
from localclip.train.config import TrainConfig, apply_overrides, config_from_dict
from localclip.train.run_folder import RunFolder
from localclip.train.trainer import Trainer, run_worker
from localclip.train.workloads import check_data, check_model

__all__ = ["ALGORITHMS", "RunFolder", "TrainConfig", "Trainer", "apply_overrides", "config_from_dict", "run_resolved", "run_training"]


def run_training(
    config: TrainConfig,
    out: str | os.PathLike,
    *,
    runtime: str = "simulate",
    resume: bool = False,
    progress: bool = True,
    fetch_corpus: Callable[[TrainConfig], object] | None = None,
) -> dict | None:
    """Train ``config`` into the run folder ``out``; return the summary (rank 0's under torchrun).

    Everything that can be checked is checked before the folder is touched: the config, the
    model options, the folder itself (see :meth:`RunFolder.prepare`: a folder in use by another
    process, a resume whose config differs), the corpus, then the memory the run needs
    (:func:`localclip.train.capacity.check_memory`, which reads the corpus's size), in that
    order, so that a refused folder is one line and costs no download. ``fetch_corpus(config)``,
    if given, is called before the corpus is checked (the ``localclip`` command downloads a
    missing corpus there). On
    SIGTERM/SIGINT the workers checkpoint and :class:`~localclip.errors.Interrupted` is raised.

    ``config`` is resolved here (:func:`localclip.algorithms.build.resolved`); a caller that has
    resolved it already (the CLI, to name the run's folder) calls :func:`run_resolved`.
    """
    from localclip.algorithms import build

    return run_resolved(build.resolved(config), out, runtime=runtime, resume=resume, progress=progress, fetch_corpus=fetch_corpus)


def run_resolved(
    config: TrainConfig,
    out: str | os.PathLike,
    *,
    runtime: str = "simulate",
    resume: bool = False,
    progress: bool = True,
    fetch_corpus: Callable[[TrainConfig], object] | None = None,
) -> dict | None:
    """:func:`run_training` of a config that :func:`localclip.algorithms.build.resolved` returned."""
    from localclip import interrupt
    from localclip.comm import launch

    from localclip import devices

    devices.check_available(config.run.device)
    if config.run.device.startswith("cuda:") and runtime != "simulate" and config.algorithm.workers > 1:
        raise ConfigError(f"Invalid device: {config.run.device!r} with runtime={runtime} (each worker process takes its own GPU: use cuda or auto)")
    check_model(config)
    out = str(Path(out).resolve())
    config_json = run_config_json(config)
    if runtime not in launch.RUNTIMES:
        raise ConfigError(f"Invalid --runtime: {runtime!r} (expected one of {', '.join(launch.RUNTIMES)})")
    if config.round.non_participants == "idle" and runtime != "simulate":
        raise ConfigError(f"Invalid --runtime: {runtime!r} with non_participants=idle (its slots run in the simulator: use simulate)")
    if runtime == "ft":
        return _run_ft(config, out, config_json, resume, progress)
    if runtime == "torchrun":
        return launch.torchrun(_torchrun_worker, config, out, resume, progress, timeout=config.run.timeout, backend=devices.backend_for(config.run.device))
    run = RunFolder(out)
    try:
        checkpoints = run.prepare(config_json, resume=resume)
        if fetch_corpus is not None:
            fetch_corpus(config)
        _check_corpus(config)
        check_data(config)
        check_memory(config, runtime)  # reads the corpus for its size: after it is known to be there
        run.begin(config_json, resuming=bool(checkpoints))
        backend = {} if runtime == "simulate" else {"backend": devices.backend_for(config.run.device)}
        try:
            with interrupt.catch():
                results = launch.run_workers(runtime, run_worker, group_size(config), config, out, checkpoints, progress, timeout=config.run.timeout, **backend)
        except BaseException:
            run.remove_created()  # a run that failed before its first record leaves no folder behind
            raise
    finally:
        run.release()
    return results[0]


def replica_folder(out: str | os.PathLike, rank: int) -> Path:
    """Where worker ``rank`` of a fault-tolerant run (``--runtime ft``) keeps its own run folder."""
    return Path(out) / f"replica-{rank}"


def _run_ft(config: TrainConfig, out: str, config_json: str, resume: bool, progress: bool) -> dict | None:
    """``--runtime ft``: every worker is a run of its own between rounds (records, evaluations,
    checkpoints, lock) in :func:`replica_folder`; the rounds are fault-tolerant
    (:mod:`localclip.comm.ft`). Returns the summary of the lowest-ranked worker that finished."""
    from localclip.comm import launch
    from localclip.algorithms import build as algorithms

    def bad(name, why):
        raise ConfigError(f"Invalid {name}: {config.value(name)!r} ({why})")

    algorithms.check_membership(config, bad, what="--runtime ft")
    if config.algorithm.fail:
        raise ConfigError(f"Invalid fail: {config.algorithm.fail} with --runtime ft: failure plans run in the simulator (--runtime simulate)")
    _check_corpus(config)
    check_data(config)
    single = bool(os.environ.get("TORCHFT_LIGHTHOUSE"))
    ranks = [int(os.environ.get("LOCALCLIP_REPLICA", "0"))] if single else range(config.algorithm.workers)
    for rank in ranks:  # every folder checked before any worker starts (prepare touches nothing)
        folder = RunFolder(replica_folder(out, rank))
        try:
            folder.prepare(config_json, resume=resume)
        finally:
            folder.release()
    results = launch.run_workers("ft", _ft_worker, config.algorithm.workers, config, out, config_json, resume, progress, timeout=config.run.timeout)
    return next((r for r in results if r is not None), None)


def _ft_worker(config: TrainConfig, out: str, config_json: str, resume: bool, progress: bool):
    """One fault-tolerant worker: its own run folder, then :func:`run_worker`."""
    from localclip.comm import current

    run = RunFolder(replica_folder(out, current().rank))
    try:
        checkpoints = run.prepare(config_json, resume=resume)
        run.begin(config_json, resuming=bool(checkpoints))
        try:
            return run_worker(config, str(run.path), checkpoints, progress)
        except BaseException:
            run.remove_created()
            raise
    finally:
        run.release()


def run_config_json(config: TrainConfig) -> str:
    """What ``config.json`` holds: the resolved config and, under ``provenance``, the code that
    started the run (:func:`localclip.provenance.code_version`)."""
    return json.dumps({**json.loads(config.to_json()), "provenance": code_version()}, indent=2, sort_keys=True)


def _check_corpus(config: TrainConfig) -> None:
    """Refuse a missing or non-canonical corpus; say once, in one line each, which custom files
    ``allow_custom_corpus`` accepted (the workers stay quiet)."""
    import sys

    from localclip import data

    if config.workload.task != "lm" or config.workload.dataset not in data.CORPORA:
        return
    for note in data.verify_corpus(config.workload.dataset, config.workload.data_root, allow_custom=config.workload.allow_custom_corpus):
        print(f"localclip: warning: {note}", file=sys.stderr, flush=True)


def _torchrun_worker(config: TrainConfig, out: str, resume: bool, progress: bool):
    """Under torchrun every process runs the CLI: rank 0 alone checks the corpus and prepares
    the folder, and the others learn the outcome from one all-reduce instead of racing it."""
    import torch

    from localclip.comm import current

    comm = current()
    failed = torch.zeros(1)
    error = None
    if comm.rank == 0:
        run = RunFolder(out)
        try:
            config_json = run_config_json(config)
            checkpoints = run.prepare(config_json, resume=resume)
            _check_corpus(config)
            run.begin(config_json, resuming=bool(checkpoints))
        except LocalclipError as exc:
            failed.fill_(1)
            error = exc
    comm.all_reduce([failed], op="max")
    if error is not None:
        raise error
    if failed.item():
        raise RunFolderError(f"rank {comm.rank}: rank 0 could not prepare the run folder {out}")
    try:
        return run_worker(config, out, RunFolder(out).checkpoint_sets(), progress)
    finally:
        if comm.rank == 0:
            run.release()
