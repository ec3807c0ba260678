"""Benchmark: one model-averaging round of the AWD-LSTM PTB model (24,221,600 parameters) over gloo.

For each world size, ``localclip.comm.launch.spawn`` starts that many processes (FileStore rendezvous
in a temporary folder, no ports), each with ``--threads`` torch intra-op threads (default 1: the
setting of every multi-worker run on this 2-core machine). Inside each worker the variants of a
table run interleaved (the starting one rotated each round), each after a ``dist.barrier()``;
a round's time is that of the slowest rank (the round is over when every worker has its result).
Rank 0 prints medians and ratios to the table's baseline: of the medians, and the median of
per-round ratios (paired, less sensitive to load changes).

Table 1, a plain round:
  (i)    BASELINE: one ``dist.all_reduce`` of a preallocated flat float32 buffer with as many
         elements as the averager sends (the transport's limit: the least any round can cost);
  (ii)   ``localclip.PeriodicAverager.average()`` (flat buffer backing the parameters, one fused
         pass that scales by 1/K and checks for NaN/Inf, one all-reduce);
  (ii')  the round as it was before (commit 1627d22), inlined here: a read-only ``sum`` as the
         NaN/Inf check, the all-reduce in 8 MiB chunks, each divided by K on arrival;
  (iii)  torch's ``torch.distributed.algorithms.model_averaging.utils.average_parameters``
         (``cat`` into a new flat buffer, divide, all-reduce, re-point ``p.data``);
  (iv)   per-tensor ``dist.reduce`` to rank 0 then ``dist.broadcast``, then a division.
Table 2, outer steps (ratios to the same baseline (i)), each in 8 MiB chunks (the default with an
outer optimizer) unless said otherwise:
  (v)    ``average()`` with ``OuterSGD(0.7, momentum=0.9, nesterov=True)`` (DiLoCo's);
  (vi)   ``average()`` with ``OuterSGD(0.7)`` (no momentum);
  (vii)  ``average()`` with ``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)`` as the outer
         optimizer (``TorchOuter``: the pseudo-gradient in ``.grad``, torch's foreach step);
  (v')   (v) as one all-reduce (``chunk_bytes=None``; the default before 2026-12-04): the outer
         step starts when the whole buffer has arrived.
Table 3, compressed rounds (ratios to (ii), the uncompressed round):
  (viii) ``average()`` with ``compression="bf16"``;  (ix) with ``"fp16"``;
  (x)    a raw ``dist.all_reduce`` of a preallocated bf16 buffer of the same length;
  (viii') (viii) in 8 MiB chunks (each chunk decoded as it arrives, while the next travels).

Each variant owns its own copy of the model (torch's util re-points ``p.data`` at its new buffer,
which would break the averager's views).

With ``--profile`` (default: at the first world size) a fourth table times (ii) with chunked
all-reduces (2, 8, 32 MiB), after checking that every chunking gives the one-chunk average
(also with a NaN on rank 1, which must then be left out): bit for bit for 2 workers; for more,
gloo's ring adds in an order that depends on where an element falls in its buffer, so they may
differ by float32 rounding.

    PYTHONPATH=src python benchmarks/bench_averaging.py                    # 2 workers, 1 thread each, ~3 min
    PYTHONPATH=src python benchmarks/bench_averaging.py --world-sizes 2 --quick
    PYTHONPATH=src python benchmarks/bench_averaging.py --threads 2 --profile none

With ``--link RATE`` (e.g. ``1gbit``, ``10gbit``; root, ``ip`` and ``tc`` needed) the two workers
run in two network namespaces of their own, joined by a veth pair whose both ends are shaped to
RATE by a token-bucket filter: a point-to-point link of that speed instead of loopback, the
setting the library is for. It prints the same tables and the rate the raw all-reduce reaches
against the link's. There the chunked rounds (v') and (viii') show what chunking is for: once the
link, not the CPU, is the bottleneck, the work on one chunk overlaps the transport of the next.
(The first --link run, 2026-12-04, timed chunked Nesterov as (v') beside an unchunked (v).)

    sudo PYTHONPATH=src python benchmarks/bench_averaging.py --link 1gbit 10gbit --repeats 5

With ``--steps`` it times local *steps* instead of rounds (table 5, streaming rounds): each
worker trains a recipe's model (default ptb-small's tied 2x200 LSTM, its batch 5 and bptt 20,
on random tokens) with CELGC at the recipe's period (ptb-small: I = 8), as

  (s0) compute alone: no rounds (period = infinity);
  (s1) blocking rounds (the default: the whole model every period, every worker waiting);
  (s2) ``fragments=4``: a quarter of the model every period/4 steps, blocking;
  (s3) ``fragments=4, overlap=1``: each fragment's all-reduce travels during the next local step;
  (s4) ``overlap=1`` alone (the whole model, one step of overlap);
  (s5) ``fragments=4, overlap=1, compression="int4"``: (s3) with int4 rounds (error feedback on):
       each fragment's all-to-all travels during the next local step, its all-gather at the landing.

Each variant owns its model; they run interleaved in blocks of whole periods, each block after a
``dist.barrier()`` and shifted by the overlap so that no round is in flight at a block's end (a
round's cost stays in its own block); the time per step is a block's (slowest rank's) time over
its steps. Ratios are to (s0). It also prints each variant's peak bytes sent in one round, against a
full round's, with the fragments' sizes (element ranges: each within 1/P + 2.5 % of the model).

    PYTHONPATH=src python benchmarks/bench_averaging.py --steps                     # ptb-small, ~2 min
    sudo PYTHONPATH=src python benchmarks/bench_averaging.py --steps --link 1gbit 100mbit

With ``--lowbit`` it times only one table instead, side by side: ``average()`` with compression
none, bf16, int8 and int4 (int8/int4 with error feedback), interleaved as above, with each
one's bytes per round (``bytes_communicated / rounds``: the payload, see
``localclip.averaging.codecs``), the ratios of both to the uncompressed round, each round's CPU
time and rank 0's most minor page faults in one timed round (a round that allocates a buffer of
the model's size anew pays a first touch per 4 KiB page of it). It combines with
``--link`` and ``--world-sizes``.

    sudo PYTHONPATH=src python benchmarks/bench_averaging.py --lowbit --link 1gbit --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.utils  # noqa: F401 - (iii) below

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from localclip import OuterSGD, PeriodicAverager  # noqa: E402
from localclip.comm import current  # noqa: E402
from localclip.comm.launch import spawn  # noqa: E402
from localclip.models import AWDLSTM  # noqa: E402

BASELINE = "(i) dist.all_reduce, flat float32 [BASELINE]"
PLAIN = "(ii) PeriodicAverager.average()"
TABLES = {
    "plain": (BASELINE, PLAIN, "(ii') before: sum check, 8 MiB chunks, div", "(iii) torch average_parameters",
              "(iv) per-tensor reduce + broadcast + div"),
    "outer": (BASELINE, "(v) average(), OuterSGD Nesterov 0.7/0.9", "(vi) average(), OuterSGD 0.7, no momentum",
              "(vii) average(), torch.optim.SGD Nesterov outer", "(v') (v) as one all-reduce (chunk_bytes=None)"),
    "compressed": (PLAIN, "(viii) average(), compression=bf16", "(ix) average(), compression=fp16",
                   "(x) dist.all_reduce, flat bf16", "(viii') (viii) with 8 MiB chunks"),
}


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AWDLSTM(10000)


def per_tensor_average(params, world_size):
    for p in params:
        dist.reduce(p.data, dst=0)
        dist.broadcast(p.data, src=0)
        p.data.div_(world_size)


class BeforeRound:
    """The round of commit 1627d22, for comparison: read-only NaN/Inf check by a ``sum``, then
    the all-reduce in 8 MiB chunks, each divided by K as it arrives."""

    def __init__(self, averager: PeriodicAverager, chunk_bytes: int = 8 << 20):
        self.values = averager.flat_buffers[0]
        self.flat = torch.empty(self.values.numel() + 1)  # values + weight slot, as then
        self.flat[:-1].copy_(self.values)
        self.chunks = self.flat.split(chunk_bytes // 4)
        self.world = dist.get_world_size()

    def __call__(self):
        values = self.flat[:-1]
        if not bool(torch.isfinite(values.sum())):
            raise RuntimeError("non-finite")
        self.flat[-1] = 1.0
        works = [dist.all_reduce(c, async_op=True) for c in self.chunks]
        for w, c in zip(works, self.chunks):
            w.wait()
            c.div_(self.world)


def worker(repeats: int, warmup: int, phases: bool, threads: int):
    torch.set_num_threads(threads)
    comm = current()
    rank, world = comm.rank, comm.world_size
    group = dist.group.WORLD
    model_ii = build(rank)
    averager = PeriodicAverager(model_ii, period=1, group=comm)
    before = BeforeRound(averager)
    model_iii, model_iv = build(rank), build(rank)
    params_iii, params_iv = list(model_iii.parameters()), list(model_iv.parameters())
    n = averager.flat_buffers[0].numel()
    # Zeros: repeated summing keeps them finite (a random buffer would overflow after ~60 rounds).
    flat = torch.zeros(n)
    flat_bf16 = torch.zeros(n, dtype=torch.bfloat16)
    outer = {
        "(v)": PeriodicAverager(build(rank), period=1, group=comm, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True)),
        "(vi)": PeriodicAverager(build(rank), period=1, group=comm, outer_optimizer=OuterSGD(0.7)),
        "(vii)": PeriodicAverager(build(rank), period=1, group=comm,
                                  outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)),
        "(v')": PeriodicAverager(build(rank), period=1, group=comm, outer_optimizer=OuterSGD(0.7, 0.9, nesterov=True),
                                 chunk_bytes=None),
    }
    compressed = {c: PeriodicAverager(build(rank), period=1, group=comm, compression=c) for c in ("bf16", "fp16")}
    compressed["bf16 chunked"] = PeriodicAverager(build(rank), period=1, group=comm, compression="bf16", chunk_bytes=8 << 20)
    ops = dict(zip(TABLES["plain"], (
        lambda: dist.all_reduce(flat), functools.partial(averager.average, force=True), before,
        lambda: torch.distributed.algorithms.model_averaging.utils.average_parameters(iter(params_iii), group),
        lambda: per_tensor_average(params_iv, world),
    )))
    result = {"numel": n, "threads": torch.get_num_threads(), "times": {}}
    result["times"]["plain"] = _slowest(_interleave(ops, repeats, warmup))
    ops = dict(zip(TABLES["outer"], (lambda: dist.all_reduce(flat), functools.partial(outer["(v)"].average, force=True), functools.partial(outer["(vi)"].average, force=True),
                                     functools.partial(outer["(vii)"].average, force=True), functools.partial(outer["(v')"].average, force=True))))
    result["times"]["outer"] = _slowest(_interleave(ops, repeats, warmup))
    ops = dict(zip(TABLES["compressed"], (functools.partial(averager.average, force=True), functools.partial(compressed["bf16"].average, force=True), functools.partial(compressed["fp16"].average, force=True),
                                          lambda: dist.all_reduce(flat_bf16), functools.partial(compressed["bf16 chunked"].average, force=True))))
    result["times"]["compressed"] = _slowest(_interleave(ops, repeats, warmup))
    result["bytes"] = {"none": averager.bytes_communicated / max(1, averager.rounds),
                       "bf16": compressed["bf16"].bytes_communicated / max(1, compressed["bf16"].rounds)}
    if phases:
        del model_iii, model_iv, params_iii, params_iv, outer, compressed  # room for the chunked copies
        averagers = _chunk_averagers(rank, comm)
        result["check"] = _check_chunkings(averagers)
        result["chunks"] = _profile_chunks(averagers, flat, repeats, warmup)
    return result if rank == 0 else None


STEP_VARIANTS = {
    "(s0) compute alone (no rounds)": dict(period=None),
    "(s1) blocking rounds": dict(),
    "(s2) fragments=4, blocking": dict(fragments=4),
    "(s3) fragments=4, overlap=1": dict(fragments=4, overlap=1),
    "(s4) fragments=1, overlap=1": dict(overlap=1),
    "(s5) fragments=4, overlap=1, int4": dict(fragments=4, overlap=1, compression="int4"),
}


def step_worker(recipe: str, blocks: int, warmup: int, threads: int):
    """Table 5: time per local step of each :data:`STEP_VARIANTS` (see the module docstring)."""
    from localclip.algorithms import CELGC
    from localclip.models import build_model, detach_hidden
    from localclip.recipes import get_recipe

    torch.set_num_threads(threads)
    comm = current()
    cfg = get_recipe(recipe)
    gen = torch.Generator().manual_seed(1234 + comm.rank)
    ntoken = 10000
    runs = {}
    for name, options in STEP_VARIANTS.items():
        options = dict(options)
        period = options.pop("period", cfg.round.period) or 1 << 40
        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.workload.model, ntoken=ntoken, **cfg.workload.model_options)
        alg = CELGC(model, lr=cfg.local.lr, gamma=cfg.local.gamma, period=period, group=comm, **options)
        runs[name] = {"model": model, "alg": alg, "hidden": model.init_hidden(cfg.workload.batch_size), "peak": 0}

    def step(run):
        x = torch.randint(0, ntoken, (cfg.workload.bptt, cfg.workload.batch_size), generator=gen)
        y = torch.randint(0, ntoken, (cfg.workload.bptt, cfg.workload.batch_size), generator=gen)
        run["hidden"] = detach_hidden(run["hidden"])
        out = run["model"](x, run["hidden"])
        run["hidden"] = out.hidden
        run["alg"].zero_grad()
        torch.nn.functional.cross_entropy(out.logits.reshape(-1, ntoken), y.reshape(-1)).backward()
        before = run["alg"].bytes_communicated
        run["alg"].step()
        run["peak"] = max(run["peak"], run["alg"].bytes_communicated - before)

    for run in runs.values():  # the shift: a block then ends right after the last round landed
        for _ in range(run["alg"].averager.overlap):
            step(run)
    block = 2 * cfg.round.period
    names = list(runs)
    times = {k: [] for k in names}
    for r in range(warmup + blocks):
        for k in names[r % len(names):] + names[: r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(block):
                step(runs[k])
            if r >= warmup:
                times[k].append((time.perf_counter() - t0) / block)
    for run in runs.values():
        run["alg"].average()  # nothing left in flight before the group goes
    full = runs["(s1) blocking rounds"]["alg"].averager
    result = {
        "recipe": recipe, "period": cfg.round.period, "threads": torch.get_num_threads(), "numel": full.numel,
        "steps": _slowest(times), "peak": {k: run["peak"] for k, run in runs.items()},
        "fragment_bytes": runs["(s2) fragments=4, blocking"]["alg"].averager.fragment_bytes,
    }
    return result if comm.rank == 0 else None


def _print_steps(res: dict) -> None:
    _table(f"5. Time per local step, {res['recipe']} CELGC I = {res['period']} (ratio = median / median of (s0); "
           "paired = median of per-block ratios)", res["steps"], header="ms/step")
    full = res["peak"]["(s1) blocking rounds"]
    print(f"   peak bytes in one round (a full round: {full:,} bytes, model + 4-byte weight):")
    for k, v in res["peak"].items():
        if v:
            print(f"     {k:<48} {v:>12,}  {v / full:.3f}x a full round")
    sizes = res["fragment_bytes"]
    print(f"   the 4 fragments' bytes: {', '.join(f'{b:,}' for b in sizes)} "
          f"(largest {max(sizes) / sum(sizes):.3f} of the model; 1/4 + 5 % would be {1.05 / 4:.4f})")


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


CHUNKS = {"one all-reduce (default)": None, "2 MiB chunks": 2 << 20, "8 MiB chunks": 8 << 20, "32 MiB chunks": 32 << 20}


def _chunk_averagers(rank, comm):
    return {name: PeriodicAverager(build(rank), period=1, group=comm, chunk_bytes=size) for name, size in CHUNKS.items()}


def _check_chunkings(averagers) -> dict:
    """From the same start every chunking must give the one-chunk average (up to the rounding of
    gloo's summation order), also when rank 1's parameters hold a NaN (it is then left out).
    Returns the max relative difference."""
    flats = {name: avg.flat_buffers[0] for name, avg in averagers.items()}
    start = next(iter(flats.values())).clone()
    out = {}
    for case in ("all finite", "NaN on rank 1"):
        results = {}
        for name, avg in averagers.items():
            flats[name].copy_(start)
            if case != "all finite" and avg.comm.rank == 1:
                flats[name][12345] = math.nan
            avg.average(force=True)
            results[name] = flats[name].clone()
        ref = next(iter(results.values()))
        for name, r in list(results.items())[1:]:
            d = ((r - ref).abs().max() / ref.abs().max()).reshape(1)
            d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
            dist.all_reduce(d, op=dist.ReduceOp.MAX)
            out[f"{case}: {name} vs one all-reduce"] = d.item()
    for name, avg in averagers.items():
        flats[name].copy_(start)
    return out


def _profile_chunks(averagers, flat, repeats, warmup):
    ops = {BASELINE: lambda: dist.all_reduce(flat)}
    ops.update({f"(ii) average(), {name}": functools.partial(avg.average, force=True) for name, avg in averagers.items()})
    return _slowest(_interleave(ops, repeats, warmup))


def _table(title, times, base=None, header="ms"):
    names = list(times)
    base = base if base is not None else names[0]
    mb = statistics.median(times[base])
    print(f"\n{title}")
    print(f"{'':<52} {'median ' + header:>10} {'IQR ms':>15} {'ratio':>6} {'paired':>7}")
    for k in names:
        t = times[k]
        q = statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0]] * 3
        paired = statistics.median(x / b for x, b in zip(t, times[base]))
        print(f"{k:<52} {1e3 * statistics.median(t):>10.1f} {1e3 * q[0]:>7.1f}-{1e3 * q[2]:<7.1f} "
              f"{statistics.median(t) / mb:>6.2f} {paired:>7.2f}")


# -- a shaped link between two network namespaces (--link) -------------------------------------

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def link_bits(rate: str) -> float:
    """tc's rate syntax (``1gbit``, ``500mbit``) in bit/s."""
    for unit in sorted(_UNITS, key=len, reverse=True):
        if rate.lower().endswith(unit):
            try:
                value = float(rate[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * _UNITS[unit]
    raise SystemExit(f"bench_averaging: invalid --link rate {rate!r} (expected e.g. 1gbit, 500mbit, 10gbit)")


class ShapedLink:
    """Two network namespaces joined by a veth pair, each end shaped to ``rate`` by tbf.

    The namespaces are this script's own (named after its pid) and are deleted on exit, which
    deletes the veth pair with them; nothing outside them is touched."""

    def __init__(self, rate: str):
        self.rate, self.bits = rate, link_bits(rate)
        tag = f"lcb{os.getpid() % 100000}"
        self.namespaces = [f"{tag}-ns0", f"{tag}-ns1"]
        self.devices = [f"{tag}a", f"{tag}b"]
        self.addresses = ["10.251.0.1", "10.251.0.2"]

    def __enter__(self):
        if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
            raise SystemExit("bench_averaging: --link needs root and the ip and tc commands (iproute2)")
        try:
            for ns in self.namespaces:
                _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
            # tbf needs a bucket of at least one timer tick of traffic; 1 ms of the rate, >= 64 KiB.
            burst = max(64 << 10, int(self.bits / 8 / 1000))
            for ns, dev, addr in zip(self.namespaces, self.devices, self.addresses):
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", self.rate, "burst", str(burst), "latency", "50ms")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        # A set-up that failed before moving the pair into the namespaces leaves it here.
        subprocess.run(["ip", "link", "del", self.devices[0]], capture_output=True)

    def command(self, rank: int, argv: list[str]) -> tuple[list[str], dict]:
        """The command line and environment that run ``argv`` as worker ``rank`` on its side."""
        env = dict(os.environ, GLOO_SOCKET_IFNAME=self.devices[rank])
        return ["ip", "netns", "exec", self.namespaces[rank], *argv], env


def _sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench_averaging: {' '.join(argv)} failed: {done.stderr.strip()}")


def _over_link(link: ShapedLink, args, profile: bool) -> dict:
    """Run the benchmark's two workers across ``link``; rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="lc-bench-link-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        procs = []
        for rank in range(2):
            argv = [sys.executable, os.path.abspath(__file__), "--_rank", str(rank), "--_store", store, "--_result", out,
                    "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--threads", str(args.threads),
                    "--profile", "first" if profile else "none", "--recipe", args.recipe] + (["--steps"] if args.steps else []) \
                   + (["--lowbit"] if args.lowbit else [])
            cmd, env = link.command(rank, argv)
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise SystemExit(f"bench_averaging: a worker over the {link.rate} link failed (exit codes {codes})")
        with open(out) as f:
            return json.load(f)


def _link_worker(args) -> int:
    """One worker of ``--link`` (run inside its namespace by :func:`_over_link`)."""
    from localclip.comm import distributed

    distributed.init(backend="gloo", rank=args._rank, world_size=2, store_path=args._store, timeout=600)
    try:
        profile = args.profile != "none"
        if args.steps:
            result = step_worker(args.recipe, args.repeats, args.warmup, args.threads)
        else:
            result = (lowbit_worker if args.lowbit else worker)(args.repeats, args.warmup, profile, args.threads)
        if args._rank == 0:
            with open(args._result, "w") as f:
                json.dump(result, f)
    finally:
        distributed.shutdown()
    return 0


def _print_result(res: dict, title: str, elapsed: float, repeats: int, link: ShapedLink | None = None) -> None:
    if "steps" in res:
        print(f"\n=== {title} ({res['threads']} torch thread(s)/worker): {res['numel']:,} float32 per full round "
              f"({4 * res['numel'] / 2**20:.1f} MiB); {repeats} blocks of {2 * res['period']} steps per variant, interleaved; "
              f"slowest rank per block; {elapsed:.0f}s ===")
        if link is not None:
            print(f"   link {link.rate}: a full round's {4 * res['numel'] * 8 / link.bits * 1e3:.0f} ms of transport at the link's rate "
                  f"(bytes / rate; a 2-worker all-reduce sends the model once each way)")
        _print_steps(res)
        return
    print(f"\n=== {title} ({res['threads']} torch thread(s)/worker): {res['numel']:,} "
          f"float32 per round ({4 * res['numel'] / 2**20:.1f} MiB); {repeats} rounds interleaved; "
          f"slowest rank per round; {elapsed:.0f}s ===")
    if link is not None:
        raw = statistics.median(res["times"]["plain"][BASELINE])
        sent = 4 * res["numel"] * 8  # bits each worker sends in a 2-worker all-reduce (half, then half)
        print(f"   link {link.rate}: the raw all-reduce moves {sent / raw / 1e9:.2f} Gbit/s per direction "
              f"({sent / raw / link.bits:.2f}x the link's {link.bits / 1e9:g} Gbit/s); modelled as in the converge "
              f"report (bytes / rate + 50 us): {1e3 * (sent / link.bits + 50e-6):.0f} ms, measured {1e3 * raw:.0f} ms")
    _table("1. One plain averaging round (ratio = median / median of (i); paired = median of per-round ratios)",
           res["times"]["plain"])
    _table("2. One round with an outer step (ratios to (i))", res["times"]["outer"])
    _table("3. Compressed rounds (ratios to (ii), the uncompressed round)", res["times"]["compressed"])
    b = res["bytes"]
    print(f"   bytes sent per round (counted from the tensors all-reduced): none {b['none']:,.0f}, "
          f"bf16 {b['bf16']:,.0f} ({b['bf16'] / b['none']:.3f}x)")
    if "chunks" in res:
        print("\nChunkings vs one all-reduce, same start (max |difference| / max |x|, all ranks; 0 or float32 rounding):")
        for k, v in res["check"].items():
            print(f"  {k:<60} {v:.1e}")
        _table("4. (ii) with chunked all-reduces, interleaved (ratios to (i))", res["chunks"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (default 1)")
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds per variant (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    ap.add_argument("--profile", choices=("none", "first", "all"), default="first",
                    help="time (ii)'s chunk sizes at no, the first, or every world size (default first)")
    ap.add_argument("--quick", action="store_true", help="3 timed rounds, 1 warm-up, no profile")
    ap.add_argument("--steps", action="store_true",
                    help="time local steps with blocking, fragmented and overlapped rounds and without rounds (table 5) instead of rounds")
    ap.add_argument("--recipe", default="ptb-small", help="--steps: the recipe whose model, batch, bptt and period to use (default ptb-small)")
    ap.add_argument("--lowbit", action="store_true", help="only the table of compression none/bf16/int8/int4 rounds, with their bytes")
    ap.add_argument("--link", nargs="+", metavar="RATE",
                    help="instead of loopback: 2 workers over a veth link shaped to each RATE in turn (e.g. 1gbit 10gbit; root)")
    for hidden in ("--_rank", "--_store", "--_result"):  # a --link worker inside its namespace
        ap.add_argument(hidden, type=int if hidden == "--_rank" else str, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.profile = 3, 1, "none"
    if args._rank is not None:
        return _link_worker(args)
    print(f"bench_averaging  {datetime.date.today()}  torch {torch.__version__}  {platform.machine()} "
          f"cpus={os.cpu_count()}  load avg {os.getloadavg()[0]:.2f}")
    for rate in args.link or []:
        link_bits(rate)  # every rate checked before the first link is built
    for i, rate in enumerate(args.link or []):
        t0 = time.perf_counter()
        with ShapedLink(rate) as link:
            res = _over_link(link, args, profile=args.profile == "all" or (args.profile == "first" and i == 0))
        show = _print_lowbit if args.lowbit else _print_result
        show(res, f"world size 2 over a {rate} veth link (gloo)", time.perf_counter() - t0, args.repeats, link)
    for i, world in enumerate([] if args.link else args.world_sizes):
        t0 = time.perf_counter()
        profile = args.profile == "all" or (args.profile == "first" and i == 0)
        if args.steps:
            res = spawn(step_worker, world, args.recipe, args.repeats, args.warmup, args.threads, timeout=600, join_timeout=1800)[0]
            _print_result(res, f"world size {world} (gloo)", time.perf_counter() - t0, args.repeats)
        else:
            fn, show = (lowbit_worker, _print_lowbit) if args.lowbit else (worker, _print_result)
            res = spawn(fn, world, args.repeats, args.warmup, profile, args.threads, timeout=600, join_timeout=1800)[0]
            show(res, f"world size {world} (gloo)", time.perf_counter() - t0, args.repeats)
    if args.steps:
        print("\nTargets (issue 24): (s3) <= 1.05x (s0) at 1 Gbit/s; peak bytes per round of (s2), (s3) <= 1/4 + 5 % of a full round.")
    else:
        print("\nTargets (issue 14): (ii) <= 1.1x (i); (v) <= 1.3x (i); bf16 bytes 0.5x.")
    print(f"load avg at end {os.getloadavg()[0]:.2f}")
    return 0


# -- --lowbit: compression none, bf16, int8, int4 side by side ----------------------------------

LOWBIT_COMPRESSIONS = ("none", "bf16", "int8", "int4")


def lowbit_worker(repeats: int, warmup: int, phases: bool, threads: int):
    """Rounds of ``average()`` for each of :data:`LOWBIT_COMPRESSIONS`, interleaved; rank 0's
    result (``phases`` is unused: the signature is :func:`worker`'s)."""
    torch.set_num_threads(threads)
    comm = current()
    averagers = {c: PeriodicAverager(build(comm.rank), period=1, group=comm, compression=c) for c in LOWBIT_COMPRESSIONS}
    cpu = {c: [] for c in averagers}
    faults = {c: [] for c in averagers}

    def timed(c):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        averagers[c].average(force=True)
        cpu[c].append(time.process_time() - t0)
        faults[c].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

    ops = {c: functools.partial(timed, c) for c in averagers}
    result = {"numel": averagers["none"].numel, "threads": torch.get_num_threads(), "world": comm.world_size}
    result["times"] = _slowest(_interleave(ops, repeats, warmup))
    result["cpu"] = _slowest({c: v[warmup:] for c, v in cpu.items()})
    result["faults"] = {c: max(v[warmup:]) for c, v in faults.items()}  # this rank's, the worst round
    result["bytes"] = {c: avg.bytes_communicated / avg.rounds for c, avg in averagers.items()}
    return result if comm.rank == 0 else None


def _print_lowbit(res: dict, title: str, elapsed: float, repeats: int, link: ShapedLink | None = None) -> None:
    print(f"\n=== {title} ({res['threads']} torch thread(s)/worker): {res['numel']:,} "
          f"float32 per round ({4 * res['numel'] / 2**20:.1f} MiB); {repeats} rounds interleaved; "
          f"slowest rank per round; {elapsed:.0f}s ===")
    times, nbytes = res["times"], res["bytes"]
    base = statistics.median(times["none"])
    print(f"{'compression':<12} {'median ms':>10} {'IQR ms':>15} {'time ratio':>10} {'paired':>7} {'CPU ms':>7} {'bytes/round':>13} {'bytes ratio':>11} {'faults':>7}")
    for c in LOWBIT_COMPRESSIONS:
        t = times[c]
        q = statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0]] * 3
        paired = statistics.median(x / b for x, b in zip(t, times["none"]))
        print(f"{c:<12} {1e3 * statistics.median(t):>10.1f} {1e3 * q[0]:>7.1f}-{1e3 * q[2]:<7.1f} {statistics.median(t) / base:>10.2f} "
              f"{paired:>7.2f} {1e3 * statistics.median(res['cpu'][c]):>7.0f} {nbytes[c]:>13,.0f} {nbytes[c] / nbytes['none']:>11.4f} {res['faults'][c]:>7,}")
    print("   CPU ms: the process's CPU time in the round (slowest rank), the part a busier or slower CPU stretches")
    print(f"   faults: rank 0's most minor page faults in one timed round (first touches of fresh memory; one float32 "
          f"buffer of the model is {4 * res['numel'] // 4096:,} pages)")


if __name__ == "__main__":
    if "--_rank" in sys.argv:  # a --link worker: the parent records the table
        sys.exit(main())
    from _record import run

    sys.exit(run("bench_averaging", main, sys.argv[1:]))
