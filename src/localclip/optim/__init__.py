"""Clipped SGD (the local update of CELGC), clipped AdamW, and the schedule that decays γ with lr.

Nothing in this package communicates; see :mod:`localclip.algorithms` for the distributed
algorithms built on it. :data:`INNER_OPTIMIZERS` names the local updates a config can choose
(``clipped_sgd``: :class:`ClippedSGD`; ``adamw``: :class:`ClippedAdamW`).
"""

from localclip.optim.clipped_adamw import ClippedAdamW
from localclip.optim.clipped_sgd import CLIP_MODES, ClippedSGD, clipped_sgd, grad_norm
from localclip.optim.schedule import GammaFollowsLR, StepDecay

INNER_OPTIMIZERS = ("clipped_sgd", "adamw")

__all__ = ["CLIP_MODES", "INNER_OPTIMIZERS", "ClippedAdamW", "ClippedSGD", "GammaFollowsLR", "StepDecay", "clipped_sgd", "grad_norm"]
