"""N workers simulated in one process, running the same algorithm code as real processes.

Each simulated worker is a thread, and the threads take turns: exactly one holds the baton and
runs, the others wait. A worker hands the baton on when it enters a collective, so worker 0 runs
until its first collective, then worker 1, and so on; the last worker to arrive performs the
reduction (in rank order, so results are deterministic) and carries on. Between collectives a
worker therefore computes exactly as a separate process would, with two consequences:

* blocking collectives need no special casing in the algorithms (same code as over gloo);
* each worker gets its own random streams: the process-wide torch, NumPy and Python generators are
  saved when a worker hands the baton on and restored when it gets it back, so a simulated worker
  draws the same dropout masks as a spawned process seeded the same way.

Only one worker computes at a time, so every op may use all intra-op threads of the machine.
CUDA generators are not swapped: simulate on the CPU, or accept shared CUDA random streams.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from localclip.comm.base import DEFAULT_TIMEOUT, Communicator, check_timeout, use
from localclip.errors import CommunicationError

__all__ = ["SimulatedWorld", "SimulatedCommunicator"]


@dataclass
class _Collective:
    kind: str  # "all_reduce:sum", "all_reduce:max" or "broadcast:<src>"
    shapes: list
    arrived: dict = field(default_factory=dict)  # rank -> tensors
    done: bool = False


class _WorkerFailed(Exception):
    """Raised in waiting workers after another worker failed (the real error is re-raised by run)."""


class SimulatedWorld:
    """A group of ``world_size`` simulated workers that take turns in one process."""

    def __init__(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT):
        if world_size < 1:
            raise ValueError(f"Invalid world size: {world_size} (must be >= 1)")
        self.world_size = world_size
        self.timeout = check_timeout(timeout)
        self._cond = threading.Condition()
        self._turn = 0
        self._finished = [False] * world_size
        self._next_seq = [0] * world_size
        self._collectives: dict[int, _Collective] = {}
        self._rng: list[tuple | None] = [None] * world_size
        self._failure: tuple[int, BaseException] | None = None

    def communicator(self, rank: int) -> "SimulatedCommunicator":
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Invalid rank: {rank} (world size {self.world_size})")
        return SimulatedCommunicator(self, rank)

    def run(self, fn: Callable[..., object], *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` once per worker, each in its own thread with its own
        communicator installed (see :func:`localclip.comm.current`); return the results by rank.

        If a worker raises, the others are stopped at their next collective and the first
        worker's exception is re-raised here.
        """
        results: list = [None] * self.world_size

        def worker(rank: int) -> None:
            use(self.communicator(rank))
            try:
                self._acquire(rank)
                results[rank] = fn(*args, **kwargs)
            except _WorkerFailed:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                with self._cond:
                    if self._failure is None:
                        self._failure = (rank, exc)
                    self._cond.notify_all()
            finally:
                use(None)
                self._finish(rank)

        threads = [
            threading.Thread(target=worker, args=(r,), name=f"localclip-sim-{r}", daemon=True)
            for r in range(self.world_size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            # Short joins keep the main thread responsive to KeyboardInterrupt.
            while t.is_alive():
                t.join(0.1)
        if self._failure is not None:
            raise self._failure[1]
        return results

    # -- the baton ---------------------------------------------------------------------------

    def _acquire(self, rank: int) -> None:
        """Block until it is ``rank``'s turn, then restore its random streams."""
        with self._cond:
            self._wait_until(rank, lambda: self._turn == rank, "its turn")
        state = self._rng[rank]
        if state is not None:
            torch.set_rng_state(state[0])
            np.random.set_state(state[1])
            random.setstate(state[2])

    def _pass_on(self, rank: int) -> None:
        """Save ``rank``'s random streams and hand the baton to the next unfinished worker."""
        self._rng[rank] = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        with self._cond:
            alive = [r for r in range(self.world_size) if not self._finished[r]]
            later = [r for r in alive if r > rank]
            if later or alive:
                self._turn = (later or alive)[0]
            self._cond.notify_all()

    def _wait_until(self, rank: int, ready: Callable[[], bool], what: str) -> None:
        # No timeout here: while one worker holds the baton the others must wait however long it
        # computes (an evaluation, a checkpoint). A simulated world cannot hang silently anyway:
        # a worker that leaves early or calls a different collective is reported as an error.
        while not ready():
            if self._failure is not None:
                raise _WorkerFailed()
            self._cond.wait(1.0)

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
        if self._turn == rank:
            self._pass_on(rank)
        else:
            with self._cond:
                self._cond.notify_all()

    # -- collectives -------------------------------------------------------------------------

    def collective(self, rank: int, kind: str, tensors: list[torch.Tensor]) -> float:
        """Take part in the next collective; returns the seconds spent waiting for the others."""
        seq = self._next_seq[rank]
        self._next_seq[rank] += 1
        shapes = [(t.shape, t.dtype) for t in tensors]
        coll = self._collectives.setdefault(seq, _Collective(kind, shapes))
        if coll.kind != kind or coll.shapes != shapes:
            first = min(coll.arrived) if coll.arrived else "?"
            raise CommunicationError(
                f"simulated collective #{seq} mismatch: rank {rank} called {kind} on {shapes}, "
                f"rank {first} called {coll.kind} on {coll.shapes}"
            )
        coll.arrived[rank] = tensors
        if len(coll.arrived) == self.world_size:
            self._complete(coll)
            del self._collectives[seq]
            return 0.0
        start = time.perf_counter()
        self._pass_on(rank)
        with self._cond:
            self._wait_until(rank, lambda: coll.done and self._turn == rank, f"collective #{seq} ({kind})")
        self._acquire(rank)
        return time.perf_counter() - start

    @staticmethod
    @torch.no_grad()
    def _complete(coll: _Collective) -> None:
        by_rank = [coll.arrived[r] for r in sorted(coll.arrived)]
        op, _, arg = coll.kind.partition(":")
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

    # Time spent waiting for the other simulated workers' turns is their compute, not
    # communication: it is left out of ``seconds``.
    def _all_reduce(self, tensors, op, then):
        self.waited += self.world.collective(self.rank, f"all_reduce:{op}", tensors)
        if then is not None:
            for t in tensors:
                then(t)

    def _broadcast(self, tensors, src):
        self.waited += self.world.collective(self.rank, f"broadcast:{src}", tensors)
