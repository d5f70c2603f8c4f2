#!/usr/bin/env bash
# Every benchmark in one go, each table also saved to OUTDIR/<name>.txt. A failing benchmark
# does not stop the others. Qwen3-0.6B's config.json comes from $BENCH_CONFIG (default
# ../shared/qwen3-0.6b-base), MMLU from $STATES_DATA (default ../shared/data).
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
exit $status
