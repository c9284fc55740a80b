"""KIVI / RateQuant decode against fp16: tok/s of mlx-lm's `generate_step` on pre-filled caches
and resident bytes, with the packed store attended three ways:
- `transient`: the store dequantized whole every step, then mlx-lm's attention (the fallback);
- `fused`: veloxquant.attention routes the attention to the cache (`KIVICache.fused_attention`):
  the partial + combine kernels where MLX runs on a GPU, the pure-MLX twin on the CPU.

Arms: fp16 `KVCache`; uniform KIVI-2 (G 64, the RateQuant runtime's group); a mixed
allocation at b̄ = 3 (RateQuant's uniform reference: keys and values each an interleaved 2/4-bit
split over the heads, so every layer launches two partial kernels). Each KIVI arm on both
paths, and with --cuda-cores each fused arm again with its coded tiles on the CUDA cores
(`kernels.MMA = False`; the tensor cores are the default). Timings are interleaved over
--repeats rounds (median [min, max]); ratios are per round.

    # GPU (8B shape, bf16)
    python benchmarks/bench_kivi_decode.py --random-weights benchmarks/configs/llama3-8b.json \
        --dtype bfloat16 --contexts 4096 16384 65536 131072 [--no-transient]
    # CPU ratios (the twin on the fused arms)
    python benchmarks/bench_kivi_decode.py --random-weights benchmarks/configs/smollm2-135m.json \
        --dtype float32 --contexts 1024 4096 16384 --tokens 8 --repeats 3
"""

from __future__ import annotations

import copy

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

from veloxquant import KVCacheConfig, attention
from veloxquant.methods.kivi import kernels as K
from _common import random_weights_model
from bench_generate import decode_arguments, interleaved_decode, print_decode
from bench_vecinfer import filled_caches

CONFIGS = {
    "kivi2": KVCacheConfig(method="kivi", bits=2, group_size=64),
    "mixed3": KVCacheConfig(method="ratequant", bits=3, uncalibrated=True, group_size=64),
}


def fused_copy(caches: list) -> list:
    """The same filled caches on the fused path (a copy's flushes do not reach the original)."""
    out = []
    for c in caches:
        d = copy.copy(c)
        d.fused = True
        out.append(d)
    return out


def main() -> None:
    p = decode_arguments(__doc__, contexts=[4096, 16384], repeats=3)
    p.add_argument(
        "--cuda-cores",
        action="store_true",
        help="also each fused arm with its coded tiles on the CUDA cores (kernels.MMA False)",
    )
    p.add_argument(
        "--no-transient",
        action="store_true",
        help="fused arms only (the transient arms' dequantized past does not fit an 80 GB card "
        "beside the others at 64K on the 8B shape)",
    )
    args = p.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    token = mx.array([[42]])
    attention.install()
    if not attention.routes(model):
        raise RuntimeError(f"{type(model).__module__}: attention is not routed to fused caches")
    for ctx in args.contexts:
        arms = {"fp16": (filled_caches(model, None, ctx), lambda: None)}
        for name, config in CONFIGS.items():
            caches = filled_caches(model, config, ctx, fused=True)
            if not args.no_transient:
                arms[f"{name}_transient"] = (caches, lambda: None)
            arms[f"{name}_fused"] = (fused_copy(caches), lambda: setattr(K, "MMA", True))
            if args.cuda_cores:
                arms[f"{name}_fused_cc"] = (fused_copy(caches), lambda: setattr(K, "MMA", False))
        result = interleaved_decode(model, arms, token, args.repeats, args.tokens)
        print(f"context {ctx}: {args.tokens} generated tokens, {args.repeats} interleaved repeats")
        print_decode(result)
        fp = sum(c.nbytes for c in arms["fp16"][0])
        for name in CONFIGS:
            kv = sum(c.nbytes for c in arms[f"{name}_fused"][0])
            paths = {c.last_attention for c in arms[f"{name}_fused"][0]}
            print(
                f"  KV bytes (from the arrays) {name} / fp16: {kv / fp:.3f}x "
                f"({kv / 2**20:.1f} / {fp / 2**20:.1f} MiB); fused attention {paths}"
            )
        del arms
        mx.clear_cache()


if __name__ == "__main__":
    main()
