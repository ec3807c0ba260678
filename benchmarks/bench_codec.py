"""CPU time of the int8/int4 block codec (:mod:`localclip.averaging.codecs`) on one thread, against another
version of it, interleaved, with a check that both give the same bits.

    PYTHONPATH=src python benchmarks/bench_codec.py --against main --repeats 7

``--against REV`` imports the codec as it is at git revision ``REV`` (``src/localclip/averaging/codecs/``,
or ``src/localclip/lowbit.py`` at revisions before that package; written to a temporary
directory under another name) beside the working tree's, and first checks that
the two give the same bits: for inputs of many kinds (normal, heavy-tailed, zeros, NaN/Inf
blocks, lengths not a multiple of 256, odd lengths, tiny, subnormal and huge values, negative
zero) the same codes and scales from :func:`encode`, the same float32 bits from :func:`decode`,
for 8 and 4 bits, rounding to nearest and stochastic (the same generator seed); and the same
averages, residuals and bytes from simulated :func:`lowbit_average` rounds (2 and 3 workers,
scratch buffers, error feedback, a worker left out, stochastic rounding). Then it times each
operation on a 24,221,600-element tensor (the AWD-LSTM model), old and new alternating in each
repeat (by the process's CPU time: one thread), and prints the medians and the median of the
paired ratios old / new (above 1: the working tree is faster). A round is one simulated ``lowbit_average`` of two workers taking
turns (both workers' CPU time, with error feedback and reused scratch buffers, as the averager
calls it).

``encode`` and ``decode`` return new tensors, and a new 97 MB float32 output costs a page fault
per 4 KiB on its first touch (glibc maps so large a block anew and unmaps it when it is freed),
about as much as the decoding itself. A round pays none of that: it keeps its buffers from one
round to the next. So each phase is also timed as the round runs it, into buffers kept between
calls (``... into buffers``: encode; encode with error feedback, the residual taking the input
and giving back what the codes stand for; decode), and the fresh-memory cost is printed apart:
one float32 buffer of the same length allocated and written against one already mapped written
again.

Beside each figure, what memory allows on this machine for the same bytes: each phase reads R
and writes W bytes (encode: the float32 input, then the codes and the float32 scales, one per
256 elements; decode: the reverse), and two passes that move only those bytes are timed with the
codec, interleaved, at one thread and at all the threads this process may use (one thread is
timed by the process's CPU time, as the codec is, which other jobs on a loaded machine inflate
far less than the wall-clock; all threads by the wall-clock, meaningful on a quiet machine only):

  copy   a float32 copy of (R + W) / 2 bytes: the same traffic, read and written by ``copy_``;
  fused  one read-and-write pass with the phase's own shape, a converting copy reading R bytes
         and writing W (float32 to uint8 for an encode, uint8 to float32 for a decode; int4's
         half-size side by a stride-2 read or a broadcast write).

and the working tree's codec figure is printed as a fraction of each (limit time / codec time,
100 % = as fast as memory). A round's limit is its passes' sum: each of 2 workers encodes its n
elements, decodes the n elements of its shard from both, re-encodes its shard (n/2) and decodes
the gathered average (n); error feedback's residual reads and writes are left out, so the limit
is a lower bound.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from localclip.averaging import codecs as new
from localclip.comm import SimulatedWorld, current

NUMEL = 24_221_600
WIDTH = 38  # the operation column
REPO = Path(__file__).resolve().parents[1]


CODECS = "src/localclip/averaging/codecs"


def load_revision(rev: str):
    """The int8/int4 codec as it is at git revision ``rev``: the package ``localclip.averaging.codecs``
    (as a package named ``codecs_at_rev``, its imports of itself pointed at that copy) or, at a
    revision before it, the module ``localclip.lowbit`` (as ``lowbit_at_rev``)."""
    def show(path: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True)

    folder = Path(tempfile.mkdtemp(prefix="bench_codec_"))
    listing = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:{CODECS}"], capture_output=True, text=True)
    if listing.returncode == 0:
        name, path = "codecs_at_rev", folder / "codecs_at_rev" / "__init__.py"
        path.parent.mkdir()
        for file in listing.stdout.split():
            if file.endswith(".py"):
                text = show(f"{CODECS}/{file}").stdout.replace("localclip.averaging.codecs", name)
                (path.parent / file).write_text(text)
        search = [str(path.parent)]
    else:
        shown = show("src/localclip/lowbit.py")
        if shown.returncode:
            raise SystemExit(f"bench_codec: revision {rev!r} has neither {CODECS}/ nor src/localclip/lowbit.py: {shown.stderr.strip()}")
        name, path, search = "lowbit_at_rev", folder / "lowbit_at_rev.py", None
        path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=search)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- same bits ------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def cases(seed: int = 0):
    """(name, 1-D float32 tensor) inputs of many kinds and lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 15, 16, 255, 256, 257, 511, 512, 513, 1001, 4096, 5000 + 7, 65_537]
    for n in lengths:
        yield f"normal {n}", torch.randn(n, generator=g) * 3
        yield f"cauchy {n}", torch.empty(n).cauchy_(generator=g)
        yield f"zeros {n}", torch.zeros(n)
        yield f"negative zeros {n}", torch.full((n,), -0.0)
        x = torch.randn(n, generator=g)
        x[torch.randint(0, n, (max(1, n // 300),), generator=g)] = float("nan")
        yield f"nan {n}", x
        x = torch.randn(n, generator=g)
        x[torch.randint(0, n, (max(1, n // 300),), generator=g)] = float("inf")
        x[torch.randint(0, n, (max(1, n // 500),), generator=g)] = -float("inf")
        yield f"inf {n}", x
        yield f"tiny {n}", torch.randn(n, generator=g) * 1e-38
        yield f"subnormal {n}", torch.randn(n, generator=g) * 1e-42
        yield f"smallest {n}", torch.randint(-3, 4, (n,), generator=g).float() * 1e-45
        yield f"huge {n}", torch.randn(n, generator=g) * 1e37
        yield f"max {n}", torch.randn(n, generator=g).sign() * torch.finfo(torch.float32).max
        x = torch.randn(n, generator=g) * torch.logspace(-40, 38, n).float()
        x[torch.rand(n, generator=g) < 0.1] = -0.0
        yield f"mixed scales {n}", x
        # Blocks of zeros of both signs, mixed in random proportions (the sign of a zero scale).
        x = torch.where(torch.rand(n, generator=g) < torch.rand(-(-n // 256), generator=g).repeat_interleave(256)[:n], -0.0, 0.0)
        x[torch.rand(n, generator=g) < 0.001] = 1.5
        yield f"signed zeros {n}", x
        # Exact multiples of a step and halfway values: ties, every code, the clamp's edge.
        k = torch.randint(-254, 255, (n,), generator=g).float() / 2
        k[::256] = 127.0
        yield f"ties {n}", k * 0.37
        yield f"int4 ties {n}", torch.randint(-14, 15, (n,), generator=g).float() / 2


def check_codec(old, rounds: bool = True) -> int:
    """Compare ``old`` and the working tree's codec over :func:`cases`; return the cases checked."""
    checked = 0
    for name, x in cases():
        for bits in (8, 4):
            for seed in (None, 7):
                gen = (lambda: None) if seed is None else (lambda: torch.Generator().manual_seed(seed))
                a, b = old.encode(x, bits, generator=gen()), new.encode(x, bits, generator=gen())
                what = f"{name}, int{bits}, {'nearest' if seed is None else 'stochastic'}"
                assert _same(a.codes, b.codes), f"codes differ: {what}"
                assert _same(a.scales, b.scales), f"scales differ: {what}"
                assert (a.numel, a.bits, a.block) == (b.numel, b.bits, b.block), what
                assert _same(old.decode(a), new.decode(b)), f"decoded bits differ: {what}"
                assert _same(old.decode(a), new.decode(a)), f"decoded bits differ (old codes): {what}"
                checked += 1
    for name, x in list(cases(1))[::7]:
        for block in (1, 3, 16, 100, 1024):
            for bits in (8, 4):
                if bits == 4 and block % 2:
                    continue  # refused since int4 packs two codes a byte within a block
                try:
                    a = old.encode(x, bits, block=block)
                except (RuntimeError, ValueError):  # int4 with an odd block and an odd length: an error from both
                    with contextlib.suppress(RuntimeError, ValueError):
                        new.encode(x, bits, block=block)
                        raise AssertionError(f"{name}, block {block}, int{bits}: encoded where the other version raised")
                    continue
                b = new.encode(x, bits, block=block)
                assert _same(a.codes, b.codes) and _same(a.scales, b.scales), f"{name}, block {block}, int{bits}"
                assert _same(old.decode(a), new.decode(b)), f"decoded bits differ: {name}, block {block}, int{bits}"
                checked += 1
    if rounds:
        checked += check_rounds(old)
    return checked


def check_rounds(old) -> int:
    """Simulated rounds: the same averages, residuals, shard residuals and bytes."""
    checked = 0

    def worker(module, n, bits, stochastic, kind):
        comm = current()
        fb, scratch, out = module.ErrorFeedback(n), module.Scratch(), []
        gen = torch.Generator().manual_seed(100 + comm.rank) if stochastic else None
        g = torch.Generator().manual_seed(comm.rank)
        for k in range(3):
            delta = torch.randn(n, generator=g) * (10.0 ** (3 * k - 3))
            if kind == "nonfinite" and k == 1 and comm.rank == 1:
                delta[n // 3] = float("nan")
                delta[-1] = float("inf")
            if kind == "zeros" and k == 1:
                delta.zero_()
            if kind == "signed zeros":  # without feedback, so that -0.0 reaches the encoder
                delta = torch.where(torch.rand(n, generator=g) < k / 2, -0.0, 0.0)
                delta[torch.rand(n, generator=g) < 0.002] = 1.0
            weighted = kind == "weighted"
            res = module.lowbit_average(comm, delta, bits, fb if kind not in ("nofeedback", "signed zeros") else None, generator=gen,
                                        taking_part=(not (k == 1 and comm.rank == 1)) if weighted else None, scratch=scratch)
            out.append((res.average.clone(), res.bytes_sent, res.payload, res.taking_part, fb.residual.clone(),
                        None if fb.shard_residual is None else fb.shard_residual.clone()))
        return out

    for world in (2, 3):
        for n in (1, 300, 2 * 256 * world, 2 * 256 * world + 77, 10_001, 40 * 256 * world + 5):
            for bits in (8, 4):
                for stochastic in (False, True):
                    for kind in ("plain", "weighted", "nonfinite", "zeros", "nofeedback", "signed zeros"):
                        a = SimulatedWorld(world, concurrent=False).run(worker, old, n, bits, stochastic, kind)
                        b = SimulatedWorld(world, concurrent=False).run(worker, new, n, bits, stochastic, kind)
                        for ra, rb in zip(a, b):
                            for (avg, sent, pay, part, res, shard), (avg2, sent2, pay2, part2, res2, shard2) in zip(ra, rb):
                                what = f"round: world {world}, n {n}, int{bits}, stochastic {stochastic}, {kind}"
                                assert (sent, pay, part) == (sent2, pay2, part2), what
                                assert _same(avg, avg2) and _same(res, res2) and _same(shard, shard2), what
                        checked += 1
    return checked


# -- timing ---------------------------------------------------------------------------------------


def operations(module, x: torch.Tensor, state: dict):
    """name -> zero-argument callable, for ``module``'s codec on ``x``."""
    ops = {}
    for bits in (8, 4):
        enc = module.encode(x, bits)
        ops[f"encode int{bits} nearest"] = lambda bits=bits: module.encode(x, bits)
        ops[f"encode int{bits} stochastic"] = lambda bits=bits: module.encode(x, bits, generator=torch.Generator().manual_seed(0))
        ops[f"decode int{bits}"] = lambda enc=enc: module.decode(enc)

        world = SimulatedWorld(2, concurrent=False)
        fbs = [module.ErrorFeedback(x.numel()) for _ in range(2)]
        scratch = [module.Scratch() for _ in range(2)]
        deltas = [x, x.flip(0)]

        def worker(bits=bits, fbs=fbs, scratch=scratch, deltas=deltas):
            r = current().rank
            return module.lowbit_average(current(), deltas[r], bits, fbs[r], scratch=scratch[r]).bytes_sent

        ops[f"round int{bits} (2 workers)"] = lambda world=world, worker=worker: world.run(worker)
        state.setdefault("keep", []).append((fbs, scratch))
        ops.update(reused(module, x, bits, state))
    return ops


def reused(module, x: torch.Tensor, bits: int, state: dict) -> dict:
    """name -> zero-argument callable: ``module``'s phases as a round runs them, into buffers
    kept from one call to the next (codes, scales, the decoded output, the residual and the
    working buffers of a :class:`Scratch`): encode, encode with error feedback (the residual
    takes the input, then gives back what the codes stand for), decode. Empty for a revision
    without the row-wise functions."""
    blocks = getattr(module, "blocks", None)
    if blocks is None or not hasattr(blocks, "_encode_rows") or not hasattr(blocks, "Scratch"):
        return {}
    n, block = x.numel(), module.BLOCK_NUMEL
    nb = -(-n // block)
    scratch = blocks.Scratch()
    codes = torch.zeros(1, n if bits == 8 else (n + 1) // 2, dtype=torch.uint8)
    scales = torch.zeros(1, nb)
    out = torch.zeros(1, nb * block)
    residual = torch.zeros(n)
    state.setdefault("keep", []).append((scratch, codes, scales, out, residual))
    return {
        f"encode int{bits} into buffers": lambda: blocks._encode_rows(1, n, n, bits, block, None, codes, scales, x, scratch=scratch),
        f"encode int{bits} + residual into buffers": lambda: blocks._encode_rows(
            1, n, n, bits, block, None, codes, scales, residual, x, True, scratch),
        f"decode int{bits} into a buffer": lambda: blocks._decode_rows(codes, scales, n, bits, block, out, scratch),
    }


def phase_bytes(numel: int) -> dict:
    """name -> (bytes read, bytes written) of one codec phase on ``numel`` float32 elements."""
    scales = 4 * -(-numel // 256)
    out = {}
    for bits in (8, 4):
        codes = numel * bits // 8
        out[f"encode int{bits} nearest"] = out[f"encode int{bits} stochastic"] = (4 * numel, codes + scales)
        out[f"encode int{bits} into buffers"] = (4 * numel, codes + scales)
        # The input and the residual read, the residual and the codes written.
        out[f"encode int{bits} + residual into buffers"] = (8 * numel, 4 * numel + codes + scales)
        out[f"decode int{bits}"] = out[f"decode int{bits} into a buffer"] = (codes + scales, 4 * numel)
    return out


def limit_passes(numel: int) -> dict:
    """name -> (copy, fused): zero-argument callables moving the bytes of :func:`phase_bytes`."""
    src = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    u8 = torch.randint(0, 255, (numel,), dtype=torch.uint8)
    half_u8 = u8[: numel // 2]
    f32_out, u8_out = torch.empty(numel), torch.empty(numel, dtype=torch.uint8)
    copy_in, copy_out = {}, {}
    passes = {}
    for name, (read, written) in phase_bytes(numel).items():
        n = (read + written) // 8  # float32 elements copied: (R + W) / 2 bytes
        copy_in.setdefault(n, torch.randn(n))
        copy_out.setdefault(n, torch.empty(n))
        copy = lambda a=copy_out[n], b=copy_in[n]: a.copy_(b)  # noqa: E731
        if "residual" in name:
            fused = lambda: f32_out.add_(src)  # noqa: E731 - the residual's own read-and-write pass, plus the input
        elif name.startswith("encode int8"):
            fused = lambda: u8_out.copy_(src)  # noqa: E731
        elif name.startswith("encode int4"):
            fused = lambda: u8_out[: numel // 2].copy_(src[: numel // 2 * 2: 2])  # noqa: E731
        elif name.startswith("decode int8"):
            fused = lambda: f32_out.copy_(u8)  # noqa: E731
        else:
            fused = lambda: f32_out[: numel // 2 * 2].view(-1, 2).copy_(half_u8.unsqueeze(1).expand(-1, 2))  # noqa: E731
        passes[name] = (copy, fused)
    return passes


def fresh_memory(numel: int) -> dict:
    """kind -> zero-argument callable: a float32 buffer of ``numel`` elements allocated and
    written (each 4 KiB page faulted in on its first touch: glibc maps so large a block anew and
    unmaps it when freed), and one kept from the last call written again."""
    kept = torch.empty(numel)
    return {"allocated and written": lambda: torch.empty(numel).fill_(0.0), "written, already mapped": lambda: kept.fill_(0.0)}


ROUND_PASSES = {8: ("encode int8 nearest", "decode int8"), 4: ("encode int4 nearest", "decode int4")}


def round_limit(limits: dict, bits: int) -> float:
    """A 2-worker round's limit from its passes' limits at ``numel`` (see the module docstring):
    2 x (encode n + decode n + encode n/2 + decode n)."""
    enc, dec = (limits[n] for n in ROUND_PASSES[bits])
    return 2 * (enc + dec + enc / 2 + dec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="main", help="git revision of the codec to compare with (default: main)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--numel", type=int, default=NUMEL)
    ap.add_argument("--only", nargs="*", help="time only the operations whose names contain one of these")
    ap.add_argument("--no-check", action="store_true", help="skip the same-bits check")
    ap.add_argument("--no-round-check", action="store_true", help="check the codec's bits but not the rounds'")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    old = load_revision(args.against)

    if not args.no_check:
        t0 = time.perf_counter()
        checked = check_codec(old, rounds=not args.no_round_check)
        print(f"same bits as {args.against}: {checked} cases ({time.perf_counter() - t0:.0f}s)")

    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    x[:: 1 << 16] *= 50  # some blocks with an outlier
    state: dict = {}
    impls = {"old": operations(old, x, state), "new": operations(new, x, state)}
    names = [n for n in impls["new"] if not args.only or any(o in n for o in args.only)]
    times = {(impl, n): [] for impl in impls for n in names}
    passes = limit_passes(args.numel)
    all_threads = len(os.sched_getaffinity(0))
    limits = {(kind, threads, n): [] for kind in ("copy", "fused") for threads in (1, all_threads) for n in passes}
    fresh = fresh_memory(args.numel)
    fresh_times = {kind: [] for kind in fresh}
    for rep in range(args.warmup + args.repeats):
        for n in names:
            order = ("old", "new") if rep % 2 == 0 else ("new", "old")
            for impl in order:
                if n not in impls[impl]:
                    continue
                t0 = time.process_time()
                impls[impl][n]()
                dt = time.process_time() - t0
                if rep >= args.warmup:
                    times[(impl, n)].append(dt)
        for kind, fn in fresh.items():  # fresh memory against memory already mapped, in the same repeat
            t0 = time.process_time()
            fn()
            if rep >= args.warmup:
                fresh_times[kind].append(time.process_time() - t0)
        for threads in (1, all_threads):  # the memory limits, in the same repeat
            torch.set_num_threads(threads)
            clock = time.process_time if threads == 1 else time.perf_counter
            for n, fns in passes.items():
                for kind, fn in zip(("copy", "fused"), fns):
                    t0 = clock()
                    fn()
                    if rep >= args.warmup:
                        limits[(kind, threads, n)].append(clock() - t0)
        torch.set_num_threads(1)

    print(f"\n{args.numel:,} float32 elements, 1 thread, {args.repeats} repeats interleaved "
          f"(old = {args.against}, new = working tree); ratio old / new, above 1 is faster")
    print(f"{'operation':<{WIDTH}} {'old ms':>9} {'new ms':>9} {'ratio':>7} {'paired':>7}")
    for n in names:
        o, w = times[("old", n)], times[("new", n)]
        if not o:  # an operation the other revision does not have
            print(f"{n:<{WIDTH}} {'-':>9} {1e3 * statistics.median(w):>9.1f}")
            continue
        paired = statistics.median(a / b for a, b in zip(o, w))
        print(f"{n:<{WIDTH}} {1e3 * statistics.median(o):>9.1f} {1e3 * statistics.median(w):>9.1f} "
              f"{statistics.median(o) / statistics.median(w):>7.2f} {paired:>7.2f}")

    fm = {kind: statistics.median(v) for kind, v in fresh_times.items()}
    print(f"\nFresh memory: one float32 buffer of {args.numel:,} elements ({4 * args.numel / 1e6:.0f} MB) written, 1 thread, "
          f"ms (what encode and decode pay for their new outputs, and a round into kept buffers does not):")
    for kind, t in fm.items():
        print(f"  {kind:<{WIDTH + 10}} {1e3 * t:>8.1f}")
    print(f"  {'the page faults (the difference)':<{WIDTH + 10}} {1e3 * (fm['allocated and written'] - fm['written, already mapped']):>8.1f}")

    med = {k: statistics.median(v) for k, v in limits.items()}
    print(f"\nThe working tree's codec against what memory allows for the same bytes (limit ms; codec as % of the "
          f"limit, 100 % = memory speed), at 1 and {all_threads} threads (the codec itself runs on 1):")
    print(f"{'operation':<{WIDTH}} {'new ms':>8} {'MB r+w':>7} {'copy 1T':>8} {'fused 1T':>9} {f'copy {all_threads}T':>8} "
          f"{f'fused {all_threads}T':>9} {'%copy 1T':>9} {'%fused 1T':>10} {f'%copy {all_threads}T':>9} {f'%fused {all_threads}T':>10}")
    sizes = phase_bytes(args.numel)
    for n in names:
        new_ms = statistics.median(times[("new", n)])
        if n in passes:
            lim = [med[(kind, threads, n)] for threads in (1, all_threads) for kind in ("copy", "fused")]
            mb = sum(sizes[n]) / 1e6
        elif n.startswith("round"):
            bits = 8 if "int8" in n else 4
            lim = [round_limit({p: med[(kind, threads, p)] for p in ROUND_PASSES[bits]}, bits)
                   for threads in (1, all_threads) for kind in ("copy", "fused")]
            mb = 2 * sum(sum(sizes[p]) * f for p, f in zip(ROUND_PASSES[bits], (1.5, 2))) / 1e6
        else:
            continue
        print(f"{n:<{WIDTH}} {1e3 * new_ms:>8.1f} {mb:>7.0f} " + " ".join(f"{1e3 * t:>{w}.1f}" for t, w in zip(lim, (8, 9, 8, 9)))
              + " " + " ".join(f"{100 * t / new_ms:>{w}.0f}%" for t, w in zip(lim, (8, 9, 8, 9))))
    print("Target: the codec's throughput per phase >= 40 % of the memory-copy limit on one thread.")
    return 0


if __name__ == "__main__":
    from _record import run

    sys.exit(run("bench_codec", main, sys.argv[1:]))
