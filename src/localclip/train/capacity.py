"""How many workers a run holds in memory, how much memory that takes, and the check that
refuses a run the machine cannot hold before anything is written."""

from __future__ import annotations

from localclip.train.config import TrainConfig

__all__ = ["group_size"]


def group_size(config: TrainConfig) -> int:
    """The workers a run keeps in memory at once: N, or K slots with idle non-participants
    (:mod:`localclip.train.roster`)."""
    return config.participants if config.non_participants == "idle" else config.workers
