"""Fault-tolerant rounds over torchft: a worker's communicator and membership on torchft's Manager.

Each worker is its own torchft replica group (``replica_id`` = its rank) with a
``torchft.Manager`` over torchft's reconfigurable gloo process group, synchronous quorums
(``use_async_quorum=False``: a joiner's state is loaded before the round's transport starts) and
torchft's HTTP checkpoint transport. The lighthouse that forms the quorums is torchft's own
(:func:`start_lighthouse` starts one in this process for a run on one machine). The rules a
round follows are :mod:`localclip.comm.membership`'s (docs/algorithm.md, "When workers leave
and rejoin"); here they become:

* a round is ``start_quorum`` (the live workers; a worker that is behind heals there, from a
  live peer through the checkpoint transport), the averager's weighted all-reduce over the
  quorum's process group (a healing worker sends weight 0), and ``should_commit``; a round
  that does not commit is discarded by the averager (:meth:`PeriodicAverager.use_membership`);
* every worker starts with :meth:`FaultTolerantMembership.join`: a round at which a fresh run's
  workers, all at torchft step 0 with the same seeded model, send nothing, and a late or
  restarted worker heals and receives the round's average, so that it computes its first step
  from the live workers' model and counters.

Only torchft's Manager and process group are used (this module and the launcher are the only
places that touch a process group); no torchft training wrapper is.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable

import torch

from localclip.comm.base import DEFAULT_TIMEOUT, Communicator, SingleProcess, check_timeout
from localclip.comm.membership import Members, Membership
from localclip.errors import CommunicationError

__all__ = ["FaultTolerantCommunicator", "FaultTolerantMembership", "available", "start_lighthouse"]


def available() -> str | None:
    """None if torchft can be imported, else why not (one line)."""
    # torchft's Rust side logs every quorum at INFO to stderr unless told otherwise (read once,
    # when torchft is first imported); a user's own RUST_LOG wins.
    os.environ.setdefault("RUST_LOG", "error")
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return f"torchft is not installed (pip install 'localclip[ft]'): {exc}"
    return None


def start_lighthouse(min_replicas: int = 1, *, join_timeout: float = 1.0, heartbeat_timeout: float = 5.0):
    """torchft's lighthouse on a free port of this machine; ``.address()`` is what the workers
    pass, ``.shutdown()`` stops it. A quorum forms once ``min_replicas`` workers ask and, after
    ``join_timeout`` seconds, without those that have not asked; a worker whose heartbeats stop
    for ``heartbeat_timeout`` seconds is out of the next quorum."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=int(join_timeout * 1000),
                            heartbeat_timeout_ms=int(heartbeat_timeout * 1000))


