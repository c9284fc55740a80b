#!/usr/bin/env bash
# KIVI's fused decode kernels on the GPU (benchmarks/results/kivi-fused-h200.md), one device call of
# under 10 minutes, from the repository root with MLX's CUDA backend:
#
#   bash benchmarks/h200_kivi.sh
#
# 1. the kernels against the pure-MLX twin on one layer, then 64 greedy tokens fused against
#    transient (check_kivi_kernels.py);
# 2. per layer against bf16 SDPA and the transient dequantize, 8B layer shape
#    (bench_kivi_kernels.py);
# 3. tokens/s and resident bytes: fp16 against KIVI-2 and a mixed 2/4-bit allocation, each on
#    the transient and the fused path, 8B shape in bfloat16 (bench_kivi_decode.py); 128K did
#    not fit the 2026-12-05 call (its fill, since made cheaper, ran out of time).
# Outputs go to $OUT (default /tmp/out); the exit status is non-zero when a step failed.
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/benchmarks"
echo "== kernels against the twin; generations fused against transient"
rc=0
timeout 130 python benchmarks/check_kivi_kernels.py 2>&1 | tee "$OUT/kivi_check.txt" || rc=1
echo "== per layer against bf16 SDPA, 8B layer shape"
timeout 150 python benchmarks/bench_kivi_kernels.py --transient --repeats 10 2>&1 \
  | tee "$OUT/kivi_kernels.txt" || rc=1
echo "== tokens/s against fp16, 8B shape"
timeout 280 python benchmarks/bench_kivi_decode.py --dtype bfloat16 \
  --random-weights benchmarks/configs/llama3-8b.json --contexts 16384 65536 131072 \
  --tokens 16 --repeats 3 2>&1 | tee "$OUT/kivi_decode.txt" || rc=1
exit $rc
