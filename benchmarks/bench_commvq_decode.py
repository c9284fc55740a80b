"""CommVQ decode on a GPU: its fused kernels against their pure-MLX twin, each layer's attention
against bf16 SDPA and against CommVQ's transient path, and tokens/s against fp16.

1. `--check`: the kernels against the twin on random caches (8B and SmolLM2 shapes, max |diff|
   over max |twin|), then greedy decoding of a seeded random-weight model (`--check-config`,
   SmolLM2's shape by default) with uncalibrated CommVQ caches: the fused path (kernels for
   each decode step) against the transient path, the same argmax at each step and the largest
   logit difference.
2. One layer of `--random-weights`'s shape at each context (random codes; timing does not
   depend on the codebook values): the fused attention (partial + combine), bf16
   `mx.fast.scaled_dot_product_attention` over keys and values of the same context, and the
   transient path (the coded past decoded whole, then SDPA; `--transient-max` bounds its
   contexts; `--variants` adds the kernel's A/B arms: code rows byte by byte, float16 atoms).
   20 calls per timing, interleaved repeats, median [min, max] per call; the codes'
   bandwidth is the bytes of codes and scales read over the fused time.
3. tokens/s of `generate_step` (bench_generate's harness): fp16 `KVCache` against CommVQ's
   fused caches (and its transient caches up to `--transient-max`), peak memory, KV bytes.

    python benchmarks/bench_commvq_decode.py --random-weights benchmarks/configs/llama3-8b.json \
        --dtype bfloat16 --contexts 4096 16384 65536 131072 --check
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from veloxquant import KVCacheConfig, make_cache
from veloxquant.methods.commvq import kernels as K
from _common import fmt, random_weights_model
from bench_generate import build_and_step, interleaved_decode, print_decode
from bench_vecinfer import filled_caches

CONFIGS = Path(__file__).parent / "configs"
CALLS = 20


def commvq_caches(model, n_tokens: int, fused: bool, seed: int = 0) -> list:
    """Uncalibrated CommVQ caches (the default shared-atom form) holding `n_tokens` tokens:
    random codes, scales, sinks and window, set directly (a 128K fill would encode for minutes)."""
    os.environ["VELOXQUANT_FUSED"] = "1" if fused else "0"
    caches = make_cache(model, KVCacheConfig(method="commvq", uncalibrated=True))
    for i, c in enumerate(caches):
        fill(c, n_tokens, seed + i)
    mx.eval([c.state for c in caches])
    return caches


def fill(c, n_tokens: int, seed: int) -> None:
    """Random codes, scales, sinks and window (fp16, as the cache keeps them) for n_tokens."""
    h, d = c.n_heads, c.head_dim
    n_coded = max(0, n_tokens - c.sinks - c.window)
    key = mx.random.key(seed)
    k = mx.random.split(key, 6)
    kb = c.stages + (c.stages + 1) // 2
    vbytes = -(-(d // c.value_sub_dim) * c.value_bits // 8)
    c.key_codes = mx.random.randint(0, 256, (1, h, n_coded, kb), key=k[0]).astype(mx.uint8)
    c.key_scales = (8 + 8 * mx.random.uniform(shape=(1, h, n_coded), key=k[1])).astype(mx.float16)
    c.value_codes = mx.random.randint(0, 256, (1, h, n_coded, vbytes), key=k[2]).astype(mx.uint8)
    ns, nw = min(c.sinks, n_tokens), min(c.window, n_tokens - min(c.sinks, n_tokens))
    c.sink_keys = mx.random.normal((1, h, ns, d), key=k[3]).astype(mx.float16)
    c.sink_values = mx.random.normal((1, h, ns, d), key=k[4]).astype(mx.float16)
    c.window_keys = mx.random.normal((1, h, nw, d), key=k[5]).astype(mx.float16)
    c.window_values = mx.random.normal((1, h, nw, d), key=k[3]).astype(mx.float16)
    c.offset = n_tokens


def pending_of(c, seed: int) -> dict:
    """The state a fused update of one token leaves (without storing it)."""
    k = mx.random.split(mx.random.key(seed), 2)
    new = [mx.random.normal((1, c.n_heads, 1, c.head_dim), key=x).astype(mx.float32) for x in k]
    return {
        "n_coded": c.compressed_tokens,
        "codes": (c.key_codes, c.key_scales, c.value_codes),
        "win": (c.window_keys, c.window_values),
        "sinks": None,
        "new": tuple(new),
    }


def check(args) -> None:
    print("== the kernels against the twin (random caches)")
    for cfg, contexts in (
        ("llama3-8b.json", (100, 5000, 70000)),
        ("smollm2-135m.json", (100, 3000)),
    ):
        model = random_weights_model(CONFIGS / cfg, mx.bfloat16)
        n_q = model.args.num_attention_heads
        for ctx in contexts:
            c = commvq_caches(model, ctx, True)[0]
            q = mx.random.normal((1, n_q, 1, c.head_dim), key=mx.random.key(ctx)).astype(
                mx.bfloat16
            )
            p = pending_of(c, ctx)
            got = K.decode_attention(c, q, c.head_dim**-0.5, p).astype(mx.float32)
            want = K.reference_attention(c, q.astype(mx.float32), c.head_dim**-0.5, None, p)
            err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
            print(f"  {cfg} context {ctx}: max |kernel - twin| / max |twin| {err:.3g}")
        del model
    print("== greedy tokens: fused (the kernels) against transient, seeded random weights")
    model = random_weights_model(args.check_config, mx.bfloat16, seed=3)
    vocab = model.args.vocab_size
    prompt = mx.array(np.random.default_rng(5).integers(0, vocab, 40))[None]
    config = KVCacheConfig(method="commvq", uncalibrated=True)
    logits = {}
    for fused in (False, True):
        os.environ["VELOXQUANT_FUSED"] = "1" if fused else "0"
        caches = make_cache(model, config)
        out = model(prompt, cache=caches)[:, -1]
        rows = [out]
        for _ in range(args.steps):
            out = model(mx.argmax(rows[-1], axis=-1)[:, None], cache=caches)[:, -1]
            rows.append(out)
        mx.eval(rows)
        logits[fused] = (mx.concatenate(rows).astype(mx.float32), caches)
    (a, _), (b, fused_caches) = logits[False], logits[True]
    same = (mx.argmax(a, -1) == mx.argmax(b, -1)).sum().item()
    diff = mx.abs(a - b).max().item()
    paths = {c.last_attention for c in fused_caches}
    print(
        f"  {args.steps} steps after a 40-token prompt: same argmax {same}/{args.steps + 1}, max "
        f"|logit diff| {diff:.4g} (max |logit| {mx.abs(a).max().item():.3g}); fused path {paths}; "
        f"coded tokens per layer {fused_caches[0].compressed_tokens}"
    )


def timed(fn, repeats_inside: int = CALLS) -> float:
    mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval([fn() for _ in range(repeats_inside)])
    mx.synchronize()
    return (time.perf_counter() - t0) / repeats_inside


def layer_arms(c, q, kv, pending, scale: float, transient: bool, variants: bool = False) -> dict:
    """One layer's attention three ways, each a call returning its output."""

    def fused():
        return K.decode_attention(c, q, scale, pending)

    def sdpa_bf16():
        return mx.fast.scaled_dot_product_attention(q, kv[0], kv[1], scale=scale)

    def decoded():
        keys = c.decode_keys(c.key_codes, c.key_scales, c.sinks).astype(mx.bfloat16)
        values = c.decode_values(c.value_codes).astype(mx.bfloat16)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)

    def switched(**switches):
        def call():
            saved = {name: getattr(K, name) for name in switches}
            for name, value in switches.items():
                setattr(K, name, value)
            try:
                return fused()
            finally:
                for name, value in saved.items():
                    setattr(K, name, value)

        return call

    arms = {"fused": fused, "sdpa_bf16": sdpa_bf16}
    if variants:  # A/B arms of the kernel's switches
        arms["fused_code_bytes"] = switched(CODE_WORDS=False)
        arms["fused_half_atoms"] = switched(ATOM_BYTES=2)
    if transient:
        arms["transient"] = decoded
    return arms


