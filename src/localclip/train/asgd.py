"""The NT-ASGD-like average of AWD-LSTM runs: which weights an evaluation scores.

After ``patience`` epochs in a row without a better validation perplexity, every later
evaluation scores the running average of the end-of-epoch weights instead of the raw ones;
training itself continues from the raw weights (see docs/algorithm.md for how this differs
from the AWD-LSTM reference's trigger).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from localclip import devices

__all__ = ["EpochAverage"]


class EpochAverage:
    """The running average of ``model``'s end-of-epoch weights, started by ``patience``."""

    def __init__(self, model: nn.Module, patience: int):
        self.model, self.patience = model, patience
        self.best_val = math.inf
        self.bad_epochs = 0
        self.average: list[torch.Tensor] | None = None
        self.count = 0  # end-of-epoch weights in the average

    def end_of_epoch(self, val_ppl: float) -> None:
        """Count an epoch whose validation perplexity was ``val_ppl``; average if triggered."""
        if val_ppl < self.best_val:
            self.best_val, self.bad_epochs = val_ppl, 0
        else:
            self.bad_epochs += 1
        if self.average is not None or self.bad_epochs >= self.patience:
            params = [p.detach() for p in self.model.parameters()]
            if self.average is None:
                self.average = [p.clone() for p in params]
                self.count = 1
            else:
                self.count += 1
                for a, p in zip(self.average, params):
                    a.add_(p - a, alpha=1.0 / self.count)

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holds the average (if there is one) inside the block, its raw weights after."""
        if self.average is None:
            yield
            return
        raw = [p.detach().clone() for p in self.model.parameters()]
        with torch.no_grad():
            for p, a in zip(self.model.parameters(), self.average):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, r in zip(self.model.parameters(), raw):
                    p.copy_(r)

    def state_dict(self) -> dict:
        # The trainer's checkpoint keys since before this class existed.
        return {"best_val": self.best_val, "bad_epochs": self.bad_epochs, "asgd_avg": self.average, "asgd_count": self.count}

    def load_state_dict(self, state: dict, device) -> None:
        self.best_val, self.bad_epochs = state["best_val"], state["bad_epochs"]
        self.average, self.count = devices.move(state["asgd_avg"], device), state["asgd_count"]
