"""VecInfer's one-launch kernel rotating the decode step's own query and key (the model's rope
modules tapped, `veloxquant.rope.RopeTap`) against the model's own rotation, on the GPU: a
random-weight model with caches of the default calibrated layout (`default_layout_caches`:
keys coded around a RoPE-rotated mean, so the caches know the model's RoPE), and copies of
them, decoded step for step from the same greedy tokens (the copies' with the model's
rotation). Prints, per context, how many of the steps' greedy tokens agree and at how many the
logits are the same bit for bit (the kernel rounds its rotation where MLX's rope kernel does,
`vq_rope_in`), the largest logit difference relative to the largest logit, and who rotated
(`last_rope`: the kernel for the tapped caches, the model for the copies) and whether the
caches' steps were deferred (the rope ops not built at all; `--no-defer` builds them,
`veloxquant.rope.DEFER`). The weights are seeded, so two runs decode the same tokens. ncu
counts the launches a step saves (`h200_mma.sh rope`).

    python benchmarks/check_rope_in_kernel.py --random-weights benchmarks/configs/llama3-8b.json \
        --contexts 4096 65536 --steps 32 [--no-defer]
"""

from __future__ import annotations

import argparse
import copy

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

from veloxquant import rope
from veloxquant.methods.vecinfer import kernels as K
from _common import random_weights_model
from bench_generate import default_layout_caches


def compare(model, context: int, steps: int) -> None:
    caches = default_layout_caches(model, context)  # taps the model's rope modules
    copies = [copy.copy(c) for c in caches]
    token = mx.array([[42]])
    agree, same, worst, rotated_by = 0, 0, 0.0, set()
    for _ in range(steps):
        K.ROPE_IN_KERNEL = True
        got = model(token, cache=caches)[:, -1].astype(mx.float32)
        K.ROPE_IN_KERNEL = False
        want = model(token, cache=copies)[:, -1].astype(mx.float32)
        K.ROPE_IN_KERNEL = True
        mx.eval(got, want)
        rotated_by |= {(c.last_rope, t.last_rope) for c, t in zip(caches, copies, strict=True)}
        worst = max(worst, (mx.abs(got - want).max() / mx.abs(want).max()).item())
        agree += int(mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item())
        same += int(mx.array_equal(got, want).item())
        token = mx.argmax(want, axis=-1)[:, None]
    print(
        f"context {context}: greedy tokens agree at {agree} of {steps} steps, logits identical at "
        f"{same}; largest logit "
        f"difference / largest logit {worst:.2e}; rotated by (tapped, copies) {sorted(rotated_by)}"
        f"; deferred {sorted({type(c.offset).__name__ for c in caches})}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--random-weights", metavar="CONFIG_JSON", required=True)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--no-defer", action="store_true", help="rope.DEFER off: rope ops built")
    args = p.parse_args()
    rope.DEFER = not args.no_defer
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    for context in args.contexts:
        compare(model, context, args.steps)
        mx.clear_cache()


if __name__ == "__main__":
    main()
