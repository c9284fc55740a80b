"""Where a fused VecInfer decode step encodes the token leaving the window: inside the combine
launch of the attention (`ENCODE_IN_COMBINE = True`, the default: one launch fewer per layer)
or in the encoder's own launch, which the GPU may run alongside the attention. One process,
one pre-filled cache set for both VecInfer arms, fp16 `KVCache` beside them; arms interleaved,
tokens/s of mlx-lm's `generate_step` (median [min, max]), the synchronous step and its host
graph-build time.

    python benchmarks/bench_encode_in_combine.py \
        --random-weights benchmarks/configs/llama3-8b.json --dtype bfloat16 --contexts 16384 65536
"""

from __future__ import annotations

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

from veloxquant import KVCacheConfig
from veloxquant.methods.vecinfer import kernels as K
from _common import fmt, random_weights_model
from bench_generate import build_and_step, decode_arguments, tokens_per_second
from bench_vecinfer import filled_caches


def main() -> None:
    args = decode_arguments(__doc__, contexts=[16384, 65536], repeats=5).parse_args()

    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    token = mx.array([[42]])
    default = K.ENCODE_IN_COMBINE
    for ctx in args.contexts:
        fp = filled_caches(model, None, ctx)
        vq = filled_caches(model, KVCacheConfig(method="vecinfer", uncalibrated=True), ctx)
        for c in vq:
            c.fused = True
        arms = {"fp16": (fp, default), "in-combine": (vq, True), "own-launch": (vq, False)}
        for caches, flag in arms.values():  # warm-up: compile, allocate
            K.ENCODE_IN_COMBINE = flag
            build_and_step(model, caches, token)
        names = list(arms)
        rates, steps, builds = ({n: [] for n in names} for _ in range(3))
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                caches, flag = arms[name]
                K.ENCODE_IN_COMBINE = flag
                rates[name].append(tokens_per_second(model, caches, args.tokens))
                b, s = build_and_step(model, caches, token)
                builds[name].append(b)
                steps[name].append(s)
        K.ENCODE_IN_COMBINE = default
        print(f"context {ctx}: {args.tokens} tokens, {args.repeats} interleaved repeats")
        for name in names:
            print(
                f"  {name:<10} {fmt(rates[name], unit=' tok/s')}"
                f"  step {fmt(steps[name], 1e3, ' ms')}"
                f"  host build {fmt(builds[name], 1e3, ' ms')}"
            )
        for name in names[1:]:
            ratio = [a / b for a, b in zip(rates[name], rates["fp16"], strict=True)]
            print(f"  tok/s {name} / fp16: {fmt(ratio, unit='x')}")
        del fp, vq, arms
        mx.clear_cache()


if __name__ == "__main__":
    main()
