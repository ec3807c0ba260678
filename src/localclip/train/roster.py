"""Which worker each in-process slot plays in a period when non-participants idle.

With ``non_participants="idle"`` (docs/algorithm.md, "Partial participation") only the K workers
sampled for a round train in the period that ends with it, so a run needs K workers in memory,
not N: it runs K *slots* (threads of the simulator), and slot ``j`` plays the ``j``-th, in rank
order, of the workers :func:`~localclip.averaging.sample_participants` draws for the round that
ends the coming period, from the run's seed, exactly as the averaging of a run with
``non_participants="train"`` draws them. Every slot holds the last average, so a slot only
changes whose data it trains on and whose dropout stream it draws from:

* the data: the played worker's shard of the epoch (:func:`localclip.data.worker_shard` of N
  workers), at the batch where every worker's stream stands (all shards have the same length
  and all workers draw the same BPTT lengths), so a sampled worker trains on the batches it
  would train on had it trained every period;
* randomness: the worker's dropout generator seeded from (seed, worker, round), so a worker
  that is not sampled keeps no random state, and a run's draws do not depend on the slots;
* the recurrent state: a played worker's LSTM state starts at zero each period (the one it
  ended its last period with belongs to a model the average has since replaced).

A worker therefore keeps nothing of its own between its periods and the roster stores nothing:
the config refuses the options that would give a worker such state (momentum kept per worker,
error-feedback residuals, streaming fragments).
"""

from __future__ import annotations

from localclip import rng
from localclip.averaging import sample_participants

__all__ = ["Roster"]


class Roster:
    """The K slots of a run of N workers with idle non-participants; see the module docstring."""

    def __init__(self, workers: int, participants: int, seed: int):
        if not 1 <= participants < workers:
            raise ValueError(f"Invalid participants: {participants} (a roster needs 1 <= K < N={workers})")
        self.workers, self.slots, self.seed = workers, participants, seed
        self._drawn: tuple[int, list[int]] | None = None  # the last round's draw

    def worker(self, round_index: int, slot: int) -> int:
        """The worker that ``slot`` plays in the period ending with round ``round_index`` (0-based)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"Invalid slot: {slot} (the roster has {self.slots})")
        if self._drawn is None or self._drawn[0] != round_index:
            self._drawn = (round_index, sample_participants(self.workers, self.slots, round_index, self.seed))
        return self._drawn[1][slot]

    def dropout_seed(self, worker: int, round_index: int) -> int:
        """The seed of ``worker``'s dropout generator in the period ending with round ``round_index``."""
        return rng.derive_seed("dropout", self.seed, worker, round_index)
