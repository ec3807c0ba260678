"""``localclip --version`` against ``python -c "import torch"``, measured side by side in one run.

Each round starts both commands as fresh interpreters, one after the other (the order alternating
from round to round, so that load drift hits both alike); the script prints each command's median
wall time and their ratio; the table is recorded under ``benchmarks/results/``
(:mod:`_record`: the machine, threads, load and commit above it). The command's start-up is what every
``localclip`` invocation pays before it does anything.

    PYTHONPATH=src python benchmarks/bench_startup.py            # 10 rounds
    PYTHONPATH=src python benchmarks/bench_startup.py --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from _record import run

COMMANDS = {
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "localclip --version": [sys.executable, "-m", "localclip.cli", "--version"],
}


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=300)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    for argv in COMMANDS.values():
        timed(argv)  # warm the file cache
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for r in range(args.rounds):
        names = list(COMMANDS) if r % 2 == 0 else list(reversed(COMMANDS))
        for name in names:
            times[name].append(timed(COMMANDS[name]))
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["python -c 'import torch'"]
    for name, median in medians.items():
        print(f"{name:28s} median {median:6.2f} s over {args.rounds} (min {min(times[name]):.2f}, max {max(times[name]):.2f})  {median / base:.2f}x")


if __name__ == "__main__":
    sys.exit(run("bench_startup", main))
