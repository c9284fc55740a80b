#!/usr/bin/env bash
# The tensor-core path's GPU checks and timings (benchmarks/results/mma-h200.txt, mma-h100.txt), one device call
# each of under 10 minutes, run from the repository root with MLX's CUDA backend:
#
#   bash benchmarks/h200_mma.sh steps   # per layer step: outputs and codes against the CUDA
#                                       # cores, then times; launch bounds 4 against none
#   bash benchmarks/h200_mma.sh e2e     # greedy tokens, tokens/s against fp16 and the CUDA cores
#   bash benchmarks/h200_mma.sh splits  # ncu: the kernel's GPU time against the CUDA cores', and
#                                       # against smaller splits at 16K / two waves at 64K; then
#                                       # the full ncu sections of both kernels at 64K
#   bash benchmarks/h200_mma.sh step    # ncu: every kernel of a whole decode step at 16K, fp16
#                                       # against the fused caches; then MIN_SPLIT 256 at 16K
#   BASE=/tmp/base_kernels.py bash benchmarks/h200_mma.sh merge
#                                       # a one-launch kernel change against BASE: outputs and
#                                       # codes, its timeline, ncu inside real decode steps at
#                                       # 64K, greedy tokens, tokens/s against fp16
#   bash benchmarks/h200_mma.sh merge4  # the float4 merge (this tree) against the scalar one:
#                                       # outputs, timeline, ncu inside real decode steps
#   bash benchmarks/h200_mma.sh bounds  # what bounds end-to-end decode: ncu of whole 128K steps
#                                       # (GPU time, fp16 against fused), tokens/s beside the
#                                       # attention-free bound arm, the host build alone
#   bash benchmarks/h200_mma.sh tiles4  # 4 coded tokens per thread against 2, ncu inside real
#                                       # decode steps at 64K
#   BASE=benchmarks/_base_kernels.py ARMS="name=benchmarks/_x_kernels.py ..." \
#     bash benchmarks/h200_mma.sh loop  # a tile-loop change against BASE (and ARMS): outputs and
#                                       # codes, ncu inside real decode steps at 64K and 128K,
#                                       # greedy tokens. The device has no git: write the other
#                                       # revisions' kernels.py here first (git show REV:PATH >
#                                       # benchmarks/_NAME_kernels.py, git-ignored) and name them
#                                       # in the device call's carry. ARMS may also name
#                                       # exp2f=/tmp/exp2f_kernels.py (the softmax's ex2 as exp2f)
#                                       # noahead=/tmp/noahead_kernels.py (KEY_ROWS_AHEAD off) and
#                                       # nopoly=/tmp/nopoly_kernels.py (no phase polynomial on
#                                       # the tensor cores), built here from this tree.
#                                       # NCU_CONTEXTS (default "65536 131072") picks the ncu
#                                       # contexts
#   bash benchmarks/h200_mma.sh phases  # the merge's phases (timeline-one), ncu's breakdown of
#                                       # the units one 64K launch keeps busy, the merge's rows
#                                       # in flight 32 / 64 against 16
#   bash benchmarks/h200_mma.sh rope    # the step's query and key rotated inside the one-launch
#                                       # kernel (the model's rope tapped) against the model's
#                                       # rotation: greedy tokens and logits at 4K / 64K, the
#                                       # rope ops deferred and built, ncu of every kernel of
#                                       # real 64K steps
#   bash benchmarks/h200_mma.sh rope_e2e  # ... and tokens/s against fp16 at 16K / 64K / 128K
#                                       # (CONTEXTS="4096 16384" picks others)
#   BASE=benchmarks/_base_kernels.py bash benchmarks/h200_mma.sh ropetable
#                                       # an in-kernel rotation change against BASE (and ARMS,
#                                       # as for loop): greedy tokens and logits, ncu of real
#                                       # 64K / 128K steps (NCU_CONTEXTS picks others)
#   BASE=benchmarks/_base_kernels.py bash benchmarks/h200_mma.sh setup
#                                       # a change to the coded threadgroups' setup against BASE
#                                       # (and ARMS, as for loop): outputs and codes, the setup's
#                                       # phases in steps that rotate (timeline-one --rope-in;
#                                       # --setup for this tree and the ARMS, whose stamps BASE's
#                                       # may lack), ncu of real 64K / 128K steps (NCU_CONTEXTS),
#                                       # greedy tokens. For 5fdd8c6's setup (the reads issued
#                                       # together) against the tree before it, and the slot-table
#                                       # arm: git show 01a5ca2:veloxquant/methods/vecinfer/
#                                       # kernels.py > benchmarks/_base_kernels.py; git show
#                                       # ed2c54f:(the same) > benchmarks/_slots_kernels.py;
#                                       # ARMS=slots=benchmarks/_slots_kernels.py
#   bash benchmarks/h200_mma.sh costs   # what each part of the tile loop costs: ncu inside real
#                                       # decode steps at 64K, this tree against copies with one
#                                       # kind of memory traffic taken out (benchmarks/cost_arms.py,
#                                       # wrong outputs but one arm), then ncu's full sections and
#                                       # per-instruction counters of this tree's kernel at 64K
#   bash benchmarks/h200_mma.sh tail    # the one-launch kernel's threadgroups timed from inside
#                                       # (when each SM is busy), as is and with two waves; then
#                                       # ncu inside real decode steps at 64K and 16K, this tree
#                                       # against two waves, 3 groups per SM, MIN_SPLIT 256
#
# Outputs go to $OUT (default /tmp/out). `MMA` is on in the tree, so the A/Bs run this tree's
# kernels.py against copies with it off, or with no launch bounds.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/benchmarks"
K=veloxquant/methods/vecinfer/kernels.py
grep -q '^MMA = True$' "$K" || { echo "expected MMA = True in $K" >&2; exit 2; }
sed 's/^MMA = True$/MMA = False/' "$K" > /tmp/cuda_cores_kernels.py
sed 's/^MMA_MIN_THREADGROUPS = 4$/MMA_MIN_THREADGROUPS = 0/' "$K" > /tmp/mma0_kernels.py
# the model's rotation instead of the kernel's (rope and ropetable's arm)
sed 's/^ROPE_IN_KERNEL = True$/ROPE_IN_KERNEL = False/' "$K" > /tmp/modelrope_kernels.py
grep -q '^ROPE_IN_KERNEL = False$' /tmp/modelrope_kernels.py || { echo "sed failed" >&2; exit 2; }
sed 's/^MIN_SPLIT = 512$/MIN_SPLIT = 256/' "$K" > /tmp/split256_kernels.py
# 528 already gives 64 splits (520 threadgroups, one wave) from 64K up, as split_tokens rounds
# a split to whole tiles; 1056 tries two waves of half as many tokens each
sed 's/^TARGET_GROUPS: int | None = None$/TARGET_GROUPS = 1056/' "$K" > /tmp/groups1056_kernels.py
# no launch bounds below 3 groups per SM (136 registers, no spills) and one wave of them
sed -e 's/^MMA_MIN_THREADGROUPS = 4$/MMA_MIN_THREADGROUPS = 3/' \
  -e 's/^TARGET_GROUPS: int | None = None$/TARGET_GROUPS = 396/' "$K" > /tmp/bounds3_kernels.py
