"""The communicator interface: the only collectives the algorithms may use.

CELGC needs very little from the network: an all-reduce (sum or max) of a few tensors and a
broadcast from rank 0. Low-bit averaging (:mod:`localclip.averaging.codecs.lowbit`) adds an all-to-all and an
all-gather of raw buffers, so that the sum happens in float32 on the receiving worker rather than
in the wire format. Keeping the interface this small lets one algorithm implementation run over
a real `torch.distributed` process group and over N workers simulated in one process.

Every collective is bounded by the communicator's timeout: a dead or stuck peer raises
:class:`~localclip.errors.CommunicationError` naming the rank instead of hanging. The
``start_*`` forms return a :class:`Pending` handle at once, so that a worker can keep computing
while the collective travels and apply its result later (:meth:`Pending.wait`); the plain forms
are ``start_*(...).wait()`` (all-reduce keeps its own blocking path, with ``then``). The bytes a
collective puts on the wire follow from its tensors: an all-to-all sends ``send[j]`` to each
peer ``j != rank``, an all-gather sends ``tensor`` to each of the ``world_size - 1`` peers.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Sequence

import torch

from localclip.errors import CommunicationError

__all__ = ["Communicator", "Pending", "SingleProcess", "current", "install", "register_fallback", "use"]

DEFAULT_TIMEOUT = 300.0
_REDUCE_OPS = ("sum", "max")


class Pending:
    """A collective that was started and whose result is not yet guaranteed.

    Its tensors belong to the collective until :meth:`wait` returns: reading them gives
    unspecified values, writing them corrupts the result (over gloo, the transport reads and
    writes them from its own threads meanwhile). Start collectives in the same order on every
    worker, as for blocking ones; several may be pending at once. Wait for every started
    collective before the group is shut down.
    """

    def __init__(
        self,
        comm: "Communicator",
        what: str,
        wait: Callable[[], float | None] | None = None,
        poll: Callable[[], bool] | None = None,
    ):
        self.comm, self.what = comm, what
        self._wait, self._poll = wait, poll
        self._error: BaseException | None = None
        self._done = wait is None

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return at once (never blocks)."""
        return self._done or (self._poll is not None and bool(self._poll()))

    def wait(self) -> None:
        """Block until the collective's results are in its tensors.

        Bounded by the communicator's timeout, counted from this call: a peer that does not take
        part raises :class:`~localclip.errors.CommunicationError` naming this rank. The time spent
        here is communication the local work did not hide (:attr:`Communicator.seconds`).
        Waiting again is a no-op (or raises the same error again).
        """
        if self._error is not None:
            raise self._error
        if self._done:
            return
        comm = self.comm
        start = comm.clock()
        try:
            waited = self._wait() or 0.0
        except BaseException as exc:
            self._error = exc
            comm._busy += comm.clock() - start
            raise
        comm._busy += comm.clock() - start
        comm.waited += waited
        self._done = True

    def __repr__(self) -> str:
        return f"Pending({self.what!r}, completed={self._done})"


