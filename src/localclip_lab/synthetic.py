"""The theory check: CELGC on a synthetic problem where the paper's assumptions hold by construction.

The problem is ``f(x) = Σ_i (cosh(a·x_i) − 1)`` over ``x ∈ R^d``. Its Hessian is diagonal with
``a²·cosh(a·x_i) ≤ a² + a·|f'(x_i)|``, so f is (L0, L1)-smooth with ``L0 = a²`` and ``L1 = a``
(Zhang et al., 2020), and not L-smooth for any L: far from the minimum the curvature grows with
the gradient, which is what makes clipping necessary. Each worker sees the true gradient plus
Gaussian noise of standard deviation ``noise`` per coordinate (bounded variance, Assumption 1 of
Liu et al. 2022), drawn from the worker's own ``torch.Generator``; the workers' problems are the
same (homogeneous data).

The real :class:`localclip.CELGC` runs on it through :class:`localclip.SimulatedWorld`; at every
round the averaged point's true gradient norm is compared with the target. Two experiments:

* :func:`speedup`: iterations (local steps per worker) to reach the target for N = 1, 2, 4, 8,
  16 at a fixed period, with η and γ scaled by N as the theorem's step size grows with N (the
  clip norm γ/η stays fixed). Linear speed-up means N times fewer iterations.
* :func:`period_sweep`: at a fixed N, iterations and rounds to the target as I grows:
  communication I times rarer at about the same iterations.

:func:`theory_check` runs both and writes ``results.json``, ``summary.md`` and ``figure.png``
(``localclip theory --out DIR``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from localclip import jsonio
from localclip.algorithms import CELGC
from localclip.comm import SimulatedWorld, current
from localclip.errors import ConfigError
from localclip.train.run_folder import atomic_write_text

__all__ = ["CoshProblem", "period_sweep", "run_celgc", "speedup", "theory_check"]


@dataclass(frozen=True)
class CoshProblem:
    """``f(x) = Σ_i (cosh(a·x_i) − 1)`` in ``dim`` dimensions with noisy gradients; see the module docstring."""

    dim: int = 10
    a: float = 1.0
    noise: float = 1.0
    """σ: standard deviation of each worker's gradient noise, per coordinate."""
    start: float = 3.0
    """x₀ = start/a in every coordinate: f's gradient there is a·sinh(start) ≈ 10a per coordinate."""

    def __post_init__(self):
        if not (isinstance(self.dim, int) and self.dim >= 1):
            raise ConfigError(f"Invalid dim: {self.dim!r} (expected an integer >= 1)")
        for name in ("a", "noise", "start"):
            value = getattr(self, name)
            if not (math.isfinite(value) and (value > 0 if name == "a" else value >= 0)):
                raise ConfigError(f"Invalid {name}: {value!r} (expected a finite number {'> 0' if name == 'a' else '>= 0'})")

    @property
    def L0(self) -> float:
        return self.a**2

    @property
    def L1(self) -> float:
        return self.a

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.cosh(self.a * x) - 1).sum()

    def grad(self, x: torch.Tensor) -> torch.Tensor:
        return self.a * torch.sinh(self.a * x)


class _Point(nn.Module):
    def __init__(self, problem: CoshProblem):
        super().__init__()
        self.x = nn.Parameter(torch.full((problem.dim,), problem.start / problem.a, dtype=torch.float64))


def _worker(problem: CoshProblem, period: int, lr: float, gamma: float, target: float, max_steps: int, seed: int) -> dict:
    comm = current()
    # The worker's own noise stream: the interleaving of simulated workers cannot change it.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + comm.rank)
    model = _Point(problem)
    opt = CELGC(model, lr=lr, gamma=gamma, period=period, group=comm)
    curve = []
    for step in range(1, max_steps + 1):
        opt.zero_grad()
        problem.loss(model.x).backward()
        with torch.no_grad():
            noise = torch.randn(problem.dim, generator=generator, dtype=torch.float64)
            model.x.grad.add_(noise, alpha=problem.noise)
        opt.step()
        if step % period == 0:  # a round just ended: every worker holds the average
            norm = float(torch.linalg.vector_norm(problem.grad(model.x.detach())))
            curve.append((step, norm))
            if norm <= target:
                return {"steps": step, "rounds": opt.rounds, "curve": curve, "clip_fraction": float(opt.clip_fraction)}
    return {"steps": None, "rounds": opt.rounds, "curve": curve, "clip_fraction": float(opt.clip_fraction)}


