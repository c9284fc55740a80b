"""Peak memory of RateQuant's Fisher gradient pass (one window) on a random-weight model of a
given shape with a reduced number of layers: where its memory goes, per layer and per token.

    python benchmarks/probe_fisher_memory.py --config benchmarks/configs/llama3-8b.json \
        --layers 2 4 --tokens 256 512 --dtype bfloat16 [--attention unfused]

`--attention unfused` swaps mlx-lm's attention call for plain matmul + softmax operations, to
tell the fused SDPA's gradient apart from the rest of the graph.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from _common import random_weights_model
from veloxquant.methods.ratequant import fisher


def unfused_attention(queries, keys, values, cache, scale, mask, sinks=None):
    n_rep = queries.shape[1] // keys.shape[1]
    if n_rep > 1:
        keys = mx.repeat(keys, n_rep, axis=1)
        values = mx.repeat(values, n_rep, axis=1)
    scores = (queries * scale) @ keys.swapaxes(-1, -2)
    if isinstance(mask, str):
        q_len, k_len = scores.shape[-2:]
        rows = mx.arange(k_len - q_len, k_len)[:, None]
        mask = rows >= mx.arange(k_len)[None]
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-1e9, scores.dtype))
    return mx.softmax(scores.astype(mx.float32), axis=-1).astype(values.dtype) @ values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, nargs="+", default=[256])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mode", default="runtime", choices=fisher.MODES)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--attention", default="fused", choices=["fused", "unfused"])
    args = p.parse_args()
    config = json.loads(Path(args.config).read_text())
    print(
        f"mlx {mx.__version__}, device {mx.default_device()}, {args.dtype}, {args.mode}, "
        f"chunk {args.chunk}, attention {args.attention}"
    )
    for layers in args.layers:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps({**config, "num_hidden_layers": layers}))
            model = random_weights_model(path, getattr(mx, args.dtype))
        if args.attention == "unfused":  # the name the model's own module bound at import
            sys.modules[type(model).__module__].scaled_dot_product_attention = unfused_attention
        weights = mx.get_active_memory()
        for n in args.tokens:
            mx.clear_cache()
            mx.reset_peak_memory()
            tokens = np.random.default_rng(0).integers(0, config["vocab_size"], n + 1)
            fisher.window_gradients(
                model,
                mx.array(tokens.astype(np.int32)),
                args.chunk,
                mode=args.mode,
                window=32,
                sinks=4,
                group_size=64,
            )
            over = (mx.get_peak_memory() - weights) / 2**30
            print(
                f"layers {layers:3d} tokens {n:5d}: weights {weights / 2**30:.2f} GiB, "
                f"peak over weights {over:.2f} GiB ({over / layers:.3f} per layer)",
                flush=True,
            )
        del model


if __name__ == "__main__":
    main()