# ncu's GPU time and grid of this tree's step kernel against /tmp/<name>_kernels.py's, per context.
# Clocks locked at base: with them free (--clock-control none, the first run of `splits`), a
# launch after a host gap ran 4-8x slower than the same launch back to back (the GPU idling down),
# which swamped the A/Bs.
# ncu's GPU time of every kernel of real decode steps at context $2 (clocks at base): fp16, this
# tree and the arm $1 (/tmp/$1_kernels.py), into $OUT/$1_$2*.txt; prints the parsed steps
ncu_steps() {
  name=$1
  ctx=$2
  timeout 240 ncu --profile-from-start off --clock-control base --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/${name}_$ctx.csv" \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context "$ctx" --repeats 2 --steps 3 --baseline "$name=/tmp/${name}_kernels.py" \
    > "$OUT/${name}_$ctx.txt" 2>&1
  python benchmarks/profile_decode_step.py --parse "$OUT/${name}_$ctx.csv" --steps 3 \
    --baseline "$name=/tmp/${name}_kernels.py" | tee "$OUT/${name}_${ctx}_parsed.txt"
}
# ncu's GPU time of every kernel of real decode steps at context $1 (clocks at base, time limit
# $2 s): fp16, this tree and the arms of the caller's `arms` array (--baseline NAME=PATH each),
# into $OUT/step$1*; prints the parsed steps
ncu_arms() {
  ctx=$1
  echo "== ncu inside real decode steps at $ctx: fp16, this tree, ${arms[*]}"
  timeout "$2" ncu --profile-from-start off --clock-control base --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/step$ctx.csv" \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context "$ctx" --repeats 2 --steps 3 "${arms[@]}" > "$OUT/step$ctx.txt" 2>&1
  python benchmarks/profile_decode_step.py --parse "$OUT/step$ctx.csv" --steps 3 \
    "${arms[@]}" | tee "$OUT/step${ctx}_parsed.txt"
}
# ncu of real decode steps at NCU_CONTEXTS (default 64K and 128K) for the caller's `arms`,
# then greedy tokens of the fused path against the transient one (loop and setup)
arms_steps_and_tokens() {
  for ctx in ${NCU_CONTEXTS:-65536 131072}; do
    ncu_arms "$ctx" 170 | grep -E "^==|GPU time|custom_kernel|sdpa"
  done
  echo "== greedy tokens, fused against transient"
  timeout 100 python benchmarks/check_fused_generation.py \
    --random-weights benchmarks/configs/smollm2-135m.json 2>&1 | tee "$OUT/check.txt"
}
ncu_times() {
  name=$1
  shift
  echo "== ncu: this tree against $name, contexts $*"
  timeout 120 ncu --clock-control base --cache-control all -k regex:attn_ \
    --metrics gpu__time_duration.sum,launch__grid_size \
    python benchmarks/ab_kernel_revisions.py --baseline "/tmp/${name}_kernels.py" --steps \
    --calls 3 --contexts "$@" > "$OUT/ncu_$name.txt" 2>&1
  grep -E "^context|gpu__time_duration|launch__grid_size" "$OUT/ncu_$name.txt"
}
case "${1:-}" in
steps)
  echo "== tensor cores (this tree) against the CUDA cores (baseline), per layer step"
  timeout 240 python benchmarks/ab_kernel_revisions.py --baseline /tmp/cuda_cores_kernels.py \
    --steps --contexts 4096 16384 65536 131072 --repeats 8 2>&1 | tee "$OUT/steps_mma.txt"
  echo "== tensor cores: launch bounds for 4 threadgroups (this tree) against none (baseline)"
  timeout 150 python benchmarks/ab_kernel_revisions.py --baseline /tmp/mma0_kernels.py --steps \
    --contexts 65536 131072 --repeats 6 2>&1 | tee "$OUT/steps_bounds.txt"
  ;;
