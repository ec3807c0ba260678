"""Low-bit (int8, int4) averaging of a flat float32 tensor, with error feedback.

Owns the block codec (:func:`encode`, :func:`decode`), the error-feedback state
(:class:`ErrorFeedback`), the reduction built on them (:func:`lowbit_average`) and the buffers
it may reuse between rounds (:class:`Scratch`). It knows nothing of models or schedules: the
averager hands it the flat change since the anchor and gets back the average, the same bits on
every worker, and the bytes it sent.

Codec. Symmetric absmax scaling per block of :data:`BLOCK_NUMEL` = 256 consecutive elements:
``scale = max|x| / qmax`` (float32, one per block), ``code = round(x / scale)`` clamped to
``[-qmax, qmax]`` with ``qmax`` = 127 (int8) or 7 (int4), ``x' = code * scale``. int4 codes are
stored offset by 8 and packed two per byte (element ``2k`` in the low nibble); an odd length is
padded with one zero code. 256 keeps the scales at 4/256 bytes per element (int8: 1.016 bytes
per element, 0.254x float32; int4: 0.516, 0.129x) while one outlier spoils only 255 neighbours.
Rounding is to nearest (ties to even) by default; with a ``torch.Generator`` it is stochastic
(``floor(x / scale + u)``, ``u`` uniform in [0, 1) drawn from that generator only), unbiased.
All of it is elementwise float32 arithmetic, so the same bytes decode to the same bits anywhere.

Special values. A block of zeros has scale 0 and decodes to zeros. A block holding a NaN or an
Inf is lost as a whole: its scale is NaN and all of its elements decode to NaN (a quantizer has
no code for Inf, and one non-finite value says nothing about its neighbours). The residual of
such a block is dropped (set to 0) so that a NaN does not come back in every later round; a
non-finite input therefore shows as NaN in that block of the average on every worker, for the
caller's non-finite policy to see.

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
once by its sender and once by its shard's owner, and both errors are fed back.

Error feedback. Worker ``i`` sends ``q_i = Q(d_i + e_i)`` and keeps ``e_i <- d_i + e_i - q_i``;
the owner of a shard sends ``Q(a + f)`` of the average ``a`` and keeps ``f <- a + f - Q(a + f)``.
Summed over rounds, the decoded averages equal the averages of the true inputs minus the
current residuals (``mean_i e_i + f``): the running sum tracks the truth within one round's
quantization error, instead of drifting by a bias each round.

Transport. Each phase is issued as several collectives of at most :data:`PIECE_BYTES` per
peer, all started (``start_all_to_all``, ``start_all_gather``) before the first is waited for:
over gloo on a shaped 100 Mbit/s link one all-to-all of 12.3 MB each way took 1.9-2.1 s (twice
the wire time) and 8 such pieces one after the other as long, while 32 pieces in flight
together took 1.04 s. The pieces carry the same bytes, so the results do not depend on them.
:func:`start_lowbit_average` issues the same reduction in three phases (:class:`LowbitPending`:
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

import sys
from typing import NamedTuple

import torch

from localclip.comm.base import Communicator

__all__ = ["BLOCK_NUMEL", "Encoded", "ErrorFeedback", "LowbitPending", "LowbitRound", "Scratch", "decode", "encode", "encoded_nbytes",
           "lowbit_average", "start_lowbit_average"]

BLOCK_NUMEL = 256
# Each phase goes out as collectives of at most this many bytes per peer, all started before any
# is waited for (see "Transport" in the module docstring).
PIECE_BYTES = 512 << 10
_QMAX = {8: 127, 4: 7}


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or bits not in _QMAX:
        raise ValueError(f"Invalid bits: {bits!r} (expected 8 or 4)")
    return bits


def _check_block(block: int, bits: int = 8) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"Invalid block size: {block!r} (must be an integer >= 1)")
    if bits == 4 and block % 2:
        # int4 packs two codes a byte within a block's row; an odd block would share a byte
        # between two blocks' codes.
        raise ValueError(f"Invalid block size: {block!r} with bits=4 (int4 packs two codes a byte: the block must be even)")
    return block


def _code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def encoded_nbytes(numel: int, bits: int, block: int = BLOCK_NUMEL) -> int:
    """Bytes of ``numel`` elements encoded: codes plus one float32 scale per block."""
    return _code_bytes(numel, _check_bits(bits)) + 4 * -(-numel // _check_block(block))


class Encoded(NamedTuple):
    """``numel`` elements encoded: ``codes`` (uint8, :func:`encoded_nbytes` less the scales) and
    ``scales`` (float32, one per block of ``block`` elements)."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()


