"""One averaging round: who takes part, what each sends, and what the sum becomes.

A round is one all-reduce. A one-element *weight* goes first in it: each worker's 1 or 0, so
that a weighted average (partial participation, workers with non-finite values left out) is a
decision every worker takes together, known before any value arrives. Before sending, each
worker scales its values by 1/K (K: the workers expected to take part) and checks them for NaN
or Inf in the same pass (PyTorch's fused AMP kernel), so the sum is already the average and a
left-out worker's values never reach the others. After the transport, the work on the sum
(rescaling, decoding a compressed round, the outer step, the new anchor) runs block by block,
while each block is in cache.

What each worker sends is its codec's (:mod:`.codecs`): the values, or the change since the
anchor in 2 bytes, both over the all-reduce; or, for a low-bit codec (``int8``, ``int4``), no
all-reduce: each worker's change since the anchor goes through
:func:`~localclip.averaging.codecs.lowbit_average` (all-to-all, float32 sums in rank order,
all-gather), one per flat bucket, each chunk carrying its sender's weight in place of the
all-reduce's weight. Who takes part is the :class:`~.participation.Participation` policy's, for
every codec: in a low-bit round a worker not sampled or left out for non-finite values (its
change, checked before anything is sent) sends zeros with weight 0 and keeps its error-feedback
residual for a later round, and the owners divide by the weights' sum; every worker still owns
its shard of the reduction, so the bytes do not depend on who takes part. The decoded average
change is added to the anchor, and the outer step (if any) takes ``anchor − that`` as its
pseudo-gradient, as in a 2-byte round.

A low-bit round has one path, in two halves: :meth:`Round.start_lowbit` (the changes encoded,
the exchanges started) and :meth:`Round.finish_lowbit` (their results made the average); a
blocking round waits for the exchanges between the two, a round in flight (:mod:`.overlap`)
takes steps there. A float round in flight runs :meth:`Round.begin` and :meth:`Round.finish`
around a non-blocking all-reduce, with the same bits as :meth:`Round.run`.

Chunking: the all-reduce can be split into chunks so that the work on the first chunks overlaps
the transport of the rest. That pays only where there is work after the transport, a round
with an outer step; the averager's ``chunk_bytes="auto"`` chooses it then (measurements in
docs/benchmarks.md). Chunking leaves every result as it is.
"""

from __future__ import annotations

import torch

from localclip.averaging import codecs
from localclip.averaging.buffers import BLOCK_NUMEL, FlatBucket
from localclip.averaging.codecs import Codec, ErrorFeedback, LowbitPending, LowbitRound, Scratch
from localclip.averaging.participation import Participation
from localclip.comm import current
from localclip.errors import NonFiniteError

__all__ = ["DEFAULT_CHUNK_BYTES", "OUTER_CHUNK_BYTES", "Round", "average_parameters"]

DEFAULT_CHUNK_BYTES = "auto"
# What "auto" chunks a round with an outer step into (a multiple of BLOCK_NUMEL float32 elements,
# so chunking leaves every block, and so every result, as it is).
OUTER_CHUNK_BYTES = 8 << 20


