"""Where VecInfer's partial decode-attention kernel spends its time, on a GPU (8B layer shape,
default layout, the synthetic caches of bench_kernels.py).

    python benchmarks/profile_partial_kernel.py ablations --contexts 4096 16384 65536
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        -k regex:attn_partial python benchmarks/profile_partial_kernel.py ablations --calls 3
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        -k regex:attn_partial python benchmarks/profile_partial_kernel.py tiles

- `ablations`: the kernel with parts of its work cut out of the source (each arm its own set of
  cuts: the exact RoPE-phase pairs, the whole phase, the value sums, all key sub-vectors but
  one, the exact tokens' threadgroup, and combinations). Without `--calls`, wall time per
  layer (32 calls per eval, interleaved repeats, median [min, max]); with it, that many calls
  per arm for a profiler (`--cache-control all` for cold caches, as in a decode step, where
  the other layers' weights have evicted this layer's codes), each arm's kernel name printed
  to match the profiler's rows. The cut arms compute wrong output: they only time.
- `tiles`: three calls per (threads per threadgroup, tokens per thread) setting, for a
  profiler; prints each setting's kernel name (to match the profiler's rows) and its output's
  largest difference from the default setting's.
"""

from __future__ import annotations

import argparse
import math

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

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
    (
        "for (int m = 0; m < KM; ++m) {\n        float4 qv",
        "for (int m = 0; m < 1; ++m) {\n        float4 qv",
    )
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


def _cut(base: str, cuts: list) -> str:
    for old, new in cuts:
        base = base.replace(old, new)
    return base


def ablations(args) -> None:
    base = K._PARTIAL_BODY
    for cut in ABLATIONS.values():
        for old, _ in cut:
            if base.count(old) != 1:
                raise SystemExit(f"the kernel source no longer has exactly one {old!r}")
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
    p.add_argument("mode", choices=["ablations", "tiles"])
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--calls", type=int, default=0, help="ablations: this many calls per arm")
    args = p.parse_args()
    if backend() is None:
        raise SystemExit("no GPU kernel backend: the kernels cannot run here")
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    if args.mode == "ablations":
        args.contexts = args.contexts or [4096, 16384, 65536]
        ablations(args)
    else:
        args.contexts = args.contexts or [16384, 65536]
        tiles(args)


if __name__ == "__main__":
    main()
