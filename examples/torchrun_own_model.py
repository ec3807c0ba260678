"""Bring your own model: CELGC in a plain PyTorch training loop, launched with torchrun.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_own_model.py --steps 40

Copy this file and replace the model and the data. What localclip changes in a usual loop is one
line, the optimizer: ``localclip.CELGC`` takes clipped local steps on each worker's own batches
and averages the models every ``--period`` steps (no DDP wrapper: gradients are never averaged).
On GPUs torchrun + NCCL works the same; on CPUs the group uses gloo.

At the end the script checks what CELGC promises and exits non-zero if it does not hold: after
the final average every worker holds the same model, and the loss fell. ``--report PATH`` writes
this worker's numbers as JSON (``PATH`` gets ``.rankR`` appended), for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import localclip
from localclip.comm import distributed


class MyModel(nn.Module):
    """Any nn.Module will do; this one is a small residual MLP classifier."""

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4):
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.block = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU())
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.block(h))


def my_data(rank: int, world_size: int, batch_size: int) -> DataLoader:
    """Your data loader; each worker gets its own part of the data (here: every world_size-th
    example of one synthetic problem, the same on every worker)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=gen)
    teacher = torch.randn(16, 4, generator=gen)
    y = (x @ teacher + 0.5 * torch.randn(4096, 4, generator=gen)).argmax(1)
    part = slice(rank, None, world_size)
    return DataLoader(TensorDataset(x[part], y[part]), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(rank), drop_last=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--period", type=int, default=4, help="average the models every this many steps (I)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--gamma", type=float, default=0.5, help="clipping parameter: a step is at most this long")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--report", help="write this worker's results as JSON to REPORT.rankR")
    args = parser.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(f"{sys.argv[0]}: not started by torchrun (RANK/WORLD_SIZE unset); run:\n"
              f"  torchrun --standalone --nproc-per-node 2 {sys.argv[0]}", file=sys.stderr)
        return 2

    # Join torchrun's group (gloo on CPU, NCCL on GPU); a plain dist.init_process_group() works too.
    comm = distributed.init()
    try:
        torch.manual_seed(comm.rank)  # different inits on purpose: CELGC starts from rank 0's
        model = MyModel()
        opt = localclip.CELGC(model, lr=args.lr, gamma=args.gamma, period=args.period)
        loader = my_data(comm.rank, comm.world_size, args.batch_size)
        losses, step = [], 0
        while step < args.steps:
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()  # local clipped step; every `period` steps, the models are averaged
                losses.append(loss.item())
                step += 1
                if step == args.steps:
                    break
        opt.average()  # end of training: every worker holds the average

        # The checks: the same model everywhere (rank 0's copy, broadcast, must match bit for
        # bit) and a falling loss (mean of the last five steps against the first five).
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        reference = flat.clone()
        comm.broadcast([reference], src=0)
        identical = torch.equal(flat, reference)
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        result = {"rank": comm.rank, "identical": identical, "first_loss": first, "last_loss": last,
                  "rounds": opt.rounds, "clip_fraction": float(opt.clip_fraction), "checksum": float(flat.double().sum())}
        if args.report:
            with open(f"{args.report}.rank{comm.rank}", "w") as f:
                json.dump(result, f)
        if comm.rank == 0:
            print(f"{comm.world_size} workers, {args.steps} steps, {opt.rounds} rounds: loss {first:.3f} -> {last:.3f}, "
                  f"clip fraction {result['clip_fraction']:.2f}, models identical: {identical}")
        if not identical or not last < first:
            print(f"rank {comm.rank}: check failed: identical={identical}, loss {first:.3f} -> {last:.3f}", file=sys.stderr)
            return 1
        return 0
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    # In place of sys.exit: a gloo worker can abort in the interpreter's shutdown (see there).
    distributed.exit_process(main())
