"""Periodic model averaging: when the workers average, what they send, and what it costs.

:class:`PeriodicAverager` owns the "every I steps, replace the model by the average" part of
CELGC and of local SGD. To make a round cost little more than the transport itself, the averaged
tensors (trainable parameters and floating-point buffers) are moved, once, into one persistent
flat buffer per (device, dtype): each parameter's ``.data`` and each buffer becomes a view into
it. A plain round is then one pass and one in-place all-reduce:

* the pass (``torch._amp_foreach_non_finite_check_and_unscale_``, PyTorch's fused AMP kernel)
  multiplies the values by 1/K and, in the same read, tells whether any was NaN or Inf; so the
  sum that the all-reduce returns is already the average, and no division pass follows;
* one all-reduce of the whole buffer. Splitting it into chunks so that work on the first chunks
  overlaps the transport of the rest only pays where there is work after the transport: a
  plain round has none (over gloo on a loaded 2-core machine, at one intra-op thread per worker,
  8 MiB chunks made it ~25 % slower), a round with an outer step has six passes over the
  buffer, and there 8 MiB chunks made the round 1.01x instead of 1.07x the bare all-reduce over a
  1 Gbit/s link (1.09x instead of 1.37x on a loaded machine), 2.0x instead of 3.0x over a loaded
  loopback, and no worse over a quiet one (``bench_averaging.py``). So the default
  (``chunk_bytes="auto"``) is one all-reduce for plain and compressed rounds, 8 MiB chunks with an
  outer optimizer.

A separate one-element *weight* goes first in the same collective: each worker's 1 or 0, so that
a weighted average (partial participation, workers with non-finite parameters left out) is a
decision every worker takes together, known before any value arrives.

Two options change what a round sends or does with the average; both keep an *anchor*, a copy of
the averaged tensors as of the last round (identical on every worker):

* ``compression="bf16"|"fp16"``: each worker sends its change since the anchor, ``(x_i − a)/K``,
  as an all-reduce in that 2-byte format (half the bytes; the sum of K low-precision terms is
  rounded once per addition, so the error grows with K: see :meth:`PeriodicAverager.average`),
  and every worker adds the same decoded sum to the anchor, so all stay bit-identical. An
  all-reduce (rather than an all-gather and a float32 sum) is used because its bytes per worker
  do not grow with K.
* ``outer_optimizer``: the average is handed to an outer step (:mod:`localclip.outer`).

The work after the transport (decoding, the outer step, the new anchor) runs block by block, so
that its several element-wise operations read and write each block while it is in cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from localclip.comm import Communicator, current
from localclip.data.sharding import sample_participants
from localclip.errors import CommunicationError, NonFiniteError
from localclip.outer import OuterSGD, TorchOuter, make_outer

__all__ = ["PeriodicAverager", "OPTIMIZER_STATE_MODES", "COMPRESSIONS", "sample_participants"]

OPTIMIZER_STATE_MODES = ("local", "average", "reset")
COMPRESSIONS = ("none", "bf16", "fp16")
_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

DEFAULT_CHUNK_BYTES = "auto"
# What "auto" chunks a round with an outer step into (a multiple of BLOCK_NUMEL float32 elements,
# so chunking leaves every block, and so every result, as it is).
OUTER_CHUNK_BYTES = 8 << 20
# Elements per block of the post-transport passes: 1 MiB of float32 stays in L2 between the
# several element-wise operations of decoding and the outer step.
BLOCK_NUMEL = 1 << 18


class _FlatBucket:
    """A flat buffer of one device and dtype whose slices back the averaged tensors.

    The first ``n_params`` elements back trainable parameters, the rest floating-point buffers.
    """

    def __init__(self, tensors: list[torch.Tensor], bind: list, n_params: int):
        numel = sum(t.numel() for t in tensors)
        self.values = torch.empty(numel, dtype=tensors[0].dtype, device=tensors[0].device)
        self.n_params = n_params
        self.anchor: torch.Tensor | None = None  # the values as of the last round
        self.wire: torch.Tensor | None = None  # the low-precision send buffer (compression)
        offset = 0
        self.views = []
        for t, rebind in zip(tensors, bind):
            view = self.values[offset : offset + t.numel()].view_as(t)
            view.copy_(t)
            rebind(view)
            self.views.append(view)
            offset += t.numel()

    @property
    def sent(self) -> torch.Tensor:
        return self.values if self.wire is None else self.wire

    def ranges(self, chunk_numel: int | None) -> list[tuple[int, int]]:
        n = self.values.numel()
        step = n if chunk_numel is None else max(1, chunk_numel)
        return [(s, min(n, s + step)) for s in range(0, n, step)]


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
        chunk_bytes: split the all-reduce into chunks of about this size, the work on each chunk
            starting as it arrives; ``None``: one all-reduce; ``"auto"`` (the default): one
            all-reduce, or chunks of ``OUTER_CHUNK_BYTES`` with an outer optimizer (see the module
            docstring). Results do not depend on it.
        compression: ``"none"``, or send the change since the anchor as ``"bf16"`` or
            ``"fp16"`` (see the module docstring; fp16 keeps 3 more mantissa bits but overflows
            beyond ±65504, which counts as non-finite).
        outer_optimizer: ``None`` (plain averaging), an :class:`~localclip.outer.OuterSGD`, or a
            factory ``params -> torch.optim.Optimizer`` (see :mod:`localclip.outer`).

    Memory: with ``compression`` or ``outer_optimizer``, one more copy of the averaged tensors
    (the anchor, :attr:`anchor_numel`), plus the outer optimizer's state (``OuterSGD``: its
    momentum buffer, one copy of the parameters when ``momentum > 0``), plus for compression a
    2-byte send buffer of the same length.

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
        chunk_bytes: int | str | None = DEFAULT_CHUNK_BYTES,
        compression: str = "none",
        outer_optimizer: OuterSGD | TorchOuter | Callable | None = None,
    ):
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"Invalid period: {period!r} (must be an integer >= 1)")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"Invalid warmup_steps: {warmup_steps!r} (must be an integer >= 0)")
        if chunk_bytes not in (None, "auto") and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1):
            raise ValueError(f"Invalid chunk_bytes: {chunk_bytes!r} (must be an integer >= 1, None or 'auto')")
        if compression not in COMPRESSIONS:
            raise ValueError(f"Invalid compression: {compression!r} (expected one of {COMPRESSIONS})")
        outer = make_outer(outer_optimizer)
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
        self._last_round_step = 0  # step_count when the workers last held the same values (0: the broadcast)
        self.rounds = 0
        self.bytes_communicated = 0
        self.nonfinite_rounds = 0
        self.compression = compression
        self.outer = outer
        if chunk_bytes == "auto":
            chunk_bytes = OUTER_CHUNK_BYTES if outer is not None else None
        self.chunk_bytes = chunk_bytes

        self._names, self._buckets = self._flatten(module, average_buffers)
        if not self._buckets:
            raise ValueError(f"Invalid module: {type(module).__name__} has no trainable parameters or floating-point buffers to average")
        first = self._buckets[0].values
        self._weight = torch.zeros(1, dtype=torch.float32, device=first.device)
        self._found = torch.zeros(1, dtype=torch.float32, device=first.device)
        # Every worker starts from rank 0's model (x₀ is shared).
        self._collective("initial broadcast", lambda: self.comm.broadcast([b.values for b in self._buckets], src=0))
        if compression != "none" or outer is not None:
            for b in self._buckets:
                b.anchor = b.values.clone()
                if compression != "none":
                    b.wire = torch.empty(b.values.numel(), dtype=_WIRE_DTYPES[compression], device=b.values.device)
            if outer is not None:
                outer.bind([b.anchor[: b.n_params] for b in self._buckets if b.n_params])

    # -- set-up --------------------------------------------------------------------------------

    @staticmethod
    def _flatten(module: nn.Module, average_buffers: bool):
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
            # Parameters first: the outer step and naive's buffer-only round use the two halves.
            group.sort(key=lambda e: not isinstance(e[3], torch.Tensor))
            n_params = sum(e[3].numel() for e in group if isinstance(e[3], torch.Tensor))
            bucket = _FlatBucket([e[1].detach() for e in group], [e[2] for e in group], n_params)
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

    @property
    def in_sync(self) -> bool:
        """Whether no step has been counted since the last round (or the initial broadcast), so
        that the workers hold the same averaged tensors and a round would change nothing."""
        return self._last_round_step == self.step_count

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

        Right after a round (no step counted since), the workers already hold the average: no
        round is taken and none is counted. ``if_changed=True`` also skips the call before the
        first step (the workers hold rank 0's model); without it that call is a round, for a
        user who changed the parameters outside :meth:`step`.

        Each worker first scales what it sends by 1/K (K: the workers expected to take part) and
        checks it for NaN/Inf in the same pass, before anything leaves it, so that a left-out
        worker's values never reach the others; then one all-reduce sums the weights and the
        values. When all K took part the sum is the average; a worker left out (not sampled, or
        non-finite) contributes zeros and weight 0, and the others rescale by K/(weight sum).
        With ``skip_nonfinite=False`` a non-finite worker raises instead (its model already
        scaled, as it is lost anyway).

        With compression each worker sends ``(x_i − a)/K`` rounded to the 2-byte format, and the
        sum is added to the anchor: per element the error against the float32 average is at
        most about ``K·u·mean_i |x_i − a|`` (``u`` the format's unit roundoff, 2⁻⁸ for bf16, 2⁻¹¹
        for fp16: one rounding of each term and one per addition; tested), and for fp16 at least
        about ``2K·2⁻²⁵`` in absolute terms: changes below fp16's normal range (6.1e-5 after the
        division by K) keep only an absolute precision, which bf16, with float32's range, avoids.
        """
        self._check_views()
        if self.comm.world_size == 1:
            return  # nothing to talk about: no round, no bytes
        if self.step_count == self._last_round_step and (if_changed or self.rounds):
            return
        expected = self.comm.world_size
        taking_part = True
        if self.participants is not None and self.participants < self.comm.world_size:
            expected = self.participants
            chosen = sample_participants(self.comm.world_size, self.participants, self.rounds, self.participation_seed)
            taking_part = self.comm.rank in chosen
        if taking_part and not self._prepare(expected):
            if not self.skip_nonfinite:
                raise NonFiniteError(f"rank {self.comm.rank}: non-finite parameters at averaging round {self.rounds + 1}")
            taking_part = False
            self.nonfinite_rounds += 1
        if not taking_part:
            for b in self._buckets:
                b.sent.zero_()  # 0·NaN is NaN: a left-out worker must contribute true zeros
        self._weight.fill_(1.0 if taking_part else 0.0)
        pieces = [(b, lo, hi) for b in self._buckets for lo, hi in b.ranges(self._chunk_numel(b))]
        tensors = [self._weight] + [b.sent[lo:hi] for b, lo, hi in pieces]
        arrived = iter([None] + pieces)
        total = [0.0]

        def on_arrival(t: torch.Tensor) -> None:
            piece = next(arrived)
            if piece is None:
                total[0] = float(t)  # the weight goes first: the rescaling is known for every piece
            elif total[0] > 0:
                self._finish_piece(*piece, total[0], expected)

        self._collective("model averaging", lambda: self.comm.all_reduce(tensors, then=on_arrival))
        if total[0] == 0.0:
            raise NonFiniteError(f"averaging round {self.rounds + 1}: no worker had finite parameters")
        if self.outer is not None and not self.outer.blockwise:
            with_params = [b for b in self._buckets if b.n_params]
            self.outer.apply_all([b.values[: b.n_params] for b in with_params])
        self.rounds += 1
        self.bytes_communicated += sum(t.numel() * t.element_size() for t in tensors)
        self._last_round_step = self.step_count
        self._sync_optimizer_state()

    def _chunk_numel(self, bucket: _FlatBucket) -> int | None:
        return None if self.chunk_bytes is None else self.chunk_bytes // bucket.sent.element_size()

    def _prepare(self, expected: int) -> bool:
        """Fill what this worker sends (scaled by 1/expected); return whether it is all finite."""
        found = self._found.zero_()
        for b in self._buckets:
            # Float64 values are divided after the sum instead: the kernel's scale is float32,
            # and 1/3 in float32 is not exact enough for float64 averages.
            exact = b.values.dtype == torch.float64
            inv = torch.full((1,), 1.0 if exact else 1.0 / expected, dtype=torch.float32, device=b.values.device)
            if b.wire is None:
                torch._amp_foreach_non_finite_check_and_unscale_([b.values], found, inv)
                continue
            scratch = torch.empty(min(BLOCK_NUMEL, b.values.numel()), dtype=b.values.dtype, device=b.values.device)
            for lo in range(0, b.values.numel(), BLOCK_NUMEL):
                hi = min(lo + BLOCK_NUMEL, b.values.numel())
                delta = torch.sub(b.values[lo:hi], b.anchor[lo:hi], out=scratch[: hi - lo])
                delta.mul_(1.0 if exact else 1.0 / expected)
                wire = b.wire[lo:hi]
                wire.copy_(delta)
                # Checked after rounding: a delta beyond fp16's range becomes Inf here.
                torch._amp_foreach_non_finite_check_and_unscale_([wire], found, torch.ones(1, dtype=torch.float32, device=wire.device))
        return not bool(found)

    def _finish_piece(self, b: _FlatBucket, lo: int, hi: int, total: float, expected: int) -> None:
        """The received sum of ``b``'s elements [lo, hi) becomes the average (and, with an anchor,
        the outer step's result and the new anchor), block by block. ``total``: the weight sum."""
        exact = b.values.dtype == torch.float64
        rescale = expected / total
        index = sum(1 for other in self._buckets[: self._buckets.index(b)] if other.n_params)
        for start in range(lo, hi, BLOCK_NUMEL):
            end = min(start + BLOCK_NUMEL, hi)
            values = b.values[start:end]
            if b.wire is not None:
                values.copy_(b.wire[start:end])  # decode: the sum of the scaled changes
            if exact:
                values.div_(total)
            elif rescale != 1.0:
                values.mul_(rescale)
            if b.anchor is None:
                continue
            anchor = b.anchor[start:end]
            if b.wire is not None:
                values.add_(anchor)  # x̄ = a + mean change
            split = min(max(b.n_params - start, 0), end - start)  # parameters first, then buffers
            if self.outer is not None and split:
                if self.outer.blockwise:
                    self.outer.apply(index, start, values[:split], anchor[:split])
                # else the outer step reads the parameters' anchor after the transport
                anchor[split:].copy_(values[split:])
                continue
            anchor.copy_(values)

    @torch.no_grad()
    def average_buffers_only(self) -> None:
        """Average only the floating-point buffers (for algorithms whose parameters are already
        identical everywhere, like naive parallel clipping); a round only if there are any."""
        tensors = [b.values[b.n_params :] for b in self._buckets if b.values.numel() > b.n_params]
        if self.comm.world_size == 1 or not tensors:
            return
        k = self.comm.world_size
        self._collective("buffer averaging", lambda: self.comm.all_reduce(tensors, then=lambda t: t.div_(k)))
        for b in self._buckets:
            if b.anchor is not None:
                b.anchor[b.n_params :].copy_(b.values[b.n_params :])
        self.rounds += 1
        self.bytes_communicated += sum(t.numel() * t.element_size() for t in tensors)

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
        return [b.values for b in self._buckets]

    @property
    def anchor_numel(self) -> int:
        """Elements of the anchor copy (0 without compression and outer optimizer)."""
        return sum(b.anchor.numel() for b in self._buckets if b.anchor is not None)

    def state_dict(self) -> dict:
        """Counters, and with an anchor the anchor and the outer optimizer's state (a resume
        mid-period needs both to take the same next round)."""
        return {
            "period": self.period,
            "warmup_steps": self.warmup_steps,
            "step_count": self.step_count,
            "rounds": self.rounds,
            "bytes_communicated": self.bytes_communicated,
            "nonfinite_rounds": self.nonfinite_rounds,
            "last_round_step": self._last_round_step,
            "compression": self.compression,
            "outer": None if self.outer is None else self.outer.state_dict(),
            "anchors": [None if b.anchor is None else b.anchor.clone() for b in self._buckets],
        }

    def load_state_dict(self, state: dict) -> None:
        # Every check before any change: a refused checkpoint leaves the averager as it was.
        if state["period"] != self.period:
            raise ValueError(f"Checkpoint period {state['period']} differs from this averager's period {self.period}")
        compression = state.get("compression", "none")
        if compression != self.compression:
            raise ValueError(f"Checkpoint compression {compression!r} differs from this averager's {self.compression!r}")
        saved_outer = state.get("outer")
        ours = None if self.outer is None else self.outer.kind
        theirs = None if saved_outer is None else saved_outer.get("kind")
        if ours != theirs:
            raise ValueError(f"Checkpoint outer optimizer {theirs or 'none'!r} differs from this run's {ours or 'none'!r}")
        if self.outer is not None:
            self.outer.load_state_dict(saved_outer)
        for b, anchor in zip(self._buckets, state.get("anchors") or [None] * len(self._buckets)):
            if b.anchor is not None and anchor is not None:
                b.anchor.copy_(anchor)
        self.warmup_steps = state["warmup_steps"]
        self.step_count = state["step_count"]
        self.rounds = state["rounds"]
        self.bytes_communicated = state["bytes_communicated"]
        self.nonfinite_rounds = state.get("nonfinite_rounds", 0)
        self._last_round_step = state.get("last_round_step", -1)

    def __repr__(self) -> str:
        return (
            f"PeriodicAverager(period={self.period}, numel={self.numel}, world_size={self.comm.world_size}, "
            f"rounds={self.rounds}, compression={self.compression!r}, outer={self.outer!r})"
        )
