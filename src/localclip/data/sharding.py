"""Who trains on which tokens, in what order: language-model sharding and the BPTT schedule.

This module owns docs/algorithm.md §4 and the data side of §6:

* the training stream is trimmed to a multiple of the global batch ``B = N·b`` and cut into
  ``B`` contiguous streams (:func:`batchify`); worker ``k`` owns streams ``[k·b, (k+1)·b)``;
* in epoch ``e`` worker ``r`` trains on shard ``(r + e) mod N``, so one epoch is one pass of the
  whole system over the corpus; with heterogeneous data worker ``r`` keeps shard ``r``
  (:func:`worker_shard`);
* the variable-length BPTT schedule, drawn identically by every worker from a shared seed so
  that all workers take the same number of steps (:class:`BPTTSchedule`, :class:`LMBatchStream`).

Who takes part in an averaging round (§6's partial participation) is the round's concern:
:mod:`localclip.averaging.participation`.

Nothing here reads a global RNG: every draw comes from a generator seeded by the caller's seed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from localclip.rng import derive_seed
from localclip.errors import DataError

__all__ = [
    "BPTTSchedule",
    "LMBatchStream",
    "batchify",
    "get_batch",
    "shard_index",
    "worker_shard",
]


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer >= 1)")


def _check_stream(stream: torch.Tensor) -> None:
    if not isinstance(stream, torch.Tensor) or stream.dim() != 1:
        shape = tuple(stream.shape) if isinstance(stream, torch.Tensor) else type(stream).__name__
        raise ValueError(f"Invalid stream: expected a 1-D tensor of token ids, got {shape}")


def batchify(stream: torch.Tensor, global_batch: int) -> torch.Tensor:
    """Cut a 1-D token stream into ``global_batch`` contiguous streams, as columns.

    The stream is trimmed to ``T·B`` tokens (``T = len(stream) // B``, the remainder dropped) and
    column ``j`` of the ``[T, B]`` result is the ``j``-th contiguous chunk ``stream[j·T:(j+1)·T]``,
    as in PyTorch's word_language_model and AWD-LSTM. Row ``t`` is then time step ``t`` of every
    stream.
    """
    _check_stream(stream)
    _check_positive_int("global_batch", global_batch)
    nbatch = stream.numel() // global_batch
    if nbatch < 1:
        raise DataError(
            f"A stream of {stream.numel()} tokens is too short for a global batch of {global_batch} "
            "streams; use a smaller batch size or fewer workers, or a longer corpus."
        )
    return stream[: nbatch * global_batch].view(global_batch, nbatch).t().contiguous()


def shard_index(rank: int, world_size: int, epoch: int = 0, *, heterogeneous: bool = False) -> int:
    """The shard worker ``rank`` trains on in ``epoch``: ``(rank + epoch) mod N``, or ``rank``."""
    _check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"Invalid rank: {rank!r} (expected 0 <= rank < world_size={world_size})")
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"Invalid epoch: {epoch!r} (expected an integer >= 0)")
    return int(rank) if heterogeneous else int((rank + epoch) % world_size)


def worker_shard(
    stream: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    epoch: int = 0,
    heterogeneous: bool = False,
) -> torch.Tensor:
    """The ``[T, batch_size]`` part of the training stream worker ``rank`` trains on in ``epoch``.

    With ``B = world_size·batch_size`` and ``data = batchify(stream, B)``, shard ``k`` is
    ``data[:, k·b:(k+1)·b]``; worker ``r`` gets shard ``(r + epoch) mod world_size`` (§4), or
    shard ``r`` in every epoch when ``heterogeneous`` (§6). All shards have the same ``T``, so all
    workers run the same number of steps.
    """
    _check_positive_int("batch_size", batch_size)
    shard = shard_index(rank, world_size, epoch, heterogeneous=heterogeneous)
    _check_stream(stream)
    global_batch = world_size * batch_size
    nbatch = stream.numel() // global_batch
    if nbatch < 2:
        raise DataError(
            f"A stream of {stream.numel()} tokens gives each of {global_batch} streams "
            f"(world_size={world_size} x batch_size={batch_size}) {nbatch} token(s); at least 2 are "
            "needed for one (input, target) pair. Use fewer workers or a smaller batch size."
        )
    # Rows k·b..(k+1)·b of the [B, T] view are exactly columns k·b..(k+1)·b of batchify's
    # [T, B]; slicing before transposing copies only this worker's T·b tokens.
    rows = stream[: nbatch * global_batch].view(global_batch, nbatch)
    return rows[shard * batch_size : (shard + 1) * batch_size].t().contiguous()


def get_batch(source: torch.Tensor, i: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``source[i:i+L]`` and targets ``source[i+1:i+1+L]`` with ``L = min(seq_len, T-1-i)``.

    Both are ``[L, b]``; the target is the next token of every input token (flatten it for the
    loss). ``L`` is clipped so the last batch of a pass may be shorter than ``seq_len``.
    """
    if source.dim() < 1:
        raise ValueError("Invalid source: expected a [T, b] (or 1-D) tensor")
    _check_positive_int("seq_len", seq_len)
    length = source.size(0)
    if not 0 <= i < length - 1:
        raise ValueError(f"Invalid position i={i}: expected 0 <= i < {length - 1} (source has {length} rows)")
    seq_len = min(seq_len, length - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len]


class BPTTSchedule:
    r"""Sequence lengths of the variable-length BPTT of AWD-LSTM, the same on every worker.

    Each draw: with probability ``1 - p_half`` the base is ``bptt``, else ``bptt / 2``; then
    ``seq_len = max(min_len, int(Normal(base, std)))`` (``int`` truncates toward zero, as in the
    reference). A step with length ``seq_len`` scales its lr and γ by :meth:`lr_scale`
    ``= seq_len / bptt``. With ``variable=False`` every length is ``bptt`` and nothing is drawn.

    The draws come from a private ``numpy.random.Generator`` seeded from ``seed`` only: workers
    built with the same arguments draw the same sequence, so their step counts never drift
    (a drift would hang the next collective). :meth:`state_dict` captures the generator, so a
    resumed run continues the exact same draws.

    Differences from the reference: it draws from NumPy's global RNG (shared with anything else
    that uses it); here the generator is PCG64 and private, so lengths differ from the
    reference's for the same seed while following the same distribution.
    """

    def __init__(
        self,
        bptt: int = 70,
        *,
        seed: int,
        variable: bool = True,
        min_len: int = 5,
        p_half: float = 0.05,
        std: float = 5.0,
    ) -> None:
        _check_positive_int("bptt", bptt)
        _check_positive_int("min_len", min_len)
        if not 0.0 <= p_half <= 1.0:
            raise ValueError(f"Invalid p_half: {p_half} (expected a probability in [0, 1])")
        if not std >= 0.0:
            raise ValueError(f"Invalid std: {std} (expected >= 0)")
        self.bptt = int(bptt)
        self.seed = int(seed)
        self.variable = bool(variable)
        self.min_len = int(min_len)
        self.p_half = float(p_half)
        self.std = float(std)
        self.draws = 0
        self._rng = np.random.default_rng(derive_seed("bptt", self.seed))

    def __iter__(self) -> BPTTSchedule:
        return self

    def __next__(self) -> int:
        return self.next()

    def next(self) -> int:
        """The next sequence length."""
        self.draws += 1
        if not self.variable:
            return self.bptt
        # Same two draws in the same order as the reference: uniform, then normal.
        base = self.bptt if self._rng.random() < 1.0 - self.p_half else self.bptt / 2
        return max(self.min_len, int(self._rng.normal(base, self.std)))

    def lr_scale(self, seq_len: int) -> float:
        """Factor for this step's lr and γ: ``seq_len / bptt``."""
        return seq_len / self.bptt

    def _config(self) -> dict[str, Any]:
        return {
            "bptt": self.bptt,
            "seed": self.seed,
            "variable": self.variable,
            "min_len": self.min_len,
            "p_half": self.p_half,
            "std": self.std,
        }

    def state_dict(self) -> dict[str, Any]:
        return {**self._config(), "draws": self.draws, "rng": copy.deepcopy(self._rng.bit_generator.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the distribution's parameters must be the ones it was saved with."""
        saved = {k: state[k] for k in self._config() if k in state}
        mismatched = {k: (v, getattr(self, k)) for k, v in saved.items() if v != getattr(self, k)}
        if mismatched:
            details = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in mismatched.items())
            raise ValueError(f"BPTT schedule state does not match this schedule ({details})")
        self._rng.bit_generator.state = copy.deepcopy(state["rng"])
        self.draws = int(state["draws"])

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({cfg})"


def _count_batches(length: int, schedule: BPTTSchedule) -> int:
    # Walk a copy of the schedule through the epoch: the count depends only on the draws.
    probe = copy.deepcopy(schedule)
    i = n = 0
    while i < length - 2:
        i += probe.next()
        n += 1
    return n


class LMBatchStream:
    """One epoch of ``(data, target, seq_len)`` over a worker's ``[T, b]`` shard.

    Follows the AWD-LSTM loop: starting at ``i = 0``, while ``i < T - 2`` draw ``seq_len`` from
    the schedule, yield :func:`get_batch` ``(shard, i, seq_len)`` and advance ``i`` by
    ``seq_len``. The yielded ``seq_len`` is the drawn one (what lr scaling uses, as in the
    reference); the last batch's ``data`` may be shorter.

    The schedule is shared with the caller and keeps advancing across epochs: build one
    :class:`BPTTSchedule` per run and one stream per epoch (with that epoch's
    :func:`worker_shard`). Since all workers share the seed and their shards have the same ``T``,
    they all get the same number of batches (``len(stream)``).

    ``len(stream)`` is counted at construction from the schedule's state then, so build the
    stream right before iterating it. :meth:`state_dict` holds the position and the schedule's
    state; loading it into a stream built on the same shard yields exactly the remaining batches
    of an uninterrupted run.
    """

    def __init__(self, shard: torch.Tensor, schedule: BPTTSchedule) -> None:
        if shard.dim() != 2:
            raise ValueError(f"Invalid shard: expected a [T, batch_size] tensor, got shape {tuple(shard.shape)}")
        if shard.size(0) < 2:
            raise DataError(f"A shard of {shard.size(0)} time step(s) has no (input, target) pair; use a smaller batch or more data.")
        self.shard = shard
        self.schedule = schedule
        self.i = 0
        self.batch = 0
        self._num_batches = _count_batches(shard.size(0), schedule)

    def __len__(self) -> int:
        return self._num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        last = self.shard.size(0) - 2
        while self.i < last:
            seq_len = self.schedule.next()
            data, target = get_batch(self.shard, self.i, seq_len)
            # Advance before yielding: a state_dict taken while the consumer holds this batch
            # resumes after it, with no batch trained twice.
            self.i += seq_len
            self.batch += 1
            yield data, target, seq_len

    def state_dict(self) -> dict[str, Any]:
        return {
            "i": self.i,
            "batch": self.batch,
            "num_batches": self._num_batches,
            "shard_shape": list(self.shard.shape),
            "schedule": self.schedule.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["shard_shape"]) != list(self.shard.shape):
            raise ValueError(
                f"Batch stream state was saved for a shard of shape {tuple(state['shard_shape'])}, "
                f"this shard is {tuple(self.shard.shape)}; resume with the same data, world size and batch size."
            )
        self.schedule.load_state_dict(state["schedule"])
        self.i = int(state["i"])
        self.batch = int(state["batch"])
        self._num_batches = int(state["num_batches"])
