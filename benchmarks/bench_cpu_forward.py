"""Where a CPU forward pass of the default model goes, and what two streams buy.

Prints, with interleaved repeats (median [min, max]):
- one decoder layer of the model at `--tokens` tokens, op by op (each evaluated on its own),
  next to the whole layer;
  MLX's attention against `veloxquant.attention.cpu_attention` (the same ops, the causal
  softmax from `veloxquant.cpu_kernels`), mlx-lm's swiglu against the extension's, and the
  whole layer both ways (`cpu_kernels.vectorized()`), with a bit-for-bit check;
- `mx.exp`, `mx.softmax` and `mx.logsumexp` against the extension's (and numpy's `np.exp`) on
  the causal-attention score block of that layer ([H_q, S, S] float32) and on the
  vocabulary's logits of the tokens: MLX's CPU elementwise transcendentals are scalar loops
  here;
- two sequences' forward passes (lm_head and log-softmax included, as evaluate runs them) one
  after the other on one stream against side by side on two CPU streams
  (`veloxquant._platform.cpu_lanes`), each with MLX's ops and with the extension's, with a
  bit-for-bit check of the outputs.

    python benchmarks/bench_cpu_forward.py --model-dir artifacts/smollm2-135m/model
"""

from __future__ import annotations

import argparse
import contextlib
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from _common import fmt
from mlx_lm.models.activations import swiglu

from veloxquant import attention, cpu_kernels
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
    if not cpu_kernels.available():
        raise SystemExit("build the extension first: veloxquant build-cpu-kernels")

    def native_layer():
        with cpu_kernels.vectorized():
            return layer(h, mask="causal", cache=None)

    ops = {
        "q/k/v/o projections": lambda: [
            attn.q_proj(x),
            attn.k_proj(x),
            attn.v_proj(x),
            attn.o_proj(x),
        ],
        "rope q+k": lambda: [attn.rope(q), attn.rope(k)],
        "attention (sdpa, causal)": lambda: sdpa(q, k, v, scale=attn.scale, mask="causal"),
        "attention (cpu_attention)": lambda: attention.cpu_attention(q, k, v, attn.scale, "causal"),
        "mlp gate/up/down GEMMs": lambda: [
            layer.mlp.gate_proj(x),
            layer.mlp.up_proj(x),
            layer.mlp.down_proj(gate),
        ],
        "swiglu (mlx-lm)": lambda: swiglu(gate, gate),
        "swiglu (cpu_kernels)": lambda: cpu_kernels.swiglu(gate, gate),
        "whole layer": lambda: layer(h, mask="causal", cache=None),
        "whole layer, cpu_kernels": native_layer,
    }
    times = {name: [] for name in ops}
    for _ in range(args.repeats):
        for name, fn in ops.items():
            times[name] += timed(fn, 1)
    print(f"one layer of {args.model_dir} at {s} tokens, float32, {mx.default_device()}:")
    for name, t in times.items():
        print(f"  {name:26s} {fmt(t, 1e3, ' ms')}")
    same_attn = mx.array_equal(
        sdpa(q, k, v, scale=attn.scale, mask="causal"),
        attention.cpu_attention(q, k, v, attn.scale, "causal"),
    ).item()
    same_mlp = mx.array_equal(swiglu(gate, gate), cpu_kernels.swiglu(gate, gate)).item()
    same_layer = mx.array_equal(layer(h, mask="causal", cache=None), native_layer()).item()
    print(f"  bit-identical: attention {same_attn}, swiglu {same_mlp}, whole layer {same_layer}")

    scores = mx.random.normal((n_q, s, s), key=mx.random.key(1))
    mx.eval(scores)
    host = np.array(scores)
    raw = host.tobytes()
    native = cpu_kernels._load()
    logits = mx.random.normal((1, s, model.args.vocab_size), key=mx.random.key(2)) * 3
    mx.eval(logits)
    rows = {
        "mx.exp": lambda: mx.exp(scores),
        "cpu_kernels exp": lambda: native.exp_float32(raw),
        "np.exp": lambda: np.exp(host),
        "mx.softmax": lambda: mx.softmax(scores, axis=-1, precise=True),
        "cpu_kernels.softmax": lambda: cpu_kernels.softmax(scores),
        "mx.logsumexp, logits": lambda: mx.logsumexp(logits, axis=-1, keepdims=True),
        "cpu_kernels.logsumexp": lambda: cpu_kernels.logsumexp(logits),
    }
    t_rows = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, fn in rows.items():
            t_rows[name] += timed(fn, 1)
    print(
        f"over the score block [{n_q}, {s}, {s}] and the logits [1, {s}, "
        f"{model.args.vocab_size}], float32:"
    )
    for name, t in t_rows.items():
        print(f"  {name:26s} {fmt(t, 1e3, ' ms')}")

    def log_probs(tokens, ext: bool):
        x = model(tokens)
        if ext:
            return x - cpu_kernels.logsumexp(x)
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    lanes = cpu_lanes(2)
    ids = [
        mx.random.randint(0, model.args.vocab_size, (1, s), key=mx.random.key(2 + i))
        for i in range(2)
    ]
    runs = {(n, softmax): [] for n in ("one stream", "side by side") for softmax in ("mlx", "ext")}
    outputs = {}
    for _ in range(max(2, args.repeats // 2)):
        for (how, softmax), t_run in runs.items():
            with cpu_kernels.vectorized() if softmax == "ext" else contextlib.nullcontext():
                t = time.perf_counter()
                if how == "one stream":
                    outs = [log_probs(i, softmax == "ext") for i in ids]
                    for out in outs:
                        mx.eval(out)
                else:
                    outs = []
                    for i, lane in zip(ids, lanes * 2, strict=False):
                        with mx.stream(lane):
                            outs.append(log_probs(i, softmax == "ext"))
                    mx.eval(outs)
                t_run.append(time.perf_counter() - t)
            outputs[how, softmax] = outs
    ref = outputs["one stream", "mlx"]
    same = all(
        mx.array_equal(a, b).item()
        for outs in outputs.values()
        for a, b in zip(ref, outs, strict=True)
    )
    print(f"two {s}-token forward passes and log-softmax, {len(lanes)} lane(s):")
    for (how, softmax), t_run in runs.items():
        name = "MLX's ops" if softmax == "mlx" else "cpu_kernels"
        print(f"  {how:13s} {name:14s} {fmt(t_run, 1, ' s')}")
    print(f"  outputs bit-identical (all four): {same}")


if __name__ == "__main__":
    main()
