"""localclip: communication-efficient distributed training with local gradient clipping.

The public API: :class:`ClippedSGD` (the local update), :class:`PeriodicAverager` (periodic
model averaging), :class:`CELGC`, :class:`EPISODE` and :class:`NaiveParallelClipping` (the
algorithms, as optimizers), and the communicators in :mod:`localclip.comm`.
"""

from localclip import rng
from localclip.algorithms import CELGC, EPISODE, NaiveParallelClipping
from localclip.averaging import OuterSGD, PeriodicAverager
from localclip.comm import SimulatedWorld
from localclip.optim import ClippedSGD, GammaFollowsLR

__version__ = "0.1.0"

__all__ = ["rng", "CELGC", "EPISODE", "ClippedSGD", "GammaFollowsLR", "NaiveParallelClipping", "OuterSGD", "PeriodicAverager", "SimulatedWorld"]
