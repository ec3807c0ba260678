r"""Clipped SGD: the local update rule of CELGC (docs/algorithm.md).

The optimizer owns the update and nothing else: no communication happens here. The algorithms in
:mod:`localclip.algorithms` hand it a reference norm when a global clip mode needs one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["ClipStatistics", "ClippedSGD", "CLIP_MODES", "clipped_sgd"]

CLIP_MODES = ("local", "global_average", "max", "none")


class ClipStatistics:
    """What a clipping optimizer reports: counts of clipped and skipped steps and the last norm.

    The optimizer keeps ``_steps`` (an int) and the 0-dim tensors ``_clipped_steps``,
    ``_skipped_steps`` and ``_last_grad_norm`` up to date in its step (no host sync).
    """

    @property
    def clip_fraction(self) -> Tensor:
        """Fraction of steps so far that were clipped (a 0-dim tensor; NaN before any step)."""
        return self._clipped_steps / self._steps if self._steps else torch.tensor(math.nan)

    @property
    def clipped_steps(self) -> Tensor:
        return self._clipped_steps

    @property
    def skipped_steps(self) -> Tensor:
        """Steps skipped because the gradient norm was NaN or infinite (a 0-dim tensor)."""
        return self._skipped_steps

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def last_grad_norm(self) -> Tensor:
        """The raw local gradient norm of the last step (a 0-dim tensor)."""
        return self._last_grad_norm


class ClippedSGD(ClipStatistics, torch.optim.Optimizer):
    r"""SGD whose step length is bounded by clipping: the update of CELGC.

    For parameters :math:`x` (all parameter groups together) with raw gradient :math:`g`:

    .. math::
        \nu &= \|g\|_2 \quad\text{(over every parameter that has a gradient, all groups)} \\
        s &= \min(\eta, \gamma / \nu) \quad\text{(per group: its own } \eta=\text{lr and } \gamma) \\
        d &= g + \lambda x \\
        b &\leftarrow \mu b + (1 - \tau) d \quad (b = d \text{ on the first step}) \\
        d &\leftarrow d + \mu b \text{ (Nesterov) or } b \\
        x &\leftarrow x - s\, d

    With :math:`\mu = \lambda = 0` one step equals ``clip_grad_norm_(params, gamma / lr)``
    followed by ``SGD(lr)``; with :math:`\gamma = \infty` it is exactly ``torch.optim.SGD``.
    Differences from clipping the gradient before a standard SGD step, as the paper's reference
    runs do: the norm is taken over the *raw* gradient (before weight decay and momentum), the
    clip factor scales the whole momentum-and-decay direction, and the momentum buffer
    accumulates unclipped gradients. A step counts as *clipped* when :math:`\gamma/\nu < \eta` in
    any group. A step whose gradient norm is NaN or infinite is skipped (parameters and momentum
    untouched) and counted in :attr:`skipped_steps`, rather than writing NaN into the model; with
    ``clip_mode="none"`` no norm is computed and no step is skipped.

    Args:
        params: parameters or parameter groups; each group may set its own ``lr`` and ``gamma``.
        lr: the step size :math:`\eta`.
        gamma: the clipping parameter :math:`\gamma`, a bound on the step length
            :math:`\min(\eta\nu, \gamma)`; ``math.inf`` disables clipping.
        momentum, dampening, weight_decay, nesterov: as in ``torch.optim.SGD``.
        clip_mode: ``"local"`` clips with the worker's own gradient norm (the paper's);
            ``"global_average"`` with the reference norm set by :meth:`set_reference_norm`
            (the norm of the worker-averaged gradient at the last sync step); ``"max"`` with the
            larger of the two; ``"none"`` never clips (and computes no norm).
        foreach: use the multi-tensor ``torch._foreach_*`` path; default: when no fused path.
        fused: use ``torch._fused_sgd_`` (one pass over the parameters); default: when every
            parameter is a floating-point CPU or CUDA tensor.

    Clip statistics are kept as tensors, so reading them is the only host synchronisation:
    :attr:`clip_fraction` (clipped steps / steps), :attr:`last_grad_norm`.

    :attr:`last_step_length` costs extra passes over the gradients and parameters (with weight
    decay, momentum, or several groups), as much as the update itself, so it is computed only
    while :attr:`measure_step_length` is true (the default); with it false a step is the norm and
    the update alone and :attr:`last_step_length` is NaN. The trainer turns it on for the steps
    whose statistics it samples (:mod:`localclip.train.metrics`). It changes no parameter.

    Precision: the norm and the clipped step size are computed in the parameters' precision
    (float64 parameters get a float64 norm and step, exact to rounding); float16 and bfloat16
    gradients are accumulated in float32, and their step size stays float32 on the fused path.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float,
        gamma: float = math.inf,
        *,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        clip_mode: str = "local",
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        if isinstance(lr, Tensor):
            raise ValueError("Invalid learning rate: pass a float, not a tensor")
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not gamma > 0.0:
            raise ValueError(f"Invalid gamma (clipping parameter): {gamma} (must be > 0; inf disables clipping)")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Invalid momentum value: {momentum} (must be in [0, 1))")
        if not 0.0 <= dampening <= 1.0:
            raise ValueError(f"Invalid dampening value: {dampening} (must be in [0, 1])")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"Invalid nesterov=True: requires momentum > 0 and zero dampening (momentum={momentum}, dampening={dampening})")
        if clip_mode not in CLIP_MODES:
            raise ValueError(f"Invalid clip_mode: {clip_mode!r} (expected one of {CLIP_MODES})")
        if fused and foreach:
            raise ValueError("Invalid options: fused and foreach cannot both be True")
        defaults = dict(
            lr=lr, gamma=gamma, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, foreach=foreach, fused=fused,
        )
        super().__init__(params, defaults)
        self.clip_mode = clip_mode
        self._reference_norm: Tensor | None = None
        device = self.param_groups[0]["params"][0].device
        self._clipped_steps = torch.zeros((), dtype=torch.long, device=device)
        self._skipped_steps = torch.zeros((), dtype=torch.long, device=device)
        self._steps = 0
        self._last_grad_norm = torch.full((), math.nan, device=device)
        self._last_step_length = self._not_measured = torch.full((), math.nan, device=device)
        self.measure_step_length = True

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("gamma", math.inf)
            group.setdefault("foreach", None)
            group.setdefault("fused", None)
            group.setdefault("nesterov", False)

    def set_reference_norm(self, norm: Tensor | float | None) -> None:
        """Set the norm that the ``global_average`` and ``max`` clip modes use until replaced."""
        if norm is None:
            self._reference_norm = None
            return
        # Keep a float64 reference exact; anything narrower is held in float32 (the precision in
        # which float16/bfloat16 norms are accumulated).
        norm = torch.as_tensor(norm, dtype=torch.float64) if not isinstance(norm, Tensor) else norm
        self._reference_norm = norm if norm.dtype == torch.float64 else norm.to(torch.float32)

    # -- the step ------------------------------------------------------------------------------

    def _params_with_grad(self):
        return [[p for p in g["params"] if p.grad is not None] for g in self.param_groups]

    def clip_norm(self, grads: list[Tensor]) -> Tensor | None:
        """The norm that decides the clip factor under this optimizer's ``clip_mode``."""
        if self.clip_mode == "none":
            return None
        local = grad_norm(grads)
        self._last_grad_norm = local
        if self.clip_mode == "local" or self._reference_norm is None:
            # Before the first sync step a global mode has no reference yet: clip locally.
            return local
        ref = self._reference_norm.to(local.device, local.dtype)
        return ref if self.clip_mode == "global_average" else torch.maximum(local, ref)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        per_group = self._params_with_grad()
        all_grads = [p.grad for params in per_group for p in params]
        if not all_grads:
            return loss
        if any(g.is_sparse for g in all_grads):
            raise RuntimeError("ClippedSGD does not support sparse gradients")
        norm = self.clip_norm(all_grads)
        # A non-finite gradient skips the step on the device (no host sync on the fused path).
        found_inf = None if norm is None else (~torch.isfinite(norm)).float()
        clipped = None
        measure = self.measure_step_length
        lengths = []  # per group: step size · ‖direction‖, when measured
        for group, params in zip(self.param_groups, per_group):
            if not params:
                continue
            step_size = clipped_step_size(group["lr"], group["gamma"], norm)
            if norm is not None and math.isfinite(group["gamma"]):
                hit = norm * group["lr"] > group["gamma"]
                clipped = hit if clipped is None else clipped | hit
            bufs = [self.state[p].get("momentum_buffer") for p in params]
            # Without momentum the direction g + wd·x is known before the step only.
            direction = _plain_direction_norm(group, params, norm, len(per_group)) if measure and group["momentum"] == 0 else None
            clipped_sgd(
                params, [p.grad for p in params], bufs, step_size,
                weight_decay=group["weight_decay"], momentum=group["momentum"],
                dampening=group["dampening"], nesterov=group["nesterov"],
                foreach=group["foreach"], fused=group["fused"], found_inf=found_inf,
            )
            if group["momentum"] != 0:
                for p, buf in zip(params, bufs):
                    self.state[p]["momentum_buffer"] = buf
            if measure:
                lengths.append((direction if direction is not None else _momentum_direction_norm(group, bufs)) * step_size)
        self._last_step_length = _step_length(lengths, found_inf) if measure else self._not_measured
        self._steps += 1
        if clipped is not None:
            self._clipped_steps += clipped.to(self._clipped_steps.device)
        if found_inf is not None:
            self._skipped_steps += found_inf.to(self._skipped_steps.device).long()
        return loss

    @property
    def last_step_length(self) -> Tensor:
        """‖x_after − x_before‖ of the last step, ``step size · ‖d‖`` (a 0-dim tensor; 0 for a
        skipped step; NaN with Nesterov momentum, whose direction is not kept, and for a step
        taken while :attr:`measure_step_length` was false)."""
        return self._last_step_length

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self):
        sd = super().state_dict()
        sd["clip"] = {
            "clip_mode": self.clip_mode,
            "steps": self._steps,
            "clipped_steps": self._clipped_steps.clone(),
            "skipped_steps": self._skipped_steps.clone(),
            "last_grad_norm": self._last_grad_norm.clone(),
            "reference_norm": None if self._reference_norm is None else self._reference_norm.clone(),
        }
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        clip = state_dict.pop("clip", None)
        super().load_state_dict(state_dict)
        if clip is not None:
            if clip["clip_mode"] != self.clip_mode:
                raise ValueError(f"Checkpoint clip_mode {clip['clip_mode']!r} differs from this optimizer's {self.clip_mode!r}")
            self._steps = int(clip["steps"])
            self._clipped_steps.copy_(clip["clipped_steps"])
            self._skipped_steps.copy_(clip["skipped_steps"])
            self._last_grad_norm = clip["last_grad_norm"].to(self._clipped_steps.device, copy=True)
            self.set_reference_norm(clip["reference_norm"])


