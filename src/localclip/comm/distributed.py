"""Communicator over a real `torch.distributed` process group (gloo on CPU, NCCL on GPU).

This module and the launcher are the only places that import ``torch.distributed``. Averages are
computed by the callers as a SUM followed by a division: gloo's AVG reduction is not supported
everywhere and NCCL's differs between versions, while SUM is exact and universal.

Floating-point addition is not associative, and gloo's ring all-reduce adds the workers'
values in an order that rotates from chunk to chunk, so with three or more workers its sums
differ in the last bits from any fixed order. On gloo, a SUM over more than two workers is
therefore done as a reduce-scatter by ``all_to_all`` (each worker receives every worker's copy
of its own slice and adds them in rank order: ``((x0 + x1) + x2) + ...``), then an
``all_gather`` of the sums: the same bytes on the wire as the ring, and the same bits as the
simulated runtime, which adds in rank order too. Two workers need nothing of the kind
(``a + b == b + a`` exactly); NCCL keeps its own all-reduce (simulation is CPU-only).

Non-blocking collectives (``start_*``) are issued with ``async_op=True`` and waited for in
:meth:`~localclip.comm.base.Pending.wait`. The rank-ordered sum has two phases, and the second
(the all-gather) can only be issued once the first has arrived and been summed: a helper thread
does that while the caller computes on. Collectives match between processes by the order in
which they are issued, so before this communicator issues anything else it waits until every
earlier collective has issued all its phases (:meth:`ProcessGroupCommunicator._settle`): the
order is the same on every worker whatever the threads' timing.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

from localclip.comm import base
from localclip.comm.base import DEFAULT_TIMEOUT, Communicator, Pending, check_timeout, timeout_error
from localclip.errors import CommunicationError

__all__ = ["ProcessGroupCommunicator", "init", "shutdown", "is_initialized", "why_not_a_replica"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# all_gather_into_tensor was renamed all_gather_single (and deprecated) in recent torch releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def why_not_a_replica(module: torch.nn.Module) -> str | None:
    """Why ``module`` is not a full replica that localclip can average, or None if it is.

    DistributedDataParallel all-reduces the gradients at every backward (the communication that
    periodic averaging exists to avoid), and FSDP (``fully_shard`` or FullyShardedDataParallel)
    leaves each rank a shard of every parameter, while a round averages whole models.
    """
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return ("it is wrapped in DistributedDataParallel, which all-reduces the gradients at every backward: "
                "pass the model inside it (ddp.module), or use localclip.integrations.lightning or .accelerate")
    sharded = _sharded_types()
    if sharded and any(isinstance(m, sharded) for m in module.modules()):
        return "it is sharded by FSDP, which leaves each rank a slice of every parameter, while a round averages whole models: give each worker the whole model"
    for name, p in module.named_parameters():
        if type(p.data) is not torch.Tensor:  # DTensor (tensor parallelism, FSDP) and other tensor subclasses
            return f"its parameter {name!r} is a {type(p.data).__name__}, not a plain tensor: a round averages whole, unsharded models"
    return None


def _sharded_types() -> tuple[type, ...]:
    """The wrappers that leave each rank a shard (FSDP1's module class; fully_shard's mixin).

    ``torch.distributed.fsdp`` takes seconds to import, and a module can only be sharded by it
    once something has imported it: until then no module is sharded, and the check costs nothing."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return ()
    return tuple(getattr(fsdp, name) for name in ("FullyShardedDataParallel", "FSDPModule") if hasattr(fsdp, name))


