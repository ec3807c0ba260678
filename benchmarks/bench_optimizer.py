"""Benchmark: one optimizer step on the AWD-LSTM PTB parameter set (24,221,600 parameters).

Every variant applies clipped SGD, ``x <- x - min(lr, gamma/||g||) * (g + wd*x)``, to the
parameters of the real ``AWDLSTM(10000)`` (14 tensors) with fixed random gradients of norm about
1, so with ``lr=30, gamma=7.5`` the clip factor is about 0.25 and clipping is active:

  (a) torch's pair: ``clip_grad_norm_(gamma/lr, foreach=True)`` + ``SGD(foreach=True).step()``
      -- the BASELINE (ratio 1.0);
  (b) the paper's reference-experiment style: per-parameter Python loop, host-synced norm
      (without momentum only);
  (c) ``localclip.ClippedSGD`` with its defaults (fused path: BLAS-dot norm + ``_fused_sgd_``);
  (d) ``ClippedSGD(foreach=True, fused=False)``;
  (e) ``ClippedSGD(foreach=False, fused=False)`` (the reference loop);
  (c') (c) with ``measure_step_length=True``: a step whose statistics the trainer samples;
  (L) not a step: the least memory traffic a clipped step must make, as in-place passes
      (:func:`least_passes` counts them, and torch's pair's), whose paired ratio to (a) is the
      lowest ratio a clipped step can reach on this machine.

(c)-(e) run with ``measure_step_length=False``, as the trainer takes every step but the last of a
logging interval. Each of the four settings (momentum 0 and 0.9, weight decay 0 and 1.2e-6) is
timed in its own interleaved table, and a last table puts the paired ratios of every path side
by side. The first table also times the two halves of (c) alone (its norm; its fused update),
which are not variants: they show where its time goes. The output is recorded under
``benchmarks/results/`` (``benchmarks/_record.py``).

Timing protocol: ``clip_grad_norm_`` rescales the gradients in place, so before *every* timed
step of *every* variant the gradients are re-copied from a saved copy, outside the timed region
(same cache state for all variants; the copy is not counted). Parameters are not restored: their
values do not change the cost. Variants run interleaved (a b c d e, a b c d e, ..., with the
starting variant rotated each round) so that load from other work on the machine hits them all
alike; the table shows medians and two ratios to (a): of the medians, and the median of the
per-round ratios (paired, the less noisy of the two).

Before timing, a parity check runs every variant from the same start on the same gradients and
compares its update ``u = x1 - x0`` with the update computed from the formula: in float64 (as
torch.optim's tests do) every variant must agree to 1e-5 relative; in float32, the timed dtype,
the tolerance adds the float32 rounding error of the gradient norm the variant uses (torch's CPU
norm kernel loses ~1e-4 relative on these multi-million-element tensors, the BLAS dot products of
``ClippedSGD`` ~1e-5; the check prints both). Torch's pair decays by ``lr*wd*x`` while clipped SGD
decays by ``min(lr, gamma/||g||)*wd*x`` (the documented difference of ``ClippedSGD``), so at
``wd=1.2e-6`` (a) differs from the others by a predicted amount, which is checked instead.

    PYTHONPATH=src python benchmarks/bench_optimizer.py            # ~2 min quiet, ~5 min loaded (2 cores)
    PYTHONPATH=src python benchmarks/bench_optimizer.py --threads 1 --repeats 8  # ~2 min loaded
    PYTHONPATH=src python benchmarks/bench_optimizer.py --threads 1  # steadier on a busy machine
    PYTHONPATH=src python benchmarks/bench_optimizer.py --quick    # a smoke run
    PYTHONPATH=src python benchmarks/bench_optimizer.py --device cuda  # on a GPU (synchronised timing)
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from localclip import ClippedSGD  # noqa: E402
from localclip.models import AWDLSTM  # noqa: E402
from localclip.optim.clipped_sgd import grad_norm  # noqa: E402

LR, GAMMA, WD = 30.0, 7.5, 1.2e-6
TOL = 1e-5


DEVICE = torch.device("cpu")
# With one CPU thread a step's work all runs on the calling thread, so its CPU time
# (time.thread_time: user + system, page faults included) is timed, which other jobs on a loaded
# machine inflate far less than the wall-clock; otherwise the wall-clock (set in main).
CLOCK = time.perf_counter


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def make_problem(seed: int = 0):
    torch.manual_seed(seed)
    model = AWDLSTM(10000).to(DEVICE)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    # Gradient norm ~1, so gamma / (lr * ||g||) ~ 0.25: clipped, but not to nothing.
    grads = [torch.randn_like(p) / math.sqrt(n) for p in params]
    return model, params, grads


# -- the variants: each returns a step() callable over `params` (whose .grad is set) ----------


def torch_pair(params, momentum=0.0, wd=WD):
    opt = torch.optim.SGD(params, lr=LR, momentum=momentum, weight_decay=wd, foreach=True)

    def step():
        torch.nn.utils.clip_grad_norm_(params, GAMMA / LR, foreach=True)
        opt.step()

    return step


def reference_loop(params, momentum=0.0, wd=WD):
    assert momentum == 0.0

    @torch.no_grad()
    def step():
        total = sum(p.grad.norm() ** 2 for p in params) ** 0.5
        coef = min(LR, GAMMA / total.item())
        for p in params:
            d = p.grad + wd * p
            p.add_(d, alpha=-coef)

    return step


def clipped_sgd(params, momentum=0.0, wd=WD, measure=False, **kw):
    opt = ClippedSGD(params, lr=LR, gamma=GAMMA, momentum=momentum, weight_decay=wd, **kw)
    opt.measure_step_length = measure
    return opt.step


VARIANTS = {
    "(a) torch clip_grad_norm_ + SGD, foreach [BASELINE]": torch_pair,
    "(b) reference style: Python loop, .item() norm": reference_loop,
    "(c) ClippedSGD default (fused)": clipped_sgd,
    "(d) ClippedSGD foreach=True, fused=False": lambda p, **kw: clipped_sgd(p, foreach=True, fused=False, **kw),
    "(e) ClippedSGD foreach=False, fused=False (loop)": lambda p, **kw: clipped_sgd(p, foreach=False, fused=False, **kw),
    "(c') (c) measuring its step length (a sampled step)": lambda p, **kw: clipped_sgd(p, measure=True, **kw),
}
# The four settings of the last table: (momentum, weight decay).
SETTINGS = [(0.0, WD), (0.0, 0.0), (0.9, WD), (0.9, 0.0)]


def norm_part(params, momentum=0.0, wd=WD):
    return lambda: grad_norm([p.grad for p in params])


def update_part(params, momentum=0.0, wd=WD):
    # What ClippedSGD's fused path calls once it has the step size (a 0-dim tensor).
    step_size, found_inf = torch.tensor(0.25, device=DEVICE), torch.zeros((), device=DEVICE)
    return lambda: torch._fused_sgd_(
        params, [p.grad for p in params], [], weight_decay=wd, momentum=0.0, lr=step_size, dampening=0.0,
        nesterov=False, maximize=False, is_first_step=False, found_inf=found_inf)


def least_passes(params, momentum=0.0, wd=WD):
    """The least memory traffic a clipped step must make, as in-place passes timed like a step:
    one read of g for its norm (``grad_norm``, BLAS dots), then the update reading g and reading
    and writing x (and, with momentum, reading and writing the buffer), each tensor once. In
    units of one parameter set's bytes: 4 without momentum, 6 with (1 + 3, and 1 + 5 as a pass
    over g and the buffer plus one over x). Weight decay adds nothing: ``x(1 - c wd) - c g``
    reads the same tensors, and the norm is of g alone (``‖g + wd x‖`` is only a statistic, of
    the logged steps). Torch's pair, counted from torch 2.13's ``clip_grad_norm_`` and
    ``_multi_tensor_sgd``: its norm (1), the clip ``g *= c`` (2), the step ``x -= lr g`` (3), so
    6; momentum adds ``buf *= m`` (2) and ``buf += g`` (3) and reads buf in place of g, so 11;
    weight decay adds ``g + wd x`` into a new buffer (3, and its fresh pages). So the least
    ratio to torch's pair is about 4/6 = 0.67x without momentum and 6/11 = 0.55x with it, at
    weight decay 0, if both run at the same bytes per second; this pseudo-variant's paired ratio
    to (a) measures it on this machine."""
    xs = [p.detach() for p in params]
    bufs = [torch.zeros_like(x) for x in xs] if momentum else None

    def step():
        gs = [p.grad for p in params]
        grad_norm(gs)
        if bufs is None:
            torch._foreach_add_(xs, gs, alpha=-1e-9)
        else:
            torch._foreach_add_(bufs, gs, alpha=1e-9)
            torch._foreach_mul_(xs, 1.0)

    return step


LIMIT = {"(L) the least a clipped step moves, as in-place passes": least_passes}

# Not variants (they do not update the model alone): the two halves of (c), timed with the rest to
# show where its time goes.
PARTS = {
    "  (c) part 1: its norm, grad_norm (BLAS dots)": norm_part,
    "  (c) part 2: its update, torch._fused_sgd_": update_part,
}
MOMENTUM_VARIANTS = {k: v for k, v in VARIANTS.items() if not k.startswith("(b)")}


def set_grads(params, grads):
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)


# -- parity --------------------------------------------------------------------------------------


def updates(variants, params, grads, steps, **kw):
    """Each variant's total update x_steps - x0 from the same x0 on the same (fixed) gradients."""
    x0 = [p.detach().clone() for p in params]
    out = {}
    for name, make in variants.items():
        with torch.no_grad():
            for p, x in zip(params, x0):
                p.copy_(x)
        step = make(params, **kw)
        for _ in range(steps):
            set_grads(params, grads)
            step()
        out[name] = torch.cat([(p.detach() - x).reshape(-1) for p, x in zip(params, x0)])
    with torch.no_grad():
        for p, x in zip(params, x0):
            p.copy_(x)
    return out, torch.cat([x.reshape(-1) for x in x0])


