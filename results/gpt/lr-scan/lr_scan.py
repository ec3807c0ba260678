"""The short step-size scan behind ptb-gpt-small's η and γ (docs/results.md).

One worker, ptb-gpt-small's model, batch 8 x 64 tokens, 100 clipped-SGD steps; every 20 steps:
mean loss, median and largest raw gradient norm, clip fraction so far.

    .venv/bin/python results/gpt/lr-scan/lr_scan.py LR GAMMA > results/gpt/lr-scan/lrLR-gammaGAMMA.log
"""
import os, sys

import torch
import torch.nn.functional as F
from localclip import data
from localclip.models import GPT
from localclip.optim import ClippedSGD
torch.set_num_threads(1)
corpus = data.load_corpus("ptb", os.environ.get("LOCALCLIP_DATA", "../shared/data"))
lr, gamma = float(sys.argv[1]), float(sys.argv[2])
torch.manual_seed(2020)
m = GPT(len(corpus.vocab), n_layer=2, n_head=4, n_embd=128, block_size=64, dropout=0.1)
opt = ClippedSGD(m.parameters(), lr=lr, gamma=gamma)
src = data.batchify(corpus.train, 8)
norms=[]; losses=[]
for step, i in enumerate(range(0, 64*100, 64)):
    x, y = data.get_batch(src, i, 64)
    loss = F.cross_entropy(m(x).logits.reshape(-1, len(corpus.vocab)), y.reshape(-1))
    opt.zero_grad(); loss.backward(); opt.step()
    norms.append(float(opt.last_grad_norm)); losses.append(loss.item())
    if (step+1) % 20 == 0:
        print(step+1, "loss %.3f" % (sum(losses[-20:])/20), "norm med %.3f max %.3f" % (sorted(norms[-20:])[10], max(norms[-20:])), "clip", float(opt.clip_fraction), flush=True)
