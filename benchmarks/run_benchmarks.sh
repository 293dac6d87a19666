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
  if [ -x .venv-engine/bin/python ]; then  # against the live engine (python -m fx_precision.tools.engine_env .venv-engine)
    python benchmarks/onpolicy.py --engine-python .venv-engine/bin/python --steps 10 --engine-launch eager \
      --json benchmarks/results/onpolicy-cpu.json --plot benchmarks/results/onpolicy-cpu.png
    python benchmarks/engine_contract.py --engine-python .venv-engine/bin/python \
      --archs qwen3,llama,qwen2,mistral,gemma,granite,phi3 --full qwen3,llama --threads 1,2 --split-kv off \
      --shapes qwen3-0.6b,llama-3.2-1b,qwen2.5-0.5b --steps 0 --json benchmarks/results/engine-contract-cpu.json
  fi
fi
fx-precision bench --device "$device" --json "benchmarks/results/${device}-qwen3_5-4b-slice.json"
