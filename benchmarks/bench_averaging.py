"""Benchmark: one model-averaging round of the AWD-LSTM PTB model (24,221,600 parameters) over gloo.

For each world size, ``localclip.launch.spawn`` starts that many processes (FileStore rendezvous
in a temporary folder, no ports; torch threads per worker = cpu_count // world_size). Inside each
worker these run interleaved (i ii iii iv, i ii iii iv, ..., the starting one rotated each round),
each after a ``dist.barrier()``:

  (i)   BASELINE: one ``dist.all_reduce`` of a preallocated flat float32 buffer with as many
        elements as the averager sends (the transport's limit: the least any round can cost);
  (ii)  ``localclip.PeriodicAverager.average()`` (flat buffer backing the parameters, isfinite
        check, weight element, one in-place all-reduce, one division);
  (iii) torch's ``torch.distributed.algorithms.model_averaging.utils.average_parameters``
        (``cat`` into a new flat buffer, divide, all-reduce, re-point ``p.data``);
  (iv)  per-tensor ``dist.reduce`` to rank 0 then ``dist.broadcast``, then a division, per
        parameter tensor.

Each variant owns its own copy of the model (torch's util re-points ``p.data`` at its new buffer,
which would break the averager's views). A round's time is that of the slowest rank (the round
is over when every worker has its average); rank 0 gathers them and prints medians and ratios to
(i): of the medians, and the median of per-round ratios (paired, less sensitive to load changes).

With ``--profile`` (default: at the first world size) three more tables: (i), (i) through
localclip's ``Communicator.all_reduce``, the real (ii), a trimmed copy of ``PeriodicAverager.average()`` timed phase by phase, and two candidate fixes
(A: the non-finite check by ``torch.aminmax``; B: check and division fused into one pass before
the all-reduce), all interleaved, after checking that the candidates give the real round's
result (also with a NaN on rank 1); the phases; and the local passes over the flat buffer alone.

    PYTHONPATH=src python benchmarks/bench_averaging.py                   # world sizes 2 and 4, ~2 min
    PYTHONPATH=src python benchmarks/bench_averaging.py --world-sizes 2 --quick
    PYTHONPATH=src python benchmarks/bench_averaging.py --profile all --repeats 15
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
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.utils  # noqa: F401 - (iii) below

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from localclip import PeriodicAverager  # noqa: E402
from localclip.comm import current  # noqa: E402
from localclip.launch import spawn  # noqa: E402
from localclip.models import AWDLSTM  # noqa: E402

BASELINE = "(i) dist.all_reduce, flat buffer [BASELINE]"
VARIANTS = (
    BASELINE,
    "(ii) localclip PeriodicAverager.average()",
    "(iii) torch average_parameters",
    "(iv) per-tensor reduce + broadcast + div",
)


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AWDLSTM(10000)


def per_tensor_average(params, world_size):
    for p in params:
        dist.reduce(p.data, dst=0)
        dist.broadcast(p.data, src=0)
        p.data.div_(world_size)


def average_in_phases(avg: PeriodicAverager, clock) -> None:
    """A trimmed copy of ``PeriodicAverager.average()`` for the default configuration (every worker
    takes part, ``skip_nonfinite=True``, no optimizer state), with ``clock(phase)`` after each
    phase. Keep in step with ``src/localclip/averaging.py``."""
    avg._check_views()
    clock("check views")
    weight = 1.0
    if not all(bool(torch.isfinite(b.values).all()) for b in avg._buckets):
        weight = 0.0
    clock("isfinite(values).all()")
    for b in avg._buckets:
        if weight == 0.0:
            b.flat.zero_()
        b.weight.fill_(weight)
    clock("weight fill")
    avg._collective("model averaging", lambda: avg.comm.all_reduce([b.flat for b in avg._buckets]))
    clock("all_reduce (Communicator)")
    total = float(avg._buckets[0].weight)
    clock("float(weight)")
    for b in avg._buckets:
        b.flat.div_(total)
    clock("div_(total)")
    avg.rounds += 1
    avg.bytes_communicated += sum(b.nbytes for b in avg._buckets)


def worker(repeats: int, warmup: int, phases: bool):
    comm = current()
    rank, world = comm.rank, comm.world_size
    model_ii = build(rank)
    averager = PeriodicAverager(model_ii, period=1, group=comm)
    model_iii, model_iv = build(rank), build(rank)
    params_iii, params_iv = list(model_iii.parameters()), list(model_iv.parameters())
    n = averager.flat_buffers[0].numel()
    # Zeros: repeated summing keeps them finite (a random buffer would overflow after ~60 rounds).
    flat = torch.zeros(n)
    group = dist.group.WORLD
    ops = {
        VARIANTS[0]: lambda: dist.all_reduce(flat),
        VARIANTS[1]: averager.average,
        VARIANTS[2]: lambda: torch.distributed.algorithms.model_averaging.utils.average_parameters(iter(params_iii), group),
        VARIANTS[3]: lambda: per_tensor_average(params_iv, world),
    }
    times = _interleave(ops, repeats, warmup)
    result = {"numel": n, "threads": torch.get_num_threads(), "times": _slowest(times)}
    if phases:
        result["check"] = _check_candidates(averager)
        result["profile"], result["phases"] = _profile(averager, flat, repeats, warmup)
        result["local"] = _local_candidates(averager, repeats, warmup)
    return result if rank == 0 else None


def _interleave(ops, repeats, warmup):
    names = list(ops)
    times = {k: [] for k in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for k in order:
            dist.barrier()
            t0 = time.perf_counter()
            ops[k]()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[k].append(dt)
    return times


def _slowest(times):
    """Per round, the slowest rank's time (a MAX all-reduce of every rank's timings)."""
    out = {}
    for k, v in times.items():
        t = torch.tensor(v, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[k] = t.tolist()
    return out


def average_aminmax(avg: PeriodicAverager) -> None:
    """Candidate fix A: ``average()`` with the non-finite check done by ``torch.aminmax``.

    ``torch.isfinite(t)`` is composite on the CPU (``t.eq(t) * t.abs().ne(inf)``: four full passes
    and four fresh buffers, one of them as large as ``t``, then ``.all()``: a fifth pass), about 20
    times one read of ``t``; ``aminmax`` is one read-only pass.
    Exactly equivalent: min and max propagate NaN, and an infinity shows up as the min or the max.
    """
    avg._check_views()
    weight = 1.0
    for b in avg._buckets:
        lo, hi = torch.aminmax(b.values)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            weight = 0.0
    for b in avg._buckets:
        if weight == 0.0:
            b.flat.zero_()
        b.weight.fill_(weight)
    avg._collective("model averaging", lambda: avg.comm.all_reduce([b.flat for b in avg._buckets]))
    total = float(avg._buckets[0].weight)
    for b in avg._buckets:
        b.flat.div_(total)


def average_prescaled(avg: PeriodicAverager) -> None:
    """Candidate fix B: check and divide in one pass *before* the all-reduce.

    ``torch._amp_foreach_non_finite_check_and_unscale_`` (GradScaler's kernel, CPU and CUDA)
    multiplies by ``1/expected`` (the number of workers meant to take part) and flags any
    NaN/inf in the same pass; the weight element is not scaled, so after the all-reduce it holds
    the number of workers that took part: when that is ``expected`` (always, unless a worker was
    left out) nothing is left to do; otherwise one rescale by ``expected/total``. Rounding differs
    from sum-then-divide by at most an ulp (identical when ``expected`` is a power of two).
    """
    avg._check_views()
    expected = float(avg.comm.world_size)
    weight = 1.0
    for b in avg._buckets:
        found = torch.zeros(1, device=b.flat.device)
        inv = torch.full((1,), 1.0 / expected, device=b.flat.device)
        torch._amp_foreach_non_finite_check_and_unscale_([b.values], found, inv)
        if bool(found):
            weight = 0.0
    for b in avg._buckets:
        if weight == 0.0:
            b.flat.zero_()
        b.weight.fill_(weight)
    avg._collective("model averaging", lambda: avg.comm.all_reduce([b.flat for b in avg._buckets]))
    total = float(avg._buckets[0].weight)
    if total != expected:
        for b in avg._buckets:
            b.values.mul_(expected / total)


def _check_candidates(averager) -> dict:
    """From the same state, the candidate fixes must give the real ``average()``'s result, also
    when rank 1's parameters hold a NaN (it is left out). Returns max relative differences."""
    flat = averager.flat_buffers[0]
    start = flat.clone()
    out = {}
    for case in ("all finite", "NaN on rank 1"):
        results = {}
        for name, fn in (("real", averager.average), ("A", lambda: average_aminmax(averager)),
                         ("B", lambda: average_prescaled(averager))):
            flat.copy_(start)
            if case != "all finite" and averager.comm.rank == 1:
                flat[12345] = math.nan
            fn()
            results[name] = flat[:-1].clone()
        ref = results["real"]
        for name in ("A", "B"):
            d = ((results[name] - ref).abs().max() / ref.abs().max()).reshape(1)
            dist.all_reduce(d, op=dist.ReduceOp.MAX)
            out[f"{case}: candidate {name} vs average()"] = d.item()
    flat.copy_(start)
    return out


PROFILE = (
    BASELINE,
    "(i') the same via localclip's Communicator",
    "(ii) PeriodicAverager.average() (real)",
    "(ii) trimmed copy, timed by phase",
    "candidate A: aminmax check",
    "candidate B: fused check+prescale",
)


def _profile(averager, flat, repeats, warmup):
    """(i), the real (ii), its phased copy and the two candidate fixes, interleaved."""
    acc: dict[str, list[float]] = {}
    last = [0.0]

    def clock(phase):
        now = time.perf_counter()
        acc.setdefault(phase, []).append(now - last[0])
        last[0] = now

    ops = {
        PROFILE[0]: lambda: dist.all_reduce(flat),
        # localclip's transport wrapper (async issue + wait with timeout), on (i)'s buffer.
        PROFILE[1]: lambda: averager.comm.all_reduce([flat]),
        PROFILE[2]: averager.average,
        PROFILE[3]: lambda: average_in_phases(averager, clock),
        PROFILE[4]: lambda: average_aminmax(averager),
        PROFILE[5]: lambda: average_prescaled(averager),
    }
    totals = {k: [] for k in ops}
    names = list(ops)
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for k in order:
            dist.barrier()
            t0 = last[0] = time.perf_counter()
            ops[k]()
            totals[k].append(time.perf_counter() - t0)
    phases = {k: v[warmup:] for k, v in acc.items()}
    phases["total (phased copy)"] = totals[PROFILE[3]][warmup:]
    phases["total (real average())"] = totals[PROFILE[2]][warmup:]
    return _slowest({k: v[warmup:] for k, v in totals.items()}), _slowest(phases)


def _local_candidates(averager, repeats, warmup):
    """Local passes over the flat buffer: what the round does now, and cheaper forms of it."""
    flat = averager.flat_buffers[0]
    values = flat[:-1]
    found = torch.zeros(1)
    inv = torch.full((1,), 1.0)
    ops = {
        "now: isfinite(values).all() -> bool": lambda: bool(torch.isfinite(values).all()),
        "A: aminmax(values) -> 2 floats": lambda: [float(t) for t in torch.aminmax(values)],
        "now: flat.div_(total)": lambda: flat.div_(1.0),
        "alt: isfinite(values.sum()) -> bool": lambda: bool(torch.isfinite(values.sum())),
        "B: _amp_foreach_non_finite_check_and_unscale_": lambda: torch._amp_foreach_non_finite_check_and_unscale_([values], found, inv),
        "alt: flat.mul_(1/total)": lambda: flat.mul_(1.0),
    }
    times = {k: [] for k in ops}
    for r in range(warmup + repeats):
        for k, f in ops.items():
            t0 = time.perf_counter()
            f()
            if r >= warmup:
                times[k].append(time.perf_counter() - t0)
    return times  # rank 0's own (no collective involved)


def _table(title, times, base=None, header="ms"):
    names = list(times)
    base = base if base is not None else names[0]
    mb = statistics.median(times[base])
    print(f"\n{title}")
    print(f"{'':<48} {'median ' + header:>10} {'IQR ms':>15} {'ratio':>6} {'paired':>7}")
    for k in names:
        t = times[k]
        q = statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0]] * 3
        paired = statistics.median(x / b for x, b in zip(t, times[base]))
        print(f"{k:<48} {1e3 * statistics.median(t):>10.1f} {1e3 * q[0]:>7.1f}-{1e3 * q[2]:<7.1f} "
              f"{statistics.median(t) / mb:>6.2f} {paired:>7.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=8, help="timed rounds per variant (default 8)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    ap.add_argument("--profile", choices=("none", "first", "all"), default="first",
                    help="profile (ii) and the candidate fixes at no, the first, or every world size (default first)")
    ap.add_argument("--quick", action="store_true", help="3 timed rounds, 1 warm-up, no profile")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.profile = 3, 1, "none"
    print(f"bench_averaging  {datetime.date.today()}  torch {torch.__version__}  {platform.machine()} "
          f"cpus={os.cpu_count()}  load avg {os.getloadavg()[0]:.2f}")
    for i, world in enumerate(args.world_sizes):
        t0 = time.perf_counter()
        profile = args.profile == "all" or (args.profile == "first" and i == 0)
        res = spawn(worker, world, args.repeats, args.warmup, profile,
                    timeout=600, join_timeout=1800)[0]
        print(f"\n=== world size {world} (gloo, {res['threads']} torch thread(s)/worker): {res['numel']:,} "
              f"float32 per round ({4 * res['numel'] / 2**20:.1f} MiB); {args.repeats} rounds interleaved; "
              f"slowest rank per round; {time.perf_counter() - t0:.0f}s ===")
        _table("One averaging round (ratio = median / median of (i); paired = median of per-round ratios)",
               res["times"])
        if "phases" in res:
            print("\nCandidate fixes vs the real average(), same start (max |diff| / max |x|, all ranks):")
            for k, v in res["check"].items():
                print(f"  {k:<45} {v:.1e}")
            _table("Profile of (ii) and candidate fixes, interleaved (ratios to (i))", res["profile"])
            _table("Phases of (ii), trimmed copy of average() (ratios to the real average())",
                   res["phases"], base="total (real average())")
            _table("Local passes over the flat buffer, rank 0 (ratios to the isfinite check)", res["local"])
    print("\nTargets (issue): (ii) <= 1.1x (i); torch's (iii) measured ~1.9x, per-tensor (iv) ~2.2x.")
    print(f"load avg at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
