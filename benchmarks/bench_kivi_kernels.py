"""KIVI's fused decode attention one layer at a time, against bf16 SDPA of the same context.

Per layer (Llama-3-8B shape: 32 query heads, 8 KV heads, D = 128, bf16 queries; G 64, 4 sinks,
the default window): the partial + combine kernels (`kernels.decode_attention`) at KIVI-2 and
at a mixed 2/4-bit allocation (the coded tiles on the tensor cores, `kernels.MMA`, and with
--cuda-cores also on the CUDA cores), the transient path's dequantize + SDPA, and
`mx.fast.scaled_dot_product_attention` on bf16 K/V of the same length. Each timed eval runs
`--layers` independent calls rotating over `--sets` distinct caches, so that the codes do not
sit in L2 between calls; repeats are interleaved over the arms; median [min, max] per call.
Bandwidth = resident store bytes (codes, scales, zeros) / time. GPU only.

    python benchmarks/bench_kivi_kernels.py --contexts 4096 16384 65536 131072
"""

from __future__ import annotations

import argparse
import math

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from veloxquant.kernels import backend
from veloxquant.methods.kivi import KIVICache
from veloxquant.methods.kivi import kernels as K
from _common import fmt
from bench_kernels import time_arms

LAYOUTS = {"kivi2": [[2, 2]], "mixed3": [[2, 4], [4, 2]]}


def filled_layer(head_bits: list, h: int, d: int, n_tok: int, seed: int) -> KIVICache:
    """A KIVI cache of one layer holding n_tok random key-like tokens, then one decode token;
    its `_pending` is what the fused attention reads."""
    rng = np.random.default_rng(seed)
    bits = np.array([head_bits[i % len(head_bits)] for i in range(h)])
    c = KIVICache(bits, group_size=64)
    c.fused = True
    channel_scale = mx.array(rng.uniform(0.3, 4.0, size=(1, h, 1, d)).astype(np.float32))
    for s in range(0, n_tok, 8192):
        m = min(8192, n_tok - s)
        k = (mx.random.normal((1, h, m, d)) * channel_scale).astype(mx.bfloat16)
        v = mx.random.normal((1, h, m, d)).astype(mx.bfloat16)
        c.update_and_fetch(k, v)
        c._pending = None
        mx.eval(c.state)
    one = mx.random.normal((1, h, 1, d)).astype(mx.bfloat16)
    c.update_and_fetch(one, one)
    mx.eval(c.state)
    return c


def store_bytes(c: KIVICache) -> int:
    """Bytes of the coded store alone (codes, scales, zeros: what the partial kernel streams)."""
    return sum(a.nbytes for st in c.store.values() for b in st.values() for a in b.values())


def bench_context(args, n_tok: int) -> dict:
    h, gq, d, layers = args.kv_heads, args.group, args.head_dim, args.layers
    scale = 1 / math.sqrt(d)
    qs = [(mx.random.normal((1, h * gq, 1, d)) * 2).astype(mx.bfloat16) for _ in range(layers)]
    caches = {
        name: [filled_layer(bits, h, d, n_tok, seed=i) for i in range(args.sets)]
        for name, bits in LAYOUTS.items()
    }
    total = n_tok + 1
    kv = [
        (
            mx.random.normal((1, h, total, d)).astype(mx.bfloat16),
            mx.random.normal((1, h, total, d)).astype(mx.bfloat16),
        )
        for _ in range(args.sets)
    ]
    mx.eval(qs, kv)

    def fused(name: str, groups: int | None = K.TARGET_GROUPS, mma: bool = K.MMA):
        cs = caches[name]

        def run():
            K.TARGET_GROUPS = groups
            K.MMA = mma
            mx.eval(
                [
                    K.decode_attention(cs[i % args.sets], qs[i], scale, cs[i % args.sets]._pending)
                    for i in range(layers)
                ]
            )

        return run

    def transient(name: str):
        cs = caches[name]

        def run():
            outs = []
            for i in range(layers):
                # the store dequantized whole (the exact tokens left out), as every transient
                # step does
                k, v = cs[i % args.sets].dequantized()
                outs.append(mx.fast.scaled_dot_product_attention(qs[i], k, v, scale=scale))
            mx.eval(outs)

        return run

    def sdpa():
        mx.eval(
            [
                mx.fast.scaled_dot_product_attention(
                    qs[i], kv[i % args.sets][0], kv[i % args.sets][1], scale=scale
                )
                for i in range(layers)
            ]
        )

    arms = {"sdpa_bf16": sdpa}
    default_groups, default_mma = K.TARGET_GROUPS, K.MMA
    for name in LAYOUTS:
        arms[f"{name}_fused"] = fused(name)
        if args.cuda_cores:
            arms[f"{name}_fused_cc"] = fused(name, mma=False)
        for groups in args.target_groups:  # the split count's target, swept
            arms[f"{name}_fused_g{groups}"] = fused(name, groups)
        if args.transient:
            arms[f"{name}_transient"] = transient(name)
    times = time_arms(arms, args.repeats)
    K.TARGET_GROUPS, K.MMA = default_groups, default_mma
    row = {
        "context": total,
        "per_layer_s": {k: [t / layers for t in v] for k, v in times.items()},
        "bytes": {name: store_bytes(cs[0]) for name, cs in caches.items()},
        "bf16_kv_bytes": total * h * d * 2 * 2,
    }
    caches.clear()
    kv.clear()
    mx.clear_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32, help="calls per timed eval")
    p.add_argument("--sets", type=int, default=4, help="distinct caches rotated over")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--transient", action="store_true", help="also time dequantize + SDPA")
    p.add_argument(
        "--cuda-cores", action="store_true", help="also the CUDA cores' kernel (K.MMA False)"
    )
    p.add_argument(
        "--target-groups", type=int, nargs="*", default=[], help="also these TARGET_GROUPS"
    )
    args = p.parse_args()
    if backend() is None:
        raise SystemExit("no GPU backend: MLX runs on the CPU (bench_kivi_decode.py: CPU ratios)")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, backend {backend()}")
    print(f"per layer: {args.kv_heads} KV heads x{args.group} query heads, D {args.head_dim}, G 64")
    for n_tok in args.contexts:
        row = bench_context(args, n_tok)
        per = row["per_layer_s"]
        sdpa_med = sorted(per["sdpa_bf16"])[len(per["sdpa_bf16"]) // 2]
        mib = row["bf16_kv_bytes"] / 2**20
        print(f"context {row['context']}: bf16 K/V {mib:.1f} MiB per layer")
        for arm, ts in per.items():
            med = sorted(ts)[len(ts) // 2]
            name = arm.split("_")[0]
            nbytes = row["bytes"].get(name, row["bf16_kv_bytes"])
            print(
                f"  {arm:<16} {fmt(ts, 1e6, ' us')}  {nbytes / med / 1e9:7.0f} GB/s"
                f"  sdpa / this {sdpa_med / med:.2f}x"
            )


if __name__ == "__main__":
    main()
