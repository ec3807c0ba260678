"""Periodic model averaging: when the workers average, what they average, and what it costs.

:class:`PeriodicAverager` owns the "every I steps, replace the model by the average" part of
CELGC and of local SGD. To make a round cost little more than the transport itself, the averaged
tensors (trainable parameters and floating-point buffers) are moved, once, into one persistent
flat buffer per (device, dtype): each parameter's ``.data`` and each buffer becomes a view into
it. A round is then one in-place all-reduce of each flat buffer and one division, with no
packing or unpacking copies. The buffer carries one extra element, the worker's weight, so that
a weighted average (partial participation, workers with non-finite parameters left out) costs
the same single all-reduce and is a decision every worker takes together.

The all-reduce goes out in chunks of about ``chunk_bytes``, all issued at once, and each chunk is
divided by the number of workers as soon as it arrives, while the later chunks are still on the
wire: the division, the one pass over the model a round needs besides the transport, is hidden
behind it (measured in ``benchmarks/bench_averaging.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from localclip.comm import Communicator, current
from localclip.data.sharding import sample_participants
from localclip.errors import CommunicationError, NonFiniteError

__all__ = ["PeriodicAverager", "OPTIMIZER_STATE_MODES", "sample_participants"]

OPTIMIZER_STATE_MODES = ("local", "average", "reset")


DEFAULT_CHUNK_BYTES = 8 << 20


class _FlatBucket:
    """A flat buffer of one device and dtype whose slices back the averaged tensors."""

    def __init__(self, tensors: list[torch.Tensor], bind: list, chunk_bytes: int):
        numel = sum(t.numel() for t in tensors)
        # One extra element at the end holds this worker's weight in the average.
        self.flat = torch.empty(numel + 1, dtype=tensors[0].dtype, device=tensors[0].device)
        self.values = self.flat[:-1]
        self.weight = self.flat[-1:]
        self.chunks = self.flat.split(max(1, chunk_bytes // self.flat.element_size()))
        offset = 0
        self.views = []
        for t, rebind in zip(tensors, bind):
            view = self.values[offset : offset + t.numel()].view_as(t)
            view.copy_(t)
            rebind(view)
            self.views.append(view)
            offset += t.numel()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class PeriodicAverager:
    r"""Average a module's parameters and buffers across workers every ``period`` steps.

    Call :meth:`step` once after every optimizer step. After the ``period``-th, ``2·period``-th, …
    call (and after each of the first ``warmup_steps`` calls), every trainable parameter and,
    unless ``average_buffers=False``, every floating-point buffer (BatchNorm statistics) is
    replaced by its average over the group; in between everything stays local. This is averaging
    "at the start of every iteration t with t mod I = 0" of the paper: iteration 0 is covered by
    the construction, where every worker takes rank 0's parameters and buffers.

    The averaged tensors are re-homed into flat buffers (see the module docstring): create the
    averager after moving the module to its device, and do not re-assign ``param.data``
    afterwards (checked at every round). ``load_state_dict`` and in-place updates are fine.

    Args:
        module: the worker's model.
        period: the communication period I (>= 1).
        group: the :class:`~localclip.comm.Communicator`; default :func:`localclip.comm.current`.
        average_buffers: also average floating-point buffers (the reference averages parameters
            only; averaging BatchNorm statistics keeps the evaluated model consistent).
        optimizer: the optimizer whose state ``optimizer_state`` refers to.
        optimizer_state: after a round, keep the optimizer's state (SGD momentum, Adam moments)
            ``"local"`` (the default: the paper's, and DiLoCo's for AdamW), ``"average"`` it
            too, or ``"reset"`` it (the next step starts afresh; see :meth:`_sync_optimizer_state`).
        warmup_steps: average after every one of the first ``warmup_steps`` steps.
        participants: if set to K < world size, each round only K workers, drawn by
            :func:`sample_participants` from ``participation_seed``, are averaged; every worker
            then takes that average (partial participation).
        skip_nonfinite: leave a worker whose parameters contain NaN or Inf out of the average
            (it takes the average of the others); if False such a worker raises instead.
        chunk_bytes: the all-reduce's chunk size (see the module docstring); the default, 8 MiB,
            was the fastest of 2-32 MiB for a 92 MiB model over gloo.

    Attributes:
        rounds: averaging rounds so far.
        bytes_communicated: payload bytes this worker has all-reduced in those rounds.
        nonfinite_rounds: rounds in which this worker was left out for non-finite parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        period: int,
        *,
        group: Communicator | None = None,
        average_buffers: bool = True,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_state: str = "local",
        warmup_steps: int = 0,
        participants: int | None = None,
        participation_seed: int = 0,
        skip_nonfinite: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"Invalid period: {period!r} (must be an integer >= 1)")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"Invalid warmup_steps: {warmup_steps!r} (must be an integer >= 0)")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"Invalid chunk_bytes: {chunk_bytes!r} (must be an integer >= 1)")
        if optimizer_state not in OPTIMIZER_STATE_MODES:
            raise ValueError(f"Invalid optimizer_state: {optimizer_state!r} (expected one of {OPTIMIZER_STATE_MODES})")
        if optimizer_state != "local" and optimizer is None:
            raise ValueError(f"optimizer_state={optimizer_state!r} needs the optimizer")
        self.comm = group if group is not None else current()
        if participants is not None and not 1 <= participants <= self.comm.world_size:
            raise ValueError(f"Invalid participants: {participants} (must be in [1, {self.comm.world_size}])")
        self.module = module
        self.period = period
        self.warmup_steps = warmup_steps
        self.average_buffers = average_buffers
        self.optimizer = optimizer
        self.optimizer_state = optimizer_state
        self.participants = participants
        self.participation_seed = participation_seed
        self.skip_nonfinite = skip_nonfinite
        self.step_count = 0
        self._shared_at = 0  # step_count when the workers last held the same values (0: the broadcast)
        self.rounds = 0
        self.bytes_communicated = 0
        self.nonfinite_rounds = 0

        self._names, self._buckets = self._flatten(module, average_buffers, chunk_bytes)
        if not self._buckets:
            raise ValueError(f"Invalid module: {type(module).__name__} has no trainable parameters or floating-point buffers to average")
        # Every worker starts from rank 0's model (x₀ is shared).
        self._collective("initial broadcast", lambda: self.comm.broadcast([b.flat for b in self._buckets], src=0))

    # -- set-up --------------------------------------------------------------------------------

    @staticmethod
    def _flatten(module: nn.Module, average_buffers: bool, chunk_bytes: int):
        entries = []  # (name, tensor, rebind)
        seen = set()
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                entries.append((name, p, lambda v, p=p: setattr(p, "data", v), p))
        if average_buffers:
            for mod_name, mod in module.named_modules():
                for buf_name, buf in mod._buffers.items():
                    if buf is None or not buf.is_floating_point() or id(buf) in seen:
                        continue
                    seen.add(id(buf))
                    name = f"{mod_name}.{buf_name}" if mod_name else buf_name

                    def rebind(v, mod=mod, buf_name=buf_name):
                        mod._buffers[buf_name] = v

                    entries.append((name, buf, rebind, (mod, buf_name)))
        by_key: dict[tuple, list] = {}
        for entry in entries:
            t = entry[1]
            by_key.setdefault((t.device, t.dtype), []).append(entry)
        names, buckets = [], []
        for group in by_key.values():
            bucket = _FlatBucket([e[1].detach() for e in group], [e[2] for e in group], chunk_bytes)
            bucket.owners = [e[3] for e in group]
            names.append([e[0] for e in group])
            buckets.append(bucket)
        return names, buckets

    def _check_views(self) -> None:
        """Fail loudly if someone replaced a tensor the flat buffers back."""
        for names, bucket in zip(self._names, self._buckets):
            for name, owner, view in zip(names, bucket.owners, bucket.views):
                live = owner if isinstance(owner, torch.Tensor) else owner[0]._buffers[owner[1]]
                if live.data_ptr() != view.data_ptr():
                    raise RuntimeError(
                        f"tensor {name!r} was re-assigned after the PeriodicAverager was created; "
                        "create the averager after moving or replacing the module's tensors"
                    )

    # -- the schedule --------------------------------------------------------------------------

    def is_sync_step(self, step_count: int) -> bool:
        """Whether the ``step_count``-th call of :meth:`step` (1-based) ends with a round."""
        return step_count <= self.warmup_steps or (step_count - self.warmup_steps) % self.period == 0

    def step(self) -> bool:
        """Count one optimizer step; average if this step ends a period. Returns whether it did."""
        self.step_count += 1
        if self.is_sync_step(self.step_count):
            self.average()
            return True
        return False

    # -- a round -------------------------------------------------------------------------------

    def _collective(self, what: str, fn) -> None:
        try:
            fn()
        except CommunicationError as exc:
            raise CommunicationError(f"{what} (round {self.rounds + 1}, timeout {self.comm.timeout:g}s): {exc}") from exc

    @property
    def has_buffers(self) -> bool:
        """Whether floating-point buffers (BatchNorm statistics) are averaged with the parameters."""
        return any(isinstance(owner, tuple) for b in self._buckets for owner in b.owners)

    @torch.no_grad()
    def average(self, *, if_changed: bool = False) -> None:
        """Average now, whatever the schedule (end of training, before evaluation).

        With ``if_changed``, nothing happens (no round is counted) when no step has been taken
        since the last round: the workers already hold the same values, as at the end of an
        epoch that ends on a period boundary.

        Each worker first checks its values for NaN/Inf (before anything leaves it, so that a
        left-out worker's values never reach the others), then one chunked all-reduce sums values
        and weights and divides each chunk by K (the workers expected to take part) on arrival:
        when all K took part, that is the average and nothing else touches the buffer. A worker
        left out (not sampled, or non-finite) contributes zeros and weight 0, and the others
        rescale.
        """
        self._check_views()
        if self.comm.world_size == 1:
            return  # nothing to talk about: no round, no bytes
        if if_changed and self.step_count == self._shared_at:
            return
        expected = self.comm.world_size
        taking_part = True
        if self.participants is not None and self.participants < self.comm.world_size:
            expected = self.participants
            chosen = sample_participants(self.comm.world_size, self.participants, self.rounds, self.participation_seed)
            taking_part = self.comm.rank in chosen
        if taking_part and not self._all_finite():
            if not self.skip_nonfinite:
                raise NonFiniteError(f"rank {self.comm.rank}: non-finite parameters at averaging round {self.rounds + 1}")
            taking_part = False
            self.nonfinite_rounds += 1
        for b in self._buckets:
            if not taking_part:
                b.flat.zero_()  # 0·NaN is NaN: a left-out worker must contribute true zeros
            b.weight.fill_(1.0 if taking_part else 0.0)
        chunks = [c for b in self._buckets for c in b.chunks]
        # Division (not multiplication by 1/K) keeps the weight slot exact: K/K is 1.
        self._collective("model averaging", lambda: self.comm.all_reduce(chunks, then=lambda c: c.div_(expected)))
        share = float(self._buckets[0].weight)  # the workers that took part, over K
        if share == 0.0:
            raise NonFiniteError(f"averaging round {self.rounds + 1}: no worker had finite parameters")
        if share != 1.0:
            for b in self._buckets:
                b.values.div_(share)
        self.rounds += 1
        self.bytes_communicated += sum(b.nbytes for b in self._buckets)
        self._shared_at = self.step_count
        self._sync_optimizer_state()

    def _all_finite(self) -> bool:
        """Whether every averaged value is finite, in one read-only pass.

        A sum is finite only if every term is (NaN and ±inf propagate), so one ``sum`` per
        bucket decides the common case; only a non-finite sum, which finite values can also give
        by overflowing, needs the exact, slower ``isfinite`` check (five passes on the CPU).
        """
        for b in self._buckets:
            total = b.values.sum(dtype=torch.float64 if b.values.dtype == torch.float64 else torch.float32)
            if not bool(torch.isfinite(total)) and not bool(torch.isfinite(b.values).all()):
                return False
        return True

    def _sync_optimizer_state(self) -> None:
        """Apply ``optimizer_state`` to the per-parameter state of any ``torch.optim`` optimizer.

        The state that follows the model is every floating-point tensor shaped like its
        parameter: SGD's ``momentum_buffer``, Adam's ``exp_avg`` and ``exp_avg_sq`` (and
        ``max_exp_avg_sq``). Scalars such as Adam's ``step`` are the same on every worker and
        stay. ``reset`` forgets a parameter's whole state, so the optimizer starts it afresh on
        its next step as on its first (for Adam: new moments and a restarted bias correction,
        not zeroed moments under an old step count, whose first update would be about
        1/sqrt(1 - β2) times too long).
        """
        if self.optimizer_state == "local":
            return
        if self.optimizer_state == "reset":
            for p in list(self.optimizer.state):
                del self.optimizer.state[p]
            return
        bufs = [
            t for p, s in self.optimizer.state.items() for k, t in s.items()
            if k != "step" and isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == p.shape
        ]
        if bufs:
            # All workers hold the same set of buffers (same params, same number of steps).
            k = self.comm.world_size
            self._collective("momentum averaging", lambda: self.comm.all_reduce(bufs, then=lambda b: b.div_(k)))
            self.bytes_communicated += sum(b.numel() * b.element_size() for b in bufs)

    # -- introspection and checkpoints ---------------------------------------------------------

    @property
    def numel(self) -> int:
        """Number of elements averaged per round (parameters and buffers, weights excluded)."""
        return sum(b.values.numel() for b in self._buckets)

    @property
    def flat_buffers(self) -> Sequence[torch.Tensor]:
        return [b.flat for b in self._buckets]

    def state_dict(self) -> dict:
        return {
            "period": self.period,
            "warmup_steps": self.warmup_steps,
            "step_count": self.step_count,
            "rounds": self.rounds,
            "bytes_communicated": self.bytes_communicated,
            "nonfinite_rounds": self.nonfinite_rounds,
            "shared_at": self._shared_at,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["period"] != self.period:
            raise ValueError(f"Checkpoint period {state['period']} differs from this averager's period {self.period}")
        self.warmup_steps = state["warmup_steps"]
        self.step_count = state["step_count"]
        self.rounds = state["rounds"]
        self.bytes_communicated = state["bytes_communicated"]
        self.nonfinite_rounds = state.get("nonfinite_rounds", 0)
        self._shared_at = state.get("shared_at", -1)  # older checkpoints: unknown, so the next average() communicates

    def __repr__(self) -> str:
        return (
            f"PeriodicAverager(period={self.period}, numel={self.numel}, world_size={self.comm.world_size}, "
            f"rounds={self.rounds})"
        )
