#!/usr/bin/env bash
# Runs the GPU test suite and the benchmarks on a CUDA machine (used on the H200s through the device tool).
#
#   RLEXACT_COMMIT=<sha> scripts/gpu_suite.sh tests          # every test marked gpu, one log
#   RLEXACT_COMMIT=<sha> scripts/gpu_suite.sh tests "0 2"    # only these of the four test groups (below)
#   RLEXACT_COMMIT=<sha> scripts/gpu_suite.sh bench [SET]    # SET: train | rollout | decode | sweeps | all (default all)
#   RLEXACT_COMMIT=<sha> scripts/gpu_suite.sh bench decode "0 1"   # only these of the set's commands (0-based, in order)
#   RLEXACT_COMMIT=<sha> scripts/gpu_suite.sh all
#
# <sha>: the commit as the local checkout names it, written out literally; a copied tree may carry a stale .git (the
# device tool's copy holds the session start's), where $(git rev-parse HEAD) names the wrong commit.
#
# On a two-GPU machine the halves run side by side, e.g.
#   CUDA_VISIBLE_DEVICES=0 scripts/gpu_suite.sh bench train & CUDA_VISIBLE_DEVICES=1 scripts/gpu_suite.sh bench rollout
#
# tests: $OUT/gpu_tests_<card>.log (<card>: h200, h100 or gpu, from nvidia-smi's name), one complete log whose header
#   names the commit, source digest, GPU, driver, versions and the pytest command; every test file that uses the gpu
#   marker runs (the four groups' pytest processes in parallel,
#   the attention group over four pytest-xdist workers where xdist is installed: Triton compilation is CPU-bound and
#   the GPU has room for all of them). Each group also writes $OUT/gpu_tests_groupN.log as
#   it runs, so a run cut short by the device call's limit still returns what finished. With cold Triton caches the
#   four groups can exceed one device call (600 s): run them as two calls, e.g. "0 1" and then "2 3".
# bench: each benchmark writes its own JSON (with its own header: commit, command, GPU, versions, date) and log into
#   $RESULTS (default /tmp/rlexact_results), packed into $OUT/bench_<SET>.tgz at the end (the device returns at most
#   eight files). Unpack into benchmarks/results/ to commit them. A set longer than one device call (decode: about
#   eleven minutes, on cold Triton caches more) runs as two calls with command indices, e.g. "0 1 4" and then "3 2".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlexact_gpu}
RESULTS=${RESULTS:-/tmp/rlexact_results}
mkdir -p "$OUT" "$RESULTS"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
what=${1:-all}
set_name=${2:-all}
picks=${3:-}
groups="0 1 2 3"
[[ $what == tests ]] && groups=${2:-0 1 2 3}
# $RLEXACT_COMMIT, else HEAD with "+dirty" when tracked files differ from it (a copied tree may carry a stale .git)
# (a malformed $RLEXACT_COMMIT stops the run here, before any device time is spent)
commit=$(python3 -c 'from rlexact.envinfo import git_commit; print(git_commit("."))') || exit 2
export RLEXACT_COMMIT=$commit
rc=0

gpu_test_files() {
  grep -l -E "pytest\.mark\.gpu|mark\.gpu" tests/test_*.py | sort
}

case $(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1) in
  *H200*) card=h200 ;;
  *H100*) card=h100 ;;
  *) card=gpu ;;
esac

