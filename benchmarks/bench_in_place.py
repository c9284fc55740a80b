"""How a fused VecInfer decode step updates the cache: in place, inside the attention's own
combine launch (`kernels.WRITE_IN_PLACE = True`, the default: a layer's step is its two
launches), or by MLX operations (`False`: the launch returns the leaving token's codes, which
two slice updates append, and two more write the new token into the window ring). One process,
one pre-filled cache set for both VecInfer arms, fp16 `KVCache` beside them; arms interleaved,
tokens/s of mlx-lm's `generate_step` (median [min, max]), the synchronous step and its host
graph-build and submission times.

    python benchmarks/bench_in_place.py \
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
    default = K.WRITE_IN_PLACE

    def write_in_place(flag: bool):
        def select():
            K.WRITE_IN_PLACE = flag

        return select

    for ctx in args.contexts:
        fp, vq = fp16_and_fused_caches(model, ctx)
        arms = {
            "fp16": (fp, write_in_place(default)),
            "in-place": (vq, write_in_place(True)),
            "slice-updates": (vq, write_in_place(False)),
        }
        result = interleaved_decode(model, arms, token, args.repeats, args.tokens)
        K.WRITE_IN_PLACE = default
        print(f"context {ctx}: {args.tokens} tokens, {args.repeats} interleaved repeats")
        print_decode(result)
        del fp, vq, arms
        mx.clear_cache()


if __name__ == "__main__":
    main()
