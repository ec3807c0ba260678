#!/usr/bin/env bash
# The GPU check, on a machine with CUDA, in under 10 minutes:
#   1. the tests marked `gpu` (model, batches, optimizer state and averaging buffers on the GPU,
#      device-free checkpoints, a CUDA run resumed on the CPU; NCCL with two GPUs or more);
#   2. a short ptb-awd run (the paper's AWD-LSTM, N=8, b=3) of simulated workers sharing one GPU;
#   3. the optimizer-step benchmark (benchmarks/bench_optimizer.py) on CUDA.
# It prints what it measured; put the numbers in docs/benchmarks.md.
#
#   benchmarks/gpu_check.sh            # PTB from $LOCALCLIP_DATA, else ../shared/data
#   PYTHON=.venv/bin/python STEPS=60 benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DATA=${LOCALCLIP_DATA:-$(cd .. && pwd)/shared/data}
STEPS=${STEPS:-40}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/localclip-gpu-check.XXXXXX")
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'PY'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check: CUDA is not available on this machine")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
PY

echo "== 1. tests marked gpu"
start=$(date +%s)
timeout 240 "$PY" -m pytest -q -m gpu tests/devices/test_gpu.py
echo "   took $(( $(date +%s) - start )) s"

echo "== 2. ptb-awd, N=8 simulated workers on one GPU, b=3, ${STEPS} steps"
start=$(date +%s)
timeout 240 "$PY" -m localclip.cli train ptb-awd --device cuda --runtime simulate --max-steps "$STEPS" \
    --data-root "$DATA" --out "$OUT/ptb-awd" --no-progress --set eval_tokens=20000 --set log_interval=10
"$PY" - "$OUT/ptb-awd" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
s = json.loads((run / "summary.json").read_text())
train = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in l]
print(f"   steps {s['steps']}, {s['time/seconds']:.1f} s in all, compute {s['time/compute']:.1f} s, comm {s['time/comm']:.2f} s "
      f"({s['steps'] / max(s['time/compute'], 1e-9):.2f} steps/s of compute per worker), rounds {s['comm/rounds']}, "
      f"{s['comm/bytes'] / 2**20:.0f} MiB per worker")
print("   train loss " + ", ".join(f"{r['step']}: {r['train/loss']:.3f}" for r in train) + f"; val ppl (first 20k tokens) {s['val/ppl']:.1f}")
PY
echo "   took $(( $(date +%s) - start )) s"

echo "== 3. one optimizer step on the AWD-LSTM parameters, CUDA"
timeout 180 "$PY" benchmarks/bench_optimizer.py --device cuda --repeats 20
rm -rf "$OUT"
