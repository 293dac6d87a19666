#!/usr/bin/env bash
# Reproduce the committed benchmark results (run from the repository root, after the quick start).
#   CPU:  bash benchmarks/run_benchmarks.sh
#   GPU:  DEVICE=cuda bash benchmarks/run_benchmarks.sh
set -euo pipefail
device="${DEVICE:-cpu}"
mkdir -p benchmarks/results
if [ "$device" = cpu ]; then
  fx-precision bench --quick --json benchmarks/results/cpu-quick-qwen3_5-tiny.json
  fx-precision sweep --json benchmarks/results/sweep-cpu.json
  python benchmarks/plan_scaling.py --json benchmarks/results/plan-scaling-cpu.json
fi
fx-precision bench --device "$device" --json "benchmarks/results/${device}-qwen3_5-4b-slice.json"
