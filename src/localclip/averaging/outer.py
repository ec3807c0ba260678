r"""Outer optimizers: what a round does with the average, DiLoCo-style.

Plain averaging replaces every worker's model by the average :math:`\bar x` of the models. With
an outer optimizer the :class:`~localclip.averaging.PeriodicAverager` instead keeps the *anchor*
:math:`a` (the model as of the last round, the same on every worker), treats the change
:math:`\Delta = a - \bar x` as a pseudo-gradient and steps an optimizer on the anchor
(Douillard et al., "DiLoCo", 2023; torchft's ``DiLoCo``); the result is the new model and the new
anchor on every worker. Like Flower's server strategies, an outer optimizer is a small object over
the aggregated change, so plain averaging, outer SGD and Nesterov differ in a few lines:

* :class:`OuterSGD` — outer SGD with ``lr``, ``momentum`` and ``nesterov`` in PyTorch's
  convention (``buf ← μ·buf + Δ``; Nesterov: ``d = Δ + μ·buf``, else ``d = buf``;
  ``x ← a − lr·d``), written so that ``lr=1, momentum=0`` gives *exactly* the average (without
  momentum it is ``lerp(a, x̄, lr)``, exact at 1; with momentum it computes
  :math:`x = \bar x + (\Delta - lr\cdot d)`; the textbook ``a − (a − x̄)`` is not always ``x̄`` in
  floating point). It works in place, block by block, on
  the averaged tensors while they are in cache; its extra memory is the momentum buffer (one
  copy of the parameters, none when ``momentum=0``).
* :class:`TorchOuter` — any ``torch.optim.Optimizer``, from a factory ``params -> optimizer``,
  stepped on the anchor with ``.grad = Δ`` (DiLoCo's form). Its extra memory is the optimizer's
  state plus the pseudo-gradient, one copy of the parameters, because ``torch.optim`` reads it
  from ``.grad``.

Either way the averager holds the anchor, one more copy of the averaged tensors. Only trainable
parameters take the outer step; floating-point buffers (BatchNorm statistics) take the average.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["OuterSGD", "TorchOuter", "OUTER_OPTIMIZERS", "make_outer"]

OUTER_OPTIMIZERS = ("none", "sgd", "nesterov")


class OuterSGD:
    """Outer SGD (``nesterov=False``) or Nesterov (DiLoCo's: ``lr=0.7, momentum=0.9, nesterov=True``).

    See the module docstring for the update. ``momentum`` in ``[0, 1)``; ``nesterov`` needs
    ``momentum > 0``. The momentum buffers start at zero, which makes the first step's buffer
    exactly ``Δ``, as ``torch.optim.SGD``'s first step does.
    """

    blockwise = True  # apply() is called per block of the averaged tensors, in cache

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False):
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and lr < float("inf")):
            raise ValueError(f"Invalid outer lr: {lr!r} (must be a positive number)")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Invalid outer momentum: {momentum!r} (must be in [0, 1))")
        if nesterov and momentum <= 0:
            raise ValueError(f"Invalid outer nesterov=True with momentum={momentum!r} (Nesterov needs momentum > 0)")
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), bool(nesterov)
        self.buffers: list[torch.Tensor] | None = None

    @property
    def kind(self) -> str:
        return "nesterov" if self.nesterov else "sgd"

    def bind(self, anchors: list[torch.Tensor]) -> None:
        """Allocate the state for these anchor tensors (one per flat bucket, or with fragments one
        per fragment's slice of a bucket, so a tensor cut between two fragments has its momentum
        cut at the same element; parameters only)."""
        _bind_once(self)
        self.buffers = [torch.zeros_like(a) for a in anchors] if self.momentum else None

    @property
    def state_numel(self) -> int:
        """Elements of extra state (the momentum buffers)."""
        return sum(b.numel() for b in self.buffers) if self.buffers else 0

    @torch.no_grad()
    def apply(self, index: int, start: int, average: torch.Tensor, anchor: torch.Tensor) -> None:
        """One block: ``average`` holds x̄ and ``anchor`` holds a; both become the new model.

        ``index`` and ``start`` locate the block in anchor tensor ``index`` (for the momentum).
        """
        lr, mu = self.lr, self.momentum
        if not mu:
            # x = a − lr·(a − x̄) = lerp(a, x̄, lr); torch's lerp computes x̄ − (x̄ − a)·(1 − lr)
            # for lr >= 0.5, which is exactly x̄ at lr = 1.
            torch.lerp(anchor, average, lr, out=average)
            anchor.copy_(average)
            return
        delta = anchor.sub_(average)  # Δ = a − x̄, in the anchor's storage (a is not needed again)
        buf = self.buffers[index][start : start + delta.numel()]
        # One pass: buf ← μ·buf + Δ, then Δ ← Δ − lr·d (d = Δ + μ·buf, or buf). The fused kernel
        # is elementwise, so Δ may be both its parameter and its gradient.
        torch._fused_sgd_(
            [delta], [delta], [buf], weight_decay=0.0, momentum=mu, lr=lr, dampening=0.0,
            nesterov=self.nesterov, maximize=False, is_first_step=False,
        )
        average.add_(delta)  # x = x̄ + (Δ − lr·d) = a − lr·d
        anchor.copy_(average)

    def state_dict(self) -> dict:
        return {
            "kind": self.kind, "lr": self.lr, "momentum": self.momentum,
            "buffers": None if self.buffers is None else [b.clone() for b in self.buffers],
        }

    def load_state_dict(self, state: dict) -> None:
        check_same_kind(state, self.kind)
        if (state["buffers"] is None) != (self.buffers is None):
            raise ValueError(
                f"Checkpoint outer momentum {state['momentum']!r} and this run's {self.momentum!r}: "
                "one of them keeps no momentum buffer, so the outer state cannot be resumed"
            )
        if self.buffers is not None and state["buffers"] is not None:
            for b, saved in zip(self.buffers, state["buffers"]):
                b.copy_(saved)

    def __repr__(self) -> str:
        return f"OuterSGD(lr={self.lr}, momentum={self.momentum}, nesterov={self.nesterov})"


class TorchOuter:
    """Any ``torch.optim.Optimizer`` as the outer optimizer: ``factory(params)`` builds it over
    the anchor tensors, and each round sets ``anchor.grad = anchor − average`` and steps it."""

    blockwise = False  # torch.optim steps whole tensors: apply_all() runs after the transport

    def __init__(self, factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        if not callable(factory):
            raise ValueError(f"Invalid outer optimizer: {factory!r} (expected an OuterSGD or a factory params -> torch.optim.Optimizer)")
        self.factory = factory
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[torch.Tensor] = []

    @property
    def kind(self) -> str:
        return f"torch:{type(self.optimizer).__name__}" if self.optimizer is not None else "torch"

    def bind(self, anchors: list[torch.Tensor]) -> None:
        _bind_once(self)
        self.params = anchors
        for a in anchors:
            a.grad = torch.zeros_like(a)
        optimizer = self.factory(self.params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"Invalid outer optimizer factory: it returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        self.optimizer = optimizer

    @property
    def state_numel(self) -> int:
        """Elements of extra state: the pseudo-gradients and the optimizer's tensors."""
        grads = sum(p.numel() for p in self.params)
        state = sum(t.numel() for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim())
        return grads + state

    @torch.no_grad()
    def apply_all(self, averages: list[torch.Tensor]) -> None:
        """``averages[i]`` holds the average of the parameters anchored in ``self.params[i]``."""
        for avg, a in zip(averages, self.params):
            torch.sub(a, avg, out=a.grad)
        self.optimizer.step()
        for avg, a in zip(averages, self.params):
            avg.copy_(a)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_same_kind(state, self.kind)
        self.optimizer.load_state_dict(state["optimizer"])

    def __repr__(self) -> str:
        return f"TorchOuter({self.optimizer!r})"


def _bind_once(outer) -> None:
    # The state belongs to one averager (one worker): sharing it between simulated workers
    # would silently mix their momentum.
    if getattr(outer, "_bound", False):
        raise ValueError(f"Invalid outer optimizer: {outer!r} already serves another averager; make one per worker")
    outer._bound = True


def check_same_kind(state: dict, kind: str) -> None:
    if state.get("kind") != kind:
        raise ValueError(f"Checkpoint outer optimizer {state.get('kind')!r} differs from this run's {kind!r}")


def make_outer(spec) -> OuterSGD | TorchOuter | None:
    """``None``, an :class:`OuterSGD`/:class:`TorchOuter`, or a ``torch.optim`` factory."""
    if spec is None or isinstance(spec, (OuterSGD, TorchOuter)):
        return spec
    return TorchOuter(spec)
