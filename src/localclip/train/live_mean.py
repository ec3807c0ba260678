"""The mean of the workers' live models: what an evaluation inside an epoch of a streaming run scores.

Streaming rounds (``fragments > 1``: fragments synced on staggered schedules; ``overlap >= 1``:
rounds in flight carrying values sent some steps ago) leave no step inside an epoch at which every
worker holds the same averaged model. An evaluation there scores the mean of the workers' current
models instead: every parameter and floating-point buffer, averaged over the workers into a
scratch copy by one all-reduce, swapped into the model for the evaluation and swapped back
afterwards, bit for bit (:meth:`LiveMean.swapped_in`).

That all-reduce is evaluation traffic, like the sum of the evaluation's scores: it is not the
algorithm's (not counted in ``comm/rounds`` or ``comm/bytes``, nor in the step timings), it
draws no random number, and nothing of the algorithm is read or written: a round in flight is not
landed and its result not waited for (as before any collective, gloo's transport may first issue
the round's own later phases), and its snapshot and send buffers, the fragments' anchors, outer
momentum and low-bit residuals are left as they are. So a run validated inside its epochs trains
exactly as one that is not. A worker whose values hold NaN or Inf is left out of the mean, as a
round leaves it out (the mean is NaN when every worker is). The sum is in rank order over gloo and
in the simulation (:mod:`localclip.comm`), so simulated workers and gloo processes score the same
bits.

Memory while swapped in: a copy of the model's averaged tensors (its own values, put back after)
and the mean (float32, or float64 for float64 tensors).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["LiveMean"]


class LiveMean:
    """Swaps the mean of every worker's ``model`` into it (see the module docstring); ``comm`` is
    the worker's communicator. Every worker must enter :meth:`swapped_in` at the same point."""

    def __init__(self, model: nn.Module, comm):
        self.model, self.comm = model, comm

    def _tensors(self) -> list[torch.Tensor]:
        """The parameters and floating-point buffers, each once (a tied weight is one tensor)."""
        seen, out = set(), []
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.is_floating_point() and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    @contextlib.contextmanager
    def swapped_in(self):
        """Inside the block the model holds the mean of every worker's model; its own bits after."""
        tensors = self._tensors()
        if self.comm.world_size == 1 or not tensors:
            yield
            return
        with torch.no_grad():
            own = [t.detach().clone() for t in tensors]
            self._write_mean(tensors)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, o in zip(tensors, own):
                    t.copy_(o)

    @torch.no_grad()
    def _write_mean(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite ``tensors`` with their mean over the workers (the sums are freed on return,
        before the evaluation runs)."""
        # One flat sum per accumulation dtype (float64 stays float64; narrower types sum in
        # float32), all in one collective, with this worker's weight (1, or 0 if non-finite).
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(torch.float64 if t.dtype == torch.float64 else torch.float32, []).append(i)
        flats = {dtype: torch.cat([tensors[i].detach().reshape(-1).to(dtype) for i in idx]) for dtype, idx in groups.items()}
        finite = all(bool(torch.isfinite(f).all()) for f in flats.values())
        if not finite:
            for f in flats.values():
                f.zero_()
        weight = torch.tensor([1.0 if finite else 0.0], dtype=torch.float64, device=tensors[0].device)
        self.comm.all_reduce([weight, *flats.values()])  # evaluation only: not part of the algorithm's traffic
        # Divided in each flat's own dtype: the same operation on every worker and runtime.
        for dtype, idx in groups.items():
            mean = flats[dtype].div_(weight.to(dtype))
            at = 0
            for i in idx:
                t = tensors[i]
                t.copy_(mean[at : at + t.numel()].view_as(t))
                at += t.numel()
