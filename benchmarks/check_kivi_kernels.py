"""KIVI's fused decode kernels on a GPU backend (MLX CUDA or Metal) against their pure-MLX twin,
then whole generations fused against transient. The CPU tests run the same kernels' sources in
an emulator (tests/test_kivi_kernels.py); this is the check on the real compilers and hardware.

1. one layer, random key-like data, several layouts (the 8B shape at KIVI-2 and mixed widths,
   SmolLM2's shape, widths crossing 32-bit words, D 256, G 16): the kernels' output against
   `reference_attention` on the same pending update, max |difference| / max |output|, at a
   short context (no store yet), a few splits and a long one, against TOLERANCE (layouts
   the backend's threadgroup memory cannot hold are skipped, as the cache would); on CUDA
   with the coded tiles on the tensor cores (`kernels.MMA`, where they take the layout) and
   on the CUDA cores;
2. a random-weight model (`--random-weights`, default SmolLM2's shape), bfloat16: 64 greedy
   tokens after a 300-token prompt with KIVI-2 and a mixed 2/4-bit allocation, fused against
   transient (the transient path's tokens feed both), tokens agreeing and the largest logit
   difference. Exits non-zero on a failure.

    python benchmarks/check_kivi_kernels.py [--random-weights benchmarks/configs/smollm2-135m.json]
"""

from __future__ import annotations

import argparse
import os

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from veloxquant import KVCacheConfig, make_cache
from veloxquant.kernels import backend
from veloxquant.methods.kivi import KIVICache
from veloxquant.methods.kivi import kernels as K
from _common import random_weights_model

LAYOUTS = [
    # (head_bits, head_dim, group_size, query heads per KV head)
    ([[2, 2]] * 8, 128, 64, 4),
    ([[2, 4], [4, 2]] * 4, 128, 64, 4),
    ([[2, 2]] * 3, 64, 32, 3),
    ([[3, 5], [5, 3], [1, 8]], 64, 32, 3),
    ([[5, 7], [6, 3]], 256, 16, 2),
]


def layer_case(head_bits, d, g, gq, n_tok, dtype, seed=0):
    rng = np.random.default_rng(seed)
    h = len(head_bits)
    c = KIVICache(np.array(head_bits), group_size=g, window=32, sinks=4)
    c.fused = True
    scale = rng.uniform(0.3, 4.0, size=(1, h, 1, d))
    for s in range(0, n_tok, 4096):
        m = min(4096, n_tok - s)
        k = mx.array((rng.normal(size=(1, h, m, d)) * scale).astype(np.float32))
        c.update_and_fetch(k, mx.array(rng.normal(size=(1, h, m, d)).astype(np.float32)))
        c._pending = None
    k1 = mx.array(rng.normal(size=(1, h, 1, d)).astype(np.float32)).astype(dtype)
    c.update_and_fetch(k1, k1)
    q = mx.array(rng.normal(size=(1, h * gq, 1, d)).astype(np.float32)).astype(dtype)
    return c, q


# the output is rounded to the model's dtype: bfloat16 keeps 8 significant bits (3.9e-3)
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}


def check_layers(dtype: mx.Dtype, contexts=(3, 5000, 70000)) -> list[str]:
    """Returns the failures (relative error over TOLERANCE, or a layout the backend cannot
    take that the kernels claim to)."""
    print("== one layer: kernels against the twin, max |diff| / max |out|")
    failures, tol = [], TOLERANCE[str(dtype).rsplit(".", 1)[-1]]
    for head_bits, d, g, gq in LAYOUTS:
        bits = sorted({tuple(b) for b in head_bits})
        why = [K.unsupported(K.Layout(d, g, kb, vb, gq), backend()) for kb, vb in bits]
        if any(why):
            print(f"  D {d} G {g} x{gq} bits {bits}: not taken on {backend()} ({why})")
            continue
        for n_tok in contexts:
            c, q = layer_case(head_bits, d, g, gq, n_tok, dtype)
            pending = c._pending
            want = K.reference_attention(c, q.astype(mx.float32), 0.1, None, pending)
            default_mma = K.MMA
            for mma in (True, False) if backend() == "cuda" else (False,):
                K.MMA = mma
                cores = [K.use_mma(K.Layout(d, g, kb, vb, gq)) for kb, vb in bits]
                got = K.decode_attention(c, q, 0.1, pending).astype(mx.float32)
                err = mx.abs(got - want).max().item() / mx.abs(want).max().item()
                on = ", ".join("tensor" if t else "CUDA" for t in cores)
                line = f"D {d} G {g} x{gq} bits {bits} tokens {n_tok:6d} ({on} cores): {err:.2e}"
                print(f"  {line}")
                if not err <= tol:  # NaN fails too
                    failures.append(line)
                if not any(cores):
                    break
            K.MMA = default_mma
    return failures


def check_generation(config_json: str, dtype: mx.Dtype) -> list[str]:
    """Prints the tokens that agree (they may differ at near-ties of the random model's
    logits); returns the failures: the kernels not taken, or NaN logits."""
    print(f"== 64 greedy tokens, fused against transient ({dtype} random weights)")
    failures = []
    model = random_weights_model(config_json, dtype)
    prompt = mx.array(np.random.default_rng(1).integers(0, 1000, size=(1, 300)))
    for name, config in (
        ("kivi2", KVCacheConfig(method="kivi", bits=2, group_size=64)),
        ("mixed3", KVCacheConfig(method="ratequant", bits=3, uncalibrated=True, group_size=64)),
    ):
        os.environ["VELOXQUANT_FUSED"] = "0"
        ref = make_cache(model, config)
        os.environ["VELOXQUANT_FUSED"] = "1"
        fused = make_cache(model, config)
        la = model(prompt, cache=ref)[:, -1]
        lb = model(prompt, cache=fused)[:, -1]
        same, worst = 0, 0.0
        for _ in range(64):
            worst = max(worst, mx.abs(la.astype(mx.float32) - lb.astype(mx.float32)).max().item())
            tok = mx.argmax(la, axis=-1)
            same += int(mx.array_equal(tok, mx.argmax(lb, axis=-1)).item())
            la = model(tok[:, None], cache=ref)[:, -1]
            lb = model(tok[:, None], cache=fused)[:, -1]
        paths = {c.last_attention for c in fused}
        print(f"  {name}: {same}/64 tokens the same, max |logit diff| {worst:.3g}, {paths}")
        if paths != {"kernel"} or worst != worst:  # the kernels did not run, or NaN logits
            failures.append(f"{name}: attention {paths}, max logit diff {worst}")
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--random-weights", default="benchmarks/configs/smollm2-135m.json")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    if backend() is None:
        raise SystemExit("no GPU backend: MLX runs on the CPU (the tests emulate the kernels)")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, backend {backend()}")
    failures = check_layers(dtype) + check_generation(args.random_weights, dtype)
    if failures:
        raise SystemExit("FAILED:\n  " + "\n  ".join(failures))
    print("all checks passed")


if __name__ == "__main__":
    main()