def rel(a, b):
    return (a.double() - b.double()).norm().item() / b.double().norm().item()


def exact_update(x0, g, wd):
    """Clipped SGD's update in float64, from the class docstring: -min(lr, gamma/|g|) (g + wd x)."""
    g = g.double()
    return -min(LR, GAMMA / g.norm().item()) * (g + wd * x0.double())


# How each variant computes the gradient norm: its float32 rounding is the variants' only
# difference in float32 (torch's CPU norm kernel loses ~1e-4 on multi-million-element tensors).
NORMS = {
    "(a)": lambda gs: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs))),
    "(b)": lambda gs: sum(g.norm() ** 2 for g in gs) ** 0.5,
    "(c)": grad_norm, "(d)": grad_norm, "(e)": grad_norm, "(c')": grad_norm,
}


def parity(params, grads):
    """The same update from every variant, checked in float64 (as torch.optim's tests do), and
    the float32 differences explained by the norm's rounding."""
    ok = True

    def report(label, r, tol, note=""):
        nonlocal ok
        ok &= r <= tol
        print(f"  {label:<34} {r:9.2e}  (tol {tol:.1e}) {'ok' if r <= tol else 'MISMATCH'}{note}")

    p64 = [torch.nn.Parameter(p.detach().double()) for p in params]
    g64 = [g.double() for g in grads]
    gflat = torch.cat([g.reshape(-1) for g in g64])
    clip = min(1.0, GAMMA / (LR * gflat.norm().item()))
    print("Parity: relative difference |u - u_exact| / |u_exact| of each update u = x1 - x0")
    print(f"  gradient norm {gflat.norm().item():.4f}; clip factor min(1, gamma/(lr*|g|)) = {clip:.4f}")
    print("  float64 (every variant implements the same math):")
    for wd in (0.0, WD):
        ups, x0 = updates(VARIANTS, p64, g64, steps=1, wd=wd)
        ref = exact_update(x0, gflat, wd)
        for name, u in ups.items():
            r = rel(u, ref)
            if name.startswith("(a)") and wd:
                # Torch's pair decays by lr*wd*x, clipped SGD by clip*lr*wd*x (documented).
                pred = (LR * wd * (1 - clip) * x0).norm().item() / ref.norm().item()
                report(f"wd={wd:g} {name.split()[0]} vs clipped SGD", abs(r - pred) / pred, 1e-3,
                       f"  [differs by {r:.2e} = predicted {pred:.2e}: decay not clipped in torch's pair]")
            else:
                report(f"wd={wd:g} {name.split()[0]}", r, TOL)
    # With fixed gradients the clip factor is the same every step, so without weight decay the
    # two momentum variants agree over several steps (their buffers differ by that factor only).
    ups, _ = updates(MOMENTUM_VARIANTS, p64, g64, steps=3, momentum=0.9, wd=0.0)
    a = ups.pop(next(iter(ups)))
    for name, u in ups.items():
        report(f"momentum 0.9, wd=0, 3 steps: (a)-{name.split()[0]}", rel(a, u), TOL)

    print(f"  float32 (timed dtype), wd={WD:g}; tol = {TOL:g} + the float32 error of the variant's norm:")
    ups, x0 = updates(VARIANTS, params, grads, steps=1, wd=WD)
    ref = exact_update(x0, gflat, WD)
    for name, u in ups.items():
        key = name.split()[0]
        nerr = abs(NORMS[key](grads).double().item() / gflat.norm().item() - 1)
        if key == "(a)":
            ref_a = -LR * (clip * gflat + WD * x0.double())  # torch's pair's own math
            report(f"{key} vs its own float64 math", rel(u, ref_a), TOL + nerr, f"  [norm error {nerr:.1e}]")
        else:
            report(key, rel(u, ref), TOL + nerr, f"  [norm error {nerr:.1e}]")
    return ok


