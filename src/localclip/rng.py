"""Randomness inside a worker: its own generators, and seeded use of the global ones.

Simulated workers are threads of one process and run concurrently, while torch's, NumPy's and
Python's default generators are process-wide: a draw from them depends on how the threads
interleave. So nothing random inside a localclip worker reads a global generator:

* each model that drops units draws its masks from ``module.generator`` (a ``torch.Generator``
  or ``None``, meaning torch's default one); :func:`set_generator` points every module of a
  model at one worker's generator, and :func:`worker_generator` makes that generator, seeded
  from ``(seed, rank, purpose)`` exactly as in a spawned process;
* code that can only use the global generators (``nn.init`` inside a model's constructor)
  runs inside :func:`seeded`, which serialises such sections across threads and restores the
  generators' previous state afterwards, so every worker builds the same initial weights and
  nothing outside the section sees a change.

Every seed is derived from a tuple of parts by :func:`derive_seed`, so choices that must agree
across workers (participants of a round) or must differ (each worker's permutation, its dropout
stream) are named by what they are for, never by ``seed + rank`` arithmetic. The data pipeline
(:mod:`localclip.data`) draws from generators seeded this way per call.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

__all__ = ["derive_seed", "global_state", "seeded", "set_generator", "worker_generator"]

# One lock for the whole process: a seeded section must not interleave with another thread's.
_GLOBAL_RNG_LOCK = threading.RLock()


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part and on their order.

    Python's ``hash`` is salted per process for strings, and ``seed + rank`` collides
    (``(seed=1, rank=0)`` and ``(seed=0, rank=1)``); a cryptographic hash of the parts' text is
    the same in every process, on every platform and in every Python version.
    """
    for part in parts:
        # bool is an int subclass; True and 1 would silently give the same seed.
        if isinstance(part, bool) or not isinstance(part, (int, str)):
            raise TypeError(f"seed parts must be int or str, got {part!r} ({type(part).__name__})")
    text = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    # 63 bits: accepted by torch.Generator.manual_seed and numpy alike, and never negative.
    return int.from_bytes(digest, "big") >> 1


def worker_generator(seed: int, rank: int, purpose: str = "dropout", device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` (where the masks it draws live) for worker ``rank``, the same in
    every runtime for the same arguments."""
    return torch.Generator(device=device).manual_seed(derive_seed(purpose, int(seed), int(rank)))


def set_generator(module: nn.Module, generator: torch.Generator | None) -> nn.Module:
    """Make every submodule of ``module`` that has a ``generator`` attribute draw from ``generator``."""
    for m in module.modules():
        if hasattr(m, "generator"):
            m.generator = generator
    return module


def global_state() -> tuple:
    """The state of torch's (CPU), NumPy's and Python's global generators, comparable with ``==``."""
    np_state = np.random.get_state()
    return (
        torch.get_rng_state().numpy().tobytes(),
        (np_state[0], np_state[1].tobytes(), *np_state[2:]),
        random.getstate(),
    )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the global generators seeded with ``seed``, one thread at a time.

    The generators' state is saved before and restored after, so code that draws from them
    inside the block (weight initialisation) gets the same numbers in every worker and in every
    runtime, and code outside it sees no change.
    """
    with _GLOBAL_RNG_LOCK:
        torch_state, np_state, py_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        try:
            yield
        finally:
            torch.set_rng_state(torch_state)
            np.random.set_state(np_state)
            random.setstate(py_state)
