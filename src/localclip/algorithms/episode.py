r"""EPISODE (Crawshaw, Bao, Liu, ICLR 2023): local clipped steps corrected
towards the global gradient, for heterogeneous data, where CELGC's local steps drift apart."""

from __future__ import annotations

import math

import torch
from torch import nn

from localclip.algorithms.base import DistributedAlgorithm
from localclip.comm import Communicator
from localclip.optim import ClippedAdamW, ClippedSGD, grad_norm

__all__ = ["EPISODE"]


class EPISODE(DistributedAlgorithm):
    r"""EPISODE: episodic gradient clipping with periodic resampled corrections.

    A round is the ``period`` local steps between two averages; at its start every worker holds
    the synced model :math:`x_r`. Per round:

    .. math::
        G_i &= \nabla F_i(x_r) \text{ (worker } i\text{)}, \qquad G = \tfrac1N \textstyle\sum_i G_i
            \text{ (one all-reduce)} \\
        \text{clip}_r &= \|G\| > \gamma/\eta \text{ (decided once for the round)} \\
        g' &= g - G_i + G \text{ at every local step (} g \text{ the local gradient)} \\
        x &\leftarrow x - \gamma\, g'/\|g'\| \text{ if clip}_r \text{, else } x - \eta\, g'

    then the models are averaged (:class:`~localclip.averaging.PeriodicAverager`, with all its
    options: buffers, partial participation, outer optimizer, compression). The step is
    :class:`~localclip.optim.ClippedSGD`'s with the round's rule: in a clipping round its
    ``lr`` is lifted to infinity (step size exactly :math:`\gamma/\|g'\|`), otherwise its
    ``gamma`` (step size :math:`\eta`), so momentum, weight decay, the non-finite skip and the
    clip statistics work as in CELGC (a step of a clipping round counts as clipped).

    One deviation from the paper, to keep the optimizer contract (the algorithm never runs the
    model): :math:`G_i` is the gradient the user computed at :math:`x_r` for the round's first
    local step, not a gradient of a separate, fresh minibatch. This saves the paper's extra
    gradient evaluation per round; the price is that the first local step of a round is the
    mean-gradient step :math:`g' = G`. The extra all-reduce is counted in :attr:`rounds` and
    :attr:`bytes_communicated`. Extra memory: one flat copy of the gradients (the correction
    :math:`G - G_i`).

    Because the clip decision is made once at :math:`x_r`, a round that starts with
    :math:`\|G\| \le \gamma/\eta` takes all its ``period`` steps at the full :math:`\eta`, however
    large the gradients grow on the way: it is local SGD without clipping for that round. So ``lr``
    must be one at which unclipped local SGD is stable. On ptb-converge (η = 20, γ = 5, I = 32)
    the first round is such a round and the run diverges in it, as local SGD at η = 20 does
    (docs/results.md, "Beyond the paper").

    With a :class:`~localclip.optim.ClippedAdamW` as the local update
    (:meth:`from_optimizer`), the corrected gradient :math:`g'` is what AdamW receives, and the
    round's one decision compares :math:`\|G\|` with ``max_grad_norm`` :math:`c`: in a clipping
    round :math:`g'` is scaled to norm :math:`c` before the AdamW step (the counterpart of the
    step length :math:`\gamma`), otherwise AdamW takes :math:`g'` as it is; AdamW's own
    per-step clipping is off in both.

    Communication: the per-round gradient all-reduce is float32 whatever the averager's
    ``compression``, so with bf16 rounds EPISODE sends 3/4 of its float32 bytes, not 1/2.

    Args: as :class:`~localclip.algorithms.CELGC`; ``clip_mode`` must be ``"local"`` (EPISODE
    has its own clip rule, which replaces the clip modes).
    """

    def __init__(
        self,
        module: nn.Module,
        lr: float,
        gamma: float = math.inf,
        period: int = 1,
        *,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        clip_mode: str = "local",
        foreach: bool | None = None,
        fused: bool | None = None,
        group: Communicator | None = None,
        **averager_options,
    ):
        self._compose(
            module, period, group, averager_options, lr=lr, gamma=gamma, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, clip_mode=clip_mode, foreach=foreach, fused=fused,
        )

    def _setup(self, module, optimizer, period, group, averager_options) -> None:
        if not isinstance(optimizer, (ClippedSGD, ClippedAdamW)):
            raise ValueError(
                f"Invalid optimizer for EPISODE: {type(optimizer).__name__} (EPISODE decides the clipping itself, "
                "once per round: it needs a ClippedSGD or a ClippedAdamW)"
            )
        if optimizer.clip_mode != "local":
            raise ValueError(
                f"Invalid clip_mode for EPISODE: {optimizer.clip_mode!r} (EPISODE decides clipping once per round from "
                "the norm of the mean gradient; only its own rule, clip_mode='local', applies)"
            )
        for name, off in (("fragments", 1), ("overlap", 0)):
            if averager_options.get(name, off) != off:
                raise ValueError(
                    f"Invalid {name}={averager_options[name]!r} for EPISODE: its correction needs every worker at the same "
                    f"whole model when a round starts ({name}={off!r})"
                )
        streaming = averager_options.get("streaming")
        if streaming is not None and streaming.on:  # the streaming layout given as an object (streaming=)
            raise ValueError(f"Invalid streaming={streaming!r} for EPISODE: its correction needs every worker at the "
                             "same whole model when a round starts (fragments=1, overlap=0)")
        super()._setup(module, optimizer, period, group, averager_options)
        params = [p for g in self.param_groups for p in g["params"]]
        self._correction = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self._views = {}
        offset = 0
        for p in params:
            self._views[p] = self._correction[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self._clip = [False] * len(self.param_groups)  # this round's decision, per parameter group
        self._round_started = True  # iteration 0 starts a round (everyone holds rank 0's model)

    @torch.no_grad()
    def _start_round(self) -> None:
        """At x_r: the correction G − G_i from the gradients just computed, and the clip decision."""
        flat = self._correction
        with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if len(with_grad) != len(self._views):
            raise RuntimeError("EPISODE needs a gradient for every trainable parameter at the start of a round")
        for p in with_grad:
            self._views[p].copy_(p.grad)
        self._reduce_mean([flat], "EPISODE gradient all-reduce")
        norm = float(torch.linalg.vector_norm(flat))  # once per round: a host read is fine
        if isinstance(self.optimizer, ClippedAdamW):
            self._clip = [norm > g["max_grad_norm"] for g in self.param_groups]
        else:
            self._clip = [norm * g["lr"] > g["gamma"] for g in self.param_groups]
        for p in with_grad:
            self._views[p].sub_(p.grad)  # G − G_i

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._round_started:
            self._start_round()
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.add_(self._views[p])  # g' = g − G_i + G
        if isinstance(self.optimizer, ClippedAdamW):
            self._adamw_step()
        else:
            self._sgd_step()
        self._round_started = self.averager.step()
        return loss

    def _sgd_step(self) -> None:
        saved = [(g["lr"], g["gamma"]) for g in self.param_groups]
        for g, clip in zip(self.param_groups, self._clip):
            if clip:
                g["lr"] = math.inf  # step size min(inf, γ/‖g'‖) = γ/‖g'‖
            else:
                g["gamma"] = math.inf  # step size η
        try:
            self.optimizer.step()
        finally:
            for g, (lr, gamma) in zip(self.param_groups, saved):
                g["lr"], g["gamma"] = lr, gamma

    @torch.no_grad()
    def _adamw_step(self) -> None:
        """AdamW on g' scaled to norm c in a clipping round, on g' itself otherwise."""
        saved = [g["max_grad_norm"] for g in self.param_groups]
        if self._clip[0]:  # one norm over all groups, so one decision
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            norm = grad_norm(grads)
            # A zero g' stays zero; a non-finite one stays non-finite, so AdamW skips the step.
            scale = torch.where(norm > 0, saved[0] / norm, torch.ones_like(norm))
            torch._foreach_mul_(grads, scale)
            self.optimizer._clipped_steps += 1
        for g in self.param_groups:
            g["max_grad_norm"] = math.inf
        try:
            self.optimizer.step()
        finally:
            for g, limit in zip(self.param_groups, saved):
                g["max_grad_norm"] = limit

    def state_dict(self) -> dict:
        return {
            **super().state_dict(), "round_started": self._round_started, "correction": self._correction.clone(),
            "clip": list(self._clip),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._round_started = state_dict["round_started"]
        self._correction.copy_(state_dict["correction"])
        self._clip = list(state_dict["clip"])
