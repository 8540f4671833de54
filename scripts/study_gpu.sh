#!/usr/bin/env bash
# The mismatch study on one GPU in one call: SFT of the start model, every experiment, the report.
#
#   RLEXACT_COMMIT=<sha> bash scripts/study_gpu.sh
#
# Steps (wall times go to the log):
#   1. python -m rlexact.demo.sft on $SFT_DEVICE (default cuda) with $SFT_ARGS -> $SFT_OUT (the start checkpoint);
#   2. python -m rlexact.study $STUDY_EXPERIMENTS --config $STUDY_CONFIG, stopped after $STUDY_TIMEOUT seconds or
#      when steps 1-2 have taken $STUDY_BUDGET seconds, whichever comes first; the harness rewrites its JSON after
#      every finished run, so a study cut short keeps the runs it finished ("complete": false, "missing_runs");
#   3. when the study did not finish, python -m rlexact.study report (tables, and plots with matplotlib) from the JSON.
# Always, even after a failure or a timeout, $OUT receives (at most 4 files):
#   study_h200.json        the result file (also left at $STUDY_JSON, default benchmarks/results/study_h200.json)
#   study_gpu.log          everything printed, with the wall time of each step
#   study_gpu_summary.txt  the SFT's held-out evaluation, which experiments are complete, the report's tables
#   study_h200_runs.tgz    TensorBoard event files and result.json of every run, the report's tables and plots,
#                          the SFT's sft.json and the GPU-utilization trace (no checkpoints; kept under 15 MB)
#
# Environment (defaults are the H200 run of configs/study/h200.yaml):
#   OUT=/tmp/rlexact_study  STUDY_CONFIG=configs/study/h200.yaml  STUDY_TIMEOUT=480  STUDY_BUDGET=480
#   STUDY_EXPERIMENTS=all  STUDY_ARGS=""  (extra arguments of python -m rlexact.study, e.g. "--device cpu")
#   STUDY_RUNS=runs/study_h200  STUDY_JSON=benchmarks/results/study_h200.json  STUDY_DOCS=docs/study/h200
#   SFT_OUT=runs/study_ckpt_h200  SFT_DEVICE=cuda  SFT_TIMEOUT=200  SFT_ARGS="<the h200 start model, see below>"
# CPU check of the whole chain (tiny SFT, the one-step smoke study; about a minute):
#   OUT=/tmp/study_out STUDY_CONFIG=configs/study/smoke.yaml STUDY_ARGS="--device cpu" SFT_DEVICE=cpu \
#   SFT_ARGS="--steps 5 --batch-size 8 --hidden-size 32 --num-layers 1 --num-heads 2 --num-kv-heads 1 --head-dim 16 \
#   --intermediate-size 48 --eval-size 8" STUDY_RUNS=/tmp/study_runs STUDY_JSON=/tmp/study.json \
#   STUDY_DOCS=/tmp/study_docs SFT_OUT=/tmp/study_ckpt bash scripts/study_gpu.sh
set -uo pipefail
set -f # no globbing: SFT_ARGS and STUDY_ARGS are split into words as they are ("--ops + - *")
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlexact_study}
PYTHON=${PYTHON:-python3}
STUDY_CONFIG=${STUDY_CONFIG:-configs/study/h200.yaml}
STUDY_TIMEOUT=${STUDY_TIMEOUT:-480}
STUDY_BUDGET=${STUDY_BUDGET:-480}
STUDY_EXPERIMENTS=${STUDY_EXPERIMENTS:-all}
STUDY_ARGS=${STUDY_ARGS:-}
STUDY_RUNS=${STUDY_RUNS:-runs/study_h200}
STUDY_JSON=${STUDY_JSON:-benchmarks/results/study_h200.json}
STUDY_DOCS=${STUDY_DOCS:-docs/study/h200}
SFT_OUT=${SFT_OUT:-runs/study_ckpt_h200}
SFT_DEVICE=${SFT_DEVICE:-cuda}
SFT_TIMEOUT=${SFT_TIMEOUT:-200}
SFT_ARGS=${SFT_ARGS:-"--hidden-size 512 --num-layers 6 --num-heads 8 --num-kv-heads 4 --head-dim 64 \
--intermediate-size 1536 --max-operand 999 --ops + - --steps 1200 --batch-size 256 --lr 1e-3 --warmup-steps 100 \
--label-smoothing 0.2 --threads 4"}
TGZ_LIMIT=$((15 * 1024 * 1024))

