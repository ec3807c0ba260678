"""Simulated workers against real processes: the same ptb-small job under both, side by side.

For N = 2, 4 and 8 workers, the same short CELGC run (ptb-small, period 8, dropout 0.2) runs
under ``--runtime simulate`` (N concurrent threads of one process) and ``--runtime spawn`` (N
gloo processes), alternating so that load on a shared machine hits both alike. Each run's
intra-op threads are the runtime's default (cores // N, at least one, for both). Printed per N:
the median wall-clock of the whole command (start-up, data loading and, for spawn, process
start-up included: what a user waits for), the median training-loop time (``time/seconds`` of
the summary), their ratios spawn/simulate (> 1: simulation faster), the CPU seconds each
command used (this process and its children: on a machine that other jobs load, wall-clock
favours whichever runtime has more runnable threads, while CPU time per run does not), and
whether the two runtimes ended with the same model (state hash) — they must.

``--long L`` also runs every job for L steps and prints the steady-state time per local step,
(loop at L steps − loop at ``--steps``) / (L − ``--steps``): what a long run (a sweep) pays per
step, with the fixed cost of the first steps (lazy kernel set-up in every worker), the
checkpoint and the final evaluation cancelled out.

    python benchmarks/bench_runtimes.py --data-root ../shared/data
    python benchmarks/bench_runtimes.py --data-root ../shared/data --repeats 2 --steps 48 --long 240
    python benchmarks/bench_runtimes.py --data-root ../shared/data --quick      # a smoke run
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import torch

from localclip.recipes import get_recipe
from localclip.train import run_training
from localclip.algorithms import build


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def one_run(cfg, runtime: str) -> tuple[float, float, float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        start, cpu = time.perf_counter(), _cpu_seconds()
        summary = run_training(cfg, f"{tmp}/run", runtime=runtime, progress=False)
        return time.perf_counter() - start, summary["time/seconds"], _cpu_seconds() - cpu, summary["model/sha256"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=64, help="local steps per run")
    parser.add_argument("--long", type=int, default=None, help="also run L steps and print the steady-state time per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 16, 1
    if args.long is not None and args.long <= args.steps:
        parser.error(f"--long {args.long} must be more than --steps {args.steps}")

    base = get_recipe("ptb-small").replace(
        data_root=args.data_root, period=8, eval_tokens=2000,
        model_options={**get_recipe("ptb-small").workload.model_options, "dropout": 0.2},
        log_interval=8, checkpoint_interval=10**6, max_steps=args.steps,
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ptb-small, I=8, dropout 0.2, "
          f"{args.steps} steps, {args.repeats} alternating repeats (median seconds)")
    long = args.long
    print(f"{'N':>3} {'simulate wall':>14} {'spawn wall':>11} {'ratio':>6}   {'simulate loop':>14} {'spawn loop':>11} {'ratio':>6}"
          f"   {'simulate CPU':>13} {'spawn CPU':>10} {'ratio':>6}"
          + (f"   {'sim ms/step':>11} {'spawn ms/step':>13} {'ratio':>6}" if long else "") + "   same model")
    results = {}
    for n in args.workers:
        cfg = build.resolved(base.replace(workers=n))
        long_cfg = cfg.replace(max_steps=long) if long else None
        runs, per_step = {"simulate": [], "spawn": []}, {"simulate": [], "spawn": []}
        hashes, long_hashes = set(), set()
        for _ in range(args.repeats):
            for runtime in ("simulate", "spawn"):
                wall, loop, cpu, digest = one_run(cfg, runtime)
                runs[runtime].append((wall, loop, cpu))
                hashes.add(digest)
                if long_cfg is not None:
                    # Back to back with the short run, so both see the same load.
                    _, long_loop, _, long_digest = one_run(long_cfg, runtime)
                    long_hashes.add(long_digest)
                    per_step[runtime].append((long_loop - loop) / (long - args.steps))
        (ws, ls, cs), (wp, lp, cp) = ([statistics.median(r[i] for r in runs[k]) for i in range(3)] for k in ("simulate", "spawn"))
        same = len(hashes) == 1 and len(long_hashes) <= 1
        line = (f"{n:>3} {ws:>14.2f} {wp:>11.2f} {wp / ws:>6.2f}   {ls:>14.2f} {lp:>11.2f} {lp / ls:>6.2f}"
                f"   {cs:>13.2f} {cp:>10.2f} {cp / cs:>6.2f}")
        results[n] = {"wall_spawn_over_simulate": wp / ws, "loop_spawn_over_simulate": lp / ls,
                      "cpu_spawn_over_simulate": cp / cs, "same_model": same}
        if long:
            ss, sp = (statistics.median(per_step[k]) for k in ("simulate", "spawn"))
            line += f"   {ss * 1e3:>11.1f} {sp * 1e3:>13.1f} {sp / ss:>6.2f}"
            results[n]["per_step_spawn_over_simulate"] = sp / ss
        print(line + f"   {'yes' if same else 'NO'}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    import sys

    from _record import run

    sys.exit(run("bench_runtimes", main))
