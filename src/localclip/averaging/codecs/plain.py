"""``compression="none"``: a round sends the float values themselves (each scaled by 1/K) in one
all-reduce, and the sum is the average."""

from __future__ import annotations

from localclip.averaging.codecs.base import Codec

__all__ = ["Plain"]


class Plain(Codec):
    """The values as they are: no anchor of its own, nothing encoded (see :mod:`.base`)."""

    name = "none"
