"""What a round does to the inner optimizer's state: keep it per worker, average it, or reset it."""

from __future__ import annotations

import torch

__all__ = ["OPTIMIZER_STATE_MODES", "sync_optimizer_state"]

OPTIMIZER_STATE_MODES = ("local", "average", "reset")


def sync_optimizer_state(optimizer: torch.optim.Optimizer, mode: str, comm, collective) -> int:
    """Apply ``mode`` to the per-parameter state of any ``torch.optim`` optimizer after a round;
    return the payload bytes it all-reduced.

    The state that follows the model is every floating-point tensor shaped like its
    parameter: SGD's ``momentum_buffer``, Adam's ``exp_avg`` and ``exp_avg_sq`` (and
    ``max_exp_avg_sq``). Scalars such as Adam's ``step`` are the same on every worker and
    stay. ``reset`` forgets a parameter's whole state, so the optimizer starts it afresh on
    its next step as on its first (for Adam: new moments and a restarted bias correction,
    not zeroed moments under an old step count, whose first update would be about
    1/sqrt(1 - β2) times too long). ``collective(what, fn)`` runs a collective, naming it in
    any error.
    """
    if mode == "local":
        return 0
    if mode == "reset":
        for p in list(optimizer.state):
            del optimizer.state[p]
        return 0
    bufs = [
        t for p, s in optimizer.state.items() for k, t in s.items()
        if k != "step" and isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == p.shape
    ]
    if not bufs:
        return 0
    # All workers hold the same set of buffers (same params, same number of steps).
    k = comm.world_size
    collective("momentum averaging", lambda: comm.all_reduce(bufs, then=lambda b: b.div_(k)))
    return sum(b.numel() * b.element_size() for b in bufs)
