"""A round's wire formats: one interface (:class:`Codec`) and the five formats, by name.

* :mod:`.base` — the interface: what a worker sends for each flat bucket, and how the average
  comes back;
* :mod:`.plain` — ``none``: the float values, in one all-reduce;
* :mod:`.half` — ``bf16``, ``fp16``: the change since the anchor in 2 bytes, in one all-reduce;
* :mod:`.blocks` — the int8/int4 block codec (absmax scale per 256 elements) and its buffers;
* :mod:`.lowbit` — ``int8``, ``int4``: the reduction of block codes (all-to-all, float32 sums,
  all-gather), in three phases;
* :mod:`.feedback` — error feedback: what the low-bit encodings left out, added to the next round.

:func:`get` maps a compression's name (:data:`COMPRESSIONS`) to its codec; the averager and the
builder both ask it.
"""

from __future__ import annotations

from localclip.averaging.codecs.base import Codec
from localclip.averaging.codecs.blocks import BLOCK_NUMEL, Encoded, Scratch, decode, encode, encoded_nbytes
from localclip.averaging.codecs.feedback import ErrorFeedback
from localclip.averaging.codecs.half import WIRE_DTYPES, Half
from localclip.averaging.codecs.lowbit import BITS as LOWBIT
from localclip.averaging.codecs.lowbit import Lowbit, LowbitPending, LowbitRound, lowbit_average, start_lowbit_average
from localclip.averaging.codecs.plain import Plain

__all__ = [
    "BLOCK_NUMEL", "COMPRESSIONS", "Codec", "Encoded", "ErrorFeedback", "Half", "LOWBIT", "Lowbit", "LowbitPending", "LowbitRound",
    "Plain", "Scratch", "WIRE_DTYPES", "decode", "encode", "encoded_nbytes", "get", "lowbit_average", "start_lowbit_average",
]

COMPRESSIONS = ("none", *WIRE_DTYPES, *LOWBIT)


def get(compression: str | Codec = "none", error_feedback: bool = True) -> Codec:
    """The codec of ``compression`` (a name of :data:`COMPRESSIONS`, or a :class:`Codec`, returned
    as it is); ``error_feedback=False`` applies to int8/int4 only."""
    if isinstance(compression, Codec):
        return compression
    if compression not in COMPRESSIONS:
        raise ValueError(f"Invalid compression: {compression!r} (expected one of {COMPRESSIONS})")
    if not isinstance(error_feedback, bool):
        raise ValueError(f"Invalid error_feedback: {error_feedback!r} (expected True or False)")
    if not error_feedback and compression not in LOWBIT:
        raise ValueError(f"Invalid error_feedback=False with compression={compression!r}: it applies to {', '.join(LOWBIT)}")
    if compression in LOWBIT:
        return Lowbit(compression, error_feedback)
    return Half(compression) if compression in WIRE_DTYPES else Plain()
