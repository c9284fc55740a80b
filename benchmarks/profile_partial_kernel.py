"""Where VecInfer's partial decode-attention kernel spends its time, on a GPU (8B layer shape,
default layout, the synthetic caches of bench_kernels.py).

    python benchmarks/profile_partial_kernel.py ablations --contexts 4096 16384 65536
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        -k regex:attn_partial python benchmarks/profile_partial_kernel.py ablations --calls 3
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        -k regex:attn_partial python benchmarks/profile_partial_kernel.py tiles
    python benchmarks/profile_partial_kernel.py timeline --contexts 4096 16384 65536
    python benchmarks/profile_partial_kernel.py timeline-one --contexts 16384 65536 131072

- `ablations`: the kernel with parts of its work cut out of the source (each arm its own set of
  cuts: the exact RoPE-phase pairs, the whole phase, the value sums, all key sub-vectors but
  one, the exact tokens' threadgroup, and combinations). Without `--calls`, wall time per
  layer (32 calls per eval, interleaved repeats, median [min, max]); with it, that many calls
  per arm for a profiler (`--cache-control all` for cold caches, as in a decode step, where
  the other layers' weights have evicted this layer's codes), each arm's kernel name printed
  to match the profiler's rows. The cut arms compute wrong output: they only time.
- `timeline` (CUDA): the kernel with timestamps at its phase boundaries, written by thread 0
  of every threadgroup (`%globaltimer` for when a group starts and ends, `clock64` for the
  phases in between): when the groups start, how long each phase takes, and which group ends
  last, with warm caches and with L2 flushed before the launch (`--arms` adds ablations,
  `--constants NAME=INT` overrides the kernel module's settings). The flush is a 256 MB write:
  it empties L2 but not the SMs' own instruction caches, which ncu's `--cache-control all`
  does, so its "cold" is warmer than ncu's; and one 16K cold run showed every group stalled
  ~100 us in the same phase (not understood, not seen at 4K or 64K): read its cold rows with
  ncu's times beside them.
- `timeline-one` (CUDA): the same for the one-launch kernel that decode steps run (tensor cores
  on): per threadgroup, when it starts, starts its tile loop (tensor cores: the setup before
  it), finishes its split, finishes the merge (the last group per KV head) and ends (the exact
  group's encode), and the SM it ran on; reported as each
  SM's busy fraction of the kernel's span, the groups per SM, and those times' median / 90% /
  max, warm and with L2 flushed (`--constants TARGET_GROUPS=1056` and the like override the
  kernels module's settings, `--kernels PATH` runs another revision's kernels.py, `--cut
  no-merge` times the kernel without its merge (its output then wrong), `--cut no-rows` and
  `--cut no-hadamard` without the merge's output-row loads or its value Hadamard, `--cut
  one-fence` with one thread fencing before the count, and `--setup` the coded groups' setup
  in phases: its loads to q~, q~'s barrier, the phase setup's sines and cosines, the W product,
  the value book and the first rows; SETUP_STAMPS).
- `tiles`: three calls per (threads per threadgroup, tokens per thread) setting, for a
  profiler; prints each setting's kernel name (to match the profiler's rows) and its output's
  largest difference from the default setting's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from veloxquant.kernels import backend
from veloxquant.methods.vecinfer import kernels as K
from _common import fmt
from bench_kernels import decode_inputs, time_arms

H, G, D, LAYERS, SETS = 8, 4, 128, 32, 4

# (text in the partial kernel's source, what replaces it)
NO_EXACT_PAIRS = [("for (int j = 0; j < p_exact; ++j) {", "for (int j = 0; j < 0; ++j) {")]
NO_POLYNOMIAL = [
    (
        "if (p_exact < P) {\n          VQ_UNROLL\n          for (int g = 0; g < G; ++g) {",
        "if (false) {\n          VQ_UNROLL\n          for (int g = 0; g < G; ++g) {",
    )
]
NO_VALUES = [  # the whole-tile loop and the bounds-checked one
    ("for (int b = 0; b < R * VM; b += VPF) {", "for (int b = 0; b < 0; b += VPF) {"),
    ("tb < tile_len; tb += VPF * TG) {", "tb < 0; tb += VPF * TG) {"),
]
ONE_KEY_SUB = [
    ("for (int mc = 0; mc < KM; mc += KCH) {", "for (int mc = 0; mc < KCH; mc += KCH) {"),
    (
        "for (int m = 0; m < KCH; ++m) {\n          float4 qv",
        "for (int m = 0; m < 1; ++m) {\n          float4 qv",
    ),
]
NO_EXACT = [("const int n_fp = n_sink + n_win + n_new;", "const int n_fp = 0;")]
OVERHEAD = ONE_KEY_SUB + NO_VALUES + NO_EXACT_PAIRS + NO_POLYNOMIAL
ABLATIONS = {
    "default": [],
    "no exact phase pairs": NO_EXACT_PAIRS,
    "no phase": NO_EXACT_PAIRS + NO_POLYNOMIAL,
    "no value sums": NO_VALUES,
    "1 key sub-vector": ONE_KEY_SUB,
    "1 key sub-vector, no value sums": ONE_KEY_SUB + NO_VALUES,
    "only the overhead": OVERHEAD,
    "no exact tokens": NO_EXACT,
    "overhead, no exact tokens": OVERHEAD + NO_EXACT,
}
TILES = [(128, 4), (128, 2), (256, 2), (256, 1), (256, 4)]


def _check_cuts(base: str, cuts) -> None:
    """Exit unless every text a cut replaces is in `base` exactly once."""
    for cut in cuts:
        for old, _ in cut:
            if base.count(old) != 1:
                raise SystemExit(f"the kernel source no longer has exactly one {old!r}")


def _cut(base: str, cuts: list) -> str:
    for old, new in cuts:
        base = base.replace(old, new)
    return base


def ablations(args) -> None:
    base = K._PARTIAL_BODY
    _check_cuts(base, ABLATIONS.values())
    scale = 1 / math.sqrt(D)
    for n in args.contexts:
        caches, qs, pend = decode_inputs(n, SETS, LAYERS, H, G, D)
        try:
            if args.calls:
                for name, cut in ABLATIONS.items():
                    K._PARTIAL_BODY = _cut(base, cut)
                    K.clear_memos(caches)  # the sources are rebuilt from the body above
                    for _ in range(args.calls):
                        mx.eval(K.decode_attention(caches[0], qs[0], scale, pend[0])[0])
                    lay = K.layout_of(caches[0], H * G)
                    kernel = K.attention_kernel_sources(lay, mx.bfloat16)[0].kernel_name
                    print(f"context {n}: {name}: kernel {kernel}")
                continue

            def arm(cut, caches=caches, qs=qs, pend=pend):
                def run():
                    K._PARTIAL_BODY = _cut(base, cut)
                    K.clear_memos(caches)
                    outs = [
                        K.decode_attention(caches[i % SETS], qs[i], scale, pend[i % SETS])
                        for i in range(LAYERS)
                    ]
                    mx.eval([o[0] for o in outs])

                return run

            times = time_arms({k: arm(v) for k, v in ABLATIONS.items()}, args.repeats)
        finally:
            K._PARTIAL_BODY = base
            K.clear_memos(caches)
        print(f"context {n}: wall time per layer")
        for k, v in times.items():
            print(f"  {k:<32} {fmt([t / LAYERS for t in v], 1e6, ' us')}")


# Timeline stamps. Slots 4-7 are the first tile of a split, 8-11 its last tile when it has more
# than one (each later tile overwrites them); the exact threadgroup has its own. A tile's
# "scores" span its key code loads, key sub-vectors and RoPE phase term; "end" is stamped
# before the group's running max and sum are written.
STAMP_NAMES = [
    "start",
    "queries, codebooks",
    "Hadamard",
    "setup barrier",
    "tile 0 phase table",
    "tile 0 scores",
    "tile 0 softmax",
    "tile 0 value sums",
    "last tile phase",
    "last tile scores",
    "last tile softmax",
    "last tile values",
    "end",
    "exact queries",
    "exact tokens",
    "exact merged",
]
NS = len(STAMP_NAMES) + 1  # the last slot holds the SM id
_TI = "(min((tile - t_begin) / (TILE * R), 1) * 4)"
# (slot, text before the stamp, text after it): the two texts together must be in the source
# exactly once.
_RESCALE = "      VQ_UNROLL\n      for (int g = 0; g < G; ++g) {\n        const float al"
_PHASE_END = "              s[r][g] += v;\n            }\n          }\n        }\n      }\n"
_HADAMARD = (
    "    VQ_UNROLL\n    for (int gi = 0; gi < GW; ++gi) {\n"
    "      const int g = (int)vq_warp + gi * NWARPS;\n      if (g < G) {"
)
_EXACT_OUT = (
    "    for (int i = (int)vq_tid; i < G * D; i += TILE) {\n      part_o[(split * HQ + h * G)"
)
STAMPS = [
    (0, "const int n_splits = T > 0 ? (T + tps - 1) / tps : 0;\n", ""),
    (1, "", _HADAMARD),
    (2, "", "    if (QS > G * KD) {"),
    (3, "    VQ_BARRIER();\n\n", "    // key code rows read"),
    (f"4 + {_TI}", "          VQ_BARRIER();\n        }\n      }\n", ""),
    (f"5 + {_TI}", _PHASE_END, ""),
    (f"6 + {_TI}", "      VQ_BARRIER();\n", _RESCALE),
    (f"7 + {_TI}", "      VQ_BARRIER();\n", "    }\n    // reduce the TG token strides'"),
    (13, "    VQ_BARRIER();\n", "    const int n_fp"),
    (14, "", "    // merge the SIMD groups"),
    (15, "      VQ_BARRIER();\n    }\n", _EXACT_OUT),
    (12, "", "  if (vq_tid < G) {\n    part_m[split * HQ"),
]
_STAMP_MACRO = r"""
#define VQ_STAMP(k) if (vq_tid == 0) { \
  unsigned long long gt_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt_)); \
  const long long ck_ = clock64(); \
  const int at_ = ((int)vq_gy * (int)gridDim.x + (int)vq_gx) * (2 * NSTAMP) + 2 * (k); \
  tstamp[at_] = (uint32_t)gt_; tstamp[at_ + 1] = (uint32_t)ck_; }
