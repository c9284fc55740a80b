#!/usr/bin/env bash
# The tensor-core path's GPU checks and timings (benchmarks/results/mma-tiles-cpu.md), in two
# device calls of under 10 minutes each, run from the repository root with MLX's CUDA backend:
#
#   bash benchmarks/h200_mma.sh steps   # per layer step: outputs and codes against the CUDA
#                                       # cores, then times; launch bounds 4 against none
#   bash benchmarks/h200_mma.sh e2e     # greedy tokens, tokens/s against fp16, in-step ncu
#
# Outputs go to $OUT (default /tmp/out). `MMA` is off in the tree, so the A/Bs run this tree's
# kernels.py against a copy with it on; the stages that need it on in the tree itself edit the
# working copy and put it back.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/benchmarks"
K=veloxquant/methods/vecinfer/kernels.py
sed 's/^MMA = False$/MMA = True/' "$K" > /tmp/mma4_kernels.py
sed 's/^MMA_MIN_THREADGROUPS = 4$/MMA_MIN_THREADGROUPS = 0/' /tmp/mma4_kernels.py > /tmp/mma0_kernels.py
cp "$K" /tmp/tree_kernels.py
trap 'cp /tmp/tree_kernels.py "$K"' EXIT
case "${1:-}" in
steps)
  echo "== CUDA cores (this tree) against the tensor cores (baseline), per layer step"
  timeout 300 python benchmarks/ab_kernel_revisions.py --baseline /tmp/mma4_kernels.py --steps \
    --contexts 4096 16384 65536 131072 --repeats 10 2>&1 | tee "$OUT/steps_mma.txt"
  echo "== tensor cores: launch bounds for 4 threadgroups (this tree) against none (baseline)"
  cp /tmp/mma4_kernels.py "$K"
  timeout 200 python benchmarks/ab_kernel_revisions.py --baseline /tmp/mma0_kernels.py --steps \
    --contexts 65536 131072 --repeats 8 2>&1 | tee "$OUT/steps_bounds.txt"
  ;;
e2e)
  echo "== greedy tokens, fused on the tensor cores against transient"
  timeout 120 python benchmarks/check_fused_generation.py --mma \
    --random-weights benchmarks/configs/smollm2-135m.json 2>&1 | tee "$OUT/check_mma.txt"
  echo "== tokens/s: fp16, CUDA cores, tensor cores"
  timeout 330 python benchmarks/bench_generate.py --mma --dtype bfloat16 \
    --random-weights benchmarks/configs/llama3-8b.json --contexts 16384 65536 131072 \
    --repeats 3 2>&1 | tee "$OUT/generate_mma.txt"
  echo "== in-step GPU time at 64K, tensor cores"
  cp /tmp/mma4_kernels.py "$K"
  timeout 140 ncu --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/step_mma_65536.csv" \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context 65536 --repeats 2 > "$OUT/step_mma_65536.txt" 2>&1
  python benchmarks/profile_decode_step.py --parse "$OUT/step_mma_65536.csv" 2>&1 | head -30
  ;;
*)
  echo "usage: bash benchmarks/h200_mma.sh steps|e2e" >&2
  exit 2
  ;;
esac
