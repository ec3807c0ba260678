"""Where a low-bit round's CPU time goes, per worker: a breakdown by what each part does.

N gloo processes (default 2, one torch thread each, loopback) each hold the AWD-LSTM model of
``bench_averaging.py`` (24.2 M parameters) in a :class:`~localclip.PeriodicAverager` with
compression int8 or int4 (error feedback on) and run ``average(force=True)`` rounds: first some
rounds timed with ``time.process_time`` alone (the process's CPU time, user and system: what a
round costs), then as many under ``cProfile`` with the same clock, whose per-function times give
the breakdown. Each torch call (a C function in the profile) is charged to the Python function
that made it, and each such function to a part of the round:

* the change since the anchor and its finite check (``Round._lowbit_changes``);
* the sender's encode: the residual plus the change, the codes, the residual's update
  (``_encode_rows`` and the codec's helpers under it, called from ``start_lowbit_average``);
* the owner's decode of its shard from every worker, the sum, the shard residual and the
  re-encode (``LowbitPending.advance`` and the helpers it calls);
* the decode of the gathered average (``LowbitPending.wait``);
* the anchor plus the average into the model, and the new anchor (``Round.finish_lowbit``);
* the transport: the communicator's start and wait of each piece's collective, gloo's own
  copies and sends, and the waits for peers (``localclip.comm``, ``torch.distributed``);
* everything else (the averager's Python, the piece bookkeeping).

The profiler adds its own cost to every call, so the profiled total is above the plain one; the
ratio is printed, and the profiled parts are scaled to the plain total in the last column (an
estimate: the profiler's overhead falls on the small calls more than on the large ones). Calls
per round count the torch calls and the Python calls, the per-call overhead that pieces add.

    PYTHONPATH=src python benchmarks/bench_lowbit_round.py --rounds 3
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from localclip import PeriodicAverager  # noqa: E402
from localclip.comm import current  # noqa: E402
from localclip.comm.launch import spawn  # noqa: E402

PARTS = (
    "change since the anchor + finite check",
    "sender encode (residual + change, codes, residual)",
    "owner decode + sum + shard residual + re-encode",
    "decode of the gathered average",
    "anchor + average into the model, new anchor",
    "transport (start, wait, gloo copies and sends)",
    "other Python (averager, pieces' bookkeeping)",
)

# (file suffix, function name) -> part; a function not listed takes its caller's part.
_ROOTS = {
    ("averaging/round.py", "_lowbit_changes"): 0,
    ("codecs/blocks.py", "_encode_rows"): 1,
    ("codecs/lowbit.py", "advance"): 2,
    ("codecs/lowbit.py", "wait"): 3,
    ("averaging/round.py", "finish_lowbit"): 4,
}
_TRANSPORT = ("localclip/comm/", "torch/distributed/")


def _shares(func, stats, memo, seen=()) -> list[float]:
    """The shares of the round's parts in a profiled function's time: one part for the roots
    above and the transport; otherwise its callers' shares, weighted by the time spent in it
    from each (cProfile keeps one level of callers, so a helper called from two parts is split
    in proportion)."""
    if func in memo:
        return memo[func]
    path, _, name = func
    one = [0.0] * len(PARTS)
    part = next((p for (suffix, fname), p in _ROOTS.items() if path.endswith(suffix) and name == fname), None)
    if part is None and any(t in path for t in _TRANSPORT):
        part = 5
    callers = stats[func][4]
    if part is None and (not callers or func in seen):
        part = 6
    if part is not None:
        one[part] = 1.0
        memo[func] = one
        return one
    weights = {c: v[3] for c, v in callers.items()}
    if not sum(weights.values()):
        weights = {c: v[1] for c, v in callers.items()}
    total = sum(weights.values()) or 1.0
    for c, w in weights.items():
        for i, s in enumerate(_shares(c, stats, memo, seen + (func,))):
            one[i] += w / total * s
    memo[func] = one
    return one


def breakdown(profile: cProfile.Profile) -> tuple[list[float], list[float], list[float]]:
    """Seconds, torch calls and Python calls per part (totals of the profiled rounds)."""
    stats = pstats.Stats(profile).stats
    seconds, c_calls, py_calls = [0.0] * len(PARTS), [0.0] * len(PARTS), [0.0] * len(PARTS)
    memo: dict = {}
    for func, (_, calls, tottime, _, _) in stats.items():
        calls_by = c_calls if func[0] == "~" else py_calls
        for part, share in enumerate(_shares(func, stats, memo)):
            seconds[part] += tottime * share
            calls_by[part] += calls * share
    return seconds, c_calls, py_calls


def worker(compressions: list[str], rounds: int, warmup: int, threads: int):
    torch.set_num_threads(threads)
    comm = current()
    from bench_averaging import build

    result = {"threads": torch.get_num_threads(), "world": comm.rank, "by": {}}
    for compression in compressions:
        averager = PeriodicAverager(build(comm.rank), period=1, group=comm, compression=compression)
        result["numel"] = averager.numel
        for _ in range(warmup):
            averager.average(force=True)
        plain = []
        for _ in range(rounds):
            t0 = time.process_time()
            averager.average(force=True)
            plain.append(time.process_time() - t0)
        profile = cProfile.Profile(time.process_time)
        t0 = time.process_time()
        profile.enable()
        for _ in range(rounds):
            averager.average(force=True)
        profile.disable()
        profiled = time.process_time() - t0
        seconds, c_calls, py_calls = breakdown(profile)
        result["by"][compression] = {"plain": plain, "profiled": profiled / rounds,
                                     "parts": [s / rounds for s in seconds],
                                     "c_calls": [c / rounds for c in c_calls], "py_calls": [c / rounds for c in py_calls]}
        del averager
    return result


def _print(results: list[dict], rounds: int) -> None:
    for compression in results[0]["by"]:
        print(f"\n=== {compression}: {len(results)} gloo processes, {results[0]['threads']} torch thread(s) each, "
              f"{results[0]['numel']:,} float32, {rounds} rounds plain then {rounds} profiled ===")
        for rank, res in enumerate(results):
            r = res["by"][compression]
            plain = statistics.median(r["plain"])
            total = sum(r["parts"])
            scale = plain / total if total else 0.0
            print(f"rank {rank}: CPU ms per round {1e3 * plain:.0f} plain (rounds: "
                  f"{', '.join(f'{1e3 * t:.0f}' for t in r['plain'])}); {1e3 * r['profiled']:.0f} profiled "
                  f"({r['profiled'] / plain:.2f}x)")
            print(f"  {'part':<52} {'profiled ms':>11} {'share':>6} {'torch calls':>11} {'py calls':>9} {'scaled ms':>9}")
            for name, s, cc, pc in zip(PARTS, r["parts"], r["c_calls"], r["py_calls"]):
                print(f"  {name:<52} {1e3 * s:>11.1f} {s / total:>6.1%} {cc:>11.0f} {pc:>9.0f} {1e3 * s * scale:>9.1f}")
            print(f"  {'total':<52} {1e3 * total:>11.1f} {1:>6.0%} {sum(r['c_calls']):>11.0f} {sum(r['py_calls']):>9.0f} "
                  f"{1e3 * plain:>9.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compressions", nargs="+", default=["int8", "int4"], choices=("int8", "int4"))
    ap.add_argument("--rounds", type=int, default=3, help="rounds timed plain, then as many profiled (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (default 1)")
    args = ap.parse_args(argv)
    print(f"bench_lowbit_round  torch {torch.__version__}  cpus={os.cpu_count()}  load avg {os.getloadavg()[0]:.2f}")
    results = spawn(worker, args.world_size, args.compressions, args.rounds, args.warmup, args.threads,
                    timeout=900, join_timeout=2400)
    _print(results, args.rounds)
    print(f"load avg at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    from _record import run

    sys.exit(run("bench_lowbit_round", main, sys.argv[1:]))
