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
"""

from __future__ import annotations

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


def _padded(rows: int, m: int, block: int, device, scratch: "Scratch | None" = None, name: str = "") -> torch.Tensor:
    """A float32 matrix of ``rows`` rows of whole blocks covering ``m`` elements, zero past ``m``
    (only the tail is cleared: the caller fills columns ``[0, m)``)."""
    width = -(-m // block) * block
    xp = _buffer(scratch, name, (rows, width), torch.float32, device)
    xp[:, m:].zero_()
    return xp


class Scratch:
    """Buffers that :func:`~.lowbit.lowbit_average` reuses from one call to the next: a round allocates
    several copies of the model, and fresh memory costs a page fault per 4 KiB (about half of
    a round's time on the CPU without them). One per caller (per flat bucket); not thread-safe."""

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


def drop_nonfinite(residual: torch.Tensor) -> None:
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
