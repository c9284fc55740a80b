"""Where a CPU forward pass of the default model goes, and what two streams buy.

Prints, with interleaved repeats (median [min, max]):
- one decoder layer of the model at `--tokens` tokens, op by op (each evaluated on its own),
  next to the whole layer;
- `mx.exp` against numpy's `np.exp` on the causal-attention score block of that layer
  ([H_q, S, S] float32): MLX's CPU elementwise transcendentals are scalar loops here;
- two sequences' forward passes one after the other on one stream against side by side on two
  CPU streams (`veloxquant._platform.cpu_lanes`), with a bit-for-bit check of the outputs.

    python benchmarks/bench_cpu_forward.py --model-dir artifacts/smollm2-135m/model
"""

from __future__ import annotations

import argparse
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from _common import fmt
from veloxquant._platform import cpu_lanes
from veloxquant.model_import import load_model


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        r = fn()
        if isinstance(r, (mx.array, list, tuple)):
            mx.eval(r)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    model, _ = load_model(args.model_dir)
    layer = model.layers[args.layer]
    attn = layer.self_attn
    s = args.tokens
    h = mx.random.normal((1, s, model.args.hidden_size), key=mx.random.key(0))
    mx.eval(h)
    n_q, n_kv, d = attn.n_heads, attn.n_kv_heads, model.args.head_dim
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).reshape(1, s, n_q, d).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(1, s, n_kv, d).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(1, s, n_kv, d).transpose(0, 2, 1, 3)
    mx.eval(x, q, k, v)
    gate = layer.mlp.gate_proj(x)
    mx.eval(gate)
    sdpa = mx.fast.scaled_dot_product_attention
    ops = {
        "q/k/v/o projections": lambda: [
            attn.q_proj(x),
            attn.k_proj(x),
            attn.v_proj(x),
            attn.o_proj(x),
        ],
        "rope q+k": lambda: [attn.rope(q), attn.rope(k)],
        "attention (sdpa, causal)": lambda: sdpa(q, k, v, scale=attn.scale, mask="causal"),
        "mlp gate/up/down GEMMs": lambda: [
            layer.mlp.gate_proj(x),
            layer.mlp.up_proj(x),
            layer.mlp.down_proj(gate),
        ],
        "silu (sigmoid) * up": lambda: mx.sigmoid(gate) * gate * gate,
        "whole layer": lambda: layer(h, mask="causal", cache=None),
    }
    times = {name: [] for name in ops}
    for _ in range(args.repeats):
        for name, fn in ops.items():
            times[name] += timed(fn, 1)
    print(f"one layer of {args.model_dir} at {s} tokens, float32, {mx.default_device()}:")
    for name, t in times.items():
        print(f"  {name:26s} {fmt(t, 1e3, ' ms')}")

    scores = mx.random.normal((n_q, s, s), key=mx.random.key(1))
    mx.eval(scores)
    host = np.array(scores)
    t_mx, t_np = [], []
    for _ in range(args.repeats):
        t_mx += timed(lambda: mx.exp(scores), 1)
        t_np += timed(lambda: np.exp(host), 1)
    print(f"exp over the score block [{n_q}, {s}, {s}] float32:")
    print(f"  mx.exp {fmt(t_mx, 1e3, ' ms')}   np.exp {fmt(t_np, 1e3, ' ms')}")

    lanes = cpu_lanes(2)
    ids = [
        mx.random.randint(0, model.args.vocab_size, (1, s), key=mx.random.key(2 + i))
        for i in range(2)
    ]
    one, two, same = [], [], True
    for _ in range(max(2, args.repeats // 2)):
        t = time.perf_counter()
        seq = [model.model(i) for i in ids]
        for out in seq:
            mx.eval(out)
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        side = []
        for i, lane in zip(ids, lanes * 2, strict=False):
            with mx.stream(lane):
                side.append(model.model(i))
        mx.eval(side)
        two.append(time.perf_counter() - t)
        same &= all(mx.array_equal(a, b).item() for a, b in zip(seq, side, strict=True))
    print(f"two {s}-token forward passes (no lm_head), {len(lanes)} lane(s):")
    print(f"  one stream {fmt(one, 1, ' s')}   side by side {fmt(two, 1, ' s')}")
    print(f"  outputs bit-identical: {same}")


if __name__ == "__main__":
    main()
