"""A Hugging Face GPT-2 trained with local AdamW steps and periodic averaging, under torchrun.

    pip install 'localclip[hf]'
    torchrun --standalone --nproc-per-node 2 examples/hf_gpt2.py --steps 30

The model is ``transformers.GPT2LMHeadModel`` built from a tiny ``GPT2Config`` (random init,
nothing downloaded); the data is a synthetic next-token task, so the script runs anywhere. The
training loop is the usual one, ``torch.optim.AdamW`` with ``clip_grad_norm_`` as practitioners
write it; localclip adds one object, a ``PeriodicAverager``, and one call after each step:
together that is CELGC with an AdamW inner step (DiLoCo-style local training). Use
``--optimizer-state average`` to average Adam's moments at each round too, or ``reset``.

At the end the script checks that every worker holds the same model and that the loss fell, and
exits non-zero otherwise; ``--report PATH`` writes this worker's numbers to ``PATH.rankR``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import localclip
from localclip.comm import distributed


def synthetic_batches(rank: int, batch_size: int, seq_len: int, vocab: int, steps: int):
    """Sequences that count up by a stride (token t+1 = token t + stride mod vocab): learnable
    in a few dozen steps. Each worker draws its own batches."""
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
        yield (start + stride * torch.arange(seq_len)) % vocab


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--period", type=int, default=4, help="average the models every this many steps (I)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--optimizer-state", choices=["local", "average", "reset"], default="local")
    parser.add_argument("--report", help="write this worker's results as JSON to REPORT.rankR")
    args = parser.parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(f"{sys.argv[0]}: not started by torchrun (RANK/WORLD_SIZE unset); run:\n"
              f"  torchrun --standalone --nproc-per-node 2 {sys.argv[0]}", file=sys.stderr)
        return 2
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print(f"{sys.argv[0]}: needs Hugging Face transformers: pip install 'localclip[hf]'", file=sys.stderr)
        return 2

    transformers.logging.set_verbosity_error()  # a tiny config's notes are not the user's problem
    comm = distributed.init()
    try:
        torch.manual_seed(0)
        vocab = 64
        config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                            bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)  # random init: no download
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        # Every worker starts from rank 0's weights; every `period` steps the models (and, if
        # asked, Adam's moments) are averaged in one all-reduce.
        averager = localclip.PeriodicAverager(model, args.period, optimizer=opt, optimizer_state=args.optimizer_state)
        losses = []
        for tokens in synthetic_batches(comm.rank, batch_size=16, seq_len=24, vocab=vocab, steps=args.steps):
            opt.zero_grad()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            averager.step()
            losses.append(loss.item())
        averager.average()

        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        reference = flat.clone()
        comm.broadcast([reference], src=0)
        identical = torch.equal(flat, reference)
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        result = {"rank": comm.rank, "identical": identical, "first_loss": first, "last_loss": last,
                  "rounds": averager.rounds, "checksum": float(flat.double().sum())}
        if args.report:
            with open(f"{args.report}.rank{comm.rank}", "w") as f:
                json.dump(result, f)
        if comm.rank == 0:
            print(f"GPT-2 ({sum(p.numel() for p in model.parameters())} parameters), {comm.world_size} workers, {args.steps} steps, "
                  f"{averager.rounds} rounds: loss {first:.3f} -> {last:.3f}, models identical: {identical}")
        if not identical or not last < first:
            print(f"rank {comm.rank}: check failed: identical={identical}, loss {first:.3f} -> {last:.3f}", file=sys.stderr)
            return 1
        return 0
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    # In place of sys.exit: a gloo worker can abort in the interpreter's shutdown (see there).
    distributed.exit_process(main())
