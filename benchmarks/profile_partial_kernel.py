"""Where VecInfer's partial decode-attention kernel spends its time, on a GPU (8B layer shape,
default layout, the synthetic caches of bench_kernels.py).

    python benchmarks/profile_partial_kernel.py ablations --contexts 4096 16384 65536
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        -k regex:attn_partial python benchmarks/profile_partial_kernel.py tiles

- `ablations`: wall time per layer (32 calls per eval, interleaved repeats, median [min, max])
  of the kernel with parts of its work cut out of the source, cumulatively: the value loop,
  all key sub-vectors but one, the exact tokens' threadgroup, the code loads, the phase term;
  and an empty kernel. The cut arms compute wrong output: they only time.
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
NO_VALUES = ("tl < tile_len; tl += TG) {", "tl < 0; tl += TG) {")
ONE_KEY_SUB = ("for (int m = 0; m < KM; ++m) {", "for (int m = 0; m < 1; ++m) {")
NO_EXACT = ("const int n_fp = n_sink + n_win + n_new;", "const int n_fp = 0;")
NO_LOADS = ("w[r][i] = kwords[row + i];", "w[r][i] = (uint32_t)(row + i);")
NO_SINCOS = ("VQ_SINCOS(mpos * inv_freq[j], sn, cs);", "sn = 0.0f; cs = 1.0f;")
NO_TABLE = ("float2 z = etab[j * (TILE + 1) + (int)vq_tid];", "float2 z = VQ_F2(1.0f, 0.0f);")
NO_CODED = ("if (split < n_splits) {", "if (split < 0) {")
ABLATIONS = {
    "default": [],
    "no value loop": [NO_VALUES],
    "+ 1 key sub-vector": [NO_VALUES, ONE_KEY_SUB],
    "+ no exact part": [NO_VALUES, ONE_KEY_SUB, NO_EXACT],
    "+ no code loads": [NO_VALUES, ONE_KEY_SUB, NO_EXACT, NO_LOADS],
    "+ no phase": [NO_VALUES, ONE_KEY_SUB, NO_EXACT, NO_LOADS, NO_SINCOS, NO_TABLE],
    "empty kernel": [NO_EXACT, NO_CODED],
}
TILES = [(128, 4), (128, 2), (256, 2), (256, 1), (256, 4)]


def ablations(args) -> None:
    base = K._PARTIAL_BODY
    for cut in ABLATIONS.values():
        for old, _ in cut:
            if base.count(old) != 1:
                raise SystemExit(f"the kernel source no longer has exactly one {old!r}")
    for n in args.contexts:
        caches, qs, pend = decode_inputs(n, SETS, LAYERS, H, G, D)

        def arm(cut, caches=caches, qs=qs, pend=pend):
            def run():
                body = base
                for old, new in cut:
                    body = body.replace(old, new)
                K._PARTIAL_BODY = body
                K.clear_memos(caches)  # the sources are rebuilt from the body above
                outs = [
                    K.decode_attention(caches[i % SETS], qs[i], 1 / math.sqrt(D), pend[i % SETS])
                    for i in range(LAYERS)
                ]
                mx.eval([o[0] for o in outs])

            return run

        try:
            times = time_arms({k: arm(v) for k, v in ABLATIONS.items()}, args.repeats)
        finally:
            K._PARTIAL_BODY = base
            K.clear_memos(caches)
        print(f"context {n}: wall time per layer")
        for k, v in times.items():
            print(f"  {k:<20} {fmt([t / LAYERS for t in v], 1e6, ' us')}")


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
