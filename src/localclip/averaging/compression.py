"""Compressed rounds: each worker sends its change since the anchor in a 2-byte format.

With ``compression="bf16"|"fp16"`` a worker sends ``(x_i − a)/K`` (``a`` the anchor, the
averaged values as of the last round, identical on every worker) as an all-reduce in that
format: half the bytes of float32. Every worker adds the same decoded sum to the anchor, so all
stay bit-identical. The sum of K low-precision terms is rounded once per addition, so the error
grows with K (see :meth:`~localclip.averaging.PeriodicAverager.average`). An all-reduce, rather
than an all-gather and a float32 sum, keeps the bytes per worker from growing with K.
"""

from __future__ import annotations

import torch

from localclip.averaging.buffers import BLOCK_NUMEL, FlatBucket

__all__ = ["COMPRESSIONS", "check", "encode", "make_wire"]

COMPRESSIONS = ("none", "bf16", "fp16")
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check(compression: str) -> None:
    if compression not in COMPRESSIONS:
        raise ValueError(f"Invalid compression: {compression!r} (expected one of {COMPRESSIONS})")


def make_wire(bucket: FlatBucket, compression: str) -> torch.Tensor:
    """The send buffer of ``bucket`` in ``compression``'s format."""
    return torch.empty(bucket.values.numel(), dtype=WIRE_DTYPES[compression], device=bucket.values.device)


def encode(bucket: FlatBucket, scale: float, found: torch.Tensor) -> None:
    """Fill ``bucket.wire`` with ``(values − anchor)·scale``, block by block, and flag in
    ``found`` any value that is not finite after rounding (a change beyond fp16's range)."""
    b = bucket
    scratch = torch.empty(min(BLOCK_NUMEL, b.values.numel()), dtype=b.values.dtype, device=b.values.device)
    for lo in range(0, b.values.numel(), BLOCK_NUMEL):
        hi = min(lo + BLOCK_NUMEL, b.values.numel())
        delta = torch.sub(b.values[lo:hi], b.anchor[lo:hi], out=scratch[: hi - lo])
        delta.mul_(scale)
        wire = b.wire[lo:hi]
        wire.copy_(delta)
        # Checked after rounding: a delta beyond fp16's range becomes Inf here.
        torch._amp_foreach_non_finite_check_and_unscale_([wire], found, torch.ones(1, dtype=torch.float32, device=wire.device))
