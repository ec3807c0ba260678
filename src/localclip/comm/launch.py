"""Runtimes: how N workers come to exist — simulated threads, spawned processes, or torchrun.

Each runtime calls the same worker function once per worker with that worker's communicator
installed (:func:`localclip.comm.current` returns it), and returns the results by rank:

* ``simulate`` — N threads of this process running at once (:class:`~localclip.comm.SimulatedWorld`),
  the CPU threads split between them as ``spawn`` splits them between processes;
* ``spawn`` — N fresh processes on this machine joined into a gloo group through a ``FileStore``
  in a temporary folder (no ports), the CPU threads split between them;
* ``torchrun`` — this process is one worker of a group that ``torchrun`` set up (``env://``),
  gloo or NCCL, one or many nodes;
* ``ft`` — N processes here, each its own torchft replica group over a lighthouse this process
  starts (:mod:`localclip.comm.ft`); or, with ``TORCHFT_LIGHTHOUSE`` and ``LOCALCLIP_REPLICA``
  set, this process is one worker (replica ``LOCALCLIP_REPLICA``) of a run over that
  lighthouse, on any machine. A worker that dies does not stop the others.

With ``backend="nccl"`` each worker process is pinned to one GPU (``LOCAL_RANK``, or its rank
under spawn, modulo the GPUs present) before the group is made (see :mod:`localclip.devices`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from localclip import interrupt
from localclip.comm import DEFAULT_TIMEOUT, SimulatedWorld
from localclip.errors import CommunicationError, ConfigError, Interrupted

__all__ = ["RUNTIMES", "ft", "run_workers", "simulate", "spawn", "torchrun"]

RUNTIMES = ("simulate", "spawn", "torchrun", "ft")


def default_threads(world_size: int) -> int:
    """Intra-op threads each of ``world_size`` workers on this machine gets (at least one)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def simulate(
    fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, threads_per_worker: int | None = None, **kwargs
) -> list:
    """Run ``fn`` as ``world_size`` concurrent simulated workers, each with ``threads_per_worker``
    intra-op threads (default: the same split as :func:`spawn`)."""
    threads = threads_per_worker if threads_per_worker is not None else default_threads(world_size)
    return SimulatedWorld(world_size, timeout=timeout, threads_per_worker=threads).run(fn, *args, **kwargs)


def _spawned_worker(rank, world_size, store, result_dir, threads, timeout, backend, fn, args, kwargs):
    from localclip.comm import distributed

    torch.set_num_threads(threads)
    if backend == "nccl":  # one GPU per worker process
        torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = None
    try:
        # The parent passes SIGTERM/SIGINT on (and says so); each worker stops at an agreement point.
        with interrupt.catch(announce=False):
            # init installs the communicator that localclip.comm.current() returns in this process.
            comm = distributed.init(backend=backend, rank=rank, world_size=world_size, store_path=store, timeout=timeout)
            result = fn(*args, **kwargs)
            _leave_together(comm)
        payload = ("ok", result)
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent with its traceback
        payload = ("error", (type(exc).__name__, str(exc), traceback.format_exc(), _picklable(exc)))
    tmp = Path(result_dir) / f".rank{rank}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, Path(result_dir) / f"rank{rank}.pkl")
    # Skip destroy_process_group after a failure: it can block on peers that are gone.
    if payload[0] == "ok" and comm is not None:
        distributed.shutdown()


def _leave_together(comm) -> None:
    """One barrier before the group is torn down, after a worker's function returned.

    Rank 0 has more to do after the last collective (the summary, closing the metrics) than the
    others, which would otherwise destroy their gloo contexts and close their connections while
    rank 0 still works. An I/O error that gloo meets in its own thread aborts the process
    ("terminate called after throwing an instance of 'gloo::IoException'"), the suspected cause
    of a rare torchrun failure at exit (not reproduced: 0 failures in 20 runs under load).
    """
    comm.barrier()


_FAILURE_GRACE = 10.0  # seconds the peers of a failed worker get to finish or fail themselves