e2e)
  echo "== greedy tokens, fused (tensor cores) against transient"
  timeout 100 python benchmarks/check_fused_generation.py \
    --random-weights benchmarks/configs/smollm2-135m.json 2>&1 | tee "$OUT/check_mma.txt"
  echo "== tokens/s: fp16, tensor cores (default), CUDA cores; 8B then 1B shape"
  timeout 300 python benchmarks/bench_generate.py --cuda-cores --dtype bfloat16 \
    --random-weights benchmarks/configs/llama3-8b.json --contexts 4096 16384 65536 131072 \
    --repeats 3 2>&1 | tee "$OUT/generate_8b.txt"
  timeout 120 python benchmarks/bench_generate.py --cuda-cores --dtype bfloat16 \
    --random-weights benchmarks/configs/llama3-1b.json --contexts 4096 16384 65536 \
    --repeats 3 2>&1 | tee "$OUT/generate_1b.txt"
  ;;
splits)
  # per context ncu sees 14 launches: baseline x4, this tree x4 (the one-step check), then
  # baseline x3, this tree x3 (cold caches, as inside a decode step)
  ncu_times cuda_cores 16384 65536
  ncu_times split256 16384
  # launches 11 and 12 of 14 (see above): the last timed CUDA-cores call, the first tensor-cores one
  echo "== ncu --set full: the CUDA cores' (first) and the tensor cores' (second) step at 64K"
  timeout 150 ncu --clock-control none --cache-control all -k regex:attn_ --set full \
    --launch-skip 10 --launch-count 2 --page details \
    python benchmarks/ab_kernel_revisions.py --baseline /tmp/cuda_cores_kernels.py --steps \
    --calls 3 --contexts 65536 > "$OUT/ncu_full_64k.txt" 2>&1
  grep -E "attn_|Duration|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|Warp Cycles Per Issued|Issued Ipc|Compute \(SM\) Throughput" \
    "$OUT/ncu_full_64k.txt" | head -60
  ncu_times groups1056 65536
  ;;