def run_celgc(problem: CoshProblem, *, workers: int, period: int, lr: float, gamma: float, target: float,
              max_steps: int = 100_000, seed: int = 0) -> dict:
    """One CELGC run of ``workers`` simulated workers until the averaged point's true gradient
    norm is at most ``target`` (checked at every round); returns rank 0's ``steps`` (``None``:
    not reached within ``max_steps``), ``rounds`` and the curve of (step, gradient norm)."""
    for name, value in (("workers", workers), ("period", period), ("max_steps", max_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"Invalid {name}: {value!r} (expected an integer >= 1)")
    if not (target > 0 and lr > 0 and gamma > 0):
        raise ConfigError(f"Invalid target/lr/gamma: {target!r}/{lr!r}/{gamma!r} (expected numbers > 0)")
    # One intra-op thread: these tensors are tiny, and threads would only add overhead.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return SimulatedWorld(workers).run(_worker, problem, period, lr, gamma, target, max_steps, seed)[0]
    finally:
        torch.set_num_threads(threads)


def _median_steps(problem, seeds, **kwargs) -> tuple[float | None, list]:
    results = [run_celgc(problem, seed=s, **kwargs) for s in seeds]
    steps = [r["steps"] for r in results]
    return (statistics.median(steps) if all(s is not None for s in steps) else None), results


# Defaults: γ/η = 16 ≈ 5σ√d, the analysis's clip norm (docs/algorithm.md §1); with η = 0.004·N the
# longest step γ = 16η reaches the curvature scale 1/L1 only at N = 16; the target 0.3 is about
# twice the noise floor of the gradient norm at these η.
DEFAULTS = {"lr": 0.004, "gamma": 0.064, "target": 0.3}


def speedup(problem: CoshProblem, *, workers=(1, 2, 4, 8, 16), period: int = 4, lr: float = DEFAULTS["lr"], gamma: float = DEFAULTS["gamma"],
            target: float = DEFAULTS["target"], seeds=(0, 1, 2), max_steps: int = 100_000) -> list[dict]:
    """Iterations to the target per N, η = N·lr and γ = N·gamma; median over ``seeds``."""
    rows = []
    for n in workers:
        steps, results = _median_steps(problem, seeds, workers=n, period=period, lr=lr * n, gamma=gamma * n, target=target, max_steps=max_steps)
        rows.append({"N": n, "I": period, "lr": lr * n, "gamma": gamma * n, "steps": steps,
                     "steps per seed": [r["steps"] for r in results], "rounds": statistics.median(r["rounds"] for r in results),
                     "clip fraction": statistics.mean(r["clip_fraction"] for r in results)})
    base = rows[0]["steps"]
    for row in rows:
        row["speed-up"] = base / row["steps"] if base and row["steps"] else None
        row["speed-up / N"] = row["speed-up"] / (row["N"] / rows[0]["N"]) if row["speed-up"] else None
    return rows


def period_sweep(problem: CoshProblem, *, workers: int = 8, periods=(1, 2, 4, 8, 16, 32, 64), lr: float = DEFAULTS["lr"],
                 gamma: float = DEFAULTS["gamma"], target: float = DEFAULTS["target"], seeds=(0, 1, 2), max_steps: int = 100_000) -> list[dict]:
    """Iterations and rounds to the target per period I at ``workers`` workers (η and γ scaled by N as in :func:`speedup`)."""
    rows = []
    for period in periods:
        steps, results = _median_steps(problem, seeds, workers=workers, period=period, lr=lr * workers, gamma=gamma * workers, target=target, max_steps=max_steps)
        rows.append({"N": workers, "I": period, "steps": steps, "steps per seed": [r["steps"] for r in results],
                     "rounds": statistics.median(r["rounds"] for r in results)})
    base = rows[0]
    for row in rows:
        row["rounds saved"] = base["rounds"] / row["rounds"] if row["rounds"] else None
    return rows


def theory_check(out: str | os.PathLike, problem: CoshProblem | None = None, *, seeds=(0, 1, 2), figure: bool = True, **kwargs) -> dict:
    """Run :func:`speedup` and :func:`period_sweep` and write ``results.json``, ``summary.md``
    and (with ``figure``) ``figure.png`` into ``out``; ``kwargs`` go to both (lr, gamma, target)."""
    problem = problem or CoshProblem()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {**DEFAULTS, **kwargs}
    speed = speedup(problem, seeds=seeds, **settings)
    periods = period_sweep(problem, seeds=seeds, **settings)
    result = {"problem": {**asdict(problem), "L0": problem.L0, "L1": problem.L1}, "settings": {**settings, "seeds": list(seeds)},
              "speedup": speed, "periods": periods}
    atomic_write_text(out / "results.json", jsonio.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "summary.md", _markdown(result))
    from localclip.plot import NO_MATPLOTLIB, have_matplotlib

    result["figure"] = None
    if figure and not have_matplotlib():
        result["figure_note"] = NO_MATPLOTLIB  # results.json and summary.md do not need it
    elif figure:
        _figure(result, out / "figure.png")
        result["figure"] = str(out / "figure.png")
    return result


def _fmt(value) -> str:
    if value is None:
        return "not reached"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _markdown(result: dict) -> str:
    p, s = result["problem"], result["settings"]
    lines = [
        "# Theory check: CELGC on an (L0, L1)-smooth problem",
        "",
        f"f(x) = Σ (cosh({p['a']:g}·x_i) − 1), d = {p['dim']}, L0 = {p['L0']:g}, L1 = {p['L1']:g}, gradient noise σ = {p['noise']:g} "
        f"per coordinate and worker, x₀ = {p['start']:g}/a; target ‖∇f(x̄)‖ ≤ {s['target']:g}, checked at every round; "
        f"η = {s['lr']:g}·N, γ = {s['gamma']:g}·N; median over seeds {s['seeds']}.",
        "",
        "| N | I | η | steps to target | per seed | speed-up | speed-up / N | rounds | clip fraction |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["speedup"]:
        lines.append(f"| {r['N']} | {r['I']} | {r['lr']:g} | {_fmt(r['steps'])} | {r['steps per seed']} | {_fmt(r['speed-up'])} | "
                     f"{_fmt(r['speed-up / N'])} | {_fmt(r['rounds'])} | {_fmt(r['clip fraction'])} |")
    lines += ["", "| N | I | steps to target | per seed | rounds | rounds of I=1 / rounds |", "|---|---|---|---|---|---|"]
    for r in result["periods"]:
        lines.append(f"| {r['N']} | {r['I']} | {_fmt(r['steps'])} | {r['steps per seed']} | {_fmt(r['rounds'])} | {_fmt(r['rounds saved'])} |")
    return "\n".join(lines) + "\n"


def _figure(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    speed = [r for r in result["speedup"] if r["steps"]]
    ns = [r["N"] for r in speed]
    left.plot(ns, [r["steps"] for r in speed], "o-", label="CELGC, measured (median)")
    if speed:
        left.plot(ns, [speed[0]["steps"] * speed[0]["N"] / n for n in ns], "k--", label="linear speed-up (steps of N=1 / N)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("workers N")
    left.set_ylabel("local steps per worker to the target gradient norm")
    left.set_title(f"steps to ‖∇f‖ ≤ {result['settings']['target']:g}, I = {speed[0]['I'] if speed else '?'}, η and γ ∝ N")
    left.grid(alpha=0.3, which="both")
    left.legend()
    periods = [r for r in result["periods"] if r["steps"]]
    ps = [r["I"] for r in periods]
    right.plot(ps, [r["rounds"] for r in periods], "o-", label="communication rounds")
    right.plot(ps, [r["steps"] for r in periods], "s-", label="local steps per worker")
    if periods:
        right.plot(ps, [periods[0]["rounds"] * periods[0]["I"] / i for i in ps], "k--", label="rounds of I=1 / I")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("communication period I (local steps)")
    right.set_ylabel("count to the target (log scale)")
    right.set_title(f"N = {periods[0]['N'] if periods else '?'}: rounds and steps as I grows")
    right.grid(alpha=0.3, which="both")
    right.legend()
    from localclip.plot import save_figure

    save_figure(fig, out)