def _failed(result_dir: str, rank: int) -> bool:
    path = Path(result_dir) / f"rank{rank}.pkl"
    if not path.exists():
        return False
    try:
        return pickle.loads(path.read_bytes())[0] == "error"
    except Exception:  # noqa: BLE001 - a file being written is not a failure yet
        return False


def _picklable(exc: BaseException):
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001
        return None


def spawn(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT,
    join_timeout: float | None = None,
    backend: str = "gloo",
    threads_per_worker: int | None = None,
    **kwargs,
) -> list:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` new processes joined in a gloo group.

    ``fn`` must be importable (a module-level function). The group meets through a FileStore in
    a temporary folder, so parallel runs never collide on a port. Raises the first failing
    worker's exception (re-created with its rank and traceback in the message), and
    :class:`~localclip.errors.CommunicationError` if the workers do not all finish within
    ``join_timeout`` seconds (default: no limit beyond each collective's ``timeout``).
    """
    if threads_per_worker is None:
        threads_per_worker = default_threads(world_size)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="localclip-spawn-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_spawned_worker,
                args=(r, world_size, store, tmp, threads_per_worker, timeout, backend, fn, args, kwargs),
                name=f"localclip-worker-{r}",
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = None if join_timeout is None else time.monotonic() + join_timeout
        failed_at = None
        forwarding = interrupt.forward_to([p.pid for p in procs])
        forwarding.__enter__()  # signals caught by this process reach the workers
        try:
            # Poll rather than join in order: once a worker has failed, its peers are likely
            # blocked in a collective with it, so give them a short grace period, then stop them.
            while any(p.is_alive() for p in procs):
                if deadline is not None and time.monotonic() > deadline:
                    break
                if failed_at is None and any(_failed(tmp, r) for r in range(world_size)):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > _FAILURE_GRACE:
                    break
                for p in procs:
                    p.join(0.05)
        finally:
            forwarding.__exit__(None, None, None)
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        results, errors = [], []
        for r, p in enumerate(procs):
            path = Path(tmp) / f"rank{r}.pkl"
            if not path.exists():
                errors.append((r, None, f"worker exited with code {p.exitcode} and no result"))
                results.append(None)
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "ok":
                results.append(value)
            else:
                errors.append((r, value[3], f"{value[0]}: {value[1]}\n{value[2]}"))
                results.append(None)
    if alive and not errors:
        raise CommunicationError(f"ranks {alive} did not finish within {join_timeout:g}s and were killed")
    if errors:
        # Report the root cause: a worker that failed on its own, not one whose peer vanished
        # or that was stopped after another's failure.
        errors.sort(key=lambda e: (e[1] is None, isinstance(e[1], CommunicationError)))
        rank, exc, text = errors[0]
        if isinstance(exc, Interrupted):
            raise exc  # the same stop on every rank: its message stands as it is
        if isinstance(exc, BaseException):
            exc.args = (f"rank {rank}: {exc}",) if len(exc.args) <= 1 else exc.args
            raise exc
        raise CommunicationError(f"rank {rank} failed: {text}")
    return results


def torchrun(fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT, backend: str | None = None, **kwargs):
    """Join the group that ``torchrun`` set up and run ``fn`` as this process's worker."""
    from localclip.comm import distributed

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("--runtime torchrun: RANK/WORLD_SIZE are not set; start this command with torchrun")
    # torchrun passes SIGTERM/SIGINT on to every worker; rank 0 alone says what happens next.
    if backend == "nccl":  # one GPU per worker process of this node
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    with interrupt.catch(announce=os.environ["RANK"] == "0"):
        comm = distributed.init(backend=backend, timeout=timeout)  # installs this process's communicator
        try:
            result = fn(*args, **kwargs)
            _leave_together(comm)
            return result
        finally:
            distributed.shutdown()


def _ft_worker(rank, world_size, lighthouse, result_dir, threads, timeout, fn, args, kwargs):
    from localclip.comm import ft as _ft
    from localclip.comm.base import install

    torch.set_num_threads(threads)
    membership = None
    try:
        with interrupt.catch(announce=False):
            membership = _ft.FaultTolerantMembership(rank, world_size, lighthouse, timeout=timeout)
            install(membership.communicator)  # localclip.comm.current() returns it in this process
            payload = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent
        payload = ("error", (type(exc).__name__, str(exc), traceback.format_exc(), _picklable(exc)))
    if result_dir is None:
        if membership is not None:
            membership.shutdown()
        return payload
    tmp = Path(result_dir) / f".rank{rank}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, Path(result_dir) / f"rank{rank}.pkl")
    if membership is not None:
        membership.shutdown()


def ft(fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, threads_per_worker: int | None = None, **kwargs) -> list:
    """Run ``fn`` as ``world_size`` fault-tolerant workers (see the module docstring); returns
    the results by rank, None for a worker that died. Raises the first failing worker's
    exception only if no worker finished."""
    from localclip.comm import ft as _ft

    reason = _ft.available()
    if reason is not None:
        raise ConfigError(f"--runtime ft: {reason}")
    if os.environ.get("TORCHFT_LIGHTHOUSE"):
        replica = os.environ.get("LOCALCLIP_REPLICA", "")
        if not replica.isdigit() or not int(replica) < world_size:
            raise ConfigError(f"--runtime ft: LOCALCLIP_REPLICA={replica!r} must name this worker, 0..{world_size - 1}")
        status, value = _ft_worker(int(replica), world_size, os.environ["TORCHFT_LIGHTHOUSE"], None,
                                   threads_per_worker or torch.get_num_threads(), timeout, fn, args, kwargs)
        if status == "error":
            raise value[3] if isinstance(value[3], BaseException) else CommunicationError(f"{value[0]}: {value[1]}")
        return [value]
    threads = threads_per_worker or default_threads(world_size)
    # A quorum forms with a majority of the workers (no two quorums at once), waiting a few
    # seconds at the first round for the ones still starting.
    lighthouse = _ft.start_lighthouse(world_size // 2 + 1, join_timeout=5.0)
    ctx = mp.get_context("spawn")
    try:
        with tempfile.TemporaryDirectory(prefix="localclip-ft-") as tmp:
            procs = [ctx.Process(target=_ft_worker, args=(r, world_size, lighthouse.address(), tmp, threads, timeout, fn, args, kwargs),
                                 name=f"localclip-ft-{r}", daemon=False) for r in range(world_size)]
            for p in procs:
                p.start()
            with interrupt.forward_to([p.pid for p in procs]):
                for p in procs:
                    while p.is_alive():
                        p.join(0.1)
            results, errors = [], []
            for r, p in enumerate(procs):
                path = Path(tmp) / f"rank{r}.pkl"
                status, value = pickle.loads(path.read_bytes()) if path.exists() else ("error", ("Died", f"exit code {p.exitcode}", "", None))
                results.append(value if status == "ok" else None)
                if status != "ok":
                    errors.append((r, value))
    finally:
        lighthouse.shutdown()
    for rank, value in errors:
        if isinstance(value[3], Interrupted):
            raise value[3]
    if all(r is None for r in results):
        rank, value = errors[0]
        exc = value[3]
        if isinstance(exc, BaseException):
            exc.args = (f"rank {rank}: {exc}",) if len(exc.args) <= 1 else exc.args
            raise exc
        raise CommunicationError(f"rank {rank} failed: {value[0]}: {value[1]}")
    for rank, value in errors:
        print(f"localclip: --runtime ft: worker {rank} did not finish ({value[0]}: {value[1].strip().splitlines()[0] if value[1].strip() else ''}); "
              f"the others went on without it", file=sys.stderr, flush=True)
    return results


def run_workers(runtime: str, fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs):
    """Dispatch to a runtime by name; returns the list of per-rank results (this rank's only under torchrun)."""
    if runtime == "simulate":
        return simulate(fn, world_size, *args, timeout=timeout, **kwargs)
    if runtime == "spawn":
        return spawn(fn, world_size, *args, timeout=timeout, **kwargs)
    if runtime == "torchrun":
        return [torchrun(fn, *args, timeout=timeout, **kwargs)]
    if runtime == "ft":
        return ft(fn, world_size, *args, timeout=timeout, **kwargs)
    raise ConfigError(f"Invalid --runtime: {runtime!r} (expected one of {', '.join(RUNTIMES)})")