step)
  # every kernel of a whole decode step at 16K, fp16 against the fused caches (tensor cores):
  # where the 16K step loses while its attention kernel is no slower than fp16's
  timeout 330 ncu --profile-from-start off --clock-control base --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/step16k.csv" \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context 16384 --repeats 3 2>&1 | tee "$OUT/step16k.txt"
  python benchmarks/profile_decode_step.py --parse "$OUT/step16k.csv" | tee "$OUT/step16k_parsed.txt"
  ncu_times split256 16384
  ;;
tail)
  echo "== the one-launch kernel's threadgroups, timed from inside: as is, then two waves"
  timeout 120 python benchmarks/profile_partial_kernel.py timeline-one 2>&1 | tee "$OUT/timeline.txt"
  timeout 90 python benchmarks/profile_partial_kernel.py timeline-one --contexts 65536 131072 \
    --constants TARGET_GROUPS=1056 2>&1 | tee "$OUT/timeline_1056.txt"
  timeout 90 python benchmarks/profile_partial_kernel.py timeline-one --contexts 65536 \
    --constants MMA_MIN_THREADGROUPS=3 TARGET_GROUPS=396 2>&1 | tee "$OUT/timeline_bounds3.txt"
  # real decode steps, each arm on fused caches of its own; clocks locked, caches as they are
  for ctx in 65536 16384; do
    if [ "$ctx" = 65536 ]; then
      arms=(--baseline groups1056=/tmp/groups1056_kernels.py --baseline bounds3=/tmp/bounds3_kernels.py)
    else
      arms=(--baseline split256=/tmp/split256_kernels.py)
    fi
    echo "== ncu inside real decode steps at $ctx: fp16, this tree, ${arms[*]}"
    timeout 200 ncu --profile-from-start off --clock-control base --cache-control none \
      --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/step$ctx.csv" \
      python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
      --context "$ctx" --repeats 2 --steps 3 "${arms[@]}" > "$OUT/step$ctx.txt" 2>&1
    tail -3 "$OUT/step$ctx.txt"
    python benchmarks/profile_decode_step.py --parse "$OUT/step$ctx.csv" --steps 3 "${arms[@]}" \
      | tee "$OUT/step${ctx}_parsed.txt" | grep -E "GPU time|custom_kernel|sdpa"
  done
  ;;