mkdir -p "$OUT"
LOG=$OUT/study_gpu.log
SUMMARY=$OUT/study_gpu_summary.txt
TGZ=$OUT/study_h200_runs.tgz
WORK=$(mktemp -d /tmp/study_gpu.XXXXXX)
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export RLEXACT_COMMIT=${RLEXACT_COMMIT:-$(git rev-parse HEAD 2> /dev/null)}  # empty without git: "unknown" below
# a malformed $RLEXACT_COMMIT stops the study here, not when its report is written at the end
$PYTHON -c 'from rlexact.envinfo import named_commit; named_commit()' || exit 2
: > "$LOG"
say() { echo "[study_gpu $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
t_start=$(date +%s)
elapsed() { echo $(($(date +%s) - t_start)); }

say "commit ${RLEXACT_COMMIT:-unknown}; config $STUDY_CONFIG; OUT $OUT"
if command -v nvidia-smi > /dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
  nvidia-smi dmon -s u -d 5 > "$WORK/gpu_utilization.txt" 2>&1 &
  dmon_pid=$!
fi
versions='from rlexact.envinfo import library_versions as v; print(v("triton", "transformers", "lightning"))'
$PYTHON -c "$versions" 2>&1 | tee -a "$LOG"

# 1. the start checkpoint
sft_rc=0
say "SFT: $PYTHON -m rlexact.demo.sft --out $SFT_OUT --device $SFT_DEVICE $SFT_ARGS (timeout ${SFT_TIMEOUT}s)"
# shellcheck disable=SC2086  # SFT_ARGS is a list of arguments
timeout --kill-after=10 "$SFT_TIMEOUT" $PYTHON -m rlexact.demo.sft --out "$SFT_OUT" --device "$SFT_DEVICE" \
  $SFT_ARGS >> "$LOG" 2>&1 || sft_rc=$?
sft_s=$(elapsed)
say "SFT exit $sft_rc after ${sft_s}s"

# 2. the study
study_rc=skipped
if [[ $sft_rc == 0 ]]; then
  left=$((STUDY_BUDGET - $(elapsed)))
  limit=$((left < STUDY_TIMEOUT ? left : STUDY_TIMEOUT))
  ((limit < 30)) && limit=30
  cmd="$PYTHON -m rlexact.study $STUDY_EXPERIMENTS --config $STUDY_CONFIG --checkpoint $SFT_OUT --out $STUDY_RUNS \
--json $STUDY_JSON --docs $STUDY_DOCS $STUDY_ARGS"
  say "study: $cmd (timeout ${limit}s)"
  study_rc=0
  # shellcheck disable=SC2086  # cmd is a list of arguments
  timeout --kill-after=15 "$limit" $cmd >> "$LOG" 2>&1 || study_rc=$?
  note=""
  [[ $study_rc == 124 || $study_rc == 137 ]] && note=" (stopped at the time limit)"
  say "study exit $study_rc after $(($(elapsed) - sft_s))s$note"
else
  say "study skipped: the SFT failed (see above)"
fi

# 3. the report of a study that did not finish (a finished one wrote it already)
if [[ $study_rc != 0 && -f $STUDY_JSON ]]; then
  say "report from the partial JSON"
  timeout --kill-after=5 45 $PYTHON -m rlexact.study report --json "$STUDY_JSON" --docs "$STUDY_DOCS" >> "$LOG" 2>&1 ||
    say "report exit $?"
fi

# outputs (always)
[[ -n ${dmon_pid:-} ]] && kill "$dmon_pid" 2> /dev/null
if [[ -f $STUDY_JSON && $(stat -c %Y "$STUDY_JSON") -ge $t_start ]]; then # written by this call
  cp "$STUDY_JSON" "$OUT/study_h200.json"
  $PYTHON - "$STUDY_JSON" "$SFT_OUT/sft.json" > "$SUMMARY" 2>&1 << 'EOF'
import json
import sys

from rlexact.study.report import markdown_tables

doc = json.load(open(sys.argv[1]))
try:
    sft = json.load(open(sys.argv[2]))
    print(f"SFT: {sft['num_parameters']:,} parameters, {sft['train_seconds']} s of training, held-out {sft['eval']}")
except OSError as exc:
    print(f"SFT: no sft.json ({exc})")
print(f"study: commit {doc.get('commit')}, device {doc.get('device')}, date {doc.get('date')}")
for name, entry in doc.get("experiments", {}).items():
    missing = entry.get("missing_runs") or []
    print(f"  {name}: {'complete' if not missing else f'INCOMPLETE, {len(missing)} run(s) missing'}")
print()
print(markdown_tables(doc))
EOF
  cat "$SUMMARY" >> "$LOG"
else
  say "no result JSON written at $STUDY_JSON"
  echo "no result JSON: the study wrote none (see study_gpu.log)" > "$SUMMARY"
fi

list=$WORK/files.txt
pack() { # $1: include result.json files (1/0)
  : > "$list"
  if [[ -d $STUDY_RUNS/runs ]]; then
    find "$STUDY_RUNS/runs" -path '*/tb/*' -type f >> "$list"
    [[ $1 == 1 ]] && find "$STUDY_RUNS/runs" -name result.json -type f >> "$list"
  fi
  [[ -d $STUDY_DOCS ]] && find "$STUDY_DOCS" -maxdepth 1 -type f >> "$list"
  [[ -f $SFT_OUT/sft.json ]] && echo "$SFT_OUT/sft.json" >> "$list"
  [[ -f $WORK/gpu_utilization.txt ]] && echo "$WORK/gpu_utilization.txt" >> "$list"
  tar -czf "$TGZ" --files-from="$list" 2>> "$LOG"
}
pack 1
if (($(stat -c %s "$TGZ") > TGZ_LIMIT)); then
  say "tarball over 15 MB with the runs' result.json: packing without them"
  pack 0
fi
if (($(stat -c %s "$TGZ") > TGZ_LIMIT)); then
  say "tarball still over 15 MB: packing the report and sft.json only"
  find "$STUDY_DOCS" -maxdepth 1 -type f > "$list" 2> /dev/null
  [[ -f $SFT_OUT/sft.json ]] && echo "$SFT_OUT/sft.json" >> "$list"
  tar -czf "$TGZ" --files-from="$list" 2>> "$LOG"
fi
say "tarball $(stat -c %s "$TGZ") bytes, $(wc -l < "$list") files"
say "done in $(elapsed)s: SFT exit $sft_rc, study exit $study_rc"
rm -rf "$WORK"
[[ $sft_rc == 0 && $study_rc == 0 ]]
