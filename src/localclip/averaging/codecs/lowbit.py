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

Transport. Each chunk travels in pieces of at most :data:`PIECE_BYTES` per peer, each piece a
run of whole blocks, their codes followed by their scales (the weight, if any, goes first, in the
first piece), so that a piece can be decoded as soon as it lands. The send, receive and
gathered buffers are laid out piece after piece (:func:`_piece`), so that each piece's
collective sends from and receives into one run of memory, which the gloo communicator uses
as it is, with no copy. Over gloo on a shaped
100 Mbit/s link one all-to-all of 12.3 MB each way took 1.9-2.1 s (twice the wire time) and 32
pieces in flight together 1.04 s. The round is pipelined piece by piece, so that it costs about
the larger of the codec's work and the wire time rather than their sum: :func:`start_lowbit_average`
starts each piece's all-to-all as soon as that piece is encoded (the next is encoded while it
travels); :meth:`LowbitPending.advance` decodes, sums and re-encodes the shard of each piece as
it arrives and starts that piece's all-gather; :meth:`LowbitPending.wait` decodes each piece of
the average as it lands. The three phases can be called apart, so that a caller computes
between them; :func:`lowbit_average` runs the three at once. Every element goes through the
same arithmetic in the same order however the pieces are cut and whenever each phase runs, so
the bits depend on neither.

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
    BLOCK_NUMEL, Scratch, _at_least, _buffer, _check_bits, _check_block, _check_flat, _decode_piece, _encode_piece,
    _encode_rows, _piece_blocks, _put_codes, drop_nonfinite,
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
    head = 4 * weighted
    # Each chunk on the wire: its weight if any, then piece by piece its codes and their scales
    # (float32 bytes).
    pieces = _wire_pieces(m, nb, bits, block, head)
    payload = _buffer(scratch, "payload", (world * (wire + head),), torch.uint8, device)
    scales = _buffer(scratch, "scales", (world, max(b1 - b0 for b0, b1, *_ in pieces)), torch.float32, device)
    if weighted:
        _piece(payload, world, pieces[0])[:, :head].copy_(
            torch.full((world, 1), 1.0 if taking_part else 0.0, dtype=torch.float32, device=device).view(torch.uint8))
    if weighted and not taking_part:
        source, add = None, None
    elif sending is not None:
        # The input is delta + residual, summed into the residual, which then takes what the
        # codes leave out: residual <- (delta + residual) - decoded.
        source, add = sending.residual, delta
    else:
        source, add = delta, None
    # Stochastic rounding draws for every element of the rows in order (as when the rows are
    # encoded one after the other); the pieces take their columns.
    draws = None if generator is None else torch.rand(
        (world, nb * block), generator=generator, out=_buffer(scratch, "draws", (world, nb * block), torch.float32, device))
    received = _buffer(scratch, "received", tuple(payload.shape), torch.uint8, device)
    exchange = LowbitPending(comm)
    exchange.payload = payload.numel()
    exchange._to_all = []
    lost = False
    for piece in pieces:
        # Each piece leaves as soon as it is encoded; the next is encoded while it travels.
        b0, b1, lo, codes_at, scales_at, hi = piece
        k, sent = b1 - b0, _piece(payload, world, piece)
        lost |= _encode_rows(world, m, n, bits, block, None, sent[:, codes_at - lo : scales_at - lo], scales[:, :k], source,
                             add, sending is not None, scratch, (b0, b1), draws)
        sent[:, scales_at - lo :].copy_(scales[:, :k].view(torch.uint8))
        exchange._to_all.append(comm.start_all_to_all(list(sent.unbind(0)), list(_piece(received, world, piece).unbind(0))))
    if sending is not None and lost:
        drop_nonfinite(sending.residual)
    exchange._shape = (n, m, bits, block, cb, wire, weighted)
    exchange._pieces = pieces
    exchange._feedback, exchange._generator, exchange._scratch = feedback, generator, scratch
    exchange._received, exchange._chunk = received, wire + head
    return exchange


