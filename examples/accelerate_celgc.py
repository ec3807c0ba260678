"""CELGC inside Hugging Face Accelerate (see localclip.integrations.accelerate).

    pip install 'localclip[accelerate]'
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_celgc.py     # or:
    torchrun --standalone --nproc-per-node 2 examples/accelerate_celgc.py

``--multi_gpu`` is Accelerate's multi-process launcher: on a machine without GPUs it starts the
two processes on the CPU (gloo; ``DistributedType.MULTI_CPU``). ``accelerate launch --cpu``
starts a single process whatever ``--num_processes`` says.

The loop is Accelerate's usual one; ``localclip.integrations.accelerate.prepare`` replaces
``accelerator.prepare`` for the model and optimizer. At the end the script checks that every
process holds the same model and that the loss fell (exit status 1 otherwise); ``--report PATH``
writes this process's numbers to ``PATH.rankR``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--report")
    args = parser.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(f"{sys.argv[0]}: not started by torchrun or accelerate launch (RANK/WORLD_SIZE unset); run:\n"
              f"  torchrun --standalone --nproc-per-node 2 {sys.argv[0]}", file=sys.stderr)
        return 2
    try:
        from accelerate import Accelerator
    except ImportError:
        print(f"{sys.argv[0]}: needs Hugging Face Accelerate: pip install 'localclip[accelerate]'", file=sys.stderr)
        return 2
    from localclip.integrations.accelerate import prepare
    from localclip.optim import ClippedSGD

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=gen)
    y = (x @ torch.randn(16, 4, generator=gen)).argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))

    torch.manual_seed(accelerator.process_index)  # different inits: CELGC starts from rank 0's
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    optimizer = ClippedSGD(model.parameters(), lr=0.5, gamma=0.5)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader, period=args.period)

    losses = []
    for _ in range(args.epochs):
        for xb, yb in loader:  # Accelerate shards the loader: each process sees its own batches
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(loss.item())
    optimizer.average()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = accelerator.gather(flat.unsqueeze(0))
    identical = bool((everyone == everyone[0]).all())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    result = {"rank": accelerator.process_index, "identical": identical, "first_loss": first, "last_loss": last,
              "steps": len(losses), "rounds": optimizer.rounds, "distributed_type": str(accelerator.distributed_type)}
    if args.report:
        with open(f"{args.report}.rank{accelerator.process_index}", "w") as f:
            json.dump(result, f)
    if accelerator.is_main_process:
        print(f"Accelerate {accelerator.distributed_type}, {accelerator.num_processes} processes, {len(losses)} steps, "
              f"{optimizer.rounds} rounds: loss {first:.3f} -> {last:.3f}, models identical: {identical}")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group
    return 0 if identical and last < first else 1


if __name__ == "__main__":
    from localclip.comm import distributed

    # In place of sys.exit: a gloo worker can abort in the interpreter's shutdown (see there).
    distributed.exit_process(main())