merge)
  BASE=${BASE:-/tmp/base_kernels.py}
  echo "== this tree against $BASE, per layer step: outputs, codes, times"
  timeout 120 python benchmarks/ab_kernel_revisions.py --baseline "$BASE" --steps \
    --contexts 4096 16384 65536 131072 --repeats 5 2>&1 | tee "$OUT/steps_ab.txt"
  echo "== this tree's one-launch timeline"
  timeout 90 python benchmarks/profile_partial_kernel.py timeline-one 2>&1 | tee "$OUT/timeline.txt"
  echo "== ncu inside real decode steps at 64K: fp16, this tree, base"
  timeout 150 ncu --profile-from-start off --clock-control base --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/step65536.csv" \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context 65536 --repeats 2 --steps 3 --baseline "base=$BASE" > "$OUT/step65536.txt" 2>&1
  python benchmarks/profile_decode_step.py --parse "$OUT/step65536.csv" --steps 3 \
    --baseline "base=$BASE" | tee "$OUT/step65536_parsed.txt" | grep -E "GPU time|custom_kernel|sdpa"
  echo "== greedy tokens, fused against transient"
  timeout 100 python benchmarks/check_fused_generation.py \
    --random-weights benchmarks/configs/smollm2-135m.json 2>&1 | tee "$OUT/check.txt"
  echo "== tokens/s against fp16, 8B shape"
  timeout 200 python benchmarks/bench_generate.py --dtype bfloat16 \
    --random-weights benchmarks/configs/llama3-8b.json --contexts 16384 65536 131072 \
    --repeats 3 2>&1 | tee "$OUT/generate_8b.txt"
  ;;
merge4)
  # the merge's rows as float4s (kernels.COMBINE_FLOAT4, on in the tree: 16 loads in flight
  # under nvcc 13) against the scalar merge: outputs and codes (the same sums in the same
  # order: bit-identical), the timeline, and ncu inside real decode steps at 64K and 16K
  grep -q '^COMBINE_FLOAT4 = True$' "$K" || { echo "expected COMBINE_FLOAT4 = True in $K" >&2; exit 2; }
  sed 's/^COMBINE_FLOAT4 = True$/COMBINE_FLOAT4 = False/' "$K" > /tmp/scalar_kernels.py
  echo "== float4 merge (this tree) against the scalar merge (baseline), per layer step"
  timeout 120 python benchmarks/ab_kernel_revisions.py --baseline /tmp/scalar_kernels.py --steps \
    --contexts 16384 65536 131072 --repeats 5 2>&1 | tee "$OUT/steps_scalar.txt"
  for k in "$K" /tmp/scalar_kernels.py; do
    echo "== timeline-one, $k"
    timeout 60 python benchmarks/profile_partial_kernel.py timeline-one --kernels "$k" \
      --contexts 16384 65536 2>&1 | tee -a "$OUT/timeline_merge4.txt"
  done
  for ctx in 65536 16384; do
    echo "== ncu inside real decode steps at $ctx: fp16, this tree, scalar merge"
    timeout 150 ncu --profile-from-start off --clock-control base --cache-control none \
      --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/step$ctx.csv" \
      python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
      --context "$ctx" --repeats 2 --steps 3 --baseline scalar=/tmp/scalar_kernels.py \
      > "$OUT/step$ctx.txt" 2>&1
    python benchmarks/profile_decode_step.py --parse "$OUT/step$ctx.csv" --steps 3 \
      --baseline scalar=/tmp/scalar_kernels.py | tee "$OUT/step${ctx}_parsed.txt" |
      grep -E "GPU time|custom_kernel|sdpa"
  done
  ;;
bounds)
  # what bounds end-to-end decode: ncu over every kernel of whole 128K steps (the GPU time per
  # step, fp16 against fused: the most a free host could give), tokens/s beside the bound arms
  # (no_attention: the step without attention, which no cache can beat), the host build alone
  echo "== ncu inside real decode steps at 131072: fp16, this tree"
  timeout 150 ncu --profile-from-start off --clock-control base --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/step131072.csv" \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context 131072 --repeats 2 --steps 3 > "$OUT/step131072.txt" 2>&1
  python benchmarks/profile_decode_step.py --parse "$OUT/step131072.csv" --steps 3 |
    tee "$OUT/step131072_parsed.txt" | grep -E "GPU time|custom_kernel|sdpa"
  echo "== tokens/s against fp16 and the bound arms, 8B shape"
  timeout 230 python benchmarks/bench_generate.py --dtype bfloat16 --bounds \
    --random-weights benchmarks/configs/llama3-8b.json --contexts 65536 131072 \
    --repeats 3 2>&1 | tee "$OUT/generate_bounds_8b.txt"
  echo "== the host build of a step, kernels stubbed"
  timeout 60 python benchmarks/bench_host_build.py --repeats 30 2>&1 | tee "$OUT/host_build.txt"
  ;;