class Round:
    """Runs rounds over ``buckets``: see the module docstring. Holds no counters: the averager does."""

    def __init__(self, comm, buckets: list[FlatBucket], *, codec: Codec, participation: Participation, chunk_bytes, outer,
                 shares: "Round | None" = None):
        self.comm, self.buckets, self.codec, self.participation = comm, buckets, codec, participation
        self.chunk_bytes, self.outer = chunk_bytes, outer
        self.lowbit = codec.reduction == "lowbit"
        # Low-bit rounds: each bucket's error feedback (None: none kept) and reused buffers; a
        # round that ``shares`` another's (a fragment's rounds in flight and blocking) uses those.
        self.feedback: list[ErrorFeedback] | None = None
        self.scratch: list[Scratch] | None = None
        if shares is not None:
            self.feedback, self.scratch = shares.feedback, shares.scratch
        elif self.lowbit:
            feedback = [codec.feedback(b.values.numel(), b.values.device) for b in buckets]
            self.feedback = feedback if all(f is not None for f in feedback) else None
            self.scratch = [Scratch() for _ in buckets]
        first = buckets[0].values
        self._weight = torch.zeros(1, dtype=torch.float32, device=first.device)
        self._found = torch.zeros(1, dtype=torch.float32, device=first.device)

    @torch.no_grad()
    def run(self, index: int, collective, on_left_out) -> int:
        """Round ``index`` (0-based); returns its payload bytes. ``collective(what, fn)`` runs the
        all-reduce; ``on_left_out()`` is called when this worker is left out for non-finite values."""
        if self.lowbit:
            return self._run_lowbit(index, collective, on_left_out)
        expected = self.begin(index, on_left_out)
        pieces = [(b, lo, hi) for b in self.buckets for lo, hi in b.ranges(self._chunk_numel(b))]
        tensors = [self._weight] + [b.sent[lo:hi] for b, lo, hi in pieces]
        arrived = iter([None] + pieces)
        total = [0.0]

        def on_arrival(t: torch.Tensor) -> None:
            piece = next(arrived)
            if piece is None:
                total[0] = float(t)  # the weight goes first: the rescaling is known for every piece
            elif total[0] > 0:
                self._finish_piece(*piece, total[0], expected)

        collective("model averaging", lambda: self.comm.all_reduce(tensors, then=on_arrival))
        if total[0] == 0.0:
            raise NonFiniteError(f"averaging round {index + 1}: no worker had finite parameters")
        if self.outer is not None and not self.outer.blockwise:
            with_params = [b for b in self.buckets if b.n_params]
            self.outer.apply_all([b.values[: b.n_params] for b in with_params])
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def begin(self, index: int, on_left_out) -> int:
        """Round ``index``'s first half: decide who takes part, fill what this worker sends and its
        weight (1 or 0); returns K, the workers expected to take part."""
        expected = self.expected()
        taking_part = self._taking_part(index)
        if taking_part and not self._prepare(expected):
            if not self.participation.skip_nonfinite:
                raise NonFiniteError(f"rank {self.comm.rank}: non-finite parameters at averaging round {index + 1}")
            taking_part = False
            on_left_out()
        if not taking_part:
            for b in self.buckets:
                b.sent.zero_()  # 0·NaN is NaN: a left-out worker must contribute true zeros
        self._weight.fill_(1.0 if taking_part else 0.0)
        return expected

    @torch.no_grad()
    def finish(self, index: int, total: float, expected: int) -> None:
        """Round ``index``'s second half after a transport that was not followed piece by piece
        (a round in flight, :mod:`.overlap`): the sum in the send buffers becomes the average,
        outer-stepped, and the new anchor. ``total``: the weight sum."""
        if total == 0.0:
            raise NonFiniteError(f"averaging round {index + 1}: no worker had finite parameters")
        for b in self.buckets:
            self._finish_piece(b, 0, b.values.numel(), total, expected)
        if self.outer is not None and not self.outer.blockwise:
            self.outer.apply_all([b.values[: b.n_params] for b in self.buckets if b.n_params])

    # A round under a changing group (localclip.comm.membership): the averager sets the round's
    # Members here for the round's duration, and they decide K and who takes part.
    members = None

    def expected(self) -> int:
        """K, the workers expected to take part in a round (partial participation: the sampled;
        under a changing group: the round's quorum)."""
        if self.members is not None:
            return self.members.quorum
        return self.participation.expected(self.comm.world_size)

    def _taking_part(self, index: int) -> bool:
        """Whether this worker is sampled for round ``index`` (partial participation), or takes
        part in it under a changing group."""
        if self.members is not None:
            return self.members.taking_part
        return self.participation.taking_part(self.comm.rank, self.comm.world_size, index)

    def _chunk_numel(self, bucket: FlatBucket) -> int | None:
        return None if self.chunk_bytes is None else self.chunk_bytes // bucket.sent.element_size()

    def _prepare(self, expected: int) -> bool:
        """Fill what this worker sends (scaled by 1/expected); return whether it is all finite."""
        found = self._found.zero_()
        for b in self.buckets:
            # Float64 values are divided after the sum instead: the kernel's scale is float32,
            # and 1/3 in float32 is not exact enough for float64 averages.
            exact = b.values.dtype == torch.float64
            inv = torch.full((1,), 1.0 if exact else 1.0 / expected, dtype=torch.float32, device=b.values.device)
            if b.wire is None:
                torch._amp_foreach_non_finite_check_and_unscale_([b.values], found, inv)
                continue
            self.codec.encode(b.values, b.anchor, b.wire, 1.0 if exact else 1.0 / expected, found)
        return not bool(found)

    def _finish_piece(self, b: FlatBucket, lo: int, hi: int, total: float, expected: int) -> None:
        """The received sum of ``b``'s elements [lo, hi) becomes the average (and, with an anchor,
        the outer step's result and the new anchor), block by block. ``total``: the weight sum."""
        exact = b.values.dtype == torch.float64
        rescale = expected / total
        index = sum(1 for other in self.buckets[: self.buckets.index(b)] if other.n_params)
        for start in range(lo, hi, BLOCK_NUMEL):
            end = min(start + BLOCK_NUMEL, hi)
            values = b.values[start:end]
            if b.wire is not None:
                self.codec.decode(b.wire[start:end], values)  # the sum of the scaled changes
            if exact:
                values.div_(total)
            elif rescale != 1.0:
                values.mul_(rescale)
            if b.anchor is None:
                continue
            anchor = b.anchor[start:end]
            if b.wire is not None:
                values.add_(anchor)  # x̄ = a + mean change
            self._step_anchor(b, index, start, end, values, anchor)

    def _step_anchor(self, b: FlatBucket, index: int, start: int, end: int, values: torch.Tensor, anchor: torch.Tensor) -> None:
        """``values`` holds the block's average x̄: the outer step (if any) on its parameters, and
        the new anchor. ``index``: the bucket's place among those with parameters."""
        split = min(max(b.n_params - start, 0), end - start)  # parameters first, then buffers
        if self.outer is not None and split:
            if self.outer.blockwise:
                self.outer.apply(index, start, values[:split], anchor[:split])
            # else the outer step reads the parameters' anchor after the transport
            anchor[split:].copy_(values[split:])
            return
        anchor.copy_(values)

    def _run_lowbit(self, index: int, collective, on_left_out) -> int:
        """A blocking low-bit round (see the module docstring); returns its payload bytes."""
        changes, taking_part = self._lowbit_changes(index, self._taking_part(index), on_left_out)
        results = []
        collective("model averaging", lambda: results.extend([e.wait() for e in self._start_exchanges(changes, taking_part)]))
        self.finish_lowbit(index, results)
        return sum(r.payload for r in results)

    @torch.no_grad()
    def start_lowbit(self, index: int, collective, on_left_out) -> list[LowbitPending]:
        """Round ``index``'s low-bit exchanges, started (one per bucket: the change since the
        anchor encoded, the residuals updated, the all-to-alls on their way); :meth:`finish_lowbit`
        takes their results."""
        changes, taking_part = self._lowbit_changes(index, self._taking_part(index), on_left_out)
        exchanges = []
        collective("model averaging (start)", lambda: exchanges.extend(self._start_exchanges(changes, taking_part)))
        return exchanges

    def _start_exchanges(self, changes: list[torch.Tensor], taking_part: bool) -> list[LowbitPending]:
        feedback = self.feedback or [None] * len(changes)
        return [self.codec.start(self.comm, change, f, taking_part=taking_part, scratch=s)
                for change, f, s in zip(changes, feedback, self.scratch)]

    @torch.no_grad()
    def finish_lowbit(self, index: int, results: list[LowbitRound]) -> None:
        """Round ``index``'s low-bit results (one per bucket) become the average, anchor plus
        the decoded average change, outer-stepped, and the new anchor."""
        with_params = 0
        for b, result in zip(self.buckets, results):
            if result.taking_part == 0:
                raise NonFiniteError(f"averaging round {index + 1}: no worker had finite parameters")
            for start in range(0, b.values.numel(), BLOCK_NUMEL):
                end = min(start + BLOCK_NUMEL, b.values.numel())
                values, anchor = b.values[start:end], b.anchor[start:end]
                torch.add(anchor, result.average[start:end], out=values)  # x̄ = a + mean change
                self._step_anchor(b, with_params, start, end, values, anchor)
            with_params += bool(b.n_params)
        if self.outer is not None and not self.outer.blockwise:
            self.outer.apply_all([b.values[: b.n_params] for b in self.buckets if b.n_params])

    def _lowbit_changes(self, index: int, taking_part: bool, on_left_out) -> tuple[list[torch.Tensor], bool]:
        """Each bucket's change since the anchor, and whether this worker takes part (False once
        it is left out for a non-finite change)."""
        # In float32 (the low-bit reduction's format), kept in the buffer that lowbit_average returns the average
        # in (Scratch.output says why that is safe).
        changes = [s.output(b.values.numel(), b.values.device) for s, b in zip(self.scratch, self.buckets)]
        if taking_part:
            found = self._found.zero_()
            one = torch.ones(1, dtype=torch.float32, device=found.device)
            for b, change in zip(self.buckets, changes):
                torch.sub(b.values, b.anchor, out=change)
                # Checked before anything leaves this worker (one pass: the multiplication by 1 is exact).
                torch._amp_foreach_non_finite_check_and_unscale_([change], found, one)
            if bool(found):
                if not self.participation.skip_nonfinite:
                    raise NonFiniteError(f"rank {self.comm.rank}: non-finite parameters at averaging round {index + 1}")
                taking_part = False
                on_left_out()
        return changes, taking_part

    @torch.no_grad()
    def buffers_only(self, collective) -> int:
        """Average only the floating-point buffers (the parameters are identical everywhere, as in
        naive parallel clipping); returns the payload bytes, 0 if there are none (no round)."""
        tensors = [b.values[b.n_params :] for b in self.buckets if b.values.numel() > b.n_params]
        if self.comm.world_size == 1 or not tensors:
            return 0
        k = self.comm.world_size
        collective("buffer averaging", lambda: self.comm.all_reduce(tensors, then=lambda t: t.div_(k)))
        for b in self.buckets:
            if b.anchor is not None:
                b.anchor[b.n_params :].copy_(b.values[b.n_params :])
        return sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def average_parameters(tensors, group=None, *, codec: Codec | str = "none", participation: Participation | None = None,
                       index: int = 0) -> int:
    """One round, with no averager around it: each tensor of ``tensors`` becomes, in place, its
    average over the workers of ``group`` (default :func:`localclip.comm.current`); returns the
    payload bytes this worker sent.

    What :func:`torch.distributed.algorithms.model_averaging.utils.average_parameters` is to
    torch's averager: the same :class:`Round` that :class:`~localclip.averaging.PeriodicAverager`
    runs, over a copy of the tensors in flat buffers, keeping nothing afterwards. There is no
    anchor to send a change against, so an anchored ``codec`` (bf16, fp16, int8, int4) sends the
    change since zero, the values themselves, in its format; ``participation`` and round
    ``index`` decide who takes part (every worker, by default). Every worker calls it with
    tensors of the same shapes, dtypes and order.
    """
    comm = group if group is not None else current()
    codec = codecs.get(codec)
    tensors = list(tensors)
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    buckets = []
    for group_tensors in by_key.values():
        bucket = FlatBucket([t.detach() for t in group_tensors], [lambda view: None] * len(group_tensors),
                            sum(t.numel() for t in group_tensors))
        if codec.anchored:
            bucket.anchor = torch.zeros_like(bucket.values)
            bucket.wire = codec.send_buffer(bucket.values)
        buckets.append(bucket)
    if not buckets:
        return 0
    rnd = Round(comm, buckets, codec=codec, participation=participation or Participation(), chunk_bytes=None, outer=None)
    sent = rnd.run(index, lambda what, fn: fn(), lambda: None)
    for group_tensors, bucket in zip(by_key.values(), buckets):
        for t, view in zip(group_tensors, bucket.views):
            t.copy_(view)
    return sent