def layer_attention(args, model) -> None:
    a = model.args
    n_q, h, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    print(f"== one layer's decode attention ({n_q} query / {h} KV heads, D {d}), {CALLS} calls")
    for ctx in args.contexts:
        c = commvq_caches(model, ctx, True)[0]
        p = pending_of(c, 1)
        q = mx.random.normal((1, n_q, 1, d), key=mx.random.key(2)).astype(mx.bfloat16)
        kv = [
            mx.random.normal((1, h, ctx, d), key=mx.random.key(s)).astype(mx.bfloat16)
            for s in (3, 4)
        ]
        mx.eval(q, kv)
        arms = layer_arms(c, q, kv, p, d**-0.5, ctx <= args.transient_max, args.variants)
        times = {name: [] for name in arms}
        names = list(arms)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(timed(arms[name], CALLS if name != "transient" else 2))
        code_bytes = c.key_codes.nbytes + c.key_scales.nbytes + c.value_codes.nbytes
        line = "  ".join(f"{n} {fmt(t, 1e6, ' us')}" for n, t in times.items())
        fused = float(np.median(times["fused"]))
        ratio = np.median(times["sdpa_bf16"]) / fused
        mib = code_bytes / 2**20
        print(
            f"context {ctx}: {line}\n  sdpa / fused {ratio:.3g}x; codes read {mib:.1f} MiB, "
            f"{code_bytes / fused / 1e9:.3g} GB/s; path {c.attention_path}"
        )
        del c, kv


