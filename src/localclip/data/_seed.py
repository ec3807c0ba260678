"""Seed derivation: the one function that turns (seed, rank, epoch, ...) into a generator seed.

Every random choice in :mod:`localclip.data` that must agree across workers (participants of a
round) or must differ across them (each worker's permutation) is seeded from a tuple of parts
through :func:`derive_seed`, so no code path ever touches a global RNG.
"""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


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
