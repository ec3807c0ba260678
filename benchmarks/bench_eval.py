"""The final evaluation of an LSTM language model at other batch sizes and window lengths, side by side.

ptb-small evaluates the test split at batch 2 (the reference's): two contiguous streams of about
41,000 tokens each, read window by window with the recurrent state carried across windows. The
workers split a batch's columns, so at batch 2 only two of them work and each one walks 41,000
time steps in sequence. This script measures, on one model, what else would cost less:

* the same batch with longer windows (``eval_bptt``): with the state carried and no gradient,
  the loss of a stream does not depend on where it is cut into windows, so this is the same
  quantity, equal up to float rounding;
* larger batches (``test_batch_size``): more, shorter streams, each starting from a zero
  state; another quantity, since a stream's first tokens are predicted without context.

Each setting evaluates its columns one worker's share at a time in this process, with one
intra-op thread, and reports the CPU time of the busiest worker (the wall time of a final
evaluation when each worker has a core) and the perplexity, with both ratios to batch 2.

    PYTHONPATH=src python benchmarks/bench_eval.py --checkpoint RUN/checkpoints/step-S/rank-0.pt
    PYTHONPATH=src python benchmarks/bench_eval.py --tokens 8000      # a quick look on a prefix
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import run  # noqa: E402

from localclip import data, rng  # noqa: E402
from localclip.models import build_model  # noqa: E402
from localclip.recipes import get_recipe  # noqa: E402

# (batch, window) pairs; the first is ptb-small's test evaluation, the baseline of the ratios.
SETTINGS = [(2, 35), (2, 350), (2, 3500), (4, 35), (10, 35), (20, 35)]


@torch.no_grad()
def evaluate(model, source: torch.Tensor, batch: int, window: int, workers: int) -> tuple[float, float]:
    """(loss, CPU seconds of the busiest worker) of ``source`` at ``batch`` columns and
    ``window`` tokens per forward, the columns split over ``workers`` as the trainer splits them."""
    columns = data.batchify(source, batch)
    loss_sum, count, busiest = 0.0, 0, 0.0
    for rank in range(workers):
        mine = columns[:, rank::workers]
        if mine.size(1) == 0:
            continue
        start = time.thread_time()
        hidden = model.init_hidden(mine.size(1))
        for i in range(0, mine.size(0) - 1, window):
            x, y = data.get_batch(mine, i, window)
            out = model(x, hidden)
            hidden = out.hidden
            loss_sum += F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), y.reshape(-1), reduction="sum").double().item()
            count += y.numel()
        busiest = max(busiest, time.thread_time() - start)
    return loss_sum / count, busiest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="ptb-small")
    parser.add_argument("--checkpoint", help="a rank's checkpoint file whose model to evaluate (default: the recipe's initial model)")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=None, help="evaluate only the split's first N tokens")
    parser.add_argument("--split", default="test")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = get_recipe(args.recipe).replace(data_root=args.data_root)
    corpus = data.load_corpus(config.workload.dataset, config.workload.data_root, warn=False)
    with rng.seeded(config.run.seed):
        model = build_model(config.workload.model, ntoken=len(corpus.vocab), **config.workload.model_options)
    if args.checkpoint:
        model.load_state_dict(torch.load(args.checkpoint, map_location="cpu", weights_only=True)["model"])
    model.eval()
    source = corpus.split(args.split)
    if args.tokens:
        source = source[: args.tokens]
    print(f"bench_eval: {args.recipe} model {'from ' + args.checkpoint if args.checkpoint else 'at its initialisation'}, "
          f"{args.split} split, {source.numel()} tokens, {args.workers} workers, 1 intra-op thread")
    print(f"{'batch':>6}{'window':>8}{'busiest worker s':>18}{'ppl':>12}{'time ratio':>12}{'ppl vs batch 2':>16}")
    base = None
    for batch, window in SETTINGS:
        loss, seconds = evaluate(model, source, batch, window, args.workers)
        base = base or (loss, seconds)
        print(f"{batch:>6}{window:>8}{seconds:>18.2f}{math.exp(loss):>12.4f}{seconds / base[1]:>12.3f}{math.exp(loss - base[0]) - 1:>+16.2e}")
    print("time ratio: the busiest worker's CPU time over batch 2's; ppl vs batch 2: the perplexity's relative difference from batch 2's")
    return 0


if __name__ == "__main__":
    sys.exit(run("bench_eval", main))