loop)
  BASE=${BASE:-benchmarks/_base_kernels.py}
  [ -f "$BASE" ] || { echo "no $BASE: see the loop mode's comment at the top" >&2; exit 2; }
  sed 's/= vq_ex2(/= vq_exp2(/' "$K" > /tmp/exp2f_kernels.py
  sed 's/^KEY_ROWS_AHEAD = True$/KEY_ROWS_AHEAD = False/' "$K" > /tmp/noahead_kernels.py
  grep -q '^KEY_ROWS_AHEAD = False$' /tmp/noahead_kernels.py || { echo "sed failed" >&2; exit 2; }
  sed 's/poly_pairs=poly_pairs(cache.rope, int(d))/poly_pairs=0/' "$K" > /tmp/nopoly_kernels.py
  grep -q 'poly_pairs=0 if cache.key_mean' /tmp/nopoly_kernels.py || { echo "sed failed" >&2; exit 2; }
  arms=(--baseline "base=$BASE")
  for a in ${ARMS:-}; do arms+=(--baseline "$a"); done
  echo "== this tree against $BASE, per layer step: outputs, codes, times"
  timeout 100 python benchmarks/ab_kernel_revisions.py --baseline "$BASE" --steps \
    --contexts 16384 65536 131072 --repeats 3 2>&1 | tee "$OUT/steps_ab.txt"
  arms_steps_and_tokens
  ;;
setup)
  BASE=${BASE:-benchmarks/_base_kernels.py}
  [ -f "$BASE" ] || { echo "no $BASE: see the setup mode's comment at the top" >&2; exit 2; }
  arms=(--baseline "base=$BASE")
  for a in ${ARMS:-}; do arms+=(--baseline "$a"); done
  echo "== this tree against $BASE, per layer step at 16K: outputs, codes"
  timeout 100 python benchmarks/ab_kernel_revisions.py --baseline "$BASE" --steps \
    --contexts 16384 --repeats 2 2>&1 | tee "$OUT/steps_ab.txt"
  P="python benchmarks/profile_partial_kernel.py timeline-one --contexts 65536 131072 --rope-in"
  echo "== timeline-one, this tree (the setup's phases)"
  timeout 60 $P --setup 2>&1 | tee "$OUT/timeline_tree.txt"
  echo "== timeline-one, $BASE"
  timeout 60 $P --kernels "$BASE" 2>&1 | tee "$OUT/timeline_base.txt"
  for a in ${ARMS:-}; do
    echo "== timeline-one, ${a#*=}"
    timeout 60 $P --setup --kernels "${a#*=}" 2>&1 | tee "$OUT/timeline_${a%%=*}.txt"
  done
  arms_steps_and_tokens
  ;;
phases)
  # the merge's phases (timeline-one's stamps) at 16K / 64K / 128K; which unit bounds one
  # launch in a real 64K step (ncu's breakdown of the L1/TEX and SM throughputs); the merge
  # with 32 and 64 output rows in flight per thread (COMBINE_LOADS4) against 16; the merge
  # without its row loads
  P="python benchmarks/profile_partial_kernel.py timeline-one"
  echo "== timeline-one, this tree"
  timeout 100 $P --contexts 16384 65536 131072 2>&1 | tee "$OUT/phases.txt"
  echo "== ncu breakdown, one launch in a real 64K step"
  m=breakdown:l1tex__throughput.avg.pct_of_peak_sustained_active
  m=$m,breakdown:sm__throughput.avg.pct_of_peak_sustained_active
  m=$m,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
  m=$m,l1tex__data_pipe_lsu_wavefronts.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed.sum
  m=$m,sm__cycles_active.avg,gpu__time_duration.sum
  timeout 150 ncu --profile-from-start off --clock-control base --cache-control none -k regex:attn_ \
    --launch-skip 40 --launch-count 1 --metrics "$m" \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context 65536 --repeats 1 --steps 2 > "$OUT/breakdown.txt" 2>&1
  grep -vE "^==PROF==|^\s*$" "$OUT/breakdown.txt" | tail -n 45
  for n in 32 64; do
    sed "s/^COMBINE_LOADS4 = 16$/COMBINE_LOADS4 = $n/" "$K" > "/tmp/rows${n}_kernels.py"
    grep -q "^COMBINE_LOADS4 = $n$" "/tmp/rows${n}_kernels.py" || { echo "sed failed" >&2; exit 2; }
    echo "== timeline-one, COMBINE_LOADS4 = $n"
    timeout 45 $P --contexts 65536 --kernels "/tmp/rows${n}_kernels.py" 2>&1
  done
  echo "== timeline-one, the merge without its row loads"
  timeout 45 $P --contexts 65536 --cut no-rows 2>&1
  ;;