"""


def stamped_body(body: str) -> str:
    """`body` (a partial kernel source) with VQ_STAMP calls at STAMPS' places, and thread 0
    writing its SM's id; exits if a place is not in the source exactly once."""
    for slot, before, after in STAMPS:
        if body.count(before + after) != 1:
            raise SystemExit(f"the kernel source no longer has exactly one {before + after!r}")
        body = body.replace(before + after, f"{before}VQ_STAMP({slot});\n{after}")
    sm = (
        "  if (vq_tid == 0) {\n    uint32_t sm_;\n"
        '    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));\n'
        "    tstamp[((int)vq_gy * (int)gridDim.x + (int)vq_gx) * (2 * NSTAMP) + 2 * (NSTAMP - 1)]"
        " = sm_;\n  }\n"
    )
    body = body.replace("VQ_STAMP(12);\n", "VQ_STAMP(12);\n" + sm)
    return f"  constexpr int NSTAMP = {NS};\n" + _STAMP_MACRO + body


def stamped_source(src):
    """The partial kernel's KernelSource `src` with the timeline stamps and their output,
    `tstamp` (uint32, 2 * NS per threadgroup), after its own outputs."""
    return dataclasses.replace(src, outputs=(*src.outputs, "tstamp"), body=stamped_body(src.body))


