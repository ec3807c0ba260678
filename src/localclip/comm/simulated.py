"""N workers simulated in one process, running the same algorithm code as real processes.

Each simulated worker is a thread with its own communicator installed (see
:func:`localclip.comm.current`). By default the threads run **concurrently**: torch kernels
release the GIL, so N workers on C cores keep the machine busy as N processes would, and each
worker thread gets the intra-op thread count a spawned process would get (``C // N``, at least
one). At most ``C // threads`` workers compute at the same time (a worker gives up its slot
while it waits in a collective): more threads than cores would only fight over the cores and
over the GIL, whose hand-over between threads that launch many small kernels costs more than
the kernels (measured: 8 unrestricted workers on 2 cores ran 3x slower than 8 processes).
A collective is a real barrier: each worker deposits its tensors and waits; the last to
arrive reduces them in rank order and releases the others. So

* blocking collectives need no special casing in the algorithms (same code as over gloo);
* a non-blocking collective (``start_*``) deposits the tensors and returns at once; the worker
  computes on and waits later (:meth:`~localclip.comm.base.Pending.wait`), and the last worker
  to arrive writes every worker's results, so a worker never waits for a peer that is itself
  waiting for it (a worker that polls ``is_completed`` in a loop keeps its compute slot, so
  with fewer slots than workers it should ``wait``). Sums are in rank order, as
  :mod:`localclip.comm.distributed` adds them over gloo, so both runtimes give the same bits;
* a worker that raises, leaves early or calls a different collective releases the others with
  a :class:`~localclip.errors.CommunicationError` naming it, and a worker that does not arrive
  fails the others once no worker has arrived at any collective for the world's ``timeout``, as
  a dead process would. The clock restarts at every arrival because with fewer compute slots
  than workers the workers compute a period in turn: the first to reach a round waits while the
  others compute their whole periods one after another (a process waits only for the slowest
  peer's lag), though every one of them is alive.

Randomness: localclip's workers draw only from their own ``torch.Generator`` (see
:mod:`localclip.rng`), so results do not depend on how the threads interleave. torch's, NumPy's
and Python's *global* generators are shared by all threads of a process: user code that draws
from them inside :meth:`SimulatedWorld.run` gets numbers that depend on thread timing, and
``run`` warns when it sees their state changed. Such code gets correct, per-worker streams with
``concurrent=False``: the workers then take turns (one holds the baton and runs; it hands the
baton on when it waits for a collective, to the next worker that is not itself waiting for an
incomplete one), and the global generators are saved when a worker hands
the baton on and restored when it gets it back, so each worker draws exactly what a spawned
process seeded the same way would draw. Turn-taking is slower (one worker computes at a time,
with all intra-op threads). CUDA generators are never swapped: simulate on the CPU.
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from localclip import rng
from localclip.comm.base import DEFAULT_TIMEOUT, Communicator, Pending, check_timeout, use
from localclip.errors import CommunicationError, Interrupted

__all__ = ["SimulatedWorld", "SimulatedCommunicator"]


@dataclass
class _Collective:
    kind: str  # "all_reduce:sum", "all_reduce:max", "broadcast:<src>", "all_to_all" or "all_gather"
    shapes: list
    arrived: dict = field(default_factory=dict)  # rank -> tensors
    done: bool = False


class _WorkerFailed(Exception):
    """Raised in waiting workers after another worker failed (the real error is re-raised by run)."""


class SimulatedWorld:
    """A group of ``world_size`` simulated workers in one process; see the module docstring.

    Args:
        world_size: number of workers, at least 1.
        timeout: seconds a worker waits in a collective while no worker arrives at any
            collective (concurrent mode).
        concurrent: run the workers at once (default) or take turns (``False``: for worker code
            that draws from the global random generators).
        threads_per_worker: intra-op threads of each worker thread in concurrent mode (default:
            ``torch.get_num_threads() // world_size``, at least 1). Turn-taking workers use all.
        max_running: how many workers may compute at once in concurrent mode (default:
            ``torch.get_num_threads() // threads_per_worker``, at least 1).
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        concurrent: bool = True,
        threads_per_worker: int | None = None,
        max_running: int | None = None,
    ):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"Invalid world size: {world_size!r} (must be an integer >= 1)")
        if threads_per_worker is not None and (not isinstance(threads_per_worker, int) or threads_per_worker < 1):
            raise ValueError(f"Invalid threads_per_worker: {threads_per_worker!r} (must be an integer >= 1)")
        if max_running is not None and (not isinstance(max_running, int) or max_running < 1):
            raise ValueError(f"Invalid max_running: {max_running!r} (must be an integer >= 1)")
        self.max_running = max_running
        self.world_size = world_size
        self.timeout = check_timeout(timeout)
        self.concurrent = bool(concurrent)
        self.threads_per_worker = threads_per_worker
        self._cond = threading.Condition()
        self._reset()

    def _reset(self) -> None:
        self._turn = 0
        self._finished = [False] * self.world_size
        self._next_seq = [0] * self.world_size
        self._collectives: dict[int, _Collective] = {}
        self._rng: list[tuple | None] = [None] * self.world_size
        self._failure: tuple[int, BaseException] | None = None
        self._slots: threading.Semaphore | None = None
        self._running = [False] * self.world_size  # which workers hold a compute slot
        self._last_arrival = time.monotonic()  # the timeout counts from here (concurrent mode)
        self._waiting_on: list[_Collective | None] = [None] * self.world_size  # turn-taking

    def communicator(self, rank: int) -> "SimulatedCommunicator":
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Invalid rank: {rank} (world size {self.world_size})")
        return SimulatedCommunicator(self, rank)

    def run(self, fn: Callable[..., object], *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` once per worker, each in its own thread with its own
        communicator installed (see :func:`localclip.comm.current`); return the results by rank.

        If a worker raises, the others are released from their collectives and the first
        failing worker's exception is re-raised here, its message prefixed with its rank.
        """
        self._reset()
        results: list = [None] * self.world_size
        caller_threads = torch.get_num_threads()
        threads = self.threads_per_worker or max(1, caller_threads // self.world_size)
        before = rng.global_state() if self.concurrent else None
        if self.concurrent:
            self._slots = threading.Semaphore(self.max_running or max(1, caller_threads // threads))

        def worker(rank: int) -> None:
            use(self.communicator(rank))
            try:
                if self.concurrent:
                    # Per calling thread under OpenMP: each worker gets its own team.
                    torch.set_num_threads(threads)
                    self._take_slot(rank)
                else:
                    self._acquire(rank)
                results[rank] = fn(*args, **kwargs)
            except _WorkerFailed:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                self._fail(rank, exc)
            finally:
                use(None)
                self._give_slot(rank)
                self._finish(rank)

        workers = [
            threading.Thread(target=worker, args=(r,), name=f"localclip-sim-{r}", daemon=True)
            for r in range(self.world_size)
        ]
        try:
            for t in workers:
                t.start()
            for t in workers:
                # Short joins keep the main thread responsive to KeyboardInterrupt.
                while t.is_alive():
                    t.join(0.1)
        except BaseException as exc:
            # Interrupted: release the workers from their collectives before leaving.
            self._fail(-1, exc)
            raise
        finally:
            torch.set_num_threads(caller_threads)
        if self._failure is not None:
            rank, exc = self._failure
            # Every worker stops at the same step on a stop request: its message needs no rank.
            if rank >= 0 and len(exc.args) <= 1 and not str(exc).startswith(f"rank {rank}") and not isinstance(exc, Interrupted):
                exc.args = (f"rank {rank}: {exc}",)
            raise exc
        if before is not None and rng.global_state() != before:
            warnings.warn(
                "worker code drew from torch's, NumPy's or Python's global random generator while the "
                "simulated workers ran concurrently, so those draws depend on thread timing; use a "
                "torch.Generator per worker (localclip.rng) or SimulatedWorld(..., concurrent=False)",
                RuntimeWarning,
                stacklevel=2,
            )
        return results

    def _fail(self, rank: int, exc: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = (rank, exc)
            self._cond.notify_all()

    def _take_slot(self, rank: int) -> None:
        while not self._slots.acquire(timeout=1.0):
            self._check_failure()
        self._running[rank] = True

    def _give_slot(self, rank: int) -> None:
        if self._running[rank]:
            self._running[rank] = False
            self._slots.release()

    # -- turn-taking (concurrent=False) ------------------------------------------------------

    def _acquire(self, rank: int) -> None:
        """Block until it is ``rank``'s turn, then restore its random streams."""
        with self._cond:
            while self._turn != rank:
                self._check_failure()
                self._cond.wait(1.0)
        state = self._rng[rank]
        if state is not None:
            torch.set_rng_state(state[0])
            np.random.set_state(state[1])
            random.setstate(state[2])

    def _pass_on(self, rank: int) -> None:
        """Save ``rank``'s random streams and hand the baton to the next unfinished worker (in
        rank order, after ``rank``) that is not waiting for an incomplete collective."""
        self._rng[rank] = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        with self._cond:
            order = [(rank + k) % self.world_size for k in range(1, self.world_size + 1)]
            alive = [r for r in order if not self._finished[r]]
            runnable = [r for r in alive if self._waiting_on[r] is None or self._waiting_on[r].done]
            if alive and not runnable and self._failure is None:
                # Every worker waits for a collective that only a running worker could complete.
                waits = {r: self._waiting_on[r].kind for r in alive}
                self._failure = (rank, CommunicationError(
                    f"simulated workers deadlocked: every worker waits for an incomplete collective {waits}"
                ))
            if runnable or alive:
                self._turn = (runnable or alive)[0]
            self._cond.notify_all()

    def _check_failure(self) -> None:
        if self._failure is not None:
            raise _WorkerFailed()

    def _finish(self, rank: int) -> None:
        with self._cond:
            self._finished[rank] = True
            waiting = [c for c in self._collectives.values() if not c.done and rank not in c.arrived]
            if waiting and self._failure is None:
                self._failure = (
                    rank,
                    CommunicationError(
                        f"simulated rank {rank} finished while ranks {sorted(waiting[0].arrived)} "
                        f"wait for it in a collective ({waiting[0].kind})"
                    ),
                )
            self._cond.notify_all()
        if not self.concurrent and self._turn == rank:
            self._pass_on(rank)

    # -- collectives -------------------------------------------------------------------------

    def collective(self, rank: int, kind: str, tensors: list[torch.Tensor], clock: Callable[[], float] = time.perf_counter) -> float:
        """Take part in the next collective; returns the seconds (of ``clock``) spent waiting for the others."""
        seq, coll = self.arrive(rank, kind, tensors)
        return self.await_(rank, seq, coll, clock)

    def arrive(self, rank: int, kind: str, tensors: list[torch.Tensor]) -> tuple[int, _Collective]:
        """Deposit ``tensors`` for ``rank``'s next collective and return at once (the start of a
        non-blocking collective). The last worker to arrive completes it for everyone."""
        # An all-to-all's pieces may differ in size between pairs: checked when it completes.
        shapes = [len(tensors)] if kind == "all_to_all" else [(t.shape, t.dtype) for t in tensors]
        with self._cond:
            self._check_failure()
            seq = self._next_seq[rank]
            self._next_seq[rank] += 1
            coll = self._collectives.setdefault(seq, _Collective(kind, shapes))
            if coll.kind != kind or coll.shapes != shapes:
                first = min(coll.arrived) if coll.arrived else "?"
                raise CommunicationError(
                    f"simulated collective #{seq} mismatch: rank {rank} called {kind} on {shapes}, "
                    f"rank {first} called {coll.kind} on {coll.shapes}"
                )
            coll.arrived[rank] = tensors
            self._last_arrival = time.monotonic()
            gone = [r for r in range(self.world_size) if self._finished[r] and r not in coll.arrived]
            if gone:
                # A peer that has returned will never arrive: fail now, not after the timeout.
                error = CommunicationError(
                    f"simulated rank {gone[0]} finished while ranks {sorted(coll.arrived)} wait for it in a collective ({kind})"
                )
                if self._failure is None:
                    self._failure = (gone[0], error)
                self._cond.notify_all()
                raise error
            if len(coll.arrived) == self.world_size:
                # The last to arrive reduces; the others wait for exactly this (or compute on).
                try:
                    self._complete(coll)
                except CommunicationError as exc:
                    if self._failure is None:
                        self._failure = (rank, exc)
                    raise
                finally:
                    self._cond.notify_all()
                del self._collectives[seq]
        return seq, coll

    def await_(self, rank: int, seq: int, coll: _Collective, clock: Callable[[], float] = time.perf_counter) -> float:
        """Block until collective ``seq`` (which ``rank`` has arrived at) is complete; returns the
        seconds (of ``clock``) spent waiting. Concurrent: fails once no worker has arrived at any
        collective for the timeout.
        Turn-taking: hands the baton to the next worker that can run."""
        if coll.done:
            return 0.0
        start = clock()
        if self.concurrent:
            self._wait_concurrent(rank, seq, coll)
        else:
            with self._cond:
                self._waiting_on[rank] = coll
            self._pass_on(rank)
            with self._cond:
                while not (coll.done and self._turn == rank):
                    self._check_failure()
                    self._cond.wait(1.0)
                self._waiting_on[rank] = None
            self._acquire(rank)
        return clock() - start

    def _wait_concurrent(self, rank: int, seq: int, coll: _Collective) -> None:
        self._give_slot(rank)  # a waiting worker lets another compute
        try:
            with self._cond:
                while not coll.done:
                    self._check_failure()
                    left = self._last_arrival + self.timeout - time.monotonic()
                    if left <= 0:
                        missing = sorted(set(range(self.world_size)) - set(coll.arrived))
                        raise CommunicationError(
                            f"rank {rank}: simulated collective #{seq} ({coll.kind}) did not complete within the "
                            f"{self.timeout:g}s collective timeout: ranks {missing} did not arrive"
                        )
                    self._cond.wait(min(left, 1.0))
        finally:
            self._take_slot(rank)

    @staticmethod
    @torch.no_grad()
    def _complete(coll: _Collective) -> None:
        by_rank = [coll.arrived[r] for r in sorted(coll.arrived)]
        op, _, arg = coll.kind.partition(":")
        world = len(by_rank)
        if op == "all_to_all":
            # by_rank[i] = send_i (world tensors) + recv_i (world tensors): recv_j[i] <- send_i[j].
            for i in range(world):
                for j in range(world):
                    src, dst = by_rank[i][j], by_rank[j][world + i]
                    if src.numel() != dst.numel() or src.dtype != dst.dtype:
                        raise CommunicationError(
                            f"simulated all_to_all mismatch: rank {i} sends {src.numel()} {src.dtype} element(s) to "
                            f"rank {j}, which expects {dst.numel()} {dst.dtype}"
                        )
            pieces = [[by_rank[i][j].clone() for j in range(world)] for i in range(world)]  # send may alias recv
            for i in range(world):
                for j in range(world):
                    by_rank[j][world + i].copy_(pieces[i][j].reshape(by_rank[j][world + i].shape))
            coll.done = True
            return
        if op == "all_gather":
            # by_rank[i] = [tensor_i] + out_i (world tensors): out_j[i] <- tensor_i.
            sent = [tensors[0].clone() for tensors in by_rank]
            for tensors in by_rank:
                for i in range(world):
                    tensors[1 + i].copy_(sent[i])
            coll.done = True
            return
        for i in range(len(by_rank[0])):
            if op == "broadcast":
                result = by_rank[int(arg)][i].clone()
            else:
                result = by_rank[0][i].clone()
                for tensors in by_rank[1:]:
                    if arg == "sum":
                        result.add_(tensors[i])
                    else:
                        torch.maximum(result, tensors[i], out=result)
            for tensors in by_rank:
                tensors[i].copy_(result)
        coll.done = True


class SimulatedCommunicator(Communicator):
    """Worker ``rank``'s handle on a :class:`SimulatedWorld`."""

    def __init__(self, world: SimulatedWorld, rank: int):
        self.world, self.rank = world, rank
        self.world_size, self.timeout = world.world_size, world.timeout
        self.waited = 0.0
        if world.concurrent:
            # Wall-clock time of a thread that shares the cores with N-1 others overstates its
            # compute about N/cores-fold; its own CPU time does not (waits cost none).
            self.clock = time.thread_time

    # Time spent waiting for the other simulated workers is their compute (or their turns), not
    # communication: it is left out of ``seconds``.
    def _all_reduce(self, tensors, op, then):
        self.waited += self.world.collective(self.rank, f"all_reduce:{op}", tensors, self.clock)
        if then is not None:
            for t in tensors:
                then(t)

    def _broadcast(self, tensors, src):
        self.waited += self.world.collective(self.rank, f"broadcast:{src}", tensors, self.clock)

    # Non-blocking: deposit the tensors now (the last worker to arrive completes the collective,
    # writing every worker's results), wait for completion in Pending.wait.
    def _start(self, kind: str, tensors: list[torch.Tensor], what: str):
        seq, coll = self.world.arrive(self.rank, kind, tensors)
        return Pending(self, what, wait=lambda: self.world.await_(self.rank, seq, coll, self.clock), poll=lambda: coll.done)

    def _start_all_reduce(self, tensors, op, what):
        return self._start(f"all_reduce:{op}", tensors, what)

    def _start_all_to_all(self, send, recv, what):
        return self._start("all_to_all", send + recv, what)

    def _start_all_gather(self, tensor, out, what):
        return self._start("all_gather", [tensor, *out], what)