rope)
  echo "== greedy tokens and logits: RoPE in the kernel against the model's rotation (8B shape,"
  echo "   seeded weights), the rope ops deferred (the default) and built (--no-defer)"
  for defer in "" --no-defer; do
    timeout 100 python benchmarks/check_rope_in_kernel.py $defer \
      --random-weights benchmarks/configs/llama3-8b.json --contexts 4096 65536 --steps 32 2>&1 \
      | tee -a "$OUT/check_rope.txt"
  done
  echo "== ncu inside real 64K decode steps, every kernel: fp16, this tree, the model's RoPE"
  ncu_steps modelrope 65536 | head -60
  ;;
rope_e2e)
  echo "== tokens/s: fp16, RoPE in the kernel, the model's RoPE (8B shape)"
  timeout 540 python benchmarks/bench_generate.py --model-rope --dtype bfloat16 \
    --random-weights benchmarks/configs/llama3-8b.json --contexts ${CONTEXTS:-16384 65536 131072} \
    --repeats 3 2>&1 | tee "$OUT/generate_rope.txt"
  ;;
ropetable)
  # a change to the in-kernel rotation against BASE (another revision's kernels.py, as for
  # `loop`): greedy tokens and logits against the model's rotation at 4K / 64K, then ncu of
  # every kernel of real decode steps at 64K and 128K: fp16, this tree, BASE, the model's RoPE
  BASE=${BASE:-benchmarks/_base_kernels.py}
  [ -f "$BASE" ] || { echo "no $BASE: see the loop mode's comment at the top" >&2; exit 2; }
  echo "== greedy tokens and logits: RoPE in the kernel against the model's rotation (8B shape,"
  echo "   seeded weights, the rope ops deferred)"
  timeout 100 python benchmarks/check_rope_in_kernel.py \
    --random-weights benchmarks/configs/llama3-8b.json --contexts 4096 65536 --steps 32 2>&1 \
    | tee "$OUT/check_rope.txt"
  arms=(--baseline "base=$BASE" --baseline "modelrope=/tmp/modelrope_kernels.py")
  for a in ${ARMS:-}; do arms+=(--baseline "$a"); done
  for ctx in ${NCU_CONTEXTS:-65536 131072}; do
    ncu_arms "$ctx" 240 | head -60
  done
  ;;
