"""Benchmark: N = 1000 workers with K = 8 sampled a round against 8 workers, on ptb-small.

Two short CELGC runs of ptb-small (period 8, its batch 5 and bptt 20), each for ``--steps``
local steps in a fresh child process of its own (so that each one's peak memory is its own):

* BASELINE: 8 workers, all taking part in every round (``--workers 8``);
* 1000 workers, 8 sampled a round, non-participants idle (``--workers 1000 --set
  participants=8 --set non_participants=idle``): the simulator holds the 8 slots that play the
  sampled workers (:mod:`localclip.train.roster`).

Both evaluate on the first ``--eval-tokens`` tokens of each split and checkpoint as ptb-small
does. With N = 1000 an epoch is only 9 steps per worker (each worker's shard is 1/1000 of
PTB), so that run also pays an evaluation and a checkpoint every 9 steps: its training-loop
time includes them, as a user's would. Printed side by side: each run's training-loop time
(``time/seconds`` of the summary) per step, the whole command's wall-clock, its peak resident
memory (``ru_maxrss``), its thread count at the end of training, and the ratios of the 1000-
worker run to the baseline (the targets: speed ratio about 1, memory ratio under 2). The table,
with the CPU model, threads, load average, torch version and commit, is recorded under
``benchmarks/results/`` (:mod:`_record`).

    PYTHONPATH=src python benchmarks/bench_workers.py --data-root ../shared/data           # ~2 min
    PYTHONPATH=src python benchmarks/bench_workers.py --data-root ../shared/data --steps 16  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time

from _record import run

RUNS = {
    "8 workers (baseline)": dict(workers=8),
    "1000 workers, K=8 idle": dict(workers=1000, participants=8, non_participants="idle"),
}


def child(args) -> None:
    """One run, in this process: print its numbers as one JSON line."""
    from localclip.recipes import get_recipe
    from localclip.train import run_training

    cfg = get_recipe("ptb-small").replace(
        # Epochs enough for the steps (an epoch of 1000 workers is 9 steps): max_steps ends the run.
        **json.loads(args.child), max_steps=args.steps, epochs=float(args.steps), eval_tokens=args.eval_tokens,
        data_root=args.data_root, loggers=[], seed=args.seed,
    )
    threads = []
    from localclip.train import trainer

    # The threads alive at the end of training (the workers' included): sampled by wrapping the
    # final evaluation, which every worker reaches before it returns.
    final = trainer.Trainer._log_eval

    def counting(self, *a, **k):
        if k.get("final"):
            threads.append(threading.active_count())
        return final(self, *a, **k)

    trainer.Trainer._log_eval = counting
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        summary = run_training(cfg, f"{tmp}/run", progress=False)
        wall = time.perf_counter() - start
    print(json.dumps({
        "loop": summary["time/seconds"], "wall": wall, "steps": summary["steps"], "val_ppl": summary["val/ppl"],
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "threads": max(threads),
    }))


def run_child(args, options: dict) -> dict:
    command = [sys.executable, __file__, "--child", json.dumps(options), "--steps", str(args.steps),
               "--eval-tokens", str(args.eval_tokens), "--seed", str(args.seed)]
    if args.data_root:
        command += ["--data-root", args.data_root]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"bench_workers: the run {options} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=48, help="local steps per run (default 48)")
    parser.add_argument("--eval-tokens", type=int, default=2000, help="tokens of each split evaluated (default 2000)")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--seed", type=int, default=2020)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    results = {name: run_child(args, options) for name, options in RUNS.items()}
    base = results["8 workers (baseline)"]
    lines = [
        f"bench_workers: ptb-small, CELGC I=8, {args.steps} steps per worker, eval_tokens={args.eval_tokens}",
        "",
        f"{'run':<26}{'steps':>6}{'loop s/step':>12}{'wall s':>9}{'peak MiB':>10}{'threads':>9}{'val ppl':>10}{'speed ratio':>13}{'memory ratio':>14}",
    ]
    for name, r in results.items():
        speed = (r["loop"] / r["steps"]) / (base["loop"] / base["steps"])
        memory = r["maxrss"] / base["maxrss"]
        lines.append(f"{name:<26}{r['steps']:>6}{r['loop'] / r['steps']:>12.3f}{r['wall']:>9.1f}{r['maxrss'] / 2**20:>10.0f}{r['threads']:>9}"
                     f"{r['val_ppl']:>10.1f}{speed:>13.2f}{memory:>14.2f}")
    lines.append("ratios: the run's loop time per step and peak memory over the baseline's (targets: about 1, under 2)")
    print("\n".join(lines))


if __name__ == "__main__":
    if "--child" in sys.argv:
        main()
    else:
        sys.exit(run("bench_workers", main))
