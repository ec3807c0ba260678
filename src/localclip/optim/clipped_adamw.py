r"""AdamW after clipping the gradient's norm: the local update practitioners use for transformers.

The optimizer owns that update and nothing else (no communication), with the same statistics
as :class:`~localclip.optim.ClippedSGD` (``clipped_steps``, ``skipped_steps``, ``clip_fraction``)
so that the algorithms and the trainer treat both alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from localclip.optim.clipped_sgd import ClipStatistics, grad_norm

__all__ = ["ClippedAdamW"]


class ClippedAdamW(ClipStatistics, torch.optim.AdamW):
    r"""``clip_grad_norm_(params, max_grad_norm)`` then ``torch.optim.AdamW.step()``, in one call.

    For the raw gradient :math:`g` of every parameter that has one (all groups together):

    .. math::
        \nu = \|g\|_2, \qquad \hat g = g \cdot \min\bigl(1, \tfrac{c}{\nu}\bigr),

    then AdamW's step with :math:`\hat g` (decoupled weight decay, bias-corrected moments).
    :math:`c` is ``max_grad_norm`` (per group, the same in all groups by default);
    ``math.inf`` gives exactly ``torch.optim.AdamW``. A step counts as *clipped* when
    :math:`\nu > c`. Differences from ``clip_grad_norm_`` + ``AdamW``: the clip factor is
    :math:`c/\nu` rather than :math:`c/(\nu + 10^{-6})`, and a step whose norm is NaN or infinite
    is skipped (parameters, moments and step count untouched) and counted in
    :attr:`skipped_steps`, as ``torch.amp.GradScaler`` skips a step with an overflow.

    The gradients are divided in place by :math:`\max(1, \nu/c)`, a device tensor (no host
    sync). On the fused path (the default for floating-point CPU and CUDA parameters) the skip
    decision does not leave the device either: it goes to PyTorch's fused AdamW kernel as its
    ``found_inf`` input, the channel ``GradScaler`` uses. On the other paths it is read on the
    host, one synchronisation per step.

    Args:
        params: parameters or parameter groups (e.g. no weight decay on biases and LayerNorms).
        lr, betas, eps, weight_decay, amsgrad, foreach, fused: as ``torch.optim.AdamW``
            (``fused`` defaults to True where every parameter supports it).
        max_grad_norm: :math:`c`, the bound on the gradient norm; ``math.inf`` disables clipping.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float = math.inf,
        amsgrad: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0:
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm!r} (must be > 0; inf disables clipping)")
        params = list(params)
        if fused is None and not foreach:
            flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
            fused = bool(flat) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in flat)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, fused=fused or None)
        for group in self.param_groups:
            group.setdefault("max_grad_norm", float(max_grad_norm))
        self.defaults["max_grad_norm"] = float(max_grad_norm)
        device = self.param_groups[0]["params"][0].device
        self._clipped_steps = torch.zeros((), dtype=torch.long, device=device)
        self._skipped_steps = torch.zeros((), dtype=torch.long, device=device)
        self._steps = 0
        self._last_grad_norm = torch.full((), math.nan, device=device)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("max_grad_norm", math.inf)

    # -- statistics: ClipStatistics, kept up to date by step() ------------------------------------

    clip_mode = "local"  # the only one: each worker clips with its own gradient's norm

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return loss
        if any(g.dtype == torch.float64 for g in grads):
            # Float64 models (the parity tests) get a float64 norm, as clip_grad_norm_ gives.
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
        else:
            norm = grad_norm(grads)
        self._last_grad_norm = norm
        found_inf = (~torch.isfinite(norm)).float()
        limits = {g["max_grad_norm"] for g in self.param_groups}
        if len(limits) > 1:
            raise ValueError(f"ClippedAdamW: param groups disagree on max_grad_norm ({sorted(limits)}); the norm is one over all groups")
        limit = limits.pop()
        # 1 when not clipping; ν/c when clipping (clamp keeps a zero norm at 1).
        scale = torch.clamp(norm / limit, min=1.0) if math.isfinite(limit) else None
        if scale is not None:
            torch._foreach_div_(grads, scale)
        if all(g["fused"] for g in self.param_groups):
            # GradScaler's channel into the fused kernel: skip the step on the device.
            self.found_inf = found_inf
            try:
                super().step()
            finally:
                del self.found_inf
        elif not bool(found_inf):
            super().step()
        self._steps += 1
        if scale is not None:
            self._clipped_steps += (norm > limit).to(self._clipped_steps.device)
        self._skipped_steps += found_inf.to(self._skipped_steps.device).long()
        return loss

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self):
        sd = super().state_dict()
        sd["clip"] = {
            "steps": self._steps,
            "clipped_steps": self._clipped_steps.clone(),
            "skipped_steps": self._skipped_steps.clone(),
            "last_grad_norm": self._last_grad_norm.clone(),
        }
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        clip = state_dict.pop("clip", None)
        super().load_state_dict(state_dict)
        if clip is not None:
            self._steps = int(clip["steps"])
            self._clipped_steps.copy_(clip["clipped_steps"])
            self._skipped_steps.copy_(clip["skipped_steps"])
            self._last_grad_norm = clip["last_grad_norm"].to(self._clipped_steps.device, copy=True)