class FaultTolerantCommunicator(Communicator):
    """Worker ``rank``'s collectives over its membership's current quorum.

    Collectives run only inside a round (between the membership's ``begin_round`` and
    ``commit``): outside one a fault-tolerant group has no fixed members. ``broadcast`` is the
    identity: every worker builds the same initial model from the run's seed, and a joiner takes
    its state by healing, so the broadcast that starts a fixed group has nothing to do here.
    """

    def __init__(self, membership: "FaultTolerantMembership", rank: int, world_size: int, timeout: float):
        self.membership, self.rank, self.world_size, self.timeout = membership, rank, world_size, timeout
        self.waited = 0.0
        # What shares this worker's records, evaluations, checkpoints and stop requests: the
        # worker alone (localclip.train.Trainer reads it), as the group changes between rounds.
        self.control = SingleProcess()

    def _all_reduce(self, tensors, op, then):
        from torch.distributed import ReduceOp

        manager = self.membership.manager
        if not self.membership.in_round:
            raise CommunicationError(f"rank {self.rank}: a fault-tolerant group all-reduces only inside a round (between begin_round and commit)")
        reduce_op = ReduceOp.SUM if op == "sum" else ReduceOp.MAX
        works = [manager.allreduce(t, reduce_op=reduce_op) for t in tensors]
        # Each tensor's ``then`` as soon as it is reduced (the work on the first sums overlaps the
        # transport of the rest), until a failure: what it wrote then is undone with the round.
        for t, work in zip(tensors, works):
            work.wait()
            if then is not None and manager.errored() is None:
                then(t)
        error = manager.errored()
        if error is not None:
            raise CommunicationError(f"rank {self.rank}: a round's all-reduce failed, a peer is gone: {_first_line(error)}")

    def _broadcast(self, tensors, src):
        return None


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "original_exception", exc)) or type(exc).__name__
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class FaultTolerantMembership(Membership):
    """Worker ``rank`` of ``world_size`` as torchft replica group ``rank``; see the module docstring.

    Args:
        rank, world_size: this worker's index and the number of workers the run plans (data
            shards are by rank); a round averages over whoever of them is live.
        lighthouse: the torchft lighthouse's address (``start_lighthouse().address()``).
        timeout: seconds a collective, a commit or a heal may take.
        quorum_timeout: seconds a worker waits for a quorum (at least the time the others need
            to reach the round: a period of local steps).
        hostname: the name the other workers reach this one's checkpoint server at.

    ``communicator`` is the worker's :class:`FaultTolerantCommunicator`: build the algorithm
    over it (``group=``), :meth:`attach` what a joiner copies, hand this to the averager
    (:meth:`PeriodicAverager.use_membership`), then call :meth:`join` before the first step.
    """

    can_fail = True

    def __init__(self, rank: int, world_size: int, lighthouse: str, *, timeout: float = DEFAULT_TIMEOUT,
                 quorum_timeout: float | None = None, hostname: str = "localhost"):
        reason = available()
        if reason is not None:
            raise CommunicationError(reason)
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo

        logging.getLogger("torchft").setLevel(logging.ERROR)
        self.rank, self.world_size, self.lighthouse = rank, world_size, lighthouse
        self.timeout = check_timeout(timeout)
        quorum = datetime.timedelta(seconds=check_timeout(quorum_timeout if quorum_timeout is not None else timeout))
        self.communicator = FaultTolerantCommunicator(self, rank, world_size, self.timeout)
        self._state_dict = self._load_state_dict = None
        self.in_round = False
        self._healed = False
        self._joining = False
        span = datetime.timedelta(seconds=self.timeout)
        # The replica group's own store (one process per group: this one), on a free port.
        self._store = dist.TCPStore(hostname, 0, 1, is_master=True, wait_for_workers=False, timeout=span)
        try:
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=span), load_state_dict=self._load, state_dict=self._save, min_replica_size=1,
                use_async_quorum=False, init_sync=False, timeout=span, quorum_timeout=quorum, connect_timeout=span,
                rank=0, world_size=1, store_addr=hostname, store_port=self._store.port, lighthouse_addr=lighthouse,
                replica_id=f"localclip_{rank}", port=0, hostname=hostname,
            )
        except Exception as exc:  # noqa: BLE001 - torchft's errors carry Rust tracebacks: one line instead
            raise CommunicationError(f"rank {rank}: cannot reach the torchft lighthouse at {lighthouse}: {_first_line(exc)}") from None

    # What torchft's checkpoint transport sends and loads: the caller's state, copied when a peer
    # asks (the round's transport scales the live values in place while the joiner reads).
    def _save(self) -> dict:
        if self._state_dict is None:
            raise RuntimeError("FaultTolerantMembership: call attach(state_dict, load_state_dict) before the first round")
        return _cloned(self._state_dict())

    def _load(self, state: dict) -> None:
        self._load_state_dict(state)
        self._healed = True

    def begin_round(self, step: int, last_round: int) -> Members:
        self._healed = False
        try:
            self.manager.start_quorum()
        except Exception as exc:  # noqa: BLE001
            raise CommunicationError(f"rank {self.rank}: no quorum from the torchft lighthouse at {self.lighthouse}: {_first_line(exc)}") from None
        self.in_round = True
        quorum = self.manager.num_participants()
        if self._joining and not self._healed and self.manager.current_step() == 0:
            # A fresh run: every worker of the quorum is at step 0 with the same seeded model.
            return Members(quorum, False, skip=True)
        return Members(quorum, not self._healed, self._healed)

    def commit(self, error: BaseException | None = None) -> bool:
        try:
            return bool(self.manager.should_commit())
        except Exception as exc:  # noqa: BLE001
            raise CommunicationError(f"rank {self.rank}: the round's commit failed: {_first_line(exc)}") from None
        finally:
            self.in_round = False

    def join(self, averager) -> bool:
        """The first round of this worker (before its first step): heals it if the run is under
        way. Returns whether it healed."""
        self._joining = True
        try:
            averager.average(force=True)
        finally:
            self._joining = False
        return self._healed

    @property
    def committed_rounds(self) -> int:
        """torchft's step: the rounds committed so far (the join round included)."""
        return self.manager.current_step()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _cloned(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cloned(v) for v in state)
    return state