def _flush_l2() -> None:
    junk = mx.zeros((1 << 26,), mx.float32)  # 256 MB, several times the L2
    mx.eval(junk + 1)


def _launch_stamped(a: dict, kernel, shapes: list, dtypes: list, cold: bool) -> list:
    """One launch of a stamped kernel on `attention_inputs`' inputs `a` (outputs zeroed first,
    so that groups that never reach a stamp leave it 0), after flushing L2 if `cold`."""
    if cold:
        _flush_l2()
    return kernel(
        inputs=a["partial"],
        grid=(a["groups"][0] * K.TILE, a["groups"][1], 1),
        threadgroup=(K.TILE, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
        init_value=0,
    )


def _timeline_once(a: dict, q: mx.array, kernel, cold: bool) -> np.ndarray:
    n_groups = a["groups"][0] * a["groups"][1]
    ns = a["n_splits"] + 1
    n_q, d = q.shape[1], q.shape[3]
    shapes = [(ns * n_q + 8,), (ns * n_q + 8,), (ns * n_q * d,), (n_groups * NS * 2,)]
    outs = _launch_stamped(a, kernel, shapes, [mx.float32] * 3 + [mx.uint32], cold)
    mx.eval(outs)
    return np.array(outs[3]).reshape(a["groups"][1], a["groups"][0], NS, 2)


def _report_timeline(st: np.ndarray, n_splits: int) -> None:
    """st[h, group, slot, (globaltimer ns, clock)], low 32 bits of each."""
    gt = st[..., 0].astype(np.int64)
    ck = st[..., 1].astype(np.int64)
    # times after the first group's start, as signed differences of the 32-bit timer (which
    # wraps every 4.3 s) from one group's start
    rel = (gt - gt[0, 0, 0] + (1 << 31)) % (1 << 32) - (1 << 31)
    t0 = rel[:, :, 0].min()
    start = (rel[:, :, 0] - t0) / 1e3
    end = (rel[:, :, 12] - t0) / 1e3
    ghz = ((ck[:, :, 12] - ck[:, :, 0]) % (1 << 32)) / np.maximum(
        (gt[:, :, 12] - gt[:, :, 0]) % (1 << 32), 1
    )
    clock = float(np.median(ghz))
    coded, exact = np.s_[:, :n_splits], np.s_[:, n_splits]
    print(f"    SM clock {clock:.2f} GHz; {len(np.unique(st[:, :, NS - 1, 0]))} SMs used")
    print(
        f"    group start after the first: median {np.median(start[coded]):.1f} us, "
        f"max {start[coded].max():.1f} us (exact groups {start[exact].min():.1f}-"
        f"{start[exact].max():.1f}); last group ends at {end.max():.1f} us"
    )

    def phase(a: int, b: int, where, one_tile: bool = False) -> np.ndarray:
        reached = (gt[where][..., a] != 0) & (gt[where][..., b] != 0)
        if one_tile:  # groups whose split has one tile
            reached &= gt[where][..., 8] == 0
        d = ((ck[where][..., b] - ck[where][..., a]) % (1 << 32)) / (clock * 1e3)
        return d[reached]

    print("    coded groups, us per phase (median / 90% / max over groups):")
    for a in range(12):
        v = phase(a, a + 1, coded)  # 7 -> 8 spans the middle tiles too
        if v.size:
            print(
                f"      {STAMP_NAMES[a]:>18} -> {STAMP_NAMES[a + 1]:<18} {np.median(v):6.2f} "
                f"{np.percentile(v, 90):6.2f} {v.max():6.2f}  ({v.size} groups)"
            )
    v = phase(7, 12, coded, one_tile=True)
    if v.size:
        print(
            f"      {STAMP_NAMES[7]:>18} -> {STAMP_NAMES[12]:<18} {np.median(v):6.2f} "
            f"{np.percentile(v, 90):6.2f} {v.max():6.2f}  ({v.size} one-tile groups)"
        )
    last = phase(0, 12, coded)
    print(
        f"      {'start':>18} -> {'end':<18} {np.median(last):6.2f} "
        f"{np.percentile(last, 90):6.2f} {last.max():6.2f}"
    )
    print("    exact groups, us per phase (median / max):")
    for a, b in ((0, 13), (13, 14), (14, 15), (15, 12), (0, 12)):
        v = phase(a, b, exact)
        if v.size:
            name = f"{STAMP_NAMES[a]:>18} -> {STAMP_NAMES[b]:<18}"
            print(f"      {name} {np.median(v):6.2f} {v.max():6.2f}")


def timeline(args) -> None:
    if backend() != "cuda":
        raise SystemExit("timeline reads CUDA's %globaltimer and clock64: it runs on CUDA only")
    base = K._PARTIAL_BODY
    for kv in args.constants:  # e.g. TOKENS_PER_THREAD=2
        name, value = kv.split("=")
        if not isinstance(getattr(K, name, None), int):
            raise SystemExit(f"--constants: the kernels module has no integer setting {name}")
        setattr(K, name, int(value))
    arms = {"default": []} | {k: ABLATIONS[k] for k in args.arms}
    _check_cuts(base, arms.values())
    scale = 1 / math.sqrt(D)
    for n in args.contexts:
        caches, qs, pend = decode_inputs(n, 1, 1, H, G, D)
        for name, cut in arms.items():
            try:
                K._PARTIAL_BODY = _cut(base, cut)
                K.clear_memos(caches)
                a = K.attention_inputs(caches[0], qs[0], scale, pend[0], one_launch=False)
            finally:
                K._PARTIAL_BODY = base
                K.clear_memos(caches)
            src = stamped_source(a["sources"][0])
            kernel = mx.fast.cuda_kernel(
                name=src.kernel_name + "_stamped",
                input_names=list(src.inputs),
                output_names=list(src.outputs),
                source=src.cuda_body(),
                header=src.header("cuda"),
            )
            for cold in (False, True):
                for _ in range(args.calls):  # the last call is reported
                    st = _timeline_once(a, qs[0], kernel, cold)
                print(
                    f"context {n}: {name}, {'cold (L2 flushed)' if cold else 'warm'}: "
                    f"{a['groups'][0]} x {a['groups'][1]} threadgroups"
                )
                _report_timeline(st, a["n_splits"])


# The one-launch kernel (CUDA's default, tensor cores on): nine globaltimer stamps per
# threadgroup by thread 0, and its SM. 0: start; 1: its split done, before the count that picks
# the last threadgroup per KV head; 2: after that threadgroup's merge; 3: the end (after the
# exact threadgroup's encode); 4: a coded threadgroup's tile loop starts (its setup done: the
# codebook copies, q~ and the phase coefficients; 0 in the exact threadgroups, which have none).
# Then the merge's own phases (ONE_MERGE_STAMPS; 5 in every group, 6-8 in the merging one only):
# 5: the count read (fence, count, barrier); 6: the first chunk's maxima and sums loaded; 7: the
# heads' largest maxima known, the exact part's rows in flight; 8: the splits' output rows summed.
ONE_STAMPS = (
    ("  VQ_SHARED int s_last;\n", 1),
    ("  if (split == n_splits && iparams[EP] > 0) {", 2),
)
ONE_LOOP_STAMP = ("    for (int tile = t_begin; tile < t_end; tile += TT) {\n", 4)
ONE_MERGE_STAMPS = (
    ("  VQ_TG float* s_tail = reinterpret_cast<VQ_TG float*>(s_big);\n", 5),
    ("  // each head's largest max:", 6),
    ("  for (int c0 = 0; c0 < n_splits; c0 += ", 7),
    ("    // each head's sum, by one SIMD group", 8),
)
NSTAMP1 = 9
# With --setup, the coded threadgroups' setup in steps (the tensor-core path with the key mean:
# the default layout): 9 its own statements begin (its global reads issued from here), 10 the
# codebooks stored (their loads landed), 11 the phase setup's sines and cosines stored (and with
# --rope-in the RoPE table filled, and its barrier passed), 12 q~ formed, past its barrier,
# 13 past the W product's barrier; then the loop (4). Its phases are printed from stamp to
# stamp.
SETUP_STAMPS = (
    ("    float qx[GW][QE],", 9),
    ("    if (CENTER) {\n      for (int i = (int)vq_tid; i < 2 * (PC + NPC) * 32; i += TILE)", 10),
    (
        "    VQ_UNROLL\n    for (int gi = 0; gi < GW; ++gi) {\n      const int g = (int)vq_warp + "
        "gi * NWARPS;\n      if (g < G) {",
        11,
    ),
    ("    // the B fragments, the same for every SIMD group", 12),
    ("    if (VBLATE) {  // s_q and s_qt are read", 13),
)
NSTAMP1_SETUP = 14


def stamp_count(setup: bool) -> int:
    """Slots of a group's row of `tstamp`: NSTAMP1, or NSTAMP1_SETUP with the setup's stamps."""
    return NSTAMP1_SETUP if setup else NSTAMP1


SETUP_PHASES = (  # (name, stamp from, stamp to) of each coded group
    ("to its statements", 0, 9),
    ("loads landed, books stored", 9, 10),
    ("phase sincos (RoPE table)", 10, 11),
    ("q~ formed, barrier", 11, 12),
    ("W product, barrier", 12, 13),
    ("value book, first rows", 13, 4),
)
MERGE_PHASES = (  # (name, stamp from, stamp to) of the merging group
    ("fence and count", 1, 5),
    ("maxima and sums loaded", 5, 6),
    ("largest maxima", 6, 7),
    ("weights, rows summed", 7, 8),
    ("sums, Hadamard, output", 8, 2),
)
_ONE_STAMP_MACRO = r"""
#define VQ_STAMP1(k) if (vq_tid == 0) { \
  unsigned long long gt_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt_)); \
  const int at_ = ((int)vq_gy * (int)gridDim.x + (int)vq_gx) * (2 * NSTAMP1) + 2 * (k); \
  tstamp[at_] = (uint32_t)gt_; \
  tstamp[at_ + 1] = (uint32_t)(gt_ >> 32); }
"""


def one_launch_stamped(src, loop: bool = False, merge: bool = True, setup: bool = False):
    """The one-launch KernelSource `src` with the stamps of ONE_STAMPS and (with `merge`)
    ONE_MERGE_STAMPS (and with `loop` the tile loop's start, stamp 4: the tensor-core path only;
    with `setup` also SETUP_STAMPS) and two more outputs: `tstamp` (uint32 [group, NSTAMP1
    stamps (NSTAMP1_SETUP with `setup`), (low, high) word of the globaltimer's ns]) and `smid`
    (uint32 per group, the SM it ran on)."""
    body = src.body
    stamps = (*ONE_STAMPS, *ONE_MERGE_STAMPS) if merge else ONE_STAMPS
    if setup:
        stamps = (*stamps, *SETUP_STAMPS)
    for text, k in (*stamps, ONE_LOOP_STAMP) if loop else stamps:
        if body.count(text) != 1:
            raise SystemExit(f"the one-launch source no longer has exactly one {text!r}")
        body = body.replace(text, f"  VQ_STAMP1({k});\n{text}")
    sm = (
        "  if (vq_tid == 0) {\n    uint32_t sm_;\n"
        '    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));\n'
        "    smid[(int)vq_gy * (int)gridDim.x + (int)vq_gx] = sm_;\n  }\n"
    )
    macro = _ONE_STAMP_MACRO.replace("NSTAMP1", str(stamp_count(setup)))
    body = macro + "  VQ_STAMP1(0);\n" + sm + body + "\n  VQ_STAMP1(3);\n"
    return dataclasses.replace(src, outputs=(*src.outputs, "tstamp", "smid"), body=body)


def _report_one_launch(ts: np.ndarray, sm: np.ndarray, n_splits: int) -> None:
    """ts[h, group, stamp] in ns, sm[h, group]."""
    t = (ts - ts[..., 0].min()) / 1e3  # us after the first group's start
    start, done, merged, end, loop = (t[..., k] for k in range(5))
    coded, exact = np.s_[:, :n_splits], np.s_[:, n_splits]
    span = end.max()
    per_sm = {}
    for s_, a, b in zip(sm.ravel(), start.ravel(), end.ravel(), strict=True):
        per_sm.setdefault(int(s_), []).append((a, b))
    busy = []  # the union of each SM's groups' [start, end], as a fraction of the span
    for spans in per_sm.values():
        spans.sort()
        total, (lo, hi) = 0.0, spans[0]
        for a, b in spans[1:]:
            if a > hi:
                total, lo, hi = total + hi - lo, a, b
            else:
                hi = max(hi, b)
        busy.append((total + hi - lo) / span)
    counts = np.bincount([len(v) for v in per_sm.values()])
    merge = (merged - done).max(axis=1)  # per KV head: the one group that merged
    last = np.argmax(merged - done, axis=1)

    def q(v) -> str:
        v = np.asarray(v).ravel()
        return f"{np.median(v):6.1f} / {np.percentile(v, 90):6.1f} / {v.max():6.1f}"

    print(
        f"    span {span:.1f} us; {len(per_sm)} SMs, groups per SM "
        f"{ {i: int(c) for i, c in enumerate(counts) if c} }; SM busy (median / min) "
        f"{np.median(busy):.2f} / {min(busy):.2f}"
    )
    print("    us (median / 90% / max over groups):")
    print(f"      start                 {q(start)}")
    print(f"      coded groups' split   {q((done - start)[coded])}  (done at {q(done[coded])})")
    if (ts[..., 4][coded] > 0).all():  # the tensor-core path's loop stamp
        print(f"        setup (to the loop) {q((loop - start)[coded])}")
        print(f"        tile loop           {q((done - loop)[coded])}")
    print(f"      exact groups' part    {q((done - start)[exact])}  (done at {q(done[exact])})")
    print(f"      merge, last group     {q(merge)}  (the last group is exact in "
          f"{int((last == n_splits).sum())} of {len(last)} heads)")  # fmt: skip
    _print_phases(t, MERGE_PHASES, (np.arange(len(last)), last), q)  # the merging groups
    print(f"      encode, exact groups  {q((end - merged)[exact])}")
    print(f"      end                   {q(end)}")
    if ts.shape[-1] == NSTAMP1_SETUP:  # --setup: the coded groups' setup, stamp to stamp
        print("      the coded groups' setup:")
        _print_phases(t, SETUP_PHASES, coded, q)


def _print_phases(t: np.ndarray, phases: tuple, pick, q) -> None:
    """Each (name, stamp from, stamp to) of `phases` over the groups `pick` of t[h, group,
    stamp], summarised by `q`."""
    for name, a, b in phases:
        print(f"        {name:<22}{q((t[..., b] - t[..., a])[pick])}")


# timeline-one --cut: text of the one-launch source and what replaces it (timing only: "no-merge"
# leaves the output unmerged)
ONE_CUTS = {
    # the tail's count and hand-over without the merge itself: what the merge costs on its own
    "no-merge": [("  if (s_last) {\n    VQ_DEVICE_FENCE();\n", "  if (s_last) {\n#if 0\n")]
    + [("\n    if (vq_tid == 0) const_cast", "\n#endif\n    if (vq_tid == 0) const_cast")],
    # the merge without its output-row loads (each row read as its weight): what the rows cost
    "no-rows": [
        (
            "          const float4 o = vq_load_cg4(part_o + ((c0 + s) * HQ + hq0 + g) * D"
            " + 4 * (i % (D / 4)));\n",
            "          const float4 o = VQ_F4(w, w, w, w);\n",
        )
    ],
    # the merge without the value Hadamard's butterfly (in registers at head_dim 128; d39b81c's
    # in threadgroup memory, whose log2(D) barriers this cut timed, read `if (VHAD) {`)
    "no-hadamard": [
        (
            "    if (VHAD && true) {\n      // the value Hadamard's butterfly in registers",
            "    if (false) {\n      // the value Hadamard's butterfly in registers",
        )
    ],
    # one thread fences (after the barrier), as cooperative groups' grid sync does
    "one-fence": [
        (
            "  VQ_DEVICE_FENCE();  // this thread's part writes, device-wide before the count\n"
            "  VQ_BARRIER();\n  if (vq_tid == 0) {\n",
            "  VQ_BARRIER();\n  if (vq_tid == 0) {\n    VQ_DEVICE_FENCE();\n",
        ),
        ("  if (s_last) {\n    VQ_DEVICE_FENCE();\n", "  if (s_last) {\n"),
        (
            "    s_last = vq_atomic_inc(count) == (uint32_t)n_splits ? 1 : 0;\n",
            "    s_last = vq_atomic_inc(count) == (uint32_t)n_splits ? 1 : 0;\n"
            "    VQ_DEVICE_FENCE();\n",
        ),
    ],
}


def one_launch_cut(src, cut: str | None):
    """The one-launch KernelSource `src` with ONE_CUTS[cut]'s edits (none for None), each of
    which must match its text exactly once."""
    for old, new in ONE_CUTS[cut] if cut else []:
        if src.body.count(old) != 1:
            raise SystemExit(f"--cut {cut}: the source no longer has exactly one {old!r}")
        src = dataclasses.replace(src, body=src.body.replace(old, new))
    return src


def timeline_one(args) -> None:
    if backend() != "cuda":
        raise SystemExit("timeline-one reads CUDA's %globaltimer: it runs on CUDA only")
    import veloxquant.kernels as vk

    scale = 1 / math.sqrt(D)
    for n in args.contexts:
        caches, qs, pend = decode_inputs(n, 1, 1, H, G, D)
        cache = caches[0]
        cache._reserve_codes(1)  # the launch encodes in place, as fused_attention makes room
        if args.rope_in:  # a step whose window is full: it encodes the leaving token in
            # place, and rotates its own query and key (unrotated here) to the cache's position
            pend[0]["encode"] = (cache._ring, cache.sinks + cache._n_coded)
            pend[0]["rotate"] = (qs[0], pend[0]["new"][0], int(cache.offset))
        a = K.attention_inputs(cache, qs[0], scale, pend[0])
        if args.rope_in and not a["rope_in"]:
            raise SystemExit("--rope-in: this step's launch does not rotate (no key mean?)")
        if len(a["sources"]) != 1:
            raise SystemExit("the step is two launches here (kernels.ONE_LAUNCH off?)")
        src = a["sources"][0]
        src = one_launch_cut(src, args.cut)
        mma = K.mma_takes(K.layout_of(cache, H * G), a["r"])
        if args.setup and not mma:
            raise SystemExit("--setup stamps the tensor-core path's setup (kernels.MMA off?)")
        src = one_launch_stamped(src, loop=mma, setup=args.setup)
        kernel = vk.compiled(src, tuple(str(x.dtype) for x in a["partial"]))
        n_groups = a["groups"][0] * a["groups"][1]
        n_stamps = stamp_count(args.setup)
        stamps = (n_groups * 2 * n_stamps,)
        shapes = [*K.one_launch_shapes(a, qs[0].shape[1], D), stamps, (n_groups,)]
        dtypes = [mx.float32, qs[0].dtype, mx.uint32, mx.uint32]
        for cold in (False, True):
            for _ in range(args.calls):  # the last call is reported
                outs = _launch_stamped(a, kernel, shapes, dtypes, cold)
                mx.eval(outs)
            st = (
                np.array(outs[2])
                .astype(np.int64)
                .reshape(a["groups"][1], a["groups"][0], n_stamps, 2)
            )
            ts = st[..., 0] + (st[..., 1] << 32)
            sm = np.array(outs[3]).reshape(a["groups"][1], a["groups"][0])
            # an older revision's kernels (--kernels) may have an int TARGET_GROUPS only
            target = K.target_groups() if hasattr(K, "target_groups") else K.TARGET_GROUPS
            print(
                f"context {n}, {'cold (L2 flushed)' if cold else 'warm'}: {a['groups'][0]} x "
                f"{a['groups'][1]} threadgroups, MMA {K.MMA}, {target} target, "
                f"kernels {K.__file__}, cut {args.cut}"
            )
            _report_one_launch(ts, sm, a["n_splits"])


def tiles(args) -> None:
    default = (K.TILE, K.TOKENS_PER_THREAD)
    try:
        for n in args.contexts:
            caches, qs, pend = decode_inputs(n, SETS, LAYERS, H, G, D)
            ref = None
            for tile, r in TILES:
                K.TILE, K.TOKENS_PER_THREAD = tile, r
                K.clear_memos(caches)  # the phase table has TILE + 1 entries per pair
                lay = K.layout_of(caches[0], H * G)
                name = K.attention_kernel_sources(lay, mx.bfloat16, r)[0].kernel_name
                for _ in range(3):
                    out = K.decode_attention(caches[0], qs[0], 1 / math.sqrt(D), pend[0])[0]
                    mx.eval(out)
                out = out.astype(mx.float32)
                ref = out if ref is None else ref
                print(
                    f"context {n}: {tile} threads x {r} tokens: kernel {name}, "
                    f"{K.threadgroup_bytes(lay, r)} B threadgroup memory, "
                    f"max |difference| {mx.abs(out - ref).max().item():.3g}"
                )
    finally:
        K.TILE, K.TOKENS_PER_THREAD = default
        K.clear_memos()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["ablations", "tiles", "timeline", "timeline-one"])
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=9, help="ablations without --calls")
    p.add_argument(
        "--calls", type=int, default=0, help="ablations, timeline (default 3): calls per arm"
    )
    p.add_argument("--arms", nargs="*", default=[], choices=list(ABLATIONS), help="timeline")
    p.add_argument("--constants", nargs="*", default=[], help="timeline: NAME=INT overrides")
    p.add_argument("--cut", choices=list(ONE_CUTS), help="timeline-one: a cut of its source")
    p.add_argument("--kernels", help="timeline-one: another revision's vecinfer kernels.py")
    p.add_argument("--setup", action="store_true", help="timeline-one: the setup's phases too")
    p.add_argument(
        "--rope-in",
        action="store_true",
        help="timeline-one: the launch rotates the step's query and key (as in decode steps)",
    )
    args = p.parse_args()
    if backend() is None:
        raise SystemExit("no GPU kernel backend: the kernels cannot run here")
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    if args.mode == "ablations":
        args.contexts = args.contexts or [4096, 16384, 65536]
        ablations(args)
    elif args.mode == "timeline-one":
        global K
        if args.kernels:
            from ab_kernel_revisions import load_baseline

            K = load_baseline(args.kernels)
        args.contexts = args.contexts or [16384, 65536, 131072]
        args.calls = args.calls or 3
        for kv in args.constants:  # e.g. TARGET_GROUPS=1056
            name, value = kv.split("=")
            if not isinstance(getattr(K, name, ""), int | None):  # TARGET_GROUPS may be None
                raise SystemExit(f"--constants: the kernels module has no integer setting {name}")
            setattr(K, name, int(value))
        timeline_one(args)
    elif args.mode == "timeline":
        args.contexts = args.contexts or [16384, 65536]
        args.calls = args.calls or 3
        timeline(args)
    else:
        args.contexts = args.contexts or [16384, 65536]
        tiles(args)


if __name__ == "__main__":
    main()