def _plain_direction_norm(group: dict, params: list, norm: Tensor | None, groups: int) -> Tensor:
    """‖g + wd·x‖ of a group without momentum, before its step: the clip norm itself when that
    is the group's own gradient norm (no weight decay, one group), else from the dot products
    ‖g‖² + 2·wd·⟨g, x⟩ + wd²·‖x‖² (one read of the gradients and parameters)."""
    wd = group["weight_decay"]
    if wd == 0 and groups == 1 and norm is not None:
        return norm
    acc = norm_dtype([p.grad for p in params])
    total = torch.zeros((), dtype=acc, device=params[0].device)
    for p in params:
        g, x = p.grad.reshape(-1).to(acc), p.detach().reshape(-1).to(acc)
        total += torch.dot(g, g)
        if wd:
            total += 2 * wd * torch.dot(g, x) + wd * wd * torch.dot(x, x)
    return total.clamp_min(0).sqrt()


def _momentum_direction_norm(group: dict, bufs: list) -> Tensor | float:
    """‖d‖ of a heavy-ball step just taken: its momentum buffer; NaN for Nesterov's d + μ·buf."""
    return math.nan if group["nesterov"] else grad_norm(bufs)


def _step_length(lengths: list, found_inf: Tensor | None) -> Tensor:
    """The length of a step over all groups from each group's; 0 for a skipped step."""
    device = next((x.device for x in lengths if isinstance(x, Tensor)), None)  # a float joins the tensors' device
    length = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in lengths]).square().sum().sqrt()
    return length if found_inf is None else torch.where(found_inf.bool(), torch.zeros_like(length), length)