costs)
  specs=$(python benchmarks/cost_arms.py /tmp) || exit 2
  arms=()
  for spec in $specs; do arms+=(--baseline "$spec"); done
  echo "== ncu inside real decode steps at 64K (attention only): fp16, this tree, ${arms[*]}"
  timeout 240 ncu --profile-from-start off --clock-control base --cache-control none \
    -k 'regex:attn_|vq_step_marker|sdpa' --metrics gpu__time_duration.sum --csv --page raw \
    --log-file "$OUT/costs65536.csv" \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context 65536 --repeats 2 --steps 3 "${arms[@]}" > "$OUT/costs65536.txt" 2>&1
  python benchmarks/profile_decode_step.py --parse "$OUT/costs65536.csv" --steps 3 "${arms[@]}" \
    | tee "$OUT/costs65536_parsed.txt" | grep -E "GPU time|custom_kernel|sdpa"
  echo "== ncu --set full, this tree's kernel in a real 64K decode step (layer 8 of the 2nd step)"
  timeout 200 ncu --profile-from-start off --cache-control all -k regex:attn_ --launch-skip 40 \
    --launch-count 1 --set full --import-source no -o "$OUT/full64k" -f \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context 65536 --repeats 1 --steps 2 > "$OUT/full64k.txt" 2>&1
  ncu --import "$OUT/full64k.ncu-rep" --page details > "$OUT/full64k_details.txt" 2>&1
  ncu --import "$OUT/full64k.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/full64k_sass.csv" 2>&1
  grep -E "Duration|L1/TEX Cache Throughput|L1/TEX Hit|Issue Slots|Warp Cycles Per Issued|Eligible Warps|bank|Stall" \
    "$OUT/full64k_details.txt" | head -40
  ;;
tiles4)
  # 4 coded tokens per thread (512-token tiles, 8 blocks per SIMD group: more loads in flight
  # per warp, more registers) against 2, inside real decode steps at 64K (ncu, clocks at base)
  sed 's/^TOKENS_PER_THREAD = 2$/TOKENS_PER_THREAD = 4/' "$K" > /tmp/r4_kernels.py
  grep -q '^TOKENS_PER_THREAD = 4$' /tmp/r4_kernels.py || { echo "sed failed" >&2; exit 2; }
  ncu_steps r4 65536 | grep -E "GPU time|custom_kernel|sdpa"
  ;;
mergecuts)
  # what the last threadgroup's merge costs, and what in it: BASE's kernel as is, without the
  # merge (its count and hand-over only), with one thread fencing; this tree with fewer loads
  # in flight; then inside real decode steps at 64K
  BASE=${BASE:-/tmp/base_kernels.py}
  tl() { timeout 60 python benchmarks/profile_partial_kernel.py timeline-one --contexts 16384 65536 "$@"; }
  for cut in "" no-merge one-fence; do
    echo "== timeline-one, $BASE, cut ${cut:-none}"
    tl --kernels "$BASE" ${cut:+--cut $cut} 2>&1 | tee -a "$OUT/timeline_cuts.txt"
  done
  for loads in 16 4 1; do
    echo "== timeline-one, this tree, COMBINE_LOADS $loads"
    tl --constants COMBINE_LOADS=$loads 2>&1 | tee -a "$OUT/timeline_cuts.txt"
  done
  for loads in 4 1; do
    sed "s/^COMBINE_LOADS = [0-9]* /COMBINE_LOADS = $loads /" "$K" > /tmp/loads${loads}_kernels.py
    grep -q "^COMBINE_LOADS = $loads " /tmp/loads${loads}_kernels.py || { echo "sed failed"; exit 2; }
  done
  arms=(--baseline "base=$BASE" --baseline loads4=/tmp/loads4_kernels.py --baseline loads1=/tmp/loads1_kernels.py)
  echo "== ncu inside real decode steps at 64K: fp16, this tree, ${arms[*]}"
  timeout 200 ncu --profile-from-start off --clock-control base --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$OUT/step65536.csv" \
    python benchmarks/profile_decode_step.py --random-weights benchmarks/configs/llama3-8b.json \
    --context 65536 --repeats 2 --steps 3 "${arms[@]}" > "$OUT/step65536.txt" 2>&1
  python benchmarks/profile_decode_step.py --parse "$OUT/step65536.csv" --steps 3 "${arms[@]}" \
    | tee "$OUT/step65536_parsed.txt" | grep -E "GPU time|custom_kernel|sdpa"
  ;;
*)
  echo "usage: bash benchmarks/h200_mma.sh steps|e2e|splits|step|tail|merge|merge4|mergecuts|loop|tiles4|bounds|costs|phases|rope|rope_e2e|ropetable|setup" >&2
  exit 2
  ;;
esac