if [[ $what == tests || $what == all ]]; then
  log=$OUT/gpu_tests_$card.log
  cmd="python3 -m pytest -m gpu -p no:cacheprovider --timeout=900 -q -rfE --durations=5"
  # four groups (the longest measured files apart): the kernel tests, the attention tests, the rollout/module tests,
  # the MoE and model tests
  mapfile -t files < <(gpu_test_files)
  g0="" g1="" g2="" g3=""
  for f in "${files[@]}"; do
    case $f in
      tests/test_triton_kernels.py | tests/test_segment_sum.py | tests/test_repro_gpu.py | tests/test_gluon_matmul.py) g0+=" $f" ;;
      tests/test_triton_attention.py) g1+=" $f" ;;
      tests/test_moe.py | tests/test_gpu_models.py) g3+=" $f" ;;
      *) g2+=" $f" ;;
    esac
  done
  # the attention file is the longest: with pytest-xdist installed its tests spread over four workers
  python3 -c "import xdist" 2> /dev/null && g1=" -n 4 --dist load$g1"
  parts=("$g0" "$g1" "$g2" "$g3")
  {
    echo "# rlexact GPU test suite, one run at commit $commit"
    echo "# source digest: $(python3 -c 'from rlexact.envinfo import source_digest; print(source_digest("."))')"
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
    echo "# versions (torch triton transformers lightning): $(python3 -c 'import torch, triton, transformers, lightning; print(torch.__version__, triton.__version__, transformers.__version__, lightning.__version__)')"
    echo "# test files using the gpu marker: ${files[*]}"
    echo "# groups run: $groups"
  } > "$log"
  for i in $groups; do
    [[ $i == [0123] ]] || { echo "gpu_suite.sh: unknown test group '$i' (0 | 1 | 2 | 3)" >&2; exit 2; }
    ( $cmd ${parts[$i]} > "$OUT/gpu_tests_group$i.log" 2>&1; echo "# exit code $?" >> "$OUT/gpu_tests_group$i.log" ) &
  done
  wait
  for i in $groups; do
    { echo "## group $i: $cmd${parts[$i]}"; cat "$OUT/gpu_tests_group$i.log"; } >> "$log"
  done
  grep -q "# exit code [^0]" "$log" && rc=1
  grep -E "passed|failed|exit code" "$log"
fi

if [[ $what == bench || $what == all ]]; then
  R=$RESULTS
  train=(
    "benchmarks/train_step.py --reps 3 --profile --out $R/train_h200.json"
    "benchmarks/ops_bench.py --out $R/ops_h200.json"
    "benchmarks/matmul_launch.py --out $R/matmul_launch_h200.json"
  )
  rt=benchmarks/rollout_throughput.py
  long="--prompt-len 8192 --new-tokens 128 --batches 4 32 --engines exact native --profile 32"  # issue 10's long-context case, with its kernels per decode step
  rollout=(
    "$rt --profile 32 --out $R/rollout_h200.json"
    "$rt $long --out $R/rollout_long_h200.json"
    "$rt --grpo --out $R/rollout_grpo_h200.json"
    "benchmarks/moe_bench.py --out $R/moe_h200.json"
  )
  # issue 10's decode and prefill files, named after the card that ran them, and the card's measured read rate that
  # their rooflines are judged against
  decode=(
    "$rt --profile 32 --out $R/rollout_$card.json"
    "$rt $long --out $R/rollout_long_$card.json"
    "benchmarks/ops_bench.py --sections attention --out $R/ops_attention_$card.json"
    "$rt --grpo --out $R/rollout_grpo_$card.json"
    "benchmarks/hbm_read_probe.py --out $R/hbm_read_probe_$card.json"
  )
  sweeps=(
    "benchmarks/attention_configs.py --out $R/attention_configs_h200.json"
    "benchmarks/matmul_variants.py --out $R/matmul_variants_h200.json"
    "benchmarks/matmul_variants.py --ms 256 --out $R/matmul_variants_m256_h200.json"
  )
  case $set_name in
    train) cmds=("${train[@]}") ;;
    rollout) cmds=("${rollout[@]}") ;;
    sweeps) cmds=("${sweeps[@]}") ;;
    decode) cmds=("${decode[@]}") ;;
    all) cmds=("${train[@]}" "${rollout[@]}" "${sweeps[@]}") ;;
    *) echo "gpu_suite.sh: unknown benchmark set '$set_name' (train | rollout | decode | sweeps | all)" >&2; exit 2 ;;
  esac
  for i in "${!cmds[@]}"; do
    c=${cmds[$i]}
    if [[ -n $picks && " $picks " != *" $i "* ]]; then continue; fi
    name=$(basename "${c##*--out }" .json)
    t0=$(date +%s)
    # shellcheck disable=SC2086
    python3 $c > "$R/$name.log" 2>&1
    status=$?
    echo "$name: exit $status in $(($(date +%s) - t0)) s"
    ((status)) && { rc=1; tail -n 20 "$R/$name.log"; }
  done
  tar czf "$OUT/bench_${set_name}.tgz" -C "$R" .
fi
exit $rc