def norm_dtype(tensors: list[Tensor]) -> torch.dtype:
    """The precision a norm over ``tensors`` is accumulated in: float64 if any is float64, else
    float32 (float16 and bfloat16 would overflow or lose the small terms)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def grad_norm(grads: list[Tensor]) -> Tensor:
    """The L2 norm of all ``grads`` as one vector, a 0-dim tensor (no host sync), accumulated in
    :func:`norm_dtype` precision."""
    acc = norm_dtype(grads)
    if grads[0].device.type == "cpu":
        # On the CPU a BLAS dot product per tensor is about twice as fast as _foreach_norm.
        flat = [g.reshape(-1) if g.dtype == acc else g.reshape(-1).to(acc) for g in grads]
        return torch.stack([torch.dot(g, g) for g in flat]).sum().sqrt()
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=acc)))


def clipped_step_size(lr: float, gamma: float, norm: Tensor | None) -> Tensor | float:
    """``min(lr, gamma / norm)``: a tensor when it depends on the norm, else the float ``lr``."""
    if norm is None or math.isinf(gamma):
        return lr
    # clamp keeps a zero or non-finite norm well defined: 0 → lr, inf → 0, nan stays nan.
    return torch.clamp(gamma / norm, max=lr)


def _fused_supported(params: list[Tensor]) -> bool:
    # Not float16/bfloat16 on the CPU: that kernel's vectorised loop computes in the parameters'
    # dtype and drops small steps (1 - 2.6e-5·300 stays 1.0 in float16; measured, torch 2.13).
    return all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") and not p.is_sparse
        and not (p.device.type == "cpu" and p.dtype in (torch.float16, torch.bfloat16))
        for p in params
    )


def clipped_sgd(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None],
    step_size: Tensor | float,
    *,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    foreach: bool | None = None,
    fused: bool | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """Functional core: ``x ← x − step_size·d`` for the direction ``d`` of the class docstring.

    ``momentum_buffers`` is updated in place (``None`` entries are filled on their first step).
    When ``found_inf`` is a non-zero 0-dim tensor nothing changes.
    """
    if fused is None and foreach is None:
        fused = _fused_supported(params)
    hyper = dict(weight_decay=weight_decay, momentum=momentum, dampening=dampening, nesterov=nesterov)
    if fused:
        _fused_clipped_sgd(params, grads, momentum_buffers, step_size, found_inf, **hyper)
        return
    # The reference paths are for checking and for unusual tensors: a host check is fine there.
    if found_inf is not None and bool(found_inf):
        return
    impl = _multi_tensor_clipped_sgd if foreach or foreach is None else _single_tensor_clipped_sgd
    if (momentum != 0 and any(b is None for b in momentum_buffers)) or len({x.dtype for x in params}) > 1:
        # The first step fills the buffers; mixed dtypes take the step size in the first one's.
        impl(params, grads, momentum_buffers, step_size, **hyper)
        return
    for wave in _block_waves(params, grads, momentum_buffers):
        impl(*wave, step_size, **hyper)


# Elements per wave of blocks (1 MiB of float32): the direction g + wd·x is written into a
# temporary of this size, which the allocator hands out again at the next wave, where a whole
# model-size temporary is fresh memory at every step (its page faults cost 5-10x an in-place pass
# over the parameters on the CPUs measured in docs/benchmarks.md). A multiple of every vector
# width, so each block starts where a whole-tensor pass would start a vector.
_BLOCK = 1 << 18


def _block_waves(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None]):
    """``(params, grads, bufs)`` lists of flat slices of at most :data:`_BLOCK` elements together:
    the same elements as the whole tensors, in cache-sized waves. CPU tensors only, and only
    where parameter, gradient and buffer are contiguous alike; any other tensor comes whole, in a
    wave of its own. Every op of the update is elementwise, so slicing changes no bit."""
    wave: tuple[list, list, list] = ([], [], [])
    size = 0
    for x, g, b in zip(params, grads, bufs):
        if x.device.type != "cpu" or not (x.is_contiguous() and g.is_contiguous() and (b is None or b.is_contiguous())):
            yield [x], [g], [b]
            continue
        x, g, b = x.view(-1), g.view(-1), None if b is None else b.view(-1)
        for start in range(0, x.numel(), _BLOCK):
            n = min(_BLOCK, x.numel() - start)
            if size + n > _BLOCK and size:
                yield wave
                wave, size = ([], [], []), 0
            wave[0].append(x[start:start + n])
            wave[1].append(g[start:start + n])
            wave[2].append(None if b is None else b[start:start + n])
            size += n
    if size:
        yield wave


def _step_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the step size applied to parameters of ``dtype``: their own, except that a
    float16/bfloat16 step would round the clip factor, so those get float32 (a 0-dim tensor: the
    result keeps the parameters' dtype)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _single_tensor_clipped_sgd(params, grads, bufs, step_size, *, weight_decay, momentum, dampening, nesterov):
    """The reference: one parameter at a time, written as the math reads."""
    for i, (x, g) in enumerate(zip(params, grads)):
        d = g.add(x, alpha=weight_decay) if weight_decay != 0 else g
        if momentum != 0:
            if bufs[i] is None:
                bufs[i] = torch.clone(d).detach()
            else:
                bufs[i].mul_(momentum).add_(d, alpha=1 - dampening)
            d = d.add(bufs[i], alpha=momentum) if nesterov else bufs[i]
        if isinstance(step_size, Tensor):
            x.addcmul_(d, -step_size.to(x.device, _step_dtype(x.dtype)))
        else:
            x.add_(d, alpha=-step_size)


def _multi_tensor_clipped_sgd(params, grads, bufs, step_size, *, weight_decay, momentum, dampening, nesterov):
    """The same update with ``torch._foreach_*`` ops (one kernel per op on CUDA)."""
    d = torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay != 0 else list(grads)
    if momentum != 0:
        fresh = [i for i, b in enumerate(bufs) if b is None]
        old = [i for i, b in enumerate(bufs) if b is not None]
        for i in fresh:
            bufs[i] = torch.clone(d[i]).detach()
        if old:
            old_bufs = [bufs[i] for i in old]
            torch._foreach_mul_(old_bufs, momentum)
            torch._foreach_add_(old_bufs, [d[i] for i in old], alpha=1 - dampening)
        d = torch._foreach_add(d, bufs, alpha=momentum) if nesterov else list(bufs)
    if isinstance(step_size, Tensor):
        neg = -step_size.to(params[0].device, _step_dtype(params[0].dtype))
        torch._foreach_addcmul_(params, d, [neg] * len(params))
    else:
        torch._foreach_add_(params, d, alpha=-step_size)


def _fused_clipped_sgd(params, grads, bufs, step_size, found_inf, *, weight_decay, momentum, dampening, nesterov):
    """``torch._fused_sgd_`` with the clipped step size as its (tensor) learning rate.

    PyTorch's fused SGD applies exactly the direction of the class docstring in one pass over
    each parameter, takes a tensor lr and skips everything when ``found_inf`` is set, so neither
    the clip factor nor the non-finite check ever leaves the device. It needs one device and
    dtype per call, and "first step" is per call, so tensors are grouped by all three.
    """
    batches: dict[tuple, list[int]] = {}
    for i, x in enumerate(params):
        first = momentum != 0 and bufs[i] is None
        batches.setdefault((x.device, x.dtype, first), []).append(i)
    for (device, dtype, first), idx in batches.items():
        if first:
            for i in idx:
                bufs[i] = torch.empty_like(params[i])
        lr = step_size.to(device, _step_dtype(dtype)) if isinstance(step_size, Tensor) else step_size
        torch._fused_sgd_(
            [params[i] for i in idx], [grads[i] for i in idx],
            [bufs[i] for i in idx] if momentum != 0 else [],
            weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
            nesterov=nesterov, maximize=False, is_first_step=first,
            found_inf=None if found_inf is None else found_inf.to(device),
        )