def tokens_per_second(args, model) -> None:
    token = mx.array([[42]])
    for ctx in args.contexts:
        arms, peaks, kv = {}, {}, {}
        builders = [("commvq", lambda n=ctx: commvq_caches(model, n, True))]
        if ctx <= args.transient_max:
            builders.append(("commvq_transient", lambda n=ctx: commvq_caches(model, n, False)))
        builders.append(("fp16", lambda n=ctx: filled_caches(model, None, n)))
        for name, build in builders:
            mx.clear_cache()
            mx.reset_peak_memory()
            caches = build()
            build_and_step(model, caches, token)
            arms[name], peaks[name] = (caches, lambda: None), mx.get_peak_memory()
            kv[name] = sum(c.nbytes for c in caches)
        order = ["fp16"] + [n for n in arms if n != "fp16"]
        result = interleaved_decode(
            model, {n: arms[n] for n in order}, token, args.repeats, args.tokens
        )
        print(f"context {ctx}: {args.tokens} generated tokens, {args.repeats} interleaved repeats")
        print_decode(result)
        gib = 2**30
        print(
            "  KV bytes (from the arrays) "
            + ", ".join(f"{n} {kv[n] / gib:.3g} GiB" for n in order)
            + f"; commvq / fp16 {kv['commvq'] / kv['fp16']:.3f}x; peak with weights (each arm's "
            "own, those built before it held): "
            + ", ".join(f"{n} {peaks[n] / gib:.3g} GiB" for n in arms)
            + f"; commvq attention { ({c.last_attention for c in arms['commvq'][0]}) }"
        )
        del arms, caches, result
        mx.clear_cache()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--random-weights", metavar="CONFIG_JSON", required=True)
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transient-max", type=int, default=16384)
    p.add_argument("--check", action="store_true")
    p.add_argument("--check-config", default=str(CONFIGS / "smollm2-135m.json"))
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--variants", action="store_true", help="A/B arms of the kernel's switches")
    p.add_argument("--skip-tokens", action="store_true")
    args = p.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}, kernels: {K.backend()}")
    if args.check:
        check(args)
    model = random_weights_model(args.random_weights, getattr(mx, args.dtype))
    if not args.skip_layer:
        layer_attention(args, model)
    if not args.skip_tokens:
        tokens_per_second(args, model)


if __name__ == "__main__":
    main()
