"""Peak memory of a chunked prefill, transient against fused, for the caches whose fused path
attends a piece of the compressed past at a time (KIVI, CommVQ, VecInfer): the transient path
builds the whole dequantized past and mlx-lm's attention scores over it for every chunk; the
fused twin holds one piece of it (`PIECE_TOKENS`, lowered here so the effect shows at CPU
sizes); VecInfer's CPU kernel (where the CPU extension is built) holds no piece at all.

Random weights of a config's architecture (timings and memory do not depend on them), float32,
uncalibrated CommVQ and VecInfer (the same shapes as calibrated ones). Peak MLX memory over the
memory held before the prefill (weights), each arm in turn on fresh caches.

    python benchmarks/bench_prefill_memory.py \
        --random-weights benchmarks/configs/smollm2-135m.json --tokens 4096 --chunk 512 --piece 512
"""

from __future__ import annotations

import argparse
import os
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from veloxquant import KVCacheConfig, cpu_kernels, make_cache
from veloxquant.methods.commvq import kernels as commvq_kernels
from veloxquant.methods.kivi import kernels as kivi_kernels
from veloxquant.methods.vecinfer import kernels as vecinfer_kernels
from _common import random_weights_model

CONFIGS = {
    "kivi2": KVCacheConfig(method="kivi", bits=2),
    "commvq": KVCacheConfig(method="commvq", uncalibrated=True),
    "vecinfer": KVCacheConfig(method="vecinfer", uncalibrated=True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--random-weights", metavar="CONFIG_JSON", required=True)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--piece", type=int, default=512, help="the twins' PIECE_TOKENS")
    args = p.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    kivi_kernels.PIECE_TOKENS = commvq_kernels.PIECE_TOKENS = args.piece
    vecinfer_kernels.PIECE_TOKENS = args.piece
    rng = np.random.default_rng(0)
    tokens = mx.array(rng.integers(0, 1000, (1, args.tokens)).astype(np.int32))
    print(f"{args.tokens} tokens in chunks of {args.chunk}, pieces of {args.piece}")
    # (VELOXQUANT_FUSED, VecInfer's CPU kernel on): transient, the twin, the CPU kernel
    arms = [("0", False), ("1", False)]
    for name, config in CONFIGS.items():
        kernel_arm = name == "vecinfer" and cpu_kernels.available()
        for fused, cpu_kernel in arms + ([("1", True)] if kernel_arm else []):
            os.environ["VELOXQUANT_FUSED"] = fused
            vecinfer_kernels.CPU_KERNEL = cpu_kernel
            caches = make_cache(model, config)
            mx.clear_cache()
            mx.reset_peak_memory()
            start = mx.get_active_memory()
            t0 = time.perf_counter()
            for s in range(0, args.tokens, args.chunk):
                mx.eval(model(tokens[:, s : s + args.chunk], cache=caches))
            peak = (mx.get_peak_memory() - start) / 2**20
            path = {c.last_attention or "transient" for c in caches}
            kv = sum(c.nbytes for c in caches) / 2**20
            print(
                f"  {name:<8} {'fused' if fused == '1' else 'transient':<9} peak over the "
                f"weights {peak:7.1f} MiB (cache {kv:.1f} MiB), {time.perf_counter() - t0:.1f} s,"
                f" attention {sorted(path)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
