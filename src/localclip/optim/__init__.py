"""Clipped SGD (the local update of CELGC), clipped AdamW, and the schedule that decays γ with lr.

Nothing in this package communicates; see :mod:`localclip.algorithm` for the distributed
algorithms built on it.
"""

from localclip.optim.clipped_adamw import ClippedAdamW
from localclip.optim.clipped_sgd import CLIP_MODES, ClippedSGD, clipped_sgd, grad_norm
from localclip.optim.schedule import GammaFollowsLR

__all__ = ["CLIP_MODES", "ClippedAdamW", "ClippedSGD", "GammaFollowsLR", "clipped_sgd", "grad_norm"]
