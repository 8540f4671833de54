#!/usr/bin/env bash
set -u
export RLEXACT_COMMIT=$(cat devx/sha) PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0
  timeout 300 python -m pytest -q -m gpu -x tests/test_triton_attention.py tests/test_split_kv.py tests/test_rollout.py -p no:cacheprovider > $OUT/tests.log 2>&1; echo "tests rc $?" >> $OUT/tests.log
  timeout 250 python benchmarks/attention_configs.py --out $OUT/attention_configs_h200.json > $OUT/pre.log 2>&1; echo "pre rc $?" >> $OUT/pre.log ) &
export CUDA_VISIBLE_DEVICES=1
timeout 330 python benchmarks/attention_configs.py --decode --out $OUT/attention_decode_configs_h200.json > $OUT/dec.log 2>&1; echo "dec rc $?" >> $OUT/dec.log
timeout 60 python benchmarks/ops_bench.py --sections attention --out $OUT/ops_attention_h200.json > $OUT/ops.log 2>&1; echo "ops rc $?" >> $OUT/ops.log
timeout 150 python - > $OUT/roll.log 2>&1 <<'PY'
import json, runpy, sys
sys.path.insert(0, "benchmarks")
from rlexact.ops import triton_attention as ta
import os
ch = json.load(open(os.environ["OUT"] + "/attention_decode_configs_h200.json"))["choice"].get("decode_launch")
print("decode launch", ch)
if ch: ta.DECODE_LAUNCH_16BIT.update(ch)
sys.argv = ["rollout_throughput.py", "--batches", "64", "256", "--engines", "exact", "--profile", "32", "--out", os.environ["OUT"] + "/roll.json"]
runpy.run_path("benchmarks/rollout_throughput.py", run_name="__main__")
PY
echo "roll rc $?" >> $OUT/roll.log
wait
tail -3 $OUT/tests.log; tail -2 $OUT/pre.log $OUT/dec.log $OUT/ops.log $OUT/roll.log
