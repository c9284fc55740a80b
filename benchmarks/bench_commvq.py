"""CommVQ costs, measured side by side on this machine (ratios, not absolute times).

1. EM training (`--capture`): one soft and one hard EM iteration of stage 0 over every
   (layer, KV head) group at the default token budget, as time per token-iteration; with
   `--calibrate` also the full calibration's wall time.
2. Encode cost: one layer's `encode_keys` + `encode_values` for 1 token and per token of a
   64-token chunk, next to the fp16 model's decode step (whole model).
3. Decode step: one-token forward with a fp16 `KVCache` vs `CommVQCache`s holding 1K and 4K
   tokens (filled through `update_and_fetch` with random keys/values; timing does not depend on
   their values or on θ, so uncalibrated caches of the calibrated shape are used): on the
   transient path, on the fused path's twin and on its CPU kernel (`kernels.CPU_KERNEL`).
   Arms rotate their order from repeat to repeat; ratios to the fp16 arm's step of the same
   repeat.
4. `--bits`: resident bits per element vs context length for 2- and 1-bit keys, the default
   shared-atom form (per head, per layer) and the paper's free θ per stage, two windows each
   (nothing else runs).

Timings are interleaved over `--repeats`, reported as median [min, max].

    python benchmarks/bench_commvq.py --capture artifacts/smollm2-135m/activations
    python benchmarks/bench_commvq.py --key-bits 1
    # GPU, without the weights (random float16 weights of the same architecture):
    python benchmarks/bench_commvq.py --random-weights artifacts/smollm2-135m/model/config.json \\
        --dtype float16 --contexts 1024 4096 16384
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from veloxquant.config import KVCacheConfig
from veloxquant.methods.commvq import METHOD, make_caches
from veloxquant.methods.commvq import codebook as cb
from veloxquant.methods.commvq import kernels as K
from veloxquant.methods.commvq import train as tr
from veloxquant.model_import import load_model
from _common import fmt, model_dtype, random_weights_model


def bench_em(args, model) -> None:
    from veloxquant.capture import load_activations, load_capture_info
    from veloxquant.methods.base import CalibrationInputs, ModelDims

    dims = ModelDims.of(model)
    hp = METHOD.hyperparameters({"key_bits": args.key_bits})
    n = min(int(load_capture_info(args.capture)["n_sampled"]), hp["max_tokens"])
    k = mx.stack([load_activations(args.capture, i, ["k_pre"])["k_pre"][:n] for i in range(dims.L)])
    k = k.transpose(0, 2, 1, 3).reshape(dims.L * dims.H_kv, n, dims.D)
    x, _ = tr.normalise(k, k.mean(axis=1))
    pairs = cb.to_pairs(x, dims.rope_traditional)
    theta0 = tr.init_stage(mx.random.key(0), pairs, 0)
    g = pairs.shape[0]
    flat = pairs.reshape(g, n, dims.D)
    inv_t = mx.full((g,), 1.0 / hp["temperature_start"])
    soft, hard = [], []
    for _ in range(args.repeats):
        for arm, out in ((inv_t, soft), (None, hard)):
            t0 = time.perf_counter()
            stats = tr.e_step(flat, theta0, arm)
            mx.eval(tr.m_step(*stats[:3], theta0, hp["ridge"]))
            out.append((time.perf_counter() - t0) / (g * n))
    r = tr.resolve_stages(dims.D, hp)
    per_stage = statistics.median(soft) * hp["iters"] + statistics.median(hard) * hp["hard_iters"]
    print(f"EM, {g} groups x {n} tokens, 4096 codewords:")
    print(f"  soft iteration: {fmt(soft, 1e6, ' us')} per token")
    print(f"  hard iteration: {fmt(hard, 1e6, ' us')} per token")
    print(
        f"  defaults ({hp['iters']} soft + {hp['hard_iters']} hard per stage, R={r}): "
        f"~{per_stage * g * n * r:.0f} s of EM for the model"
    )
    if args.calibrate:
        t0 = time.perf_counter()
        METHOD.calibrate(
            CalibrationInputs(Path(args.capture), Path(args.model_dir)), dims, hp, progress=False
        )
        print(f"  full calibration (keys, values, diagnostics): {time.perf_counter() - t0:.0f} s")


# (label, options) of the resident-bits table: the default form and the paper's.
BITS_LAYOUTS = (
    ("shared atoms, int8, per head; values per layer (default)", {}),
    ("shared atoms, int8, per layer", {"share": "layer"}),
    (
        "paper: free fp16 theta per stage and head; values per head",
        {"atoms": "stage", "atom_bits": 16, "value_share": "head"},
    ),
)


def bench_bits(model) -> None:
    """Resident bits per K/V element of one layer's cache vs context length, from `nbytes` of
    the uncalibrated caches `make_caches` builds for each layout (same shapes and dtypes as the
    calibrated ones), filled with random keys."""
    a = model.args
    h, d = a.num_key_value_heads, a.head_dim
    for key_bits, windows in ((2, (26, 48)), (1, (8, 16))):
        for label, options in BITS_LAYOUTS:
            for window in windows:
                cells = []
                for t in (1024, 4096, 32768):
                    cfg = KVCacheConfig(
                        method="commvq",
                        uncalibrated=True,
                        window=window,
                        options={"key_bits": key_bits, **options},
                    )
                    c = make_caches(model, cfg, None)[0]
                    x = mx.random.normal((1, h, t, d))
                    c.update_and_fetch(x, x)
                    cells.append(f"T={t}: {8 * c.nbytes / (2 * h * d * t):.2f}")
                print(
                    f"{key_bits}-bit keys (R={c.stages}), {label}, window {window}: "
                    + ", ".join(cells)
                )


def filled(
    model, config: KVCacheConfig | None, n_tokens: int, chunk: int = 512, fused: bool = False
) -> list:
    """Caches holding n_tokens random tokens: fp16 `KVCache`s (config None) or CommVQ caches on
    the transient path or, with `fused`, on the fused one (filled without attention calls)."""
    a = model.args
    os.environ["VELOXQUANT_FUSED"] = "1" if fused else "0"
    caches = make_caches(model, config, None) if config else [KVCache() for _ in model.layers]
    rng = np.random.default_rng(0)
    for c in caches:
        for s in range(0, n_tokens, chunk):
            m = min(chunk, n_tokens - s)
            x = mx.array(
                rng.normal(size=(1, a.num_key_value_heads, m, a.head_dim)).astype(np.float32)
            ).astype(model_dtype(model))
            c.update_and_fetch(x, x)
            if fused:
                c._pending = None  # no attention for a fill
        mx.eval([c.state for c in caches])
    return caches


def step(model, caches, token) -> None:
    mx.eval(model(token, cache=caches))


def bench_encode_and_decode(args, model, config: KVCacheConfig) -> None:
    a = model.args
    token = mx.array([[42]])
    cache = make_caches(model, config, None)[0]
    rng = np.random.default_rng(1)
    one = mx.array(rng.normal(size=(1, a.num_key_value_heads, 1, a.head_dim)).astype(np.float32))
    chunk = mx.array(rng.normal(size=(1, a.num_key_value_heads, 64, a.head_dim)).astype(np.float32))
    fp = filled(model, None, 1024)
    enc1, enc64, fp_step = [], [], []
    for x in (one, chunk):
        mx.eval(cache.encode_keys(x, 100), cache.encode_values(x))
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        mx.eval(cache.encode_keys(one, 100), cache.encode_values(one))
        enc1.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mx.eval(cache.encode_keys(chunk, 100), cache.encode_values(chunk))
        enc64.append((time.perf_counter() - t0) / 64)
        t0 = time.perf_counter()
        step(model, fp, token)
        fp_step.append(time.perf_counter() - t0)
    n_layers = len(model.layers)
    print(
        f"encode (K+V, one layer, {a.num_key_value_heads} KV heads x {a.head_dim}, "
        f"R={cache.stages}):"
    )
    print(
        f"  1 token:        {fmt(enc1, 1e6, ' us')} per layer; x{n_layers} layers = "
        f"{statistics.median(enc1) * n_layers * 1e3:.2f} ms/token"
    )
    print(f"  64-token chunk: {fmt(enc64, 1e6, ' us')} per token per layer")
    print(
        f"  fp16 decode step at 1K (whole model): {fmt(fp_step, 1e3, ' ms')}; encoding one token "
        f"in all layers = {statistics.median(enc1) * n_layers / statistics.median(fp_step):.1f}x"
        " of it"
    )
    for ctx in args.contexts:
        arms = {
            "KVCache": (filled(model, None, ctx), True),
            "commvq transient": (filled(model, config, ctx), True),
            "commvq twin": (filled(model, config, ctx, fused=True), False),
            "commvq cpu kernel": (filled(model, config, ctx, fused=True), True),
        }
        times = {name: [] for name in arms}
        names = list(arms)
        for caches, cpu_kernel in arms.values():
            K.CPU_KERNEL = cpu_kernel
            step(model, caches, token)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                caches, cpu_kernel = arms[name]
                K.CPU_KERNEL = cpu_kernel  # the twin's arm: the fused path without the kernel
                t0 = time.perf_counter()
                step(model, caches, token)
                times[name].append(time.perf_counter() - t0)
        K.CPU_KERNEL = True
        path = arms["commvq cpu kernel"][0][0].last_attention
        print(f"decode step at {ctx} context (the kernel arm's attention: {path}):")
        base = times["KVCache"]
        for name, t in times.items():
            ratios = [x / y for x, y in zip(t, base, strict=True)]
            extra = "" if name == "KVCache" else f"  ratio {fmt(ratios, unit='x')}"
            print(f"  {name:<18} {fmt(t, 1e3, ' ms')}{extra}")
        del arms


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", default="artifacts/smollm2-135m/model")
    p.add_argument("--capture", default=None, help="capture dir: time the EM on it")
    p.add_argument("--calibrate", action="store_true", help="also time a full calibration")
    p.add_argument("--key-bits", type=float, default=2)
    p.add_argument("--bits", action="store_true", help="only the resident-bits table")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--random-weights", metavar="CONFIG_JSON", default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    args = p.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    dtype = getattr(mx, args.dtype) if args.dtype else None
    if args.random_weights:
        model = random_weights_model(args.random_weights, dtype or mx.float32)
    else:
        model, _ = load_model(args.model_dir)
        if dtype is not None:
            model.set_dtype(dtype)
    if args.bits:
        bench_bits(model)
        return
    if args.capture:
        bench_em(args, model)
    config = KVCacheConfig(method="commvq", uncalibrated=True, options={"key_bits": args.key_bits})
    bench_encode_and_decode(args, model, config)


if __name__ == "__main__":
    main()
