"""Trainer overhead, measured side by side in one run (runtimes: see bench_runtimes.py).

1. Trainer overhead: ``Trainer.train_step`` (the real training step: lr/γ set-up, forward,
   loss, backward, CELGC step with its averager) against a bare loop doing the same math
   (forward, cross-entropy, backward, ClippedSGD step) on the same batches, one worker. Blocks
   of steps alternate between the two; the ratio is bare time / trainer time (throughput of the
   trainer relative to the bare loop; the issue's target is >= 0.95). Measured with one intra-op
   thread as the calling thread's CPU time (``time.thread_time``), which other jobs on a shared
   machine do not inflate; wall-clock ratios are printed too.

    python benchmarks/bench_trainer.py --data-root ../shared/data            # default sizes
    python benchmarks/bench_trainer.py --data-root ../shared/data --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from localclip import ClippedSGD
from localclip.comm import SimulatedWorld
from localclip.models import detach_hidden
from localclip.recipes import get_recipe
from localclip.train import Trainer
from localclip.algorithms import build


def trainer_overhead(config, blocks: int, block_steps: int) -> tuple[list[float], list[float]]:
    def worker():
        torch.manual_seed(0)
        trainer = Trainer(config, None, progress=False)
        workload = trainer.workload
        workload.start_epoch(0)
        batches = [b for b, _ in zip(workload.batches(), range(block_steps))]
        # The bare loop: its own model of the same architecture, plain ClippedSGD.
        model = type(trainer.model)(workload.ntokens, **config.workload.model_options)
        opt = ClippedSGD(model.parameters(), lr=config.local.lr, gamma=config.local.gamma)
        opt.measure_step_length = False  # as the trainer's steps here (none is sampled)
        hidden = model.init_hidden(config.workload.batch_size)
        bare_times, trainer_times, bare_wall, trainer_wall = [], [], [], []
        for _ in range(blocks):
            w0 = time.perf_counter()
            t0 = time.thread_time()
            for (x, y), _scale in batches:
                hidden = detach_hidden(hidden)
                out = model(x, hidden)
                hidden = out.hidden
                loss = F.cross_entropy(out.logits.reshape(-1, workload.ntokens), y.reshape(-1))
                opt.zero_grad()
                loss.backward()
                opt.step()
            bare_times.append(time.thread_time() - t0)
            bare_wall.append(time.perf_counter() - w0)
            w0 = time.perf_counter()
            t0 = time.thread_time()
            for batch, scale in batches:
                trainer.train_step(batch, scale)
            trainer_times.append(time.thread_time() - t0)
            trainer_wall.append(time.perf_counter() - w0)
        return bare_times, trainer_times, bare_wall, trainer_wall

    return SimulatedWorld(1).run(worker)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--blocks", type=int, default=21)
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.block_steps = 3, 10

    base = get_recipe("ptb-small").replace(data_root=args.data_root, eval_tokens=2000, log_interval=10**6, checkpoint_interval=10**6)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    single = build.resolved(base.replace(workers=1, algorithm="celgc", period=8))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    bare, trained, bare_wall, trained_wall = trainer_overhead(single, args.blocks, args.block_steps)
    torch.set_num_threads(threads)
    mb, mt = statistics.median(bare), statistics.median(trained)
    # Each trainer block against the bare block just before it: less sensitive to load drift.
    paired = statistics.median(b / t for b, t in zip(bare, trained))
    wall = statistics.median(b / t for b, t in zip(bare_wall, trained_wall))
    print("\n1. trainer overhead, ptb-small model, 1 worker, 1 thread, "
          f"{args.blocks} alternating blocks of {args.block_steps} steps (median CPU ms/step)")
    print(f"   bare loop      {1e3 * mb / args.block_steps:8.2f}")
    print(f"   Trainer        {1e3 * mt / args.block_steps:8.2f}")
    print(f"   throughput ratio trainer/bare = {mb / mt:.3f} (paired {paired:.3f}; wall-clock paired {wall:.3f})   (target >= 0.95)")

    print(json.dumps({"trainer_over_bare": mb / mt, "trainer_over_bare_paired": paired}))


if __name__ == "__main__":
    import sys

    from _record import run

    sys.exit(run("bench_trainer", main))
