"""Compressed rounds: each worker sends its change since the anchor in a 2-, 1- or ½-byte format.

With ``compression="bf16"|"fp16"`` a worker sends ``(x_i − a)/K`` (``a`` the anchor, the
averaged values as of the last round, identical on every worker) as an all-reduce in that
format: half the bytes of float32. Every worker adds the same decoded sum to the anchor, so all
stay bit-identical. The sum of K low-precision terms is rounded once per addition, so the error
grows with K (see :meth:`~localclip.averaging.PeriodicAverager.average`). An all-reduce, rather
than an all-gather and a float32 sum, keeps the bytes per worker from growing with K.

With ``compression="int8"|"int4"`` (:data:`LOWBIT`) a worker sends its change ``x_i − a`` (in
float32) through :func:`localclip.lowbit.lowbit_average`: blocks of 256 elements with one
float32 absmax scale each, nearest rounding (deterministic: no generator, nothing to seed), an
all-to-all of encoded chunks, float32 sums in rank order on each chunk's owner, a re-encoded
all-gather; every worker adds the same decoded average change to the anchor. With error
feedback (the default) each worker keeps what its encodings left out and adds it next round
(:class:`localclip.lowbit.ErrorFeedback`, checkpointed by the averager); without it that is
dropped every round, a bias that nearest rounding makes systematic.
"""

from __future__ import annotations

import torch

from localclip.averaging.buffers import BLOCK_NUMEL, FlatBucket

__all__ = ["COMPRESSIONS", "LOWBIT", "check", "encode", "make_wire"]

COMPRESSIONS = ("none", "bf16", "fp16", "int8", "int4")
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOWBIT = {"int8": 8, "int4": 4}  # compression -> bits of :mod:`localclip.lowbit`'s codes


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