def init(
    *,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store_path: str | os.PathLike | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> "ProcessGroupCommunicator":
    """Initialise the default process group, install its communicator for this process (what
    :func:`localclip.comm.current` returns from now on) and return it.

    With ``store_path`` the workers meet through a ``FileStore`` (one machine, no ports);
    without it, through the ``env://`` variables that ``torchrun`` sets. ``backend`` defaults to
    NCCL when CUDA is available, else gloo.
    """
    timeout = check_timeout(timeout)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    if store_path is not None:
        if rank is None or world_size is None:
            raise ValueError("init with store_path needs rank and world_size")
        store = dist.FileStore(os.fspath(store_path), world_size)
        kwargs.update(store=store, rank=rank, world_size=world_size)
    elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
        kwargs.update(_elastic_store(timeout))
    dist.init_process_group(**kwargs)
    comm = ProcessGroupCommunicator(timeout=timeout)
    base.install(comm)
    return comm


def _elastic_store(timeout: float) -> dict:
    """The torchrun store, with keys namespaced by restart attempt.

    After torchrun restarts a group, the store can still hold the gloo addresses that the
    previous attempt's workers published; a new worker that reads a dead peer's address fails
    with "Gloo connectFullMesh failed ... Connection refused". A prefix per attempt keeps each
    attempt's rendezvous to itself.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=not agent_store and rank == 0, timeout=datetime.timedelta(seconds=timeout),
    )
    prefix = f"localclip/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    return dict(store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size)


def shutdown() -> None:
    """Uninstall this process's communicator and destroy the default group."""
    if isinstance(base._process, ProcessGroupCommunicator):
        base._process._settle()  # no helper thread may issue into a destroyed group
    base.install(None)
    if is_initialized():
        dist.destroy_process_group()


def exit_process(status: int = 0):
    """End this process with ``status``: destroy the group, flush stdout and stderr, and leave
    without the interpreter's shutdown. Call it last, in place of ``sys.exit``, in a process that
    used a gloo group (a torchrun worker).

    Why: with torch 2.13 a gloo group and its worker threads outlive ``destroy_process_group``, and
    a worker thread that lets go of a collective's tensor once the interpreter has begun to shut
    down needs the GIL and aborts the process ("terminate called without an active exception",
    SIGABRT) after a run that succeeded. Seen under gdb: a ``pt_gloo_runloop`` thread in
    ``take_gil`` while the main thread was in ``Py_FinalizeEx``; 1 torchrun run in 4 to 8 of the
    Accelerate example, and in the own-model example, on a loaded 2-core machine. Files the
    program opened must be closed before (``with`` blocks are).
    """
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _user_group() -> "ProcessGroupCommunicator | None":
    # A default group that the user (or a framework) initialised without us: wrap it once.
    return ProcessGroupCommunicator() if is_initialized() else None


base.register_fallback(_user_group)


class ProcessGroupCommunicator(Communicator):
    """A worker's handle on a ``torch.distributed`` group (the default group unless given)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float = DEFAULT_TIMEOUT):
        if not is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call localclip.comm.distributed.init()")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = check_timeout(timeout)
        self._timedelta = datetime.timedelta(seconds=self.timeout)
        self._backend = str(dist.get_backend(group)).lower()
        self._phasing: list[threading.Thread] = []  # helpers still issuing a collective's later phases

    def _wait(self, works, what: str, then=None, tensors=()) -> None:
        for i, work in enumerate(works):
            try:
                if not work.wait(self._timedelta):
                    raise TimeoutError(what)
            except (RuntimeError, TimeoutError) as exc:
                raise timeout_error(what, self.timeout, self.rank, exc) from exc
            if then is not None:
                # The later tensors are still in flight on gloo's/NCCL's own threads or streams.
                then(tensors[i])

    def _settle(self) -> None:
        """Wait until every earlier collective has issued all its phases (see the module docstring).
        The helpers' own waits are bounded by the timeout; their errors surface in Pending.wait."""
        while self._phasing:
            self._phasing.pop(0).join()

    def _staged(self, tensors, collective, then=None) -> None:
        """NCCL reduces GPU tensors only: CPU ones (control flags, metrics, evaluation sums)
        travel through copies on this process's GPU and are copied back."""
        device = torch.device("cuda", torch.cuda.current_device())
        staged = [t if t.is_cuda else t.to(device) for t in tensors]
        collective(staged)
        for t, s in zip(tensors, staged):
            if s is not t:
                t.copy_(s)
            if then is not None:
                then(t)

    def _all_reduce(self, tensors, op, then):
        if self._backend == "nccl" and not all(t.is_cuda for t in tensors):
            return self._staged(tensors, lambda staged: self._all_reduce(staged, op, None), then)
        self._settle()
        if op == "sum" and self.world_size > 2 and self._backend == "gloo":
            return self._rank_ordered_sum(tensors, then)
        try:
            works = [dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True) for t in tensors]
        except RuntimeError as exc:
            raise CommunicationError(f"rank {self.rank}: all_reduce failed: {exc}") from exc
        self._wait(works, f"all_reduce({op}) of {len(tensors)} tensor(s)", then, tensors)

    def _rank_ordered_sum(self, tensors, then) -> None:
        """SUM-reduce ``tensors`` in place, adding in rank order (see the module docstring)."""
        s = _RankOrderedSum(self, tensors)
        s.scatter()
        s.gather()
        s.finish(then)

    def _start_all_reduce(self, tensors, op, what):
        self._settle()
        if op == "sum" and self.world_size > 2 and self._backend == "gloo":
            s = _RankOrderedSum(self, tensors)
            s.scatter()
            helper = threading.Thread(target=s.gather_in_background, name=f"localclip-gather-{self.rank}", daemon=True)
            helper.start()
            self._phasing.append(helper)

            def wait():
                helper.join()
                if s.error is not None:
                    raise s.error
                s.finish(None)

            return Pending(self, what, wait=wait, poll=lambda: not helper.is_alive() and (s.error is not None or s.gathered_all()))
        try:
            works = [dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True) for t in tensors]
        except RuntimeError as exc:
            raise CommunicationError(f"rank {self.rank}: {what} failed: {exc}") from exc
        return Pending(self, what, wait=lambda: self._wait(works, what), poll=lambda: all(w.is_completed() for w in works))

    def _start_all_to_all(self, send, recv, what):
        self._settle()
        # gloo's list all_to_all wants equal sizes: one all_to_all_single over the concatenations,
        # which are views (no copy) where the tensors lie one after the other in one buffer.
        flat_send = _joined(send)
        if flat_send is None:
            flat_send = torch.cat([t.reshape(-1) for t in send])
        out_splits = [t.numel() for t in recv]
        flat_recv = _joined(recv)
        direct = flat_recv is not None
        if not direct:
            flat_recv = torch.empty(sum(out_splits), dtype=flat_send.dtype, device=flat_send.device)
        try:
            work = dist.all_to_all_single(
                flat_recv, flat_send, output_split_sizes=out_splits, input_split_sizes=[t.numel() for t in send],
                group=self.group, async_op=True,
            )
        except RuntimeError as exc:
            raise CommunicationError(f"rank {self.rank}: {what} failed: {exc}") from exc

        def wait():
            self._wait([work], what)
            if not direct:
                for t, piece in zip(recv, flat_recv.split(out_splits)):
                    t.copy_(piece.view(t.shape))

        return Pending(self, what, wait=wait, poll=work.is_completed)

    def _start_all_gather(self, tensor, out, what):
        self._settle()
        flat_out = _joined(out)
        targets = [o if o.is_contiguous() else torch.empty_like(o, memory_format=torch.contiguous_format) for o in out]
        try:
            if flat_out is not None:  # the outputs lie one after the other: gathered straight into them
                work = _all_gather(flat_out, tensor.contiguous().view(-1), group=self.group, async_op=True)
            else:
                work = dist.all_gather(targets, tensor.contiguous(), group=self.group, async_op=True)
        except RuntimeError as exc:
            raise CommunicationError(f"rank {self.rank}: {what} failed: {exc}") from exc

        def wait():
            self._wait([work], what)
            if flat_out is None:
                for o, t in zip(out, targets):
                    if t is not o:
                        o.copy_(t)

        return Pending(self, what, wait=wait, poll=work.is_completed)

    def _broadcast(self, tensors, src):
        if self._backend == "nccl" and not all(t.is_cuda for t in tensors):
            return self._staged(tensors, lambda staged: self._broadcast(staged, src))
        self._settle()
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        try:
            works = [dist.broadcast(t, src=src_global, group=self.group, async_op=True) for t in tensors]
        except RuntimeError as exc:
            raise CommunicationError(f"rank {self.rank}: broadcast failed: {exc}") from exc
        self._wait(works, f"broadcast from rank {src}")


