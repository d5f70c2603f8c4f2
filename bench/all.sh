#!/usr/bin/env bash
# Every benchmark in one go, each table also saved to OUTDIR/<name>.txt. A failing benchmark
# does not stop the others. Qwen3-0.6B's config.json comes from $BENCH_CONFIG (default
# ../shared/qwen3-0.6b-base), MMLU and GSM8K from $STATES_DATA (default ../shared/data).
#   bash bench/all.sh [OUTDIR] [extra flags for every benchmark, e.g. --dtypes bf16]
set -o pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}; shift || true
mkdir -p "$out"
config=${BENCH_CONFIG:-../shared/qwen3-0.6b-base}
export PYTHONUNBUFFERED=1
status=0
for name in sample group train_step head mmlu layout; do
    echo "== bench/$name.py"
    python3 bench/$name.py --config "$config" "$@" 2>&1 | tee "$out/$name.txt" || status=1
done
# a training step at GSM8K's own lengths: short sequences sharing rows (8 sequences, so that
# peft's padded step fits 24 GB on the CPU)
echo "== bench/train_step.py --gsm8k-batch 8"
python3 bench/train_step.py --config "$config" --gsm8k-batch 8 --steps 3 "$@" 2>&1 | tee "$out/train_step_gsm8k.txt" || status=1
exit $status
