#!/usr/bin/env bash
# Runs the GPU test suite and the benchmarks on a CUDA machine (used on the H200 through the device tool).
# Usage: scripts/gpu_suite.sh [tests|bench|all] ; logs go to ${OUT:-/tmp/rlexact_gpu}.
# On one H200 (2026-11-29): tests ~4.5 min (104 tests), ops_bench ~1.5 min, rollout_throughput ~2.5 min.
# BENCHES="benchmarks/matmul_variants.py benchmarks/attention_configs.py" runs the tuning sweeps instead (~4 min).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlexact_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, lightning; print(torch.__version__, triton.__version__, transformers.__version__, lightning.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=900 ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/pytest_gpu.log" || rc=1
fi
if [[ $what == bench || $what == all ]]; then
  for b in ${BENCHES:-benchmarks/ops_bench.py benchmarks/rollout_throughput.py}; do
    [[ -f $b ]] && { python3 "$b" 2>&1 | tee "$OUT/$(basename "$b" .py).log" || rc=1; }
  done
  cp benchmarks/results/*.json "$OUT/" 2>/dev/null
fi
exit $rc
