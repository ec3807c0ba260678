"""The parts a round is composed of, from the names a user writes.

:class:`~localclip.averaging.PeriodicAverager` is composed of a codec (:mod:`.codecs`), an outer
optimizer (:mod:`.outer`), a participation policy (:mod:`.participation`) and a streaming
layout (:class:`Streaming`: :mod:`.fragments`, :mod:`.overlap`). Users name them with keyword
options (``compression="int4"``, ``outer_optimizer=...``, ``participants=2``, ``fragments=4``;
:data:`ROUND_OPTIONS`), through the averager, ``localclip.CELGC(..., **round_options)``,
``compose``, the integrations or a config's fields (the builder passes those on by the same
names): :func:`round_parts` is the one place that turns those names into parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from localclip.averaging import codecs
from localclip.averaging import fragments as _fragments
from localclip.averaging import overlap as _overlap
from localclip.averaging.codecs import Codec
from localclip.averaging.outer import OuterSGD, TorchOuter, make_outer
from localclip.averaging.participation import Participation

__all__ = ["ROUND_OPTIONS", "RoundParts", "Streaming", "round_parts"]

ROUND_OPTIONS = ("compression", "error_feedback", "outer_optimizer", "participants", "participation_seed", "skip_nonfinite",
                 "fragments", "overlap", "overlap_alpha", "overlap_merge")


@dataclass(frozen=True)
class Streaming:
    """How the averaged state streams: ``fragments`` P on staggered schedules (:mod:`.fragments`)
    and rounds in flight for ``overlap`` tau steps, merged by ``merge`` with ``alpha``
    (:mod:`.overlap`). The default is blocking rounds of the whole model."""

    fragments: int = 1
    overlap: int = 0
    alpha: float = 0.0
    merge: str = "mix"

    @property
    def on(self) -> bool:
        """Whether rounds stream (fragments, or rounds in flight)."""
        return self.fragments != 1 or self.overlap != 0

    def check(self, period: int) -> None:
        """Refuse a layout that the ``period`` cannot schedule (one line naming the values)."""
        _fragments.check(self.fragments, period)
        _overlap.check(self.overlap, period, self.alpha, self.merge)


@dataclass(frozen=True)
class RoundParts:
    """A round's parts (see the module docstring)."""

    codec: Codec
    outer: OuterSGD | TorchOuter | None
    participation: Participation
    streaming: Streaming


def round_parts(*, compression: str | Codec = "none", error_feedback: bool = True,
                outer_optimizer: OuterSGD | TorchOuter | Callable | None = None, participants: int | None = None,
                participation_seed: int = 0, skip_nonfinite: bool = True, fragments: int = 1, overlap: int = 0,
                overlap_alpha: float = 0.0, overlap_merge: str = "mix") -> RoundParts:
    """The parts that the options of :data:`ROUND_OPTIONS` name (each checked by its part; the
    streaming layout against a period by :meth:`Streaming.check`)."""
    return RoundParts(
        codec=codecs.get(compression, error_feedback),
        outer=make_outer(outer_optimizer),
        participation=Participation(participants, participation_seed, skip_nonfinite),
        streaming=Streaming(fragments, overlap, overlap_alpha, overlap_merge),
    )
