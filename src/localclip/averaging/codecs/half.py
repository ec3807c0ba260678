"""``compression="bf16"|"fp16"``: each worker sends its change since the anchor in 2 bytes.

A worker sends ``(x_i − a)/K`` (``a`` the anchor, the averaged values as of the last round,
identical on every worker) as an all-reduce in that format: half the bytes of float32. Every
worker adds the same decoded sum to the anchor, so all stay bit-identical. The sum of K
low-precision terms is rounded once per addition, so the error grows with K (see
:meth:`~localclip.averaging.PeriodicAverager.average`). An all-reduce, rather than an all-gather
and a float32 sum, keeps the bytes per worker from growing with K. fp16 keeps 3 more mantissa
bits than bf16 but overflows beyond ±65504, which counts as non-finite.
"""

from __future__ import annotations

import torch

from localclip.averaging.buffers import BLOCK_NUMEL
from localclip.averaging.codecs.base import Codec

__all__ = ["WIRE_DTYPES", "Half"]

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Half(Codec):
    """The change since the anchor in ``bf16`` or ``fp16`` (see the module docstring)."""

    anchored = True

    def __init__(self, name: str):
        if name not in WIRE_DTYPES:
            raise ValueError(f"Invalid 2-byte compression: {name!r} (expected one of {tuple(WIRE_DTYPES)})")
        self.name = name
        self.dtype = WIRE_DTYPES[name]

    def send_buffer(self, values: torch.Tensor) -> torch.Tensor:
        return torch.empty(values.numel(), dtype=self.dtype, device=values.device)

    def encode(self, values: torch.Tensor, anchor: torch.Tensor, wire: torch.Tensor, scale: float, found: torch.Tensor) -> None:
        """Block by block, so that each block's change is rounded while it is in cache."""
        scratch = torch.empty(min(BLOCK_NUMEL, values.numel()), dtype=values.dtype, device=values.device)
        for lo in range(0, values.numel(), BLOCK_NUMEL):
            hi = min(lo + BLOCK_NUMEL, values.numel())
            delta = torch.sub(values[lo:hi], anchor[lo:hi], out=scratch[: hi - lo])
            delta.mul_(scale)
            block = wire[lo:hi]
            block.copy_(delta)
            # Checked after rounding: a delta beyond fp16's range becomes Inf here.
            torch._amp_foreach_non_finite_check_and_unscale_([block], found, torch.ones(1, dtype=torch.float32, device=block.device))
