"""The smoothness probe: local smoothness against gradient norm along a run's trajectory.

Zhang et al. (2020) observed that in LSTM training the local smoothness grows with the gradient
norm, ``L(x) ≈ L0 + L1·‖∇f(x)‖``, the (L0, L1)-smoothness that CELGC's analysis assumes. This
module measures that on a localclip run:

* :func:`local_smoothness` — for any differentiable loss: the gradient norm at ``x`` and the
  finite-difference smoothness along a direction ``d``, ``‖∇f(x + d) − ∇f(x)‖ / ‖d‖`` (the
  largest over a few fractions of ``d``, as Zhang et al. take along the update);
* :func:`fit_l0_l1` — the least-squares fit of ``L0 + L1·‖∇f‖`` (both ≥ 0);
* :func:`probe_run` — from the run's starting point (rebuilt from its config and seed) and each
  checkpoint it kept, a few clipped-SGD steps on the run's training batches, measuring at each
  step along that step's update; writes ``smoothness.json`` and ``smoothness.png``
  (``localclip smoothness RUN_DIR``).

The probe scores the training loss with dropout off (so that f is one function at x and at
x + d) on rank 0's model and one worker's view of the data; it reads checkpoints and never
writes them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from localclip import jsonio
from localclip.errors import ConfigError, RunFolderError
from localclip.train.run_folder import RunFolder, atomic_write_text

__all__ = ["fit_l0_l1", "local_smoothness", "probe_run"]


def _grads(loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    loss = loss_fn()
    return [g if g is not None else torch.zeros_like(p) for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])))


def local_smoothness(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    direction: Sequence[torch.Tensor],
    fractions: Sequence[float] = (0.25, 0.5, 1.0),
    grads: Sequence[torch.Tensor] | None = None,
) -> tuple[float, float]:
    """``(‖∇f(x)‖, max over s in fractions of ‖∇f(x + s·d) − ∇f(x)‖ / ‖s·d‖)``.

    ``loss_fn()`` evaluates f at the current values of ``params`` (leaf tensors that require
    grad); ``direction`` matches ``params``. The parameters are restored exactly afterwards.
    ``grads``: ∇f(x) if already computed.
    """
    params = list(params)
    direction = list(direction)
    if len(direction) != len(params) or any(d.shape != p.shape for d, p in zip(direction, params)):
        raise ValueError("Invalid direction: it must have one tensor of the same shape per parameter")
    length = _norm(direction)
    if not length > 0:
        raise ValueError("Invalid direction: its norm is 0")
    g0 = list(grads) if grads is not None else _grads(loss_fn, params)
    saved = [p.detach().clone() for p in params]
    best = 0.0
    try:
        for s in fractions:
            with torch.no_grad():
                for p, x, d in zip(params, saved, direction):
                    p.copy_(x + s * d)
            g1 = _grads(loss_fn, params)
            best = max(best, _norm([a - b for a, b in zip(g1, g0)]) / (s * length))
    finally:
        with torch.no_grad():
            for p, x in zip(params, saved):
                p.copy_(x)
    return _norm(g0), best


def fit_l0_l1(grad_norms: Sequence[float], smoothness: Sequence[float]) -> dict:
    """Least squares ``L ≈ L0 + L1·‖∇f‖`` with ``L0, L1 ≥ 0``; returns ``{L0, L1, r2, points}``."""
    pairs = [(g, s) for g, s in zip(grad_norms, smoothness) if math.isfinite(g) and math.isfinite(s)]
    if len(pairs) < 2:
        raise ValueError(f"Invalid points: {len(pairs)} finite (gradient norm, smoothness) pairs, need at least 2")
    g = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    s = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    gm, sm = g.mean(), s.mean()
    var = ((g - gm) ** 2).sum()
    l1 = float(((g - gm) * (s - sm)).sum() / var) if var > 0 else 0.0
    l0 = float(sm - l1 * gm)
    if l1 < 0:  # smoothness does not grow with the gradient: a constant
        l0, l1 = float(sm), 0.0
    elif l0 < 0:  # through the origin
        l0, l1 = 0.0, float((g * s).sum() / (g * g).sum())
    residual = ((s - (l0 + l1 * g)) ** 2).sum()
    total = ((s - sm) ** 2).sum()
    r2 = float(1 - residual / total) if total > 0 else 1.0
    return {"L0": l0, "L1": l1, "r2": r2, "points": len(pairs)}


# -- a run's trajectory ------------------------------------------------------------------------


def _checkpoint_steps(run: RunFolder) -> list[tuple[int, str]]:
    """(step, folder name) of every checkpoint on disk, by step (``step-N`` or ``step-N-epoch-E``)."""
    found = []
    for folder in run.checkpoints.glob("step-*"):
        digits = folder.name.split("-")[1]
        if digits.isdigit() and (folder / "rank-0.pt").is_file():
            found.append((int(digits), folder.name))
    return sorted(found)


def probe_run(
    run_dir: str | os.PathLike,
    *,
    steps: int = 20,
    data_root: str | None = None,
    out: str | os.PathLike | None = None,
    figure: bool = True,
    include_start: bool = True,
) -> dict:
    """Probe the run in ``run_dir``: ``steps`` clipped steps from its start and from each kept
    checkpoint, one smoothness point per step; fit L0 + L1·‖∇f‖; write ``smoothness.json``
    (and ``smoothness.png``) into ``out`` (default: the run folder). Language-model runs only."""
    from localclip.comm import SingleProcess
    from localclip.models import detach_hidden
    from localclip.train.workloads import make_workload

    run = RunFolder(run_dir)
    if not run.config_path.is_file():
        raise RunFolderError(f"{run.path} is not a run folder (no config.json)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"Invalid steps: {steps!r} (expected an integer >= 1)")
    config, _ = run.read_config()
    if config.workload.task != "lm":
        raise ConfigError(f"{run.path}: the smoothness probe handles language-model runs (task lm), not {config.workload.task!r}")
    notes = []
    config_data_root = config.workload.data_root
    if data_root is not None:
        config = config.replace(data_root=data_root)
    elif config.workload.data_root and not Path(config.workload.data_root).expanduser().exists():
        # A run's config keeps --data-root as given: a relative one means nothing from here, an
        # absolute one may be another machine's. The data then comes from where `train` looks.
        from localclip.data import resolve_data_root

        config = config.replace(data_root=None)
        notes.append(f"the run's data_root ({config_data_root!r}, in {run.config_path}) does not exist from here; "
                     f"reading the data from {resolve_data_root(None)} (pass --data-root to choose)")
    checkpoints = _checkpoint_steps(run)
    if not checkpoints and not include_start:
        raise RunFolderError(f"{run.path} holds no checkpoint (checkpoints/step-*/rank-0.pt) to probe")
    if len(checkpoints) < 4:
        notes.append(f"only {len(checkpoints)} checkpoint(s) in {run.checkpoints}: the fit rests on "
                     f"{len(checkpoints) + bool(include_start)} starting point(s) and says little about L0 and L1; "
                     "a run with keep_checkpoints >= 4 gives more")

    workload = make_workload(config, SingleProcess())  # its model is the run's x₀ (drawn from the run's seed)
    model = workload.model
    model.eval()  # no dropout: f must be the same function at x and at x + d
    params = [p for p in model.parameters() if p.requires_grad]
    start_state = {k: v.clone() for k, v in model.state_dict().items()}
    sources = ([("start", 0, 0, start_state)] if include_start else [])
    for step, name in checkpoints:
        state = run.load_worker_checkpoint(name, 0)
        sources.append((f"step {step}", step, state["epoch"], state["model"]))

    points = []
    for label, step, epoch, state in sources:
        with torch.no_grad():
            model.load_state_dict(state)
        factor = config.schedule.lr_decay ** sum(1 for e in config.schedule.lr_decay_epochs if epoch >= e)
        lr, gamma = config.local.lr * factor, config.local.gamma * factor
        num_batches = workload.start_epoch(epoch)
        skip = step % max(1, num_batches)
        hidden = model.init_hidden(config.workload.batch_size)
        for i, (batch, _) in enumerate(workload.batches()):
            if i < skip:
                continue
            if i >= skip + steps:
                break
            x, y = batch
            h0 = detach_hidden(hidden)

            def loss_fn(x=x, y=y, h0=h0):
                out = model(x, h0)
                return F.cross_entropy(out.logits.reshape(-1, workload.ntokens), y.reshape(-1))

            g = _grads(loss_fn, params)
            norm = _norm(g)
            scale = min(lr, gamma / norm) if norm > 0 else lr
            direction = [-scale * t for t in g]
            grad_norm, smooth = local_smoothness(loss_fn, params, direction, grads=g)
            with torch.no_grad():
                hidden = model(x, h0).hidden
                for p, d in zip(params, direction):
                    p.add_(d)
            points.append({"source": label, "step": step + (i - skip), "grad_norm": grad_norm, "smoothness": smooth,
                           "step_length": scale * norm, "clipped": bool(gamma / norm < lr) if norm > 0 else False})
    fit = fit_l0_l1([p["grad_norm"] for p in points], [p["smoothness"] for p in points])
    out = Path(out) if out is not None else run.path
    out.mkdir(parents=True, exist_ok=True)
    result = {"notes": notes, "run": str(run.path), "steps_per_source": steps, "sources": [s[0] for s in sources], "fit": fit, "points": points,
              "method": "finite differences along the clipped-SGD update, max over 1/4, 1/2 and 1 of the step; dropout off; rank 0's model"}
    result["json"] = str(out / "smoothness.json")
    from localclip.plot import NO_MATPLOTLIB, have_matplotlib

    if figure and not have_matplotlib():
        result["figure_note"] = NO_MATPLOTLIB  # smoothness.json does not need it
    elif figure:
        result["figure"] = str(_figure(points, fit, out / "smoothness.png", run.path.name))
    atomic_write_text(out / "smoothness.json", jsonio.dumps({k: v for k, v in result.items() if k not in ("json", "figure", "figure_note")}, indent=2) + "\n")
    return result


def _figure(points: list[dict], fit: dict, out: Path, title: str) -> Path:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 5), constrained_layout=True)
    for source in dict.fromkeys(p["source"] for p in points):
        mine = [p for p in points if p["source"] == source]
        ax.scatter([p["grad_norm"] for p in mine], [p["smoothness"] for p in mine], s=14, label=f"from {source}")
    g = sorted(p["grad_norm"] for p in points)
    xs = [g[0] + (g[-1] - g[0]) * i / 100 for i in range(101)]
    ax.plot(xs, [fit["L0"] + fit["L1"] * x for x in xs], "k--", label=f"fit {fit['L0']:.3g} + {fit['L1']:.3g}·‖∇f‖ (R² {fit['r2']:.2f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # the minor labels overlap
    ax.set_xlabel("gradient norm ‖∇f(x)‖ (training loss, nats/token)")
    ax.set_ylabel("local smoothness ‖∇f(x+d) − ∇f(x)‖ / ‖d‖")
    ax.set_title(f"smoothness against gradient norm: {title}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    from localclip.plot import save_figure

    save_figure(fig, out)
    return out