# -- timing --------------------------------------------------------------------------------------


def bench(variants, params, grads, repeats, warmup, **kw):
    steps = {name: make(params, **kw) for name, make in variants.items()}
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            set_grads(params, grads)  # outside the timed region, before every variant alike
            sync()
            t0 = CLOCK()
            steps[n]()
            sync()
            dt = CLOCK() - t0
            if r >= warmup:
                times[n].append(dt)
    return times


def table(title, times):
    names = list(times)
    base = times[names[0]]
    med_base = statistics.median(base)
    print(f"\n{title}")
    print(f"{'variant':<54} {'median ms':>10} {'IQR ms':>13} {'ratio':>6} {'paired':>7}")
    for n in names:
        t = times[n]
        q = statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0], t[0], t[0]]
        paired = statistics.median(x / b for x, b in zip(t, base))
        print(f"{n:<54} {1e3 * statistics.median(t):>10.1f} {1e3 * q[0]:>6.1f}-{1e3 * q[2]:<6.1f} "
              f"{statistics.median(t) / med_base:>6.2f} {paired:>7.2f}")


def memory_costs(numel: int, repeats: int = 12) -> dict:
    """What separates the variants on a given machine: one in-place read-modify-write pass over
    ``numel`` floats, against writing a freshly allocated buffer of that size (the page faults
    of first touch). Torch's pair allocates one such buffer per step (``g + wd*x``), the fused
    path none; how much that costs varies a lot between machines and kernels."""
    x, y = torch.randn(numel, device=DEVICE), torch.randn(numel, device=DEVICE)
    ops = {
        "in-place pass over the parameters, x.add_(g)": lambda: x.add_(y, alpha=1e-9),
        "same into a fresh buffer, torch.add(x, g)": lambda: torch.add(x, y, alpha=1e-9),
    }
    times = {k: [] for k in ops}
    for r in range(repeats + 2):
        for k, f in ops.items():
            sync()
            t0 = CLOCK()
            f()
            sync()
            if r >= 2:
                times[k].append(CLOCK() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40, help="timed rounds per variant (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    ap.add_argument("--quick", action="store_true", help="5 timed rounds, 1 warm-up")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:K]")
    args = ap.parse_args(argv)
    global DEVICE, CLOCK
    DEVICE = torch.device(args.device)
    if args.quick:
        args.repeats, args.warmup = 5, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    one_thread = DEVICE.type == "cpu" and torch.get_num_threads() == 1
    CLOCK = time.thread_time if one_thread else time.perf_counter

    model, params, grads = make_problem()
    n = sum(p.numel() for p in params)
    print(f"bench_optimizer  {datetime.date.today()}  torch {torch.__version__}  {platform.machine()} "
          f"cpus={os.cpu_count()} threads={torch.get_num_threads()}  load avg {os.getloadavg()[0]:.2f}  device {DEVICE}"
          + (f" ({torch.cuda.get_device_name(DEVICE)})" if DEVICE.type == "cuda" else ""))
    print(f"AWDLSTM(10000): {n:,} parameters in {len(params)} tensors; lr={LR} gamma={GAMMA} wd={WD}; "
          f"{args.repeats} timed rounds, interleaved; timed by "
          + ("the thread's CPU time (one thread)" if CLOCK is time.thread_time else "the wall-clock"))
    ok = True
    if not args.skip_parity:
        ok = parity(params, grads)

    paired = {}
    for momentum, wd in SETTINGS:
        variants = VARIANTS if momentum == 0 else MOMENTUM_VARIANTS
        variants = {**variants, **LIMIT}
        if (momentum, wd) == SETTINGS[0]:
            variants = {**variants, **PARTS}
        times = bench(variants, params, grads, args.repeats, args.warmup, momentum=momentum, wd=wd)
        table(f"Momentum {momentum:g}, weight decay {wd:g} (ratio = median / median of (a); "
              "paired = median of per-round ratios)", times)
        base = times[next(iter(times))]
        paired[(momentum, wd)] = {k: statistics.median(x / b for x, b in zip(t, base)) for k, t in times.items()}
    print("\nEvery path side by side: paired ratio to (a) in the same setting (measured above, in this run)")
    cols = [f"mom {m:g} wd {w:g}" for m, w in SETTINGS]
    print(f"{'variant':<54}" + "".join(f"{c:>20}" for c in cols))
    for name in list(VARIANTS) + list(LIMIT) + list(PARTS):
        cells = [paired[s].get(name) for s in SETTINGS]
        print(f"{name:<54}" + "".join(f"{'-' if c is None else f'{c:.2f}':>20}" for c in cells))
    print("\nMemory on this machine (what the ratios above mostly measure):")
    for k, v in memory_costs(n).items():
        print(f"  {k:<54} {1e3 * v:8.1f} ms")
    met = all(paired[s][k] <= 0.35 for s in SETTINGS for k in ("(c) ClippedSGD default (fused)",
              "(d) ClippedSGD foreach=True, fused=False", "(e) ClippedSGD foreach=False, fused=False (loop)"))
    print(f"\nTarget: (c), (d) and (e) <= 0.35x torch's pair in every setting: {'met' if met else 'NOT met'} in this run.")
    print("(L) is the least that target allows on this machine: a ratio of (c) at or below (L)'s is as fast as memory "
          "lets a clipped step be.")
    print(f"load avg at end {os.getloadavg()[0]:.2f}")
    if not ok:
        print("PARITY CHECK FAILED")
        return 1
    return 0


if __name__ == "__main__":
    from _record import run

    sys.exit(run("bench_optimizer", main, sys.argv[1:]))
