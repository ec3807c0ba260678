"""The schedule: which optimizer steps end with a round, and of which fragment.

A round follows the ``period``-th, ``2·period``-th, … step, and each of the first
``warmup_steps`` steps. With ``fragments=P`` (:mod:`.fragments`) fragment p's rounds follow the
steps t with ``(t − o_p) mod period == 0`` and t ≥ o_p, ``o_p = floor(p·period/P)`` (counted after
the warm-up); fragment 0's are the rounds without fragments. The schedule also knows, per
fragment, the step at which the workers last held the same values for it (a round, or the
initial broadcast), so that an explicit average there is skipped: it would send nothing new.
"""

from __future__ import annotations

from localclip.averaging.fragments import check, offsets

__all__ = ["Schedule"]


class Schedule:
    """Counts steps against a period (and a warm-up of averaging every step), per fragment."""

    def __init__(self, period: int, warmup_steps: int = 0, fragments: int = 1):
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"Invalid period: {period!r} (must be an integer >= 1)")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"Invalid warmup_steps: {warmup_steps!r} (must be an integer >= 0)")
        check(fragments, period)
        self.period = period
        self.warmup_steps = warmup_steps
        self.offsets = offsets(fragments, period)
        self.step_count = 0
        # Per fragment: step_count when the workers last held the same values (0: the broadcast).
        self.synced_at = [0] * fragments

    def due(self, step_count: int) -> list[int]:
        """The fragments whose round follows the ``step_count``-th step (1-based)."""
        if step_count <= self.warmup_steps:
            return list(range(len(self.offsets)))
        t = step_count - self.warmup_steps
        return [p for p, o in enumerate(self.offsets) if t >= o and (t - o) % self.period == 0]

    def is_sync_step(self, step_count: int) -> bool:
        """Whether the ``step_count``-th step (1-based) ends with a round."""
        if len(self.offsets) == 1:
            return step_count <= self.warmup_steps or (step_count - self.warmup_steps) % self.period == 0
        return bool(self.due(step_count))

    def count(self) -> bool:
        """Count one step; return whether it ends with a round."""
        self.step_count += 1
        return self.is_sync_step(self.step_count)

    @property
    def last_round_step(self) -> int:
        """The earliest of the fragments' last syncs (with one fragment: the last round's step)."""
        return min(self.synced_at)

    @last_round_step.setter
    def last_round_step(self, step: int) -> None:
        self.synced_at = [step] * len(self.synced_at)

    @property
    def in_sync(self) -> bool:
        return all(s == self.step_count for s in self.synced_at)
