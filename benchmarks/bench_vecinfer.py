"""VecInfer costs, measured side by side on this machine (ratios, not absolute times).

1. k-means training: `calibrate_vecinfer` on a capture dir (real activations; the default model),
   wall time, and the distance-GEMM work it did (2·(d+1) FLOP per vector-centroid pair per
   assignment pass) as effective GFLOP/s, next to this machine's float32 GEMM rate measured in
   the same run (square 2048 matmul). Their ratio says how close to the GEMM roof k-means runs;
   its thin GEMMs (inner dim d+1 = 5 or 9) are bound by writing the [vectors, centroids] scores.
2. Encode cost per token: one layer's `encode_keys` + `encode_values` for 1 token and for a
   64-token chunk (per token), next to the fp16 model's decode step (per token, all layers).
3. Decode step: one-token forward of the real model with a fp16 `KVCache` vs a `VecInferCache`
   holding 1K and 4K tokens (filled through `update_and_fetch` with random keys/values: timing does
   not depend on their values), on the transient path and fused: the GPU kernels, or on the CPU
   the pure-MLX twin and (where the CPU extension is built) the CPU kernel. Steps alternate
   between the arms; ratios per pair.

Every timing is interleaved over `--repeats`, reported as median [min, max].

    python benchmarks/bench_vecinfer.py --model-dir /tmp/smol --capture /tmp/vi/cap
    python benchmarks/bench_vecinfer.py --model-dir /tmp/smol --skip-kmeans   # 2 and 3 only
    # GPU, without the weights: the model built from config.json with random float16 weights
    # (timings do not depend on weight values), uncalibrated codebooks of the same shape.
    python benchmarks/bench_vecinfer.py --random-weights cfg.json --dtype float16 --skip-kmeans \
        --contexts 1024 4096 16384
    # decode steps of the default calibrated layout (key mean; random codes), the real weights
    python benchmarks/bench_vecinfer.py --model-dir /tmp/smol --skip-kmeans --default-layout
"""

from __future__ import annotations

import argparse
import statistics
import time

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from veloxquant import KVCacheConfig, attention, cpu_kernels, make_cache
from veloxquant.kernels import backend as kernel_backend
from veloxquant.methods.vecinfer import kernels as vecinfer_kernels
from veloxquant.methods.vecinfer import DEFAULTS, METHOD
from veloxquant.methods.vecinfer.calibrate import n_books
from veloxquant.model_import import load_model
from _common import fmt, gemm_gflops, model_dtype, random_weights_model


