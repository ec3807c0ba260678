"""The one-worker step-size scan behind ptb-gpt-small's η = 3 and γ = 0.5 (docs/results.md, appendix G).

One worker, ptb-gpt-small's model (2 layers, 128 wide, 4 heads, context 64, dropout 0.1), batch
8 x 64 tokens taken in order from the start of PTB's training stream, 100 clipped-SGD steps from
``torch.manual_seed(2020)``; every 20 steps it prints the mean loss, the median and largest raw
gradient norm and the clip fraction so far. The published scan is four points, one per call:

    PYTHONPATH=src python benchmarks/gpt_lr_scan.py 1 inf      # unclipped SGD: trains slowly
    PYTHONPATH=src python benchmarks/gpt_lr_scan.py 3 inf      # blows up within 20 steps
    PYTHONPATH=src python benchmarks/gpt_lr_scan.py 10 inf     # blows up within 20 steps
    PYTHONPATH=src python benchmarks/gpt_lr_scan.py 3 0.5      # trains: the recipe's step

It is a script, not a sweep of :mod:`localclip_lab.plans`, because its loop is not the
trainer's: it feeds the model one fixed window order and draws the initial weights and dropout
from the global torch seed. The trainer's one-worker run of the same settings (``single``,
b = 8, bptt 64, 100 steps, seed 2020) draws its data and randomness from the worker's own
generator, and there unclipped SGD at η = 1 blows up as well, so its η = 1 point would not give
this scan's answer. The corpora are read from ``$LOCALCLIP_DATA`` (default ``../shared/data``).
"""

import os
import platform
import subprocess
import sys

import torch
import torch.nn.functional as F

from localclip import data
from localclip.models import GPT
from localclip.optim import ClippedSGD


def main(lr: float, gamma: float) -> None:
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# torch {torch.__version__}, 1 thread, {platform.processor() or platform.machine()}, "
          f"load {os.getloadavg()[0]:.2f}, commit {commit or '?'}; lr {lr:g} gamma {gamma:g}", flush=True)
    corpus = data.load_corpus("ptb", os.environ.get("LOCALCLIP_DATA", "../shared/data"))
    torch.manual_seed(2020)
    model = GPT(len(corpus.vocab), n_layer=2, n_head=4, n_embd=128, block_size=64, dropout=0.1)
    opt = ClippedSGD(model.parameters(), lr=lr, gamma=gamma)
    source = data.batchify(corpus.train, 8)
    norms, losses = [], []
    for step, i in enumerate(range(0, 64 * 100, 64)):
        x, y = data.get_batch(source, i, 64)
        loss = F.cross_entropy(model(x).logits.reshape(-1, len(corpus.vocab)), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        norms.append(float(opt.last_grad_norm))
        losses.append(loss.item())
        if (step + 1) % 20 == 0:
            print(step + 1, "loss %.3f" % (sum(losses[-20:]) / 20), "norm med %.3f max %.3f" % (sorted(norms[-20:])[10], max(norms[-20:])),
                  "clip", float(opt.clip_fraction), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]))
