"""The one interface of a round's formats: what a worker sends for each flat bucket, and how the
average comes back.

A :class:`Codec` is a description, shared freely (it holds no tensors): the round that uses it
keeps the per-bucket state it asks for (a send buffer, error-feedback residuals, reused
buffers). Two reductions carry the formats:

* ``"all_reduce"`` (``none``, ``bf16``, ``fp16``): one all-reduce of each bucket's send buffer,
  the sum arriving in it. ``none`` sends the values themselves; the 2-byte formats send the
  change since the anchor, scaled, in a buffer of their own (:meth:`Codec.send_buffer`,
  :meth:`Codec.encode`) and turn the received sum back into float (:meth:`Codec.decode`).
* ``"lowbit"`` (``int8``, ``int4``): the reduction of :mod:`.lowbit` (an all-to-all of block
  codes, float32 sums on each chunk's owner, an all-gather of the re-encoded shards) over the
  change since the anchor, with error feedback (:meth:`Codec.feedback`, :mod:`.feedback`).
"""

from __future__ import annotations

import torch

__all__ = ["Codec"]


class Codec:
    """A round's wire format (see the module docstring).

    Attributes:
        name: the compression's name (``"none"``, ``"bf16"``, ``"fp16"``, ``"int8"``, ``"int4"``).
        anchored: whether it sends the change since the anchor (the round then keeps an anchor:
            the averaged values as of the last round).
        reduction: ``"all_reduce"`` or ``"lowbit"``.
        error_feedback: whether what the encodings leave out is kept for the next round.
    """

    name: str = ""
    anchored: bool = False
    reduction: str = "all_reduce"
    error_feedback: bool = False

    def send_buffer(self, values: torch.Tensor) -> torch.Tensor | None:
        """The buffer an all-reduce round sends for a bucket of ``values``; None: the values
        themselves, in place."""
        return None

    def encode(self, values: torch.Tensor, anchor: torch.Tensor, wire: torch.Tensor, scale: float, found: torch.Tensor) -> None:
        """Fill ``wire`` with ``(values − anchor)·scale``; flag in ``found`` any value not finite
        after rounding (formats with a :meth:`send_buffer` only)."""
        raise NotImplementedError(f"{self!r} sends its values as they are")

    def decode(self, received: torch.Tensor, values: torch.Tensor) -> None:
        """``values`` takes the received sum ``received`` (a block of the send buffer)."""
        values.copy_(received)

    def feedback(self, numel: int, device):
        """One bucket's error-feedback state, or None (a low-bit format without it, or no
        low-bit format)."""
        return None

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), self.name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
