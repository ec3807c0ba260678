"""Sweep throughput against ``--jobs``, measured side by side in one run.

The same small sweep (``--runs`` runs of the ``isweep`` plan, N = 8 workers each, ``--steps``
local steps, one intra-op thread per worker as every sweep pins) is run with J = 1, 2, … up to
the number of cores (and 2x cores), each into a fresh folder; the script prints each J's wall
time, its speed over J = 1, and whether every run's metrics (wall-clock fields left out) are
identical to J = 1's. This is what `localclip sweep`'s default (one run per core) rests on.

    python benchmarks/bench_sweep_jobs.py --data-root ../shared/data
    python benchmarks/bench_sweep_jobs.py --data-root ../shared/data --runs 2 --steps 16   # quick
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import localclip_lab as experiments
from localclip import jsonio
from localclip_lab.runner import available_cores

TIMES = ("time/compute", "time/comm", "time/seconds")


def numbers(folder: Path) -> list:
    records = [jsonio.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMES} for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    cores = len(available_cores())
    names = [name for name, _ in experiments.plan("isweep")][: args.runs]
    overrides = ["eval_tokens=5000", "eval_interval=0", f"checkpoint_interval={args.steps}", "log_interval=8", "model_options.dropout=0.2"]
    jobs = sorted({1, *[j for j in (2, 4, 8, 16) if j <= cores], cores, 2 * cores})
    print(f"{cores} cores; sweep of {len(names)} runs ({', '.join(names)}), {args.steps} steps each, threads=1")
    base_time, base_numbers = None, None
    with tempfile.TemporaryDirectory() as tmp:
        for j in jobs:
            root = Path(tmp) / f"j{j}"
            start = time.perf_counter()
            experiments.run_sweep("isweep", root, data_root=args.data_root, only=names, max_steps=args.steps,
                                  overrides=overrides, jobs=j, echo=lambda _: None)
            seconds = time.perf_counter() - start
            got = {name: numbers(root / "isweep" / name) for name in names}
            base_time = base_time or seconds
            base_numbers = base_numbers or got
            print(f"jobs={j:2d}: {seconds:7.1f} s   speed vs jobs=1: {base_time / seconds:5.2f}x   "
                  f"metrics identical to jobs=1: {got == base_numbers}", flush=True)


if __name__ == "__main__":
    import sys

    from _record import run

    sys.exit(run("bench_sweep_jobs", main))
