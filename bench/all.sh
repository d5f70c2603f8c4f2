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
dtypes=fp32,bf16  # the benchmarks' default, or the last --dtypes given
previous=
for arg in "$@"; do
    [[ $previous == --dtypes ]] && dtypes=$arg
    previous=$arg
done
status=0
for name in sample group train_step head mmlu layout; do
    echo "== bench/$name.py"
    if [[ $name == group ]]; then
        # transformers' side of group.py holds about 20 GB at its peak on the CPU (its prefill of
        # 64 rows), so each dtype runs in a process of its own, nothing of the last one resident
        : > "$out/$name.txt"
        for dtype in ${dtypes//,/ }; do
            python3 bench/$name.py --config "$config" "$@" --dtypes "$dtype" 2>&1 | tee -a "$out/$name.txt" || status=1
        done
    else
        python3 bench/$name.py --config "$config" "$@" 2>&1 | tee "$out/$name.txt" || status=1
    fi
done
# a training step at GSM8K's own lengths: short sequences sharing rows (8 sequences, so that
# peft's padded step fits 24 GB on the CPU)
echo "== bench/train_step.py --gsm8k-batch 8"
python3 bench/train_step.py --config "$config" --gsm8k-batch 8 --steps 3 "$@" 2>&1 | tee "$out/train_step_gsm8k.txt" || status=1
exit $status
