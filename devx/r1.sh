#!/usr/bin/env bash
# exploratory device run (untracked, deleted before finishing)
set -u
export RLEXACT_COMMIT=dcf9ec119ce8dd7e26b31c4353bd6fdadfb3ff47 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi -L
( CUDA_VISIBLE_DEVICES=0 timeout 520 python -m pytest -q -m gpu -x tests/test_triton_attention.py tests/test_split_kv.py tests/test_rollout.py -p no:cacheprovider > $OUT/tests.log 2>&1; echo "tests rc $?" >> $OUT/tests.log ) &
export CUDA_VISIBLE_DEVICES=1
timeout 120 python benchmarks/ops_bench.py --sections attention --out $OUT/ops_attention_h200.json > $OUT/b.log 2>&1; echo "ops rc $?" >> $OUT/b.log
timeout 150 python benchmarks/rollout_throughput.py --batches 64 256 --engines exact --profile 32 --out $OUT/rollout_exact.json >> $OUT/b.log 2>&1; echo "roll rc $?" >> $OUT/b.log
timeout 120 python benchmarks/rollout_throughput.py --prompt-len 8192 --new-tokens 128 --batches 4 32 --engines exact --profile 32 --out $OUT/rollout_long_exact.json >> $OUT/b.log 2>&1; echo "long rc $?" >> $OUT/b.log
timeout 150 python benchmarks/split_kv_sweep.py --out $OUT/split_kv_sweep_h200.json >> $OUT/b.log 2>&1; echo "split rc $?" >> $OUT/b.log
wait
tail -5 $OUT/tests.log; grep "rc " $OUT/b.log