def _padded(rows: int, m: int, block: int, device, scratch: "Scratch | None" = None, name: str = "") -> torch.Tensor:
    """A float32 matrix of ``rows`` rows of whole blocks covering ``m`` elements, zero past ``m``
    (only the tail is cleared: the caller fills columns ``[0, m)``)."""
    width = -(-m // block) * block
    xp = _buffer(scratch, name, (rows, width), torch.float32, device)
    xp[:, m:].zero_()
    return xp


class Scratch:
    """Buffers that :func:`lowbit_average` reuses from one call to the next: a round allocates
    several copies of the model, and fresh memory costs a page fault per 4 KiB (about half of
    a round's time on the CPU without them). One per caller (per flat bucket); not thread-safe."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def output(self, numel: int, device) -> torch.Tensor:
        """The float32 buffer that :func:`lowbit_average` returns the average in. A caller may
        keep that call's input there: the input is read only before the all-to-all, the average
        written after the all-gather."""
        return self.get("average", (numel,), torch.float32, device)

    def get(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        t = self._buffers.get(name)
        if t is None or t.shape != torch.Size(shape) or t.dtype != dtype or t.device != torch.device(device):
            t = self._buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return t


def _buffer(scratch: Scratch | None, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device) if scratch is None else scratch.get(name, shape, dtype, device)


def _at_least(scratch: Scratch | None, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A flat buffer of ``numel`` elements: the front of the named one, grown only when too small
    (for buffers that calls of several shapes share)."""
    t = None if scratch is None else scratch._buffers.get(name)
    if t is None or t.numel() < numel or t.dtype != dtype or t.device != torch.device(device):
        t = _buffer(scratch, name, (numel,), dtype, device)
    return t[:numel]


def _rows_from_flat(xp: torch.Tensor, m: int, flat: torch.Tensor) -> None:
    """Columns ``[0, m)`` of ``xp``'s rows, in order, hold ``flat``; rows past its end hold zeros."""
    n = flat.numel()
    full, rest = divmod(n, m)
    xp[:full, :m].copy_(flat[: full * m].view(full, m))
    if rest:
        xp[full, :rest].copy_(flat[full * m :])
        xp[full, rest:m].zero_()
    xp[full + (rest > 0):, :m].zero_()


def _sub_rows(flat: torch.Tensor, xp: torch.Tensor, m: int) -> None:
    """``flat`` minus columns ``[0, m)`` of ``xp``'s rows (laid out as :func:`_rows_from_flat`)."""
    n = flat.numel()
    full, rest = divmod(n, m)
    flat[: full * m].view(full, m).sub_(xp[:full, :m])
    if rest:
        flat[full * m :].sub_(xp[full, :rest])


def _flat_from_rows(xp: torch.Tensor, m: int, out: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_rows_from_flat`: ``out`` (flat) takes columns ``[0, m)`` of ``xp``'s rows."""
    n = out.numel()
    full, rest = divmod(n, m)
    out[: full * m].view(full, m).copy_(xp[:full, :m])
    if rest:
        out[full * m :].copy_(xp[full, :rest])
    return out


# Elements per piece of _absmax on the CPU: 4 MiB of float32 (4096 blocks of 256), so that its
# pairwise passes stay in cache.
_ABSMAX_PIECE = 1 << 20


def _absmax(blocks: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """``max(hi, -lo)`` of each block (float32 ``[rows, blocks]``) from ``hi, lo = aminmax`` of the
    block, NaN where the block holds a NaN.

    On the CPU ``aminmax`` over 256 elements at a time is slow (about 2 ns an element on one
    thread), so the absolute values are halved pairwise with ``maximum`` (NaN-propagating) down
    to 8 per block, then ``amax``, a piece of blocks at a time so that the pairwise passes stay in
    cache. The maximum of the absolute values is the same number as ``max(hi, -lo)`` except for
    the sign of a zero: a block of zeros gets the scale that ``aminmax`` gives it (it can be
    -0.0, whose bits travel), computed with ``aminmax`` for such blocks only."""
    rows, nb, block = blocks.shape
    if blocks.device.type != "cpu" or rows * nb == 0:
        lo, hi = torch.aminmax(blocks, dim=2)
        return torch.maximum(hi, lo.neg_())
    flat = blocks.reshape(rows * nb, block)  # a view: xp is contiguous
    out = torch.empty(rows * nb, dtype=torch.float32, device=blocks.device)
    piece = max(1, _ABSMAX_PIECE // block)
    tmp = _buffer(scratch, "absmax", (piece if scratch is not None else min(piece, rows * nb), block), torch.float32, blocks.device)
    for lo in range(0, rows * nb, piece):
        hi = min(lo + piece, rows * nb)
        t = torch.abs(flat[lo:hi], out=tmp[: hi - lo])
        h = block
        while h > 8 and h % 2 == 0:
            h //= 2
            torch.maximum(t[:, :h], t[:, h : 2 * h], out=t[:, :h])
        torch.amax(t[:, :h], dim=1, out=out[lo:hi])
    zero = out == 0
    if bool(zero.any()):
        # aminmax's zeros for those blocks, then one maximum over the whole [rows, blocks], as
        # over aminmax's output: whether a tie of zeros keeps the first or the second operand
        # depends on whether maximum takes its vectorized or its scalar loop at that position.
        lo, hi = torch.aminmax(flat[zero], dim=1)
        neg = out.neg()
        out[zero], neg[zero] = hi, lo
        out = torch.maximum(out, neg.neg_())
    return out.view(rows, nb)


@torch.no_grad()
def _encode_rows(xp: torch.Tensor, m: int, bits: int, block: int, generator: torch.Generator | None,
                 codes_out: torch.Tensor | None = None, scratch: Scratch | None = None,
                 rand_out: torch.Tensor | None = None, decoded: bool = True):
    """Encode each row of ``xp`` (float32 ``[rows, whole blocks]``, zero past column ``m``) on its
    own: (codes ``[rows, code bytes of m]``, scales ``[rows, blocks]``, whether a block was lost).
    ``xp`` is overwritten by the decoded values (what the codes stand for; NaN in a lost block),
    or with ``decoded=False`` by the codes alone (as float32).
    The codes go into ``codes_out`` if given (uint8 ``[rows, code bytes]``, may be a strided view);
    ``rand_out`` (float32, ``xp``'s shape), if given, is overwritten: stochastic rounding draws
    into it, int4 packs its pairs in it.

    Few passes and no large allocation but the codes, because a round encodes the whole model
    twice: the absmax comes from :func:`_absmax` (NaN propagates through it, so a block with a
    NaN or an Inf is found from its scale alone), a lost block is cleared only when there is
    one, the clamp runs only when a code can leave the range, and the quotient, its rounding and
    the decoding are done in ``xp`` itself."""
    rows = xp.shape[0]
    qmax = _QMAX[bits]
    nb = xp.shape[1] // block
    blocks = xp.view(rows, nb, block)
    scales = _absmax(blocks, scratch).div_(qmax)
    finite = torch.isfinite(scales)
    lost = not bool(finite.all())
    if lost:
        scales.masked_fill_(~finite, float("nan"))
        blocks.masked_fill_(~finite.unsqueeze(2), 0.0)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # NaN > 0 is False
    y = blocks.div_(divisor.unsqueeze(2))
    if generator is None:
        y.round_()
        # A normal scale is absmax / qmax within a relative 2^-24, so |x| / scale is at most
        # qmax (1 + 2^-23) < qmax + 1/2 and rounds into [-qmax, qmax]; only tiny (subnormal)
        # scales, whose quotient is inexact, need the clamp.
        clamp = bool(((scales > 0) & (scales < torch.finfo(torch.float32).tiny)).any())
    else:
        # Always: a quotient of qmax plus a draw just under 1 rounds to qmax + 1 in float32.
        u = torch.empty_like(xp) if rand_out is None else rand_out
        y.add_(torch.rand(u.shape, generator=generator, out=u).view(y.shape)).floor_()
        clamp = True
    if clamp:
        y.clamp_(-qmax, qmax)
    cb = m if bits == 8 else (m + 1) // 2
    codes = torch.empty(rows, cb, dtype=torch.uint8, device=xp.device) if codes_out is None else codes_out
    if bits == 8:
        codes.view(torch.int8).copy_(xp[:, :m])
    else:
        # Past m the values are zeros, so an odd m's padding code is a zero code (8). Each pair
        # is packed in float32, exactly (small integers): lo + 16 hi in [-119, 119] becomes a
        # byte, and + 136 (mod 256) makes it (lo + 8) + 16 (hi + 8), two nibbles 1..15.
        if 2 * cb > xp.shape[1]:
            # An odd block size and an odd length: no column for the padding code.
            q = torch.empty(rows, 2 * cb, dtype=torch.int8, device=xp.device)
            q.copy_(xp[:, : 2 * cb])
            q = q.view(torch.uint8).add_(8)
            torch.bitwise_or(q[:, 0::2], q[:, 1::2].bitwise_left_shift(4), out=codes)
        else:
            pairs = (torch.empty(rows, cb, dtype=torch.float32, device=xp.device) if rand_out is None
                     else rand_out.view(-1)[: rows * cb].view(rows, cb))  # the draws are spent
            torch.add(xp[:, 0 : 2 * cb : 2], xp[:, 1 : 2 * cb : 2], alpha=16, out=pairs)
            codes.view(torch.int8).copy_(pairs)
            codes.add_(136)
    if decoded:
        blocks.mul_(scales.unsqueeze(2))
    return codes, scales.contiguous(), lost


def _drop_nonfinite(residual: torch.Tensor) -> None:
    residual.masked_fill_(~torch.isfinite(residual), 0.0)


@torch.no_grad()
def _decode_rows(codes: torch.Tensor, scales: torch.Tensor, m: int, bits: int, block: int,
                 out: torch.Tensor | None = None, scratch: Scratch | None = None) -> torch.Tensor:
    """Decode :func:`_encode_rows`' output back to float32: a ``[rows, m]`` view of whole blocks
    (of ``out``, float32 ``[rows, blocks * block]``, if given)."""
    rows, nb = scales.shape
    if out is None:
        out = torch.empty(rows, nb * block, dtype=torch.float32, device=codes.device)
    if bits == 8:
        out[:, :m].copy_(codes.view(torch.int8))
        used = m
    else:
        cb = codes.shape[1]
        used = 2 * cb
        if used > out.shape[1]:  # an odd block size and an odd length: no column for the padding code
            out[:, 0:used:2].copy_(codes & 0xF)
            out[:, 1:used:2].copy_(codes >> 4)
            out[:, :used].sub_(8)
        else:
            # Unpacked to signed bytes first, so that the float32 output takes one contiguous
            # conversion and no subtraction: each byte c widened to 16 bits becomes
            # (c & 15) | (c >> 4) << 8, whose two bytes are the pair in order (little-endian),
            # minus 8 each. Contiguous 16-bit passes, where strided byte stores are slow.
            q = _at_least(scratch, "int4", rows * cb, torch.int16, codes.device).view(rows, cb)
            high = _at_least(scratch, "int4 high", rows * cb, torch.int16, codes.device).view(rows, cb)
            q.copy_(codes)
            torch.bitwise_left_shift(q, 4, out=high).bitwise_and_(0x0F00)
            q.bitwise_and_(0xF).bitwise_or_(high)
            pairs = q.view(torch.int8) if sys.byteorder == "little" else q.view(torch.int8).view(rows, cb, 2).flip(2)
            out[:, :used].copy_(pairs.sub_(8).reshape(rows, used))
    out[:, used:].zero_()
    out.view(rows, nb, block).mul_(scales.unsqueeze(2))
    return out[:, :m]


def _decode_to_flat(codes: torch.Tensor, scales: torch.Tensor, m: int, bits: int, block: int, out: torch.Tensor,
                    spare: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """:func:`_decode_rows` then :func:`_flat_from_rows` into ``out``, with the whole blocks of
    each row decoded where they land in ``out`` (no second pass over them); each row's last
    partial block and a last partial row go through ``spare`` (float32 ``[rows, blocks * block]``)."""
    n = out.numel()
    full, rest = divmod(n, m)
    nbw = m // block
    whole, cw = nbw * block, _code_bytes(nbw * block, bits)
    if bits == 4 and whole % 2:  # the row's whole blocks end inside a byte
        return _flat_from_rows(_decode_rows(codes, scales, m, bits, block, spare, scratch), m, out)
    target = out[: full * m].view(full, m)
    if full and whole:
        _decode_rows(codes[:full, :cw], scales[:full, :nbw], whole, bits, block, target[:, :whole], scratch)
    if full and whole < m:
        target[:, whole:].copy_(_decode_rows(codes[:full, cw:], scales[:full, nbw:], m - whole, bits, block,
                                             spare[:full, :block], scratch))
    if rest:
        last = _decode_rows(codes[full : full + 1], scales[full : full + 1], m, bits, block, spare[full : full + 1], scratch)
        out[full * m :].copy_(last[0, :rest])
    return out


def _check_flat(x: torch.Tensor, what: str) -> None:
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"{what} must be a 1-D float32 tensor, got {tuple(x.shape)} {x.dtype}")


def encode(x: torch.Tensor, bits: int, *, block: int = BLOCK_NUMEL, generator: torch.Generator | None = None) -> Encoded:
    """Encode the 1-D float32 tensor ``x`` with ``bits`` = 8 or 4 (see the module docstring)."""
    _check_flat(x, "encode input")
    bits = _check_bits(bits)
    block = _check_block(block, bits)
    xp = _padded(1, x.numel(), block, x.device)
    xp[0, : x.numel()].copy_(x)
    codes, scales, _ = _encode_rows(xp, x.numel(), bits, block, generator, decoded=False)
    return Encoded(codes[0], scales[0], x.numel(), bits, block)


def decode(enc: Encoded) -> torch.Tensor:
    """The float32 values that ``enc`` stands for."""
    codes, scales, n, bits, block = enc.codes.view(1, -1), enc.scales.view(1, -1), enc.numel, enc.bits, enc.block
    whole = n // block * block  # elements in whole blocks: decoded in place in the result
    if bits == 4 and block % 2:
        return _decode_rows(codes, scales, n, bits, block)[0].clone()
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    cw = _code_bytes(whole, bits)
    _decode_rows(codes[:, :cw], scales[:, : whole // block], whole, bits, block, out[:whole].view(1, whole))
    if whole < n:
        out[whole:].copy_(_decode_rows(codes[:, cw:], scales[:, whole // block :], n - whole, bits, block)[0])
    return out


class ErrorFeedback:
    """One worker's residuals between low-bit rounds (see the module docstring).

    Attributes:
        residual: float32, ``numel``: what this worker's encoding of its input left out.
        shard_residual: float32, one chunk: what its re-encoding of the averaged shard it owns
            left out; ``None`` until the first round (its size depends on the world size).
    """

    def __init__(self, numel: int, device: torch.device | str | None = None):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"Invalid numel: {numel!r} (must be an integer >= 0)")
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        self.shard_residual: torch.Tensor | None = None

    def state_dict(self) -> dict:
        return {
            "residual": self.residual.clone(),
            "shard_residual": None if self.shard_residual is None else self.shard_residual.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        residual = state["residual"]
        if residual.shape != self.residual.shape:
            raise ValueError(f"Error-feedback residual has {residual.numel()} elements, expected {self.residual.numel()}")
        self.residual.copy_(residual)
        shard = state["shard_residual"]
        self.shard_residual = None if shard is None else shard.to(self.residual.device, torch.float32).clone()

    def __repr__(self) -> str:
        return f"ErrorFeedback(numel={self.residual.numel()}, |residual|max={self.residual.abs().max().item() if self.residual.numel() else 0.0:g})"


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
    xp = _padded(world, m, block, device, scratch, "input")
    if weighted and not taking_part:
        xp[:, :m].zero_()
    elif sending is not None:
        # The input is delta + residual, summed once: the residual holds it until the decoded
        # values are subtracted below.
        _rows_from_flat(xp, m, sending.residual.add_(delta))
    else:
        _rows_from_flat(xp, m, delta)
    nb = xp.shape[1] // block
    cb = m if bits == 8 else (m + 1) // 2
    wire = cb + 4 * nb  # bytes of one encoded chunk
    # Each chunk on the wire: its codes, its scales (float32 bytes), and its weight if any.
    payload = _buffer(scratch, "payload", (world, wire + 4 * weighted), torch.uint8, device)
    decoded = _buffer(scratch, "decoded", tuple(xp.shape), torch.float32, device)  # free until the all-to-all is in
    codes, scales, lost = _encode_rows(xp, m, bits, block, generator, payload[:, :cb], scratch, decoded, sending is not None)
    payload[:, cb:wire].copy_(scales.view(torch.uint8))
    if weighted:
        payload[:, wire:].copy_(torch.full((world, 1), 1.0 if taking_part else 0.0, dtype=torch.float32, device=device).view(torch.uint8))
    if sending is not None:
        # residual <- (delta + residual) - decoded.
        _sub_rows(sending.residual, xp, m)
        if lost:
            _drop_nonfinite(sending.residual)
    received = _buffer(scratch, "received", tuple(payload.shape), torch.uint8, device)
    exchange = LowbitPending(comm)
    exchange.payload = payload.numel()
    exchange._to_all = [comm.start_all_to_all(list(payload[:, lo:hi].unbind(0)), list(received[:, lo:hi].unbind(0)))
                        for lo, hi in _pieces(payload.shape[1])]
    exchange._shape = (n, m, bits, block, cb, wire, weighted)
    exchange._feedback, exchange._generator, exchange._scratch = feedback, generator, scratch
    exchange._received, exchange._decoded = received, decoded
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
        # My shard: everyone's chunk `rank`, decoded and added in float32 in rank order.
        parts = _decode_rows(received[:, :cb], received[:, cb:wire].contiguous().view(torch.float32), m, bits, block, self._decoded,
                             scratch)
        sp = _padded(1, m, block, device, scratch, "shard")
        shard = sp[0, :m]
        torch.add(parts[0], parts[1], out=shard)
        for i in range(2, world):
            shard.add_(parts[i])
        if weighted:
            weights = received[:, wire:].contiguous().view(torch.float32)[:, 0]
            total = weights[0].clone()
            for i in range(1, world):
                total.add_(weights[i])
            shard.div_(total)
            self._count = int(total.item())
        else:
            shard.div_(world)
            self._count = world
        if feedback is not None:
            if feedback.shard_residual is None or feedback.shard_residual.numel() != m:
                feedback.shard_residual = torch.zeros(m, dtype=torch.float32, device=device)
            shard.add_(feedback.shard_residual)
            feedback.shard_residual.copy_(shard)
        mine = _buffer(scratch, "mine", (1, wire), torch.uint8, device)
        # The parts are summed: their buffer takes the shard's random draws.
        _, shard_scales, lost = _encode_rows(sp, m, bits, block, self._generator, mine[:, :cb], scratch, self._decoded[:1],
                                             feedback is not None)
        mine[:, cb:].copy_(shard_scales.view(torch.uint8))
        if feedback is not None:
            feedback.shard_residual.sub_(shard)
            if lost:
                _drop_nonfinite(feedback.shard_residual)
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
            average = _decode_to_flat(gathered[:, :cb], gathered[:, cb:].contiguous().view(torch.float32), m, bits, block, out,
                                      self._decoded, scratch)
            self._result = LowbitRound(average, (world - 1) * (self._received.shape[1] + wire), self.payload, self._count)
            self._gather = None
        return self._result
