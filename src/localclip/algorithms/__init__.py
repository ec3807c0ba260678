"""The algorithms, each an optimizer over one worker's model (the user's loop stays
``zero_grad / backward / step``), one per module:

* :class:`CELGC` (:mod:`.celgc`) — clipped local steps, models averaged every ``period`` steps
  (Algorithm 1); its ``global_average`` / ``max`` clip modes add one gradient all-reduce per round.
* :class:`NaiveParallelClipping` (:mod:`.naive`) — gradients averaged every step, then clipped.
* :class:`EPISODE` (:mod:`.episode`) — CELGC's rounds with each local gradient corrected towards
  the round's mean gradient, and one clip decision per round (for heterogeneous data).
* local SGD without clipping is ``CELGC(..., gamma=math.inf)``; a single machine is any of them
  with a world of one.

:mod:`.base` holds what they share (the optimizer facade, counters, checkpoints);
:mod:`.build` is the one place that turns a config's names into one of them
(:data:`~.build.ALGORITHMS`, :func:`~.build.build_algorithm`).
"""

from localclip.algorithms.base import DistributedAlgorithm
from localclip.algorithms.celgc import CELGC
from localclip.algorithms.episode import EPISODE
from localclip.algorithms.naive import NaiveParallelClipping
from localclip.algorithms.build import ALGORITHMS, build_algorithm, compose

__all__ = ["ALGORITHMS", "build_algorithm", "compose", "CELGC", "DistributedAlgorithm", "EPISODE", "NaiveParallelClipping"]
