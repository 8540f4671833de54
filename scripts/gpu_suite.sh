#!/usr/bin/env bash
# Runs the GPU test suite and the benchmarks on a CUDA machine (used on the H200 through the device tool).
# Usage: RLEXACT_COMMIT=<sha> scripts/gpu_suite.sh [tests|bench|all]
# Writes one complete test log, $OUT/gpu_tests_h200.log, whose header names the commit, GPU, driver and library
# versions and the exact pytest command; benchmark JSONs (each with its own header) are copied to $OUT.
# GPU_GROUPS overrides the test groups (|-separated); BENCHES the benchmark scripts (e.g. the tuning sweeps
# "benchmarks/matmul_variants.py benchmarks/attention_configs.py").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlexact_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
what=${1:-all}
commit=${RLEXACT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export RLEXACT_COMMIT=$commit
rc=0
if [[ $what == tests || $what == all ]]; then
  # three pytest processes in parallel (Triton compilation is CPU-bound; the GPU has room for all three), one log
  log=$OUT/gpu_tests_h200.log
  groups=${GPU_GROUPS:-"tests/test_triton_kernels.py|tests/test_triton_attention.py tests/test_moe.py tests/test_segment_sum.py|tests/test_rollout_gpu.py tests/test_gpu_models.py tests/test_no_fallback.py tests/test_sampled_logprobs.py tests/test_module.py"}
  cmd="python3 -m pytest -m gpu -p no:cacheprovider --timeout=900 -q -rfE --durations=5"
  {
    echo "# rlexact GPU test suite, one run at commit $commit"
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
    echo "# versions (torch triton transformers lightning): $(python3 -c 'import torch, triton, transformers, lightning; print(torch.__version__, triton.__version__, transformers.__version__, lightning.__version__)')"
  } > "$log"
  IFS='|' read -ra parts <<< "$groups"
  i=0
  for g in "${parts[@]}"; do
    ( $cmd $g > "$OUT/group$i.log" 2>&1; echo "# exit code $?" >> "$OUT/group$i.log" ) &
    i=$((i + 1))
  done
  wait
  for ((j = 0; j < i; j++)); do
    { echo "## group $j: $cmd ${parts[$j]}"; cat "$OUT/group$j.log"; } >> "$log"
    rm "$OUT/group$j.log"
  done
  grep -q "# exit code [^0]" "$log" && rc=1
  grep -E "passed|failed|exit code" "$log"
fi
if [[ $what == bench || $what == all ]]; then
  for b in ${BENCHES:-benchmarks/ops_bench.py benchmarks/rollout_throughput.py}; do
    [[ -f $b ]] && { python3 "$b" > "$OUT/$(basename "$b" .py).log" 2>&1 || rc=1; tail -n 3 "$OUT/$(basename "$b" .py).log"; }
  done
  cp benchmarks/results/*.json "$OUT/" 2>/dev/null
fi
exit $rc
