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

from veloxquant.methods.vecinfer import kernels as K
from _common import random_weights_model
from bench_generate import decode_arguments, fp16_and_fused_caches, interleaved_decode, print_decode


def main() -> None:
    args = decode_arguments(__doc__, contexts=[16384, 65536], repeats=5).parse_args()

    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    token = mx.array([[42]])
    default = K.ENCODE_IN_COMBINE

    def encode_in_combine(flag: bool):
        def select():
            K.ENCODE_IN_COMBINE = flag

        return select

    for ctx in args.contexts:
        fp, vq = fp16_and_fused_caches(model, ctx)
        arms = {
            "fp16": (fp, encode_in_combine(default)),
            "in-combine": (vq, encode_in_combine(True)),
            "own-launch": (vq, encode_in_combine(False)),
        }
        result = interleaved_decode(model, arms, token, args.repeats, args.tokens)
        K.ENCODE_IN_COMBINE = default
        print(f"context {ctx}: {args.tokens} tokens, {args.repeats} interleaved repeats")
        print_decode(result)
        del fp, vq, arms
        mx.clear_cache()


if __name__ == "__main__":
    main()
