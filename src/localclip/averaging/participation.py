"""Who takes part in a round: partial participation and leaving out non-finite workers.

With ``participants=K`` below the world size N, each round only K workers, drawn by
:func:`sample_participants` from a shared seed (docs/algorithm.md §6), are averaged, and every
worker then takes their average. Every worker draws the same K without communicating: the draw
is a ``torch.randperm`` from a generator seeded with a stable hash of ``(seed, round_index)``.
With ``skip_nonfinite`` a worker whose values hold a NaN or an Inf is left out of the round too
(it takes the others' average); without it such a worker raises.
:class:`Participation` is that policy, one object for the round to ask.
"""

from __future__ import annotations

import numbers

import torch

from localclip.rng import derive_seed

__all__ = ["Participation", "sample_participants"]


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer >= 1)")


def sample_participants(world_size: int, k: int, round_index: int, seed: int) -> list[int]:
    """The sorted ranks of the ``k`` of ``world_size`` workers taking part in round ``round_index``.

    Every worker calls this with the same arguments and gets the same answer without
    communicating (§6, partial participation): the draw is a ``torch.randperm`` from a generator
    seeded with a stable hash of ``(seed, round_index)``.
    """
    _check_positive_int("world_size", world_size)
    _check_positive_int("k", k)
    if k > world_size:
        raise ValueError(f"Invalid k: {k} participants out of world_size={world_size}")
    if round_index < 0:
        raise ValueError(f"Invalid round_index: {round_index} (expected >= 0)")
    if k == world_size:
        return list(range(world_size))
    g = torch.Generator().manual_seed(derive_seed("participants", int(seed), int(round_index)))
    return sorted(torch.randperm(world_size, generator=g)[:k].tolist())


class Participation:
    """Which workers a round averages (see the module docstring).

    Args:
        participants: K, the workers sampled each round; ``None`` (or K >= the world size): all.
        seed: the draw's seed (the run's seed; the same on every worker).
        skip_nonfinite: leave a worker with non-finite values out of the round; False: raise.
    """

    def __init__(self, participants: int | None = None, seed: int = 0, skip_nonfinite: bool = True):
        self.participants, self.seed, self.skip_nonfinite = participants, seed, skip_nonfinite

    def check(self, world_size: int) -> None:
        """Refuse a K outside ``[1, world_size]``."""
        if self.participants is not None and not 1 <= self.participants <= world_size:
            raise ValueError(f"Invalid participants: {self.participants} (must be in [1, {world_size}])")

    def expected(self, world_size: int) -> int:
        """K, the workers expected to take part in a round."""
        if self.participants is not None and self.participants < world_size:
            return self.participants
        return world_size

    def taking_part(self, rank: int, world_size: int, index: int) -> bool:
        """Whether worker ``rank`` is sampled for round ``index`` (0-based)."""
        if self.participants is None or self.participants >= world_size:
            return True
        return rank in sample_participants(world_size, self.participants, index, self.seed)

    def __repr__(self) -> str:
        return f"Participation(participants={self.participants}, seed={self.seed}, skip_nonfinite={self.skip_nonfinite})"
