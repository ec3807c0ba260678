#!/usr/bin/env bash
# The ptb-gpt-small evidence runs of docs/results.md: CELGC I=8, naive parallel clipping and local
# SGD (γ = ∞), all at the recipe's η = 3, 4 simulated workers, 2 epochs, one intra-op thread each
# (they ran side by side on a shared 2-core machine).
set -u
cd "$(dirname "$0")/../.."
ROOT=results/gpt/ptb-gpt-small
DATA=${LOCALCLIP_DATA:-../shared/data}
run() { name=$1; shift; .venv/bin/localclip train ptb-gpt-small --epochs 2 --data-root "$DATA" --no-progress --set threads=1 --out "$ROOT/$name" "$@" > "$ROOT/$name.log" 2>&1; }
mkdir -p "$ROOT"
run celgc-I8 --algorithm celgc --period 8 &
run naive --algorithm naive &
run local-sgd-I8 --algorithm local-sgd --period 8 &
wait