def _wire_pieces(m: int, nb: int, bits: int, block: int, head: int) -> list[tuple[int, int, int, int, int, int]]:
    """How a chunk of ``m`` elements (``nb`` blocks) travels, after ``head`` bytes (its weight):
    ``(b0, b1, lo, codes_at, scales_at, hi)`` for each piece, blocks ``[b0, b1)`` whose codes are
    bytes ``[codes_at, scales_at)`` of the chunk and whose scales ``[scales_at, hi)``; the piece
    travels as bytes ``[lo, hi)`` (the first with the head), at most :data:`PIECE_BYTES`."""
    q = max(1, (PIECE_BYTES - head) // ((block if bits == 8 else block // 2) + 4))
    cb = m if bits == 8 else (m + 1) // 2
    pieces, at = [], head
    for b0 in range(0, nb, q):
        b1 = min(nb, b0 + q)
        codes = (min(b1 * block, m) - b0 * block) if bits == 8 else (min(b1 * block, 2 * cb) - b0 * block) // 2
        pieces.append((b0, b1, 0 if b0 == 0 else at, at, at + codes, at + codes + 4 * (b1 - b0)))
        at += codes + 4 * (b1 - b0)
    return pieces


def _piece(buffer: torch.Tensor, world: int, piece: tuple) -> torch.Tensor:
    """A piece's bytes ``[lo, hi)`` of every worker's chunk, ``[world, hi - lo]``, in a buffer laid
    out piece after piece (each piece's ``world`` runs one after the other), so that the
    collective of a piece sends from and receives into one run of memory, with no copy."""
    lo, hi = piece[2], piece[5]
    return buffer[world * lo : world * hi].view(world, hi - lo)


class LowbitPending:
    """A started :func:`lowbit_average`, in three phases, each started by the one before:

    1. :func:`start_lowbit_average`: encode, update the sender's residual and start the
       all-to-all, a piece at a time;
    2. :meth:`advance`: as each piece of the all-to-all arrives, decode this worker's shard of it
       from every worker and add it in float32 in rank order, re-encode it (shard residual) and
       start that piece of the all-gather;
    3. :meth:`wait`: decode the average as each piece of the all-gather arrives.

    Between the phases the worker computes on while the transport travels; within each, the
    work on a piece overlaps the travel of the others. The phases do the same arithmetic in the
    same order as the blocking call, so the result has the same bits whenever each is called.
    Every worker must call :meth:`advance` of its exchanges in the same order (it issues
    collectives); :meth:`wait` advances first if that was not done.

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
        feedback, scratch, received, generator = self._feedback, self._scratch, self._received, self._generator
        world, device = self.comm.world_size, received.device
        nb = -(-m // block)
        gather_pieces = _wire_pieces(m, nb, bits, block, 0)
        mine = _buffer(scratch, "mine", (1, wire), torch.uint8, device)
        shard_scales = _buffer(scratch, "shard scales", (1, max(b1 - b0 for b0, b1, *_ in gather_pieces)), torch.float32, device)
        per = _piece_blocks(block)
        size = min(per, nb) * block
        parts_buffer = _at_least(scratch, "parts", world * size, torch.float32, device)
        work = _at_least(scratch, "work", size, torch.float32, device)
        tmp = _at_least(scratch, "tmp", size, torch.float32, device)
        self._gathered = _buffer(scratch, "gathered", (world * wire,), torch.uint8, device)
        self._gather = []
        lost = False
        for p, (pending, piece, sent) in enumerate(zip(self._to_all, self._pieces, gather_pieces)):
            pending.wait()
            arrived = _piece(received, world, piece)
            if p == 0:
                if weighted:
                    weights = arrived[:, :4].contiguous().view(torch.float32)[:, 0]
                    total = weights[0].clone()
                    for i in range(1, world):
                        total.add_(weights[i])
                    self._count = int(total.item())
                else:
                    total = self._count = world
                if feedback is not None and (feedback.shard_residual is None or feedback.shard_residual.numel() != m):
                    feedback.shard_residual = torch.zeros(m, dtype=torch.float32, device=device)
            b0, b1, lo, codes_at, scales_at, hi = piece
            codes, scales = arrived[:, codes_at - lo : scales_at - lo], arrived[:, scales_at - lo :].clone().view(torch.float32)
            base = b0 * block
            _, _, lo_out, codes_out, scales_out, hi_out = sent
            # My shard of the piece, a cache-sized part at a time: everyone's chunk `rank`
            # decoded and added in float32 in rank order, divided, plus the shard residual, then
            # re-encoded (the residual takes what the codes leave out).
            for s0 in range(b0, b1, per):
                s1 = min(b1, s0 + per)
                k, c0, c1 = s1 - s0, s0 * block, s1 * block
                parts = parts_buffer[: world * (c1 - c0)].view(world, c1 - c0)
                _decode_piece(codes, scales, c0 - base, c1 - base, m - base, bits, block, parts, scratch)
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
                u = None if generator is None else torch.rand(c1 - c0, generator=generator, out=tmp[: c1 - c0])
                s, piece_lost = _encode_piece(w.view(k, block), w.view(k, block), s0, nb, bits, u)
                lost |= piece_lost
                shard_scales[0, s0 - b0 : s1 - b0].copy_(s)
                _put_codes(mine[:, codes_out:scales_out], 0, c0 - base, c1 - base, m - base, bits, w, tmp)
                if feedback is not None:
                    w.view(k, block).mul_(s.unsqueeze(1))
                    residual.sub_(shard)
            mine[:, scales_out:hi_out].copy_(shard_scales[:, : b1 - b0].view(torch.uint8))
            self._gather.append(self.comm.start_all_gather(mine[0, lo_out:hi_out], list(_piece(self._gathered, world, sent).unbind(0))))
        self._to_all = None
        if feedback is not None and lost:
            drop_nonfinite(feedback.shard_residual)

    @torch.no_grad()
    def wait(self) -> LowbitRound:
        """Phase 3 (advancing first if needed): the round's result; the same result once done."""
        self.advance()
        if self._result is None:
            n, m, bits, block, cb, wire, _ = self._shape
            gathered, scratch, world = self._gathered, self._scratch, self.comm.world_size
            device = gathered.device
            out = torch.empty(n, dtype=torch.float32, device=device) if scratch is None else scratch.output(n, device)
            nb = -(-m // block)
            per = _piece_blocks(block)
            spare = _at_least(scratch, "work", min(per, nb) * block, torch.float32, device)
            for pending, piece in zip(self._gather, _wire_pieces(m, nb, bits, block, 0)):
                pending.wait()
                b0, b1, lo, codes_at, scales_at, hi = piece
                landed = _piece(gathered, world, piece)
                codes, scales = landed[:, codes_at - lo : scales_at - lo], landed[:, scales_at - lo :].clone().view(torch.float32)
                base = b0 * block
                # Each owner's shard of the piece, decoded where it lands in the average (a
                # part that ends inside a block, past the end, through a spare buffer).
                for j in range(world):
                    for s0 in range(b0, b1, per):
                        s1 = min(b1, s0 + per)
                        c0, c1 = s0 * block, s1 * block
                        v = max(c0, min(c1, m, n - j * m))
                        if v == c0:
                            continue
                        target = out[j * m + c0 : j * m + c1] if v == c1 else spare[: c1 - c0]
                        _decode_piece(codes[j : j + 1], scales[j : j + 1], c0 - base, c1 - base, m - base, bits, block,
                                      target.view(1, -1), scratch)
                        if v < c1:
                            out[j * m + c0 : j * m + v].copy_(target[: v - c0])
            self._result = LowbitRound(out, (world - 1) * (self._chunk + wire), self.payload, self._count)
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
