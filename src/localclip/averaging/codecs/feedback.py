"""Error feedback: what a worker's low-bit encodings left out, added to its next round.

Worker ``i`` sends ``q_i = Q(d_i + e_i)`` and keeps ``e_i <- d_i + e_i - q_i``; the owner of a
shard (see :mod:`.lowbit`) sends ``Q(a + f)`` of the average ``a`` and keeps
``f <- a + f - Q(a + f)``. Summed over rounds, the decoded averages equal the averages of the
true inputs minus the current residuals (``mean_i e_i + f``): the running sum tracks the truth
within one round's quantization error, instead of drifting by a bias each round.
:class:`ErrorFeedback` holds one worker's residuals; the reduction updates them.
"""

from __future__ import annotations

import torch

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """One worker's residuals between low-bit rounds (see the module docstring).

    Attributes:
        residual: float32, ``numel``: what this worker's encoding of its input left out.
        shard_residual: float32, one chunk: what its re-encoding of the averaged shard it owns
            left out; ``None`` until the first round (its size depends on the world size).
    """

    def __init__(self, numel: int, device: torch.device | str | None = None):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"Invalid numel: {numel!r} (must be an integer >= 0)")
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        self.shard_residual: torch.Tensor | None = None

    def state_dict(self) -> dict:
        return {
            "residual": self.residual.clone(),
            "shard_residual": None if self.shard_residual is None else self.shard_residual.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        residual = state["residual"]
        if residual.shape != self.residual.shape:
            raise ValueError(f"Error-feedback residual has {residual.numel()} elements, expected {self.residual.numel()}")
        self.residual.copy_(residual)
        shard = state["shard_residual"]
        self.shard_residual = None if shard is None else shard.to(self.residual.device, torch.float32).clone()

    def __repr__(self) -> str:
        return f"ErrorFeedback(numel={self.residual.numel()}, |residual|max={self.residual.abs().max().item() if self.residual.numel() else 0.0:g})"
