"""Low-bit (int8, int4) averaging of a flat float32 tensor: the reduction in the wire format.

Owns :func:`lowbit_average`, its three phases (:func:`start_lowbit_average`,
:class:`LowbitPending`) and the :class:`Lowbit` codec that rounds run it through. The codes are :mod:`.blocks`' and the residuals :mod:`.feedback`'s; it
knows nothing of models or schedules: the round hands it the flat change since the anchor and
gets back the average, the same bits on every worker, and the bytes it sent.

Reduction. :func:`lowbit_average` is a reduce-scatter followed by an all-gather, in the wire
format: each worker adds its residual to its input, splits it into ``world_size`` chunks,
encodes each chunk and sends chunk ``j`` (codes and scales) to worker ``j`` (all-to-all).
Worker ``j`` decodes the chunks it received and adds them in float32 in rank order, divides by
the world size (or the weights' sum, below), adds its shard residual, re-encodes the averaged shard with the same codec and
sends it to all (all-gather); every worker decodes the same bytes into the same bits. It never
sums in 8 or 4 bits: codes from different workers carry different scales, so they are not in
the same units until decoded; a sum of ``world_size`` codes needs ``log2(world_size)`` more bits
than a code has; and a ring that re-quantizes partial sums at every hop adds ``world_size - 1``
rounding errors whose total depends on the ring order, so workers would disagree and error
feedback could not account for them. Here every element is quantized exactly twice per round,
once by its sender and once by its shard's owner, and both errors are fed back
(:class:`~.feedback.ErrorFeedback`).

Transport. Each phase is issued as several collectives of at most :data:`PIECE_BYTES` per
peer, all started (``start_all_to_all``, ``start_all_gather``) before the first is waited for:
over gloo on a shaped 100 Mbit/s link one all-to-all of 12.3 MB each way took 1.9-2.1 s (twice
the wire time) and 8 such pieces one after the other as long, while 32 pieces in flight
together took 1.04 s. The pieces carry the same bytes, so the results do not depend on them.
:func:`start_lowbit_average` issues the reduction in three phases (:class:`LowbitPending`:
encode and start the all-to-all; owner sum, re-encode and start the all-gather; decode), so
that a caller can compute between them; :func:`lowbit_average` runs the three at once. The
phases do the same arithmetic in the same order, so the bits do not depend on when each runs.

Weights. With ``taking_part`` each chunk also carries its sender's weight (a float32, 1 or 0),
so that a round can leave workers out (partial participation, non-finite values) without a
collective of its own: a worker left out sends zero chunks with weight 0, and each owner divides
its sum by the weights' sum, which every worker receives in the all-to-all and so knows.

Bytes. :attr:`LowbitRound.bytes_sent` is what this worker puts on the wire to its peers, scales,
padding and weights included: in the all-to-all its ``world_size - 1`` chunks for the others, in
the all-gather its shard to each of the ``world_size - 1`` others (a worker's own chunk never
leaves it). Chunks are ``ceil(numel / world_size)`` elements, so padding is under
``world_size`` elements (one more code per chunk for odd int4 chunks). A float32 all-reduce
with the same reduce-scatter and all-gather pattern (what :mod:`localclip.comm.distributed`
does for three or more workers, and what a ring moves) sends ``2 * (world_size - 1)`` float32
chunks; with two workers that is ``numel * 4`` bytes. :attr:`LowbitRound.payload` is the
all-to-all's send buffer, every chunk with its own: the whole input encoded, the counterpart of
an all-reduce's tensor (what the averager counts; on the wire both move about
``2 (world_size - 1) / world_size`` times that). The encoded bytes assume the workers share one
byte order (scales travel as raw float32 bytes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from localclip.averaging.codecs.blocks import (
    BLOCK_NUMEL, Scratch, _at_least, _buffer, _check_bits, _check_block, _check_flat, _decode_piece, _decode_to_flat,
    _encode_piece, _encode_rows, _piece_blocks, _put_codes, drop_nonfinite,
)
from localclip.averaging.codecs.base import Codec
from localclip.averaging.codecs.feedback import ErrorFeedback
from localclip.comm.base import Communicator

__all__ = ["BITS", "PIECE_BYTES", "Lowbit", "LowbitPending", "LowbitRound", "lowbit_average", "start_lowbit_average"]

BITS = {"int8": 8, "int4": 4}  # compression -> bits of the block codes

# Each phase goes out as collectives of at most this many bytes per peer, all started before any
# is waited for (see "Transport" in the module docstring).
PIECE_BYTES = 512 << 10


class LowbitRound(NamedTuple):
    """The result of :func:`lowbit_average`: the averaged tensor (the same bits on every worker),
    the bytes this worker sent to its peers (codes, scales, padding and weights, both phases),
    the bytes of its all-to-all send buffer (every chunk, its own included, with their weights:
    its whole input encoded), and how many workers took part (every worker knows the same
    number; 0 leaves a NaN average)."""

    average: torch.Tensor
    bytes_sent: int
    payload: int = 0
    taking_part: int = 0


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    """Byte ranges of at most :data:`PIECE_BYTES` covering ``nbytes`` (one empty range for 0)."""
    return [(lo, min(nbytes, lo + PIECE_BYTES)) for lo in range(0, max(nbytes, 1), PIECE_BYTES)]


@torch.no_grad()
def lowbit_average(comm: Communicator, delta: torch.Tensor, bits: int, feedback: "ErrorFeedback | None" = None, **options) -> LowbitRound:
    """Average the 1-D float32 ``delta`` over ``comm``'s workers in ``bits``-bit wire format:
    :func:`start_lowbit_average` (its arguments and keyword ``options``) waited for at once."""
    return start_lowbit_average(comm, delta, bits, feedback, **options).wait()


@torch.no_grad()
def start_lowbit_average(
    comm: Communicator,
    delta: torch.Tensor,
    bits: int,
    feedback: ErrorFeedback | None = None,
    *,
    block: int = BLOCK_NUMEL,
    generator: torch.Generator | None = None,
    taking_part: bool | None = None,
    scratch: Scratch | None = None,
) -> "LowbitPending":
    """Start averaging the 1-D float32 ``delta`` over ``comm``'s workers in ``bits``-bit wire
    format: encode ``delta`` plus the residual, update the residual and start the all-to-all;
    the rest is :meth:`LowbitPending.advance` and :meth:`LowbitPending.wait`.

    All workers call it with tensors of the same length, ``bits``, ``block`` and the same kind
    of ``taking_part`` (None on all, or a bool on all). With ``feedback``, its residuals are
    added to this round's input and replaced by what this round's encodings left out; without
    it, that is dropped. ``generator`` makes the rounding stochastic (this worker's draws only).
    ``delta`` is read only here and not modified. With one worker nothing is sent: the average
    is the input (``delta`` plus the residual, which is then zero).

    ``taking_part``: None, every worker's input counts and the sum is divided by the world
    size. A bool: each chunk carries this worker's weight (1 or 0, a float32 after its scales);
    a worker not taking part sends zero chunks and keeps its residual for a later round (it
    still owns its shard: it sums, re-encodes and sends it, updating its shard residual), and
    each owner divides its sum by the weights' sum, which every worker then knows.

    ``scratch``: buffers to reuse between calls (:class:`Scratch`); the returned average then
    lives in it, until the next call with the same scratch. ``feedback``, ``generator`` and
    ``scratch`` belong to the exchange until its :meth:`~LowbitPending.wait` returns.
    """
    _check_flat(delta, "lowbit_average input")
    bits = _check_bits(bits)
    block = _check_block(block, bits)
    n, world = delta.numel(), comm.world_size
    if feedback is not None and feedback.residual.shape != delta.shape:
        raise ValueError(f"Error-feedback residual has {feedback.residual.numel()} elements, the input {n}")
    weighted = taking_part is not None
    # What this worker sends and the residual that tracks it; a worker not taking part sends
    # zeros, and its residual waits for a round it takes part in.
    sending = feedback if not weighted or taking_part else None
    if world == 1 or n == 0:
        u = torch.zeros_like(delta) if weighted and not taking_part else delta + sending.residual if sending is not None else delta.clone()
        if sending is not None:
            sending.residual.zero_()
        return LowbitPending(comm, LowbitRound(u, 0, 0, int(taking_part) if weighted else world))

    device = delta.device
    m = -(-n // world)  # chunk length: chunk j is worker j's shard
    nb = -(-m // block)
    cb = m if bits == 8 else (m + 1) // 2
    wire = cb + 4 * nb  # bytes of one encoded chunk
    # Each chunk on the wire: its codes, its scales (float32 bytes), and its weight if any.
    payload = _buffer(scratch, "payload", (world, wire + 4 * weighted), torch.uint8, device)
    scales = _buffer(scratch, "scales", (world, nb), torch.float32, device)
    if weighted and not taking_part:
        source, add = None, None
    elif sending is not None:
        # The input is delta + residual, summed into the residual, which then takes what the
        # codes leave out: residual <- (delta + residual) - decoded.
        source, add = sending.residual, delta
    else:
        source, add = delta, None
    lost = _encode_rows(world, m, n, bits, block, generator, payload[:, :cb], scales, source, add, sending is not None, scratch)
    payload[:, cb:wire].copy_(scales.view(torch.uint8))
    if weighted:
        payload[:, wire:].copy_(torch.full((world, 1), 1.0 if taking_part else 0.0, dtype=torch.float32, device=device).view(torch.uint8))
    if sending is not None and lost:
        drop_nonfinite(sending.residual)
    received = _buffer(scratch, "received", tuple(payload.shape), torch.uint8, device)
    exchange = LowbitPending(comm)
    exchange.payload = payload.numel()
    exchange._to_all = [comm.start_all_to_all(list(payload[:, lo:hi].unbind(0)), list(received[:, lo:hi].unbind(0)))
                        for lo, hi in _pieces(payload.shape[1])]
    exchange._shape = (n, m, bits, block, cb, wire, weighted)
    exchange._feedback, exchange._generator, exchange._scratch = feedback, generator, scratch
    exchange._received = received
    return exchange


class LowbitPending:
    """A started :func:`lowbit_average`, in three phases, each started by the one before:

    1. :func:`start_lowbit_average`: encode, update the sender's residual, start the all-to-all;
    2. :meth:`advance`: wait for the all-to-all, decode this worker's shard from every worker and
       add it in float32 in rank order, re-encode it (shard residual), start the all-gather;
    3. :meth:`wait`: wait for the all-gather and decode the average.

    Between the phases the worker computes on while the transport travels. The phases do the
    same arithmetic in the same order as the blocking call, so the result has the same bits
    whenever each is called. Every worker must call :meth:`advance` of its exchanges in the same
    order (it issues a collective); :meth:`wait` advances first if that was not done.

    Attributes:
        payload: the bytes of the all-to-all's send buffer (:attr:`LowbitRound.payload`), known
            from the start.
    """

    def __init__(self, comm: Communicator, result: LowbitRound | None = None):
        self.comm, self._result = comm, result
        self.payload = 0 if result is None else result.payload
        self._to_all: list | None = None  # phase 1's collectives, until advance
        self._gather: list | None = None  # phase 2's collectives, until wait

    @property
    def advanced(self) -> bool:
        """Whether the all-gather was started (or the result is in)."""
        return self._to_all is None

    @torch.no_grad()
    def advance(self) -> None:
        """Phase 2 (see the class docstring); a no-op once done."""
        if self._to_all is None:
            return
        n, m, bits, block, cb, wire, weighted = self._shape
        feedback, scratch, received = self._feedback, self._scratch, self._received
        world, device = self.comm.world_size, received.device
        for p in self._to_all:
            p.wait()
        self._to_all = None
        if weighted:
            weights = received[:, wire:].contiguous().view(torch.float32)[:, 0]
            total = weights[0].clone()
            for i in range(1, world):
                total.add_(weights[i])
            self._count = int(total.item())
        else:
            total = self._count = world
        if feedback is not None and (feedback.shard_residual is None or feedback.shard_residual.numel() != m):
            feedback.shard_residual = torch.zeros(m, dtype=torch.float32, device=device)
        codes, scales = received[:, :cb], received[:, cb:wire].contiguous().view(torch.float32)
        nb = scales.shape[1]
        mine = _buffer(scratch, "mine", (1, wire), torch.uint8, device)
        shard_scales = _buffer(scratch, "shard scales", (1, nb), torch.float32, device)
        per = _piece_blocks(block)
        size = min(per, nb) * block
        parts_buffer = _at_least(scratch, "parts", world * size, torch.float32, device)
        work = _at_least(scratch, "work", size, torch.float32, device)
        tmp = _at_least(scratch, "tmp", size, torch.float32, device)
        lost = False
        # My shard, a piece of blocks at a time while it is in cache: everyone's chunk `rank`
        # decoded and added in float32 in rank order, divided, plus the shard residual, then
        # re-encoded (the residual takes what the codes leave out).
        for b0 in range(0, nb, per):
            k = min(per, nb - b0)
            c0, c1 = b0 * block, (b0 + k) * block
            parts = parts_buffer[: world * (c1 - c0)].view(world, c1 - c0)
            _decode_piece(codes, scales, c0, c1, m, bits, block, parts, scratch)
            v = max(min(c1, m) - c0, 0)
            w = work[: c1 - c0]
            shard = w[:v]
            torch.add(parts[0, :v], parts[1, :v], out=shard)
            for i in range(2, world):
                shard.add_(parts[i, :v])
            shard.div_(total)
            if feedback is not None:
                residual = feedback.shard_residual[c0 : c0 + v]
                shard.add_(residual)
                residual.copy_(shard)
            w[v:].zero_()
            s, piece_lost = _encode_piece(w.view(k, block), w.view(k, block), b0, nb, bits, self._generator, tmp)
            lost |= piece_lost
            shard_scales[0, b0 : b0 + k].copy_(s)
            _put_codes(mine[:, :cb], 0, c0, c1, m, bits, w, tmp)
            if feedback is not None:
                w.view(k, block).mul_(s.unsqueeze(1))
                residual.sub_(shard)
        mine[:, cb:].copy_(shard_scales.view(torch.uint8))
        if feedback is not None and lost:
            drop_nonfinite(feedback.shard_residual)
        self._gathered = _buffer(scratch, "gathered", (world, wire), torch.uint8, device)
        self._gather = [self.comm.start_all_gather(mine[0, lo:hi], list(self._gathered[:, lo:hi].unbind(0))) for lo, hi in _pieces(wire)]

    @torch.no_grad()
    def wait(self) -> LowbitRound:
        """Phase 3 (advancing first if needed): the round's result; the same result once done."""
        self.advance()
        if self._result is None:
            n, m, bits, block, cb, wire, _ = self._shape
            for p in self._gather:
                p.wait()
            gathered, scratch, world = self._gathered, self._scratch, self.comm.world_size
            out = torch.empty(n, dtype=torch.float32, device=gathered.device) if scratch is None else scratch.output(n, gathered.device)
            scales = gathered[:, cb:].contiguous().view(torch.float32)
            spare = _buffer(scratch, "decoded", (world, scales.shape[1] * block), torch.float32, gathered.device)
            average = _decode_to_flat(gathered[:, :cb], scales, m, bits, block, out, spare, scratch)
            self._result = LowbitRound(average, (world - 1) * (self._received.shape[1] + wire), self.payload, self._count)
            self._gather = None
        return self._result


class Lowbit(Codec):
    """``compression="int8"|"int4"``: the change since the anchor through :func:`lowbit_average`,
    rounded to nearest (deterministic: no generator, nothing to seed); with ``error_feedback``
    (the default) each bucket keeps what its encodings left out for the next round
    (:class:`~localclip.averaging.codecs.feedback.ErrorFeedback`); without it that is dropped
    every round, a bias that nearest rounding makes systematic."""

    anchored = True
    reduction = "lowbit"

    def __init__(self, name: str, error_feedback: bool = True):
        if name not in BITS:
            raise ValueError(f"Invalid low-bit compression: {name!r} (expected one of {tuple(BITS)})")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"Invalid error_feedback: {error_feedback!r} (expected True or False)")
        self.name, self.bits, self.error_feedback = name, BITS[name], error_feedback

    def feedback(self, numel: int, device) -> ErrorFeedback | None:
        return ErrorFeedback(numel, device=device) if self.error_feedback else None

    def start(self, comm: Communicator, change: torch.Tensor, feedback: ErrorFeedback | None, *, taking_part: bool,
              scratch: Scratch) -> "LowbitPending":
        """Start one bucket's reduction of ``change`` (:func:`start_lowbit_average`)."""
        return start_lowbit_average(comm, change, self.bits, feedback, taking_part=taking_part, scratch=scratch)

    def __repr__(self) -> str:
        return f"Lowbit({self.name!r}" + ("" if self.error_feedback else ", error_feedback=False") + ")"
