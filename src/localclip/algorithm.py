"""Moved to :mod:`localclip.algorithms` (one module per algorithm); this name keeps old imports working."""

from localclip.algorithms import CELGC, DistributedAlgorithm, NaiveParallelClipping

__all__ = ["CELGC", "DistributedAlgorithm", "NaiveParallelClipping"]
