#!/usr/bin/env bash
# Every benchmark in one go, each table also saved to OUTDIR/<name>.txt; a failing one does
# not stop the others. Extra flags go to every benchmark, e.g. --dtypes bf16.
#   bash bench/all.sh [OUTDIR] [flags]
set -o pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}; shift || true
mkdir -p "$out"
status=0
for name in sample group train_step; do
    echo "== bench/$name.py"
    python3 bench/$name.py "$@" 2>&1 | tee "$out/$name.txt" || status=1
done
exit $status