class _RankOrderedSum:
    """The phases of a rank-ordered SUM over gloo (see the module docstring): :meth:`scatter`
    issues an all-to-all of slices per tensor; :meth:`gather` waits for each, adds the slices in
    rank order and issues the all-gather of the sums; :meth:`finish` waits for those and writes
    each tensor. Blocking and non-blocking all-reduces run the same phases, so their bits agree."""

    def __init__(self, comm: ProcessGroupCommunicator, tensors: list[torch.Tensor]):
        self.comm, self.tensors = comm, tensors
        self.what = f"all_reduce(sum) of {len(tensors)} tensor(s)"
        self.sends: list = []
        self.gathers: list = []
        self.error: BaseException | None = None

    def scatter(self) -> None:
        comm, world = self.comm, self.comm.world_size
        try:
            # Issue every scatter first, so later tensors travel while earlier ones are summed.
            for t in self.tensors:
                n = t.numel()
                m = -(-n // world)  # slice length; the last slices are padded with zeros
                if n == m * world and t.is_contiguous():
                    send = t.view(-1)
                else:
                    send = t.new_zeros(m * world)
                    send[:n].copy_(t.reshape(-1))
                recv = torch.empty_like(send)
                work = dist.all_to_all_single(recv, send, group=comm.group, async_op=True)
                self.sends.append((t, send, recv, m, work))
        except RuntimeError as exc:
            raise CommunicationError(f"rank {comm.rank}: all_reduce failed: {exc}") from exc

    def gather(self) -> None:
        comm, world = self.comm, self.comm.world_size
        try:
            for t, send, recv, m, work in self.sends:
                comm._wait([work], self.what)
                pieces = recv.view(world, m)
                total = pieces[0].clone()
                for j in range(1, world):
                    total.add_(pieces[j])
                # send's own contents have been sent: it receives everyone's sums.
                self.gathers.append(_all_gather(send, total, group=comm.group, async_op=True))
        except RuntimeError as exc:
            raise CommunicationError(f"rank {comm.rank}: all_reduce failed: {exc}") from exc

    def gather_in_background(self) -> None:
        try:
            with torch.no_grad():
                self.gather()
        except BaseException as exc:  # noqa: BLE001 - re-raised by Pending.wait in the caller's thread
            self.error = exc

    def gathered_all(self) -> bool:
        return len(self.gathers) == len(self.sends) and all(w.is_completed() for w in self.gathers)

    def finish(self, then) -> None:
        for (t, send, _, _, _), work in zip(self.sends, self.gathers):
            self.comm._wait([work], self.what)
            if send.data_ptr() != t.data_ptr():
                t.copy_(send[: t.numel()].view_as(t))
            if then is not None:
                then(t)


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over ``tensors`` (no copy) when each is contiguous and each begins where the
    one before ends, in one buffer (a caller that lays out a collective's pieces so: the low-bit
    reduction); else None."""
    first = tensors[0]
    storage, start = first.untyped_storage(), first.storage_offset()
    at = start
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.storage_offset() != at):
            return None
        at += t.numel()
    return first.new_empty(0).set_(storage, start, (at - start,))