class Communicator(abc.ABC):
    """A group of ``world_size`` workers; this object is worker ``rank``'s handle on it.

    Attributes:
        rank: this worker's index in ``[0, world_size)``.
        world_size: number of workers in the group.
        timeout: seconds a collective may wait for its peers before it fails.
    """

    rank: int
    world_size: int
    timeout: float
    waited: float = 0.0  # seconds inside collectives that were not communication (simulation)
    _busy: float = 0.0
    # What a worker's time is measured with: wall-clock for a process; a concurrent simulated
    # worker shares the cores with the others, so it counts its own thread's CPU time instead.
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    @property
    def seconds(self) -> float:
        """Seconds (of :attr:`clock`) spent communicating in collectives so far."""
        return self._busy - self.waited

    def all_reduce(
        self, tensors: Sequence[torch.Tensor], op: str = "sum", *, then: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        """Reduce each tensor elementwise across workers, in place, on every worker.

        One call is one collective however many tensors it carries: implementations issue them
        all before waiting on any. ``then(tensor)`` is called on each tensor, in order, as soon
        as that tensor is reduced, so that local work on the first results overlaps the
        transport of the rest (its time is not counted as communication).
        """
        if op not in _REDUCE_OPS:
            raise ValueError(f"Invalid reduce op: {op!r} (expected one of {_REDUCE_OPS})")
        tensors = list(tensors)
        if self.world_size == 1 or not tensors:
            if then is not None:
                for t in tensors:
                    then(t)
            return
        local = 0.0

        clock = self.clock

        def timed_then(t: torch.Tensor) -> None:
            nonlocal local
            start = clock()
            then(t)
            local += clock() - start

        start = clock()
        try:
            self._all_reduce(tensors, op, timed_then if then is not None else None)
        finally:
            self._busy += clock() - start - local

    def start_all_reduce(self, tensors: Sequence[torch.Tensor], op: str = "sum") -> Pending:
        """Start :meth:`all_reduce` of ``tensors`` without waiting; see :class:`Pending`.

        The result has the same bits as the blocking form (sums in rank order, as the blocking
        form adds them).
        """
        if op not in _REDUCE_OPS:
            raise ValueError(f"Invalid reduce op: {op!r} (expected one of {_REDUCE_OPS})")
        tensors = list(tensors)
        what = f"all_reduce({op}) of {len(tensors)} tensor(s)"
        if self.world_size == 1 or not tensors:
            return Pending(self, what)
        return self._timed_start(lambda: self._start_all_reduce(tensors, op, what))

    def all_to_all(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> None:
        """Send ``send[j]`` to worker ``j`` and receive worker ``i``'s ``send[rank]`` into ``recv[i]``.

        ``send`` and ``recv`` hold ``world_size`` tensors each, all of one dtype; ``recv[i]`` must
        have as many elements as worker ``i``'s ``send[rank]`` (sizes may differ between pairs).
        ``recv[rank]`` gets a copy of ``send[rank]``. Bytes on the wire from this worker:
        ``sum(send[j].nbytes for j != rank)``.
        """
        self.start_all_to_all(send, recv).wait()

    def start_all_to_all(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]) -> Pending:
        """Start :meth:`all_to_all` without waiting; see :class:`Pending`."""
        send, recv = list(send), list(recv)
        if len(send) != self.world_size or len(recv) != self.world_size:
            raise ValueError(
                f"all_to_all needs world_size={self.world_size} send and recv tensors, got {len(send)} and {len(recv)}"
            )
        dtypes = {t.dtype for t in send + recv}
        if len(dtypes) != 1:
            raise ValueError(f"all_to_all tensors must share one dtype, got {sorted(map(str, dtypes))}")
        if recv[self.rank].numel() != send[self.rank].numel():
            raise ValueError(
                f"all_to_all: recv[{self.rank}] has {recv[self.rank].numel()} elements but send[{self.rank}] "
                f"has {send[self.rank].numel()}"
            )
        what = f"all_to_all of {sum(t.numel() for t in send)} element(s)"
        if self.world_size == 1:
            recv[0].copy_(send[0].reshape(recv[0].shape))
            return Pending(self, what)
        return self._timed_start(lambda: self._start_all_to_all(send, recv, what))

    def all_gather(self, tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> None:
        """Receive every worker's ``tensor`` into ``out``, by rank (``out[rank]`` gets a copy of this
        worker's). ``out`` holds ``world_size`` tensors of ``tensor``'s shape and dtype, the same on
        every worker. Bytes on the wire from this worker: ``tensor.nbytes * (world_size - 1)``.
        """
        self.start_all_gather(tensor, out).wait()

    def start_all_gather(self, tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> Pending:
        """Start :meth:`all_gather` without waiting; see :class:`Pending`."""
        out = list(out)
        if len(out) != self.world_size:
            raise ValueError(f"all_gather needs world_size={self.world_size} output tensors, got {len(out)}")
        for j, o in enumerate(out):
            if o.shape != tensor.shape or o.dtype != tensor.dtype:
                raise ValueError(
                    f"all_gather: out[{j}] is {tuple(o.shape)} {o.dtype}, the tensor {tuple(tensor.shape)} {tensor.dtype}"
                )
        what = f"all_gather of {tensor.numel()} element(s)"
        if self.world_size == 1:
            out[0].copy_(tensor)
            return Pending(self, what)
        return self._timed_start(lambda: self._start_all_gather(tensor, out, what))

    def _timed_start(self, start_fn: Callable[[], Pending]) -> Pending:
        start = self.clock()
        try:
            return start_fn()
        finally:
            self._busy += self.clock() - start

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite each tensor, on every worker, with worker ``src``'s copy."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"Invalid broadcast source rank: {src} (world size {self.world_size})")
        tensors = list(tensors)
        if self.world_size == 1 or not tensors:
            return
        start = self.clock()
        try:
            self._broadcast(tensors, src)
        finally:
            self._busy += self.clock() - start

    def barrier(self) -> None:
        """Wait until every worker has reached this point."""
        self.all_reduce([torch.zeros(1)])

    @abc.abstractmethod
    def _all_reduce(self, tensors: list[torch.Tensor], op: str, then: Callable[[torch.Tensor], None] | None) -> None:
        """Reduce ``tensors`` in place, calling ``then`` (if given) on each once it is reduced."""

    @abc.abstractmethod
    def _broadcast(self, tensors: list[torch.Tensor], src: int) -> None: ...

    # The non-blocking collectives: each runtime implements them (world_size > 1 only; the
    # arguments are checked). A communicator without them refuses the start_* forms.
    def _start_all_reduce(self, tensors: list[torch.Tensor], op: str, what: str) -> Pending:
        raise NotImplementedError(f"{type(self).__name__} has no non-blocking all_reduce")

    def _start_all_to_all(self, send: list[torch.Tensor], recv: list[torch.Tensor], what: str) -> Pending:
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all")

    def _start_all_gather(self, tensor: torch.Tensor, out: list[torch.Tensor], what: str) -> Pending:
        raise NotImplementedError(f"{type(self).__name__} has no all_gather")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


class SingleProcess(Communicator):
    """A world of one worker: every collective is the identity."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.timeout = 0, 1, DEFAULT_TIMEOUT

    def _all_reduce(self, tensors, op, then):  # pragma: no cover - world_size 1 never gets here
        raise AssertionError("unreachable")

    def _broadcast(self, tensors, src):  # pragma: no cover
        raise AssertionError("unreachable")


_SINGLE = SingleProcess()


# Where each runtime installs the communicator of the code it runs, and the one place that reads
# it (current()). Simulated workers are threads of one process, so they install per thread
# (use); a torch.distributed worker is a whole process (install). Nothing here imports a runtime:
# the torch.distributed module registers a fallback for groups that users set up themselves.
_local = threading.local()
_process: Communicator | None = None
_fallbacks: list[Callable[[], Communicator | None]] = []
_lock = threading.Lock()


def use(comm: Communicator | None) -> None:
    """Make ``comm`` the communicator that :func:`current` returns in this thread (simulation)."""
    _local.comm = comm


def install(comm: Communicator | None) -> None:
    """Make ``comm`` the communicator of this whole process (a ``torch.distributed`` worker)."""
    global _process
    _process = comm


def register_fallback(factory: Callable[[], Communicator | None]) -> None:
    """Register ``factory``, asked (once, on first need) for a communicator when none is installed."""
    _fallbacks.append(factory)


def current() -> Communicator:
    """The communicator of the calling worker; the same object for the worker's whole life.

    In order: the one installed for this thread (a simulated worker), else the one installed
    for this process (a ``torch.distributed`` worker), else one a registered fallback builds
    and installs (a ``torch.distributed`` group the user initialised directly), else a world
    of one.
    """
    comm = getattr(_local, "comm", None)
    if comm is not None:
        return comm
    if _process is not None:
        return _process
    with _lock:
        if _process is None:
            for factory in _fallbacks:
                comm = factory()
                if comm is not None:
                    install(comm)
                    return comm
            return _SINGLE
        return _process


def check_timeout(timeout: float) -> float:
    if not timeout > 0:
        raise ValueError(f"Invalid collective timeout: {timeout} (must be > 0 seconds)")
    return float(timeout)


def timeout_error(what: str, timeout: float, rank: int, cause: BaseException | None = None):
    """The error of a collective that timed out or lost a peer, naming which of the two."""
    text = f"{type(cause).__name__}: {cause}" if cause is not None else ""
    if cause is None or isinstance(cause, TimeoutError) or "timed out" in text.lower() or "timeout" in text.lower():
        msg = f"rank {rank}: {what} did not complete within the {timeout:g}s collective timeout"
    else:
        msg = f"rank {rank}: {what} failed, a peer is gone or broke the connection (collective timeout {timeout:g}s)"
    return CommunicationError(f"{msg} ({text})" if text else msg)
