"""Print the table of docs/results.md's ptb-gpt-small section from the run folders here."""

import math
import sys
from pathlib import Path

from localclip import jsonio

root = Path(__file__).parent / "ptb-gpt-small"
print("| run | epoch | val ppl | test ppl | rounds | bytes / worker | mean clip fraction | steps skipped (all workers) | wall-clock |")
print("|---|---|---|---|---|---|---|---|---|")
for name in sys.argv[1:] or ["naive", "celgc-I8", "local-sgd-I8"]:
    folder = root / name
    records = [jsonio.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    summary = jsonio.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
    clip = sum(r["clip/fraction"] for r in train) / len(train)
    skipped = train[-1].get("train/skipped_steps", 0)
    evals = [r for r in records if "val/ppl" in r and not r.get("final")]
    for r in evals:
        print(f"| {name} | {r['epoch']:.2f} | {r['val/ppl']:.1f} | | {r['comm/rounds']} | {r['comm/bytes'] / 1e9:.2f} GB | | | |")
    if summary:
        print(f"| {name} | {summary['epochs']:.2f} (final) | {summary['val/ppl']:.1f} | {summary['test/ppl']:.1f} | {summary['comm/rounds']} "
              f"| {summary['comm/bytes'] / 1e9:.2f} GB | {clip:.2f} | {skipped} | {summary['time/seconds'] / 60:.0f} min |")
    else:
        last = train[-1]
        loss = last["train/loss"]
        print(f"| {name} | stopped at {last['epoch']:.2f} (step {last['step']}) | — | — | {last['comm/rounds']} | {last['comm/bytes'] / 1e9:.2f} GB "
              f"| {clip:.2f} | {skipped} | train loss {'NaN' if math.isnan(loss) else f'{loss:.3f}'} |")
