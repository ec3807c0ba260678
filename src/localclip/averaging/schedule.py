"""The schedule: which optimizer steps end with a round.

A round follows the ``period``-th, ``2·period``-th, … step, and each of the first
``warmup_steps`` steps. The schedule also knows whether the workers are in sync (no step since
the last round or the initial broadcast), so that an explicit average there is skipped: it
would send nothing new.
"""

from __future__ import annotations

__all__ = ["Schedule"]


class Schedule:
    """Counts steps against a period (and a warm-up of averaging every step)."""

    def __init__(self, period: int, warmup_steps: int = 0):
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"Invalid period: {period!r} (must be an integer >= 1)")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"Invalid warmup_steps: {warmup_steps!r} (must be an integer >= 0)")
        self.period = period
        self.warmup_steps = warmup_steps
        self.step_count = 0
        self.last_round_step = 0  # step_count when the workers last held the same values (0: the broadcast)

    def is_sync_step(self, step_count: int) -> bool:
        """Whether the ``step_count``-th step (1-based) ends with a round."""
        return step_count <= self.warmup_steps or (step_count - self.warmup_steps) % self.period == 0

    def count(self) -> bool:
        """Count one step; return whether it ends with a round."""
        self.step_count += 1
        return self.is_sync_step(self.step_count)

    @property
    def in_sync(self) -> bool:
        return self.last_round_step == self.step_count
