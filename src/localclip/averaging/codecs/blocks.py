"""The int8/int4 block codec: a flat float32 tensor as codes and one float32 scale per block.

Owns the arithmetic of :func:`encode` and :func:`decode` (and their row-wise forms that the
low-bit reduction, :mod:`.lowbit`, runs on its chunks) and the buffers a caller may reuse
between calls (:class:`Scratch`).

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
such a block is dropped (set to 0, :func:`drop_nonfinite`) so that a NaN does not come back in
every later round; a non-finite input therefore shows as NaN in that block of the average on
every worker, for the caller's non-finite policy to see.

Passes. The limit of a codec on a CPU is the memory traffic of its passes, so an encoding works
a piece of blocks at a time (:data:`PIECE_NUMEL` elements per thread the process may use), every
pass over the piece running in cache: the input is read once and the codes written once. How
the work is cut into pieces changes no bit: every operation is elementwise or per block, except
one, the sign of a block of zeros' scale, which is taken as one ``maximum`` over all the blocks
would give it (:func:`_zero_signs`).
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch

__all__ = ["BLOCK_NUMEL", "Encoded", "Scratch", "decode", "encode", "encoded_nbytes"]

BLOCK_NUMEL = 256
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


class Scratch:
    """Buffers that :func:`~.lowbit.lowbit_average` reuses from one call to the next: a round's
    send and receive buffers, its average and the pieces' working buffers, whose fresh memory
    would cost a page fault per 4 KiB every round. One per caller (per flat bucket); not
    thread-safe."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def output(self, numel: int, device) -> torch.Tensor:
        """The float32 buffer that :func:`~.lowbit.lowbit_average` returns the average in. A caller may
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


# Elements per thread in a piece of the codec's passes: 512 Ki float32 (2 MiB), so that the
# passes over a piece (absmax, quotient, rounding, codes, decoding, residual) run in cache and
# each element crosses the memory bus once each way, and the thirty-odd torch calls a piece
# makes (about 4 us each) stay a few percent of its work: on one thread (AMD EPYC, AVX2)
# 24.2 M elements took 51 ms to encode with error feedback and 22 ms to decode in pieces of
# 256 Ki, 46.5 ms and 19 ms in pieces of 512 Ki, and no less in pieces of 1 Mi (int4; int8
# alike; docs/benchmarks.md, "Where a low-bit round's CPU time goes").
PIECE_NUMEL = 1 << 19


def _piece_blocks(block: int) -> int:
    """Blocks per piece of an encoding: about :data:`PIECE_NUMEL` elements for each thread this
    process may use (``torch.get_num_threads()``: each operation on a piece is split between
    them)."""
    return max(1, PIECE_NUMEL // block) * max(1, torch.get_num_threads())


def _absmax(blocks: torch.Tensor) -> torch.Tensor:
    """``max(hi, -lo)`` of each block of ``blocks`` (float32 ``[k, block]``, rows contiguous)
    from its largest and smallest element, NaN where the block holds a NaN.

    ``amax`` and ``amin`` over a block are fast where ``aminmax`` is not (about 2 ns an element
    on one thread on the CPU). They give the same numbers, except maybe the sign of a zero: a
    block of zeros gets its scale from :func:`_zero_signs`."""
    if blocks.device.type != "cpu":
        lo, hi = torch.aminmax(blocks, dim=1)
    else:
        hi, lo = torch.amax(blocks, dim=1), torch.amin(blocks, dim=1)
    return torch.maximum(hi, lo.neg_())


_SECOND_ON_TIE: dict = {}


def _second_on_tie(total: int, device) -> torch.Tensor:
    """Where ``torch.maximum`` of two float32 vectors of ``total`` elements keeps its second
    operand on a tie (bool ``[total]``), with this process's threads: its vectorized loop (runs
    of 16 or 32 elements) keeps the second, its scalar tail the first, and the threads split the
    vector where they do. Found by running it on zeros of both signs, once per length."""
    key = (total, torch.get_num_threads(), str(device))
    ties = _SECOND_ON_TIE.get(key)
    if ties is None:
        if len(_SECOND_ON_TIE) > 64:
            _SECOND_ON_TIE.clear()
        zeros = torch.zeros(total, dtype=torch.float32, device=device)
        ties = _SECOND_ON_TIE[key] = torch.signbit(torch.maximum(zeros, torch.full_like(zeros, -0.0)))
    return ties


def _zero_signs(out: torch.Tensor, blocks: torch.Tensor, second: torch.Tensor) -> None:
    """``out`` (:func:`_absmax` of ``blocks``, holding a zero) takes, in place, the zeros that the
    scales of the encoding's blocks of zeros have had since they came from ``hi, lo = aminmax``
    of each block and one ``maximum(hi, -lo)`` over all the encoding's blocks (-0.0 is a scale
    whose bits travel): ``aminmax``'s zeros for such blocks, and of ``hi`` and ``-lo`` the one
    that ``maximum`` keeps at the block's place in the encoding (``second``: the piece's slice
    of :func:`_second_on_tie`), so that the piece's bits do not depend on how the encoding is cut.

    A block of +0.0 only needs no ``aminmax``: both its zeros are +0.0 (``aminmax`` returns
    elements of the block), so its scale is -0.0 where ``maximum`` keeps ``-lo`` and +0.0 where
    it keeps ``hi``. Which blocks hold a -0.0 (int32 bits below zero) one ``amin`` over the
    piece's bits says, about a tenth of what ``aminmax`` over the blocks of zeros costs, and
    ``aminmax`` runs only on those: a change that is zero over much of the model (an unchanged
    model, a frozen part) costs about the same as any other."""
    zero = out == 0
    signed = zero & (torch.amin(blocks.view(torch.int32), dim=1) < 0)
    out[zero] = torch.where(second[zero], -0.0, 0.0)
    if bool(signed.any()):
        lo, hi = torch.aminmax(blocks[signed], dim=1)
        out[signed] = torch.where(second[signed], lo.neg_(), hi)


_TINY = torch.finfo(torch.float32).tiny


def _encode_piece(x: torch.Tensor, w: torch.Tensor, first: int, total: int, bits: int,
                  draws: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
    """Encode the blocks of ``x`` (float32 ``[k, block]``, rows contiguous: blocks ``[first,
    first + k)`` of an encoding of ``total`` blocks, all rows in order) into ``w`` (float32 ``[k, block]``, contiguous; may be ``x``): the
    codes as float32 (0 in a lost block); returns the scales (float32 ``[k]``) and whether a
    block was lost. ``draws``: stochastic rounding's uniform draws in [0, 1), float32, one per
    element of ``w`` (None: rounding to nearest).

    The passes over the piece: its largest and smallest values, the quotient by the scale, its
    rounding (and the clamp, only where a code can leave the range); one ``aminmax`` of the
    piece's absmax values says whether a block was lost (NaN or Inf), whether one is zero and
    whether a scale is subnormal, so the passes for those cases run only when they occur."""
    qmax = _QMAX[bits]
    if x.shape[0] == 0:
        return torch.empty(0, dtype=torch.float32, device=x.device), False
    absmax = _absmax(x)
    lo, hi = (float(v) for v in torch.aminmax(absmax))
    nan = lo != lo  # aminmax propagates a NaN to both
    lost = nan or hi == math.inf
    if lo == 0.0 or (nan and bool((absmax == 0).any())):
        _zero_signs(absmax, x, _second_on_tie(total, x.device)[first : first + x.shape[0]])
    scales = absmax.div_(qmax)
    # Whether a scale may be zero, NaN or subnormal (absmax below qmax times the smallest normal).
    small = lost or not lo >= qmax * _TINY
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)) if small else scales  # NaN > 0 is False
    y = torch.div(x, divisor.unsqueeze(1), out=w)
    if lost:
        finite = torch.isfinite(scales)
        scales.masked_fill_(~finite, float("nan"))
        w.masked_fill_(~finite.unsqueeze(1), 0.0)
    if draws is None:
        y.round_()
        # A normal scale is absmax / qmax within a relative 2^-24, so |x| / scale is at most
        # qmax (1 + 2^-23) < qmax + 1/2 and rounds into [-qmax, qmax]; only tiny (subnormal)
        # scales, whose quotient is inexact, need the clamp.
        clamp = small and bool(((scales > 0) & (scales < _TINY)).any())
    else:
        # Always: a quotient of qmax plus a draw just under 1 rounds to qmax + 1 in float32.
        y.add_(draws.view(y.shape)).floor_()
        clamp = True
    if clamp:
        y.clamp_(-qmax, qmax)
    return scales, lost


def _put_codes(codes: torch.Tensor, row: int, c0: int, c1: int, m: int, bits: int, y: torch.Tensor, pairs: torch.Tensor) -> None:
    """Columns ``[c0, c1)`` of ``row``'s codes (``codes``: uint8 ``[rows, code bytes of m]``)
    from ``y``, those columns' codes as float32. ``pairs``: a float32 buffer of at least half
    ``y``'s elements (int4)."""
    if bits == 8:
        e = min(c1, m)
        if e > c0:
            codes[row, c0:e].view(torch.int8).copy_(y[: e - c0])
        return
    # Past m the values are zeros, so an odd m's padding code is a zero code (8). Each pair is
    # packed in float32, exactly (small integers): lo + 16 hi in [-119, 119] becomes a byte, and
    # + 136 (mod 256) makes it (lo + 8) + 16 (hi + 8), two nibbles 1..15. c0 is even (a block is).
    e = min(c1, 2 * codes.shape[1])
    if e > c0:
        p = pairs[: (e - c0) // 2]
        torch.add(y[0 : e - c0 : 2], y[1 : e - c0 : 2], alpha=16, out=p)
        out = codes[row, c0 // 2 : e // 2]
        out.view(torch.int8).copy_(p)
        out.add_(136)


@torch.no_grad()
def _encode_rows(rows: int, m: int, n: int, bits: int, block: int, generator: torch.Generator | None,
                 codes: torch.Tensor, scales: torch.Tensor, source: torch.Tensor | None,
                 add: torch.Tensor | None = None, residual: bool = False, scratch: Scratch | None = None,
                 cols: tuple[int, int] | None = None, draws: torch.Tensor | None = None) -> bool:
    """Encode ``rows`` rows of whole blocks, row ``i`` holding flat elements ``[i m, (i + 1) m)``
    of ``source`` (``n`` elements; zeros past ``m``, past ``n``, and everywhere when ``source`` is
    None), each row on its own: the codes into ``codes`` (uint8 ``[rows, code bytes]``, may be a
    strided view), the scales into ``scales`` (float32 ``[rows, blocks]``); returns whether a
    block was lost.

    ``cols``: ``(b0, b1)``, only blocks ``[b0, b1)`` of each row (default: all of them), whose
    codes and scales then start at column 0 of ``codes`` and ``scales``. Stochastic rounding
    (``generator``) draws for the rows' elements in order; ``draws`` (float32 ``[rows, blocks *
    block]``, drawn so beforehand) stands for it where only some columns are encoded.
    ``add`` (flat, ``n`` elements): ``source`` takes ``source + add`` first, in place.
    ``residual``: ``source`` then takes ``source`` minus the decoded values (what the codes
    stand for; NaN in a lost block, that the caller drops).

    One piece of blocks at a time (:func:`_piece_blocks`): the piece is read from ``source``,
    encoded (:func:`_encode_piece`), its codes stored, decoded and subtracted while it is in
    cache; the input is read once and the codes written once, with no buffer of the input's
    size."""
    nb = -(-m // block)
    b0, b1 = (0, nb) if cols is None else cols
    base = b0 * block
    per = _piece_blocks(block)
    device = codes.device
    size = min(per, max(b1 - b0, 1)) * block
    work = _at_least(scratch, "work", size, torch.float32, device)
    tmp = _at_least(scratch, "tmp", size, torch.float32, device)
    lost = False
    for row in range(rows):
        for p0 in range(b0, b1, per):
            p1 = min(b1, p0 + per)
            k, c0, c1 = p1 - p0, p0 * block, p1 * block
            v = max(c0, min(c1, m, n - row * m)) if source is not None else c0  # the end of the input's columns
            w = work[: c1 - c0]
            if v == c1:
                # The piece is one run of the input: read where it is.
                x = source[row * m + c0 : row * m + v]
                if add is not None:
                    x.add_(add[row * m + c0 : row * m + v])
            else:
                x = w
                if v > c0:
                    src = source[row * m + c0 : row * m + v]
                    if add is not None:
                        src.add_(add[row * m + c0 : row * m + v])
                    w[: v - c0].copy_(src)
                w[v - c0 :].zero_()
            if draws is not None:
                u = draws[row, c0:c1]
            elif generator is not None:
                u = torch.rand(c1 - c0, generator=generator, out=tmp[: c1 - c0])
            else:
                u = None
            s, piece_lost = _encode_piece(x.view(k, block), w.view(k, block), row * nb + p0, rows * nb, bits, u)
            lost |= piece_lost
            scales[row, p0 - b0 : p1 - b0].copy_(s)
            _put_codes(codes, row, c0 - base, c1 - base, m - base, bits, w, tmp)
            if residual and v > c0:
                w.view(k, block).mul_(s.unsqueeze(1))
                source[row * m + c0 : row * m + v].sub_(w[: v - c0])
    return lost


def drop_nonfinite(residual: torch.Tensor) -> None:
    residual.masked_fill_(~torch.isfinite(residual), 0.0)


def _decode_piece(codes: torch.Tensor, scales: torch.Tensor, c0: int, c1: int, m: int, bits: int, block: int,
                  out: torch.Tensor, scratch: Scratch | None = None) -> None:
    """Columns ``[c0, c1)`` (whole blocks) of :func:`_decode_rows` into ``out`` (float32
    ``[rows, c1 - c0]``, rows contiguous)."""
    rows = scales.shape[0]
    if bits == 8:
        used = max(min(c1, m), c0)
        out[:, : used - c0].copy_(codes[:, c0:used].view(torch.int8))
    else:
        cb = codes.shape[1]
        used = max(min(c1, 2 * cb), c0)
        nbytes = (used - c0) // 2
        # Unpacked to signed bytes first, so that the float32 output takes one contiguous
        # conversion and no subtraction: each byte c widened to 16 bits becomes
        # (c | c << 4) & 0x0F0F = (c & 15) | (c >> 4) << 8, whose two bytes are the pair in
        # order (little-endian), minus 8 each. Contiguous 16-bit passes, where strided byte
        # stores, a gather from a table of the 256 pairs and a mixed-type multiplication by the
        # scales were all slower (measured on one thread, AVX2).
        q = _at_least(scratch, "int4", rows * nbytes, torch.int16, codes.device).view(rows, nbytes)
        high = _at_least(scratch, "int4 high", rows * nbytes, torch.int16, codes.device).view(rows, nbytes)
        q.copy_(codes[:, c0 // 2 : c0 // 2 + nbytes])
        q.bitwise_or_(torch.bitwise_left_shift(q, 4, out=high)).bitwise_and_(0x0F0F)
        pairs = q.view(torch.int8) if sys.byteorder == "little" else q.view(torch.int8).view(rows, nbytes, 2).flip(2)
        out[:, : used - c0].copy_(pairs.sub_(8).reshape(rows, 2 * nbytes))
    out[:, used - c0 :].zero_()
    out.view(rows, -1, block).mul_(scales[:, c0 // block : c1 // block].unsqueeze(2))


@torch.no_grad()
def _decode_rows(codes: torch.Tensor, scales: torch.Tensor, m: int, bits: int, block: int,
                 out: torch.Tensor | None = None, scratch: Scratch | None = None) -> torch.Tensor:
    """Decode :func:`_encode_rows`' output back to float32: a ``[rows, m]`` view of whole blocks
    (of ``out``, float32 ``[rows, blocks * block]``, if given), a piece of columns at a time so
    that each piece's conversion and multiplication by its scales run in cache."""
    rows, nb = scales.shape
    if out is None:
        out = torch.empty(rows, nb * block, dtype=torch.float32, device=codes.device)
    if bits == 4 and 2 * codes.shape[1] > nb * block:  # an odd block size and an odd length
        raise ValueError(f"Invalid int4 codes: {codes.shape[1]} bytes for {nb * block} elements")
    width = nb * block
    step = max(1, PIECE_NUMEL * max(1, torch.get_num_threads()) // max(rows, 1) // block) * block
    for c0 in range(0, width, step):
        c1 = min(width, c0 + step)
        _decode_piece(codes, scales, c0, c1, m, bits, block, out[:, c0:c1], scratch)
    return out[:, :m]


def _check_flat(x: torch.Tensor, what: str) -> None:
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"{what} must be a 1-D float32 tensor, got {tuple(x.shape)} {x.dtype}")


def encode(x: torch.Tensor, bits: int, *, block: int = BLOCK_NUMEL, generator: torch.Generator | None = None) -> Encoded:
    """Encode the 1-D float32 tensor ``x`` with ``bits`` = 8 or 4 (see the module docstring)."""
    _check_flat(x, "encode input")
    bits = _check_bits(bits)
    block = _check_block(block, bits)
    n = x.numel()
    codes = torch.empty(1, _code_bytes(n, bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(1, -(-n // block), dtype=torch.float32, device=x.device)
    _encode_rows(1, n, n, bits, block, generator, codes, scales, x)
    return Encoded(codes[0], scales[0], n, bits, block)


def decode(enc: Encoded) -> torch.Tensor:
    """The float32 values that ``enc`` stands for."""
    codes, scales, n, bits, block = enc.codes.view(1, -1), enc.scales.view(1, -1), enc.numel, enc.bits, enc.block
    whole = n // block * block  # elements in whole blocks: decoded in place in the result
    _check_block(block, bits)
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    cw = _code_bytes(whole, bits)
    _decode_rows(codes[:, :cw], scales[:, : whole // block], whole, bits, block, out[:whole].view(1, whole))
    if whole < n:
        out[whole:].copy_(_decode_rows(codes[:, cw:], scales[:, whole // block :], n - whole, bits, block)[0])
    return out