def kmeans_flops(
    hp: dict, n_layers: int, n_heads: int, head_dim: int, n_train: int, n_held: int
) -> float:
    """Distance-GEMM FLOPs of one calibrate_vecinfer run (assignment passes only)."""
    total = 0.0
    for side in ("key", "value"):
        books = n_books(hp, side, n_heads)
        groups = n_layers * books
        per_group_tokens = n_train * (n_heads // books)
        d, k = hp[f"{side}_sub_dim"], 2 ** hp[f"{side}_bits"]
        vectors = per_group_tokens * head_dim // d
        if hp["max_vectors"] is not None:
            vectors = min(vectors, hp["max_vectors"])
        held = n_held * (n_heads // books) * head_dim // d
        passes = hp["iters"] + 1  # Lloyd iterations + final assignment
        total += groups * (passes * vectors + held) * k * 2 * (d + 1)
    return total


def bench_kmeans(args, model) -> None:
    from veloxquant.capture import load_capture_info
    from veloxquant.methods.vecinfer import calibrate_vecinfer

    hp = METHOD.hyperparameters(
        {k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None}
    )
    info = load_capture_info(args.capture)
    n = int(info["n_sampled"])
    n_held = max(1, int(round(n * hp["heldout_fraction"])))
    a = model.args
    flops = kmeans_flops(
        hp, a.num_hidden_layers, a.num_key_value_heads, a.head_dim, n - n_held, n_held
    )
    rates_before = gemm_gflops(args.repeats)
    t0 = time.perf_counter()
    calibrate_vecinfer(args.capture, model, progress=False, **hp)
    seconds = time.perf_counter() - t0
    rates = rates_before + gemm_gflops(args.repeats)
    peak = statistics.median(rates)
    eff = flops / seconds / 1e9
    print(
        f"k-means (calibrate_vecinfer) on {args.capture}: "
        f"d{hp['key_sub_dim']}b{hp['key_bits']} keys, "
        f"d{hp['value_sub_dim']}b{hp['value_bits']} values, "
        f"share={hp['share']}/{hp['value_share'] or hp['share']}, "
        f"iters={hp['iters']}, "
        f"max_vectors={hp['max_vectors']}, {n} captured tokens"
    )
    print(
        f"  wall {seconds:.1f} s (one run, incl. loading and held-out diagnostics); "
        f"distance GEMMs {flops / 1e9:.1f} GFLOP -> {eff:.2f} GFLOP/s effective"
    )
    print(f"  float32 GEMM (2048^2, same run): {fmt(rates, unit=' GFLOP/s')}")
    print(
        f"  k-means runs at {eff / peak:.3f} of the measured GEMM rate "
        f"(at the GEMM rate it would take {flops / peak / 1e9:.1f} s)"
    )


def filled_caches(
    model, config: KVCacheConfig | None, n_tokens: int, chunk: int = 8192, fused: bool = False
) -> list:
    # Large chunks: every chunk appends to the codes by concatenation, so a fill costs about
    # n_tokens^2 / chunk bytes of copies (at 128K tokens and 512-token chunks the fill did not
    # finish in four minutes on an H200). fused=True (KIVI): the chunks go through the fused
    # update, which stores the same bits without the transient path's dequantization of the
    # whole store at every chunk (which kept a 128K fill of the 8B shape from finishing).
    a = model.args
    caches = make_cache(model, config) if config else [KVCache() for _ in model.layers]
    rng = np.random.default_rng(0)
    dtype = model_dtype(model)
    for c in caches:
        c.fused = fused  # filled without attention calls; the arm picks its path after
        for s in range(0, n_tokens, chunk):
            m = min(chunk, n_tokens - s)
            x = mx.array(
                rng.normal(size=(1, a.num_key_value_heads, m, a.head_dim)).astype(np.float32)
            ).astype(dtype)
            c.update_and_fetch(x, x)
            c._pending = None  # no attention for a fill
        c.fused = False
        mx.eval([c.state for c in caches])
    return caches


def decode_step(model, caches, token: mx.array) -> None:
    mx.eval(model(token, cache=caches))


def bench_encode_and_decode(args, model, config: KVCacheConfig) -> None:
    a = model.args
    token = mx.array([[42]])
    cache = make_cache(model, config)[0]
    rng = np.random.default_rng(1)
    one = mx.array(rng.normal(size=(1, a.num_key_value_heads, 1, a.head_dim)).astype(np.float32))
    chunk = mx.array(rng.normal(size=(1, a.num_key_value_heads, 64, a.head_dim)).astype(np.float32))
    fp_caches = filled_caches(model, None, 1024)
    for x in (one, chunk):
        mx.eval(cache.encode_keys(x, 0), cache.encode_values(x))
    enc1, enc64, fp_step = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        mx.eval(cache.encode_keys(one, 0), cache.encode_values(one))
        enc1.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mx.eval(cache.encode_keys(chunk, 0), cache.encode_values(chunk))
        enc64.append((time.perf_counter() - t0) / 64)
        t0 = time.perf_counter()
        decode_step(model, fp_caches, token)
        fp_step.append(time.perf_counter() - t0)
    n_layers = len(model.layers)
    print(
        f"encode (K+V, one layer, {a.num_key_value_heads} KV heads x {a.head_dim}), "
        f"{args.repeats} interleaved repeats:"
    )
    print(
        f"  1 token:          {fmt(enc1, 1e6, ' us')} per layer; x{n_layers} layers = "
        f"{statistics.median(enc1) * n_layers * 1e3:.3f} ms/token"
    )
    print(f"  64-token chunk:   {fmt(enc64, 1e6, ' us')} per token per layer")
    print(
        f"  fp16 decode step at 1K context (whole model): {fmt(fp_step, 1e3, ' ms')}; "
        "encode of one token in all layers = "
        f"{statistics.median(enc1) * n_layers / statistics.median(fp_step):.3f}"
        " of it"
    )

    # here, not at the top: bench_generate imports this module
    from bench_generate import default_layout_caches

    for ctx in args.contexts:
        fp = filled_caches(model, None, ctx)
        if args.default_layout:  # the calibrated layout's costs (key mean) without a bundle
            vi = default_layout_caches(model, ctx)
            for c in vi:
                c.fused = False
        else:
            vi = filled_caches(model, config, ctx)
        arms = {"fp16 KVCache": fp, "vecinfer transient": vi}
        # the fused path: the kernels on a GPU; on the CPU their pure-MLX twin, and the CPU
        # extension's kernel where it is built (vecinfer_kernels.CPU_KERNEL picks, per arm)
        attention.install()
        on_gpu = kernel_backend() is not None
        fused_names = ["vecinfer fused"] if on_gpu else ["vecinfer twin"]
        if not on_gpu and cpu_kernels.available():
            fused_names.append("vecinfer cpu kernel")
        cpu_kernel_arm = dict.fromkeys(arms, False)
        if attention.routes(model):
            for name in fused_names:
                if args.default_layout:
                    fused = default_layout_caches(model, ctx)
                else:
                    fused = filled_caches(model, config, ctx)
                for c in fused:
                    c.fused = True
                arms[name] = fused
                cpu_kernel_arm[name] = name == "vecinfer cpu kernel"
        fused_name = fused_names[0]
        if fused_name in arms:
            # same contents (same fill), so the first step's logits must agree
            lt = model(token, cache=vi).astype(mx.float32)
            for name in fused_names:
                vecinfer_kernels.CPU_KERNEL = cpu_kernel_arm[name]
                lf = model(token, cache=arms[name]).astype(mx.float32)
                err = float(mx.abs(lt - lf).max())
                print(
                    f"  {name} vs transient logits at {ctx}: max |diff| {err:.4g} "
                    f"(max |logit| {float(mx.abs(lt).max()):.4g}), same argmax "
                    f"{bool(mx.array_equal(lt.argmax(-1), lf.argmax(-1)))}"
                )
        for name, caches in arms.items():
            vecinfer_kernels.CPU_KERNEL = cpu_kernel_arm[name]
            decode_step(model, caches, token)  # warm-up: compile, allocate
        times = {name: [] for name in arms}
        names = list(arms)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
                vecinfer_kernels.CPU_KERNEL = cpu_kernel_arm[name]
                t0 = time.perf_counter()
                decode_step(model, arms[name], token)
                times[name].append(time.perf_counter() - t0)
        vecinfer_kernels.CPU_KERNEL = True
        want = {"vecinfer fused": "kernel", "vecinfer twin": "reference"}
        want["vecinfer cpu kernel"] = "cpu-kernel"
        for name in fused_names:
            if name in arms:
                paths = {c.last_attention for c in arms[name]}
                assert paths == {want[name]}, f"{name} arm attended via {paths}"
        print(f"decode step at {ctx} context ({args.repeats} interleaved repeats):")
        for name in names:
            print(f"  {name:<20} {fmt(times[name], 1e3, ' ms')}")
        for name in names[1:]:
            ratios = [a / b for a, b in zip(times[name], times[names[0]], strict=True)]
            print(f"  ratio {name} / fp16: {fmt(ratios, unit='x')}")
        print(
            "  resident bytes: "
            + ", ".join(f"{n} {sum(c.nbytes for c in arms[n]) / 2**20:.2f} MiB" for n in names)
        )
        del fp, vi, arms


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", default="artifacts/smollm2-135m/model")
    p.add_argument("--capture", default="artifacts/smollm2-135m/capture")
    p.add_argument(
        "--artifact-dir",
        default=None,
        help="vecinfer bundle for the cache arms (default: uncalibrated codebooks, which have "
        "no key mean, so no rotated mean to add: cheaper than a calibrated cache)",
    )
    p.add_argument(
        "--default-layout",
        action="store_true",
        help="decode steps on caches of the default calibrated layout (key mean, per-layer "
        "value books; random codes, as bench_generate.py builds them) instead of --artifact-dir's",
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--skip-kmeans", action="store_true")
    p.add_argument(
        "--random-weights",
        metavar="CONFIG_JSON",
        default=None,
        help="build the model from this config.json with random weights (timing only)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="model dtype (default: as loaded; float32 on CPU)",
    )
    for name in ("key_sub_dim", "key_bits", "value_sub_dim", "value_bits", "iters", "max_vectors"):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None)
    p.add_argument("--share", choices=["head", "layer"], default=None)
    args = p.parse_args()

    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    dtype = getattr(mx, args.dtype) if args.dtype else None
    if args.random_weights:
        model = random_weights_model(args.random_weights, dtype or mx.float32)
    else:
        model, _ = load_model(args.model_dir)
        if dtype is not None:
            model.set_dtype(dtype)
    if not args.skip_kmeans:
        bench_kmeans(args, model)
    if args.artifact_dir:
        config = KVCacheConfig(method="vecinfer", artifact_dir=args.artifact_dir)
    else:
        shape = {
            k: getattr(args, k)
            for k in ("key_sub_dim", "key_bits", "value_sub_dim", "value_bits")
            if getattr(args, k) is not None
        }
        config = KVCacheConfig(method="vecinfer", uncalibrated=True, options=shape)
    bench_encode_and_decode(args, model, config)


if __name__ == "__main__":
    main()
