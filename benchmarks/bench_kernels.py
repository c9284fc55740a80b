"""Fused VecInfer kernels, one layer at a time: correctness first, then time.

1. Correctness (before any timing, DESIGN.md section 9): the decode-attention kernels against
   the pure-MLX twin on the same cache (random data: the 8B-shape layout with key/value means
   and value scales, a 64-dim GQA-3 layout, an uncentred one, each at several contexts), the
   twin against the transient oracle on a cache filled through update_and_fetch, and the
   encode kernel's codes against the oracle's encode_keys / encode_values.
2. Time per layer (Llama-3-8B shape by default: 32 query heads, 8 KV heads, D = 128, bf16
   queries; d2b6 keys, d4b8 values with one codebook per layer, 4 sinks, 26-token window: the
   default; `--value-bits 6 --value-books head --window 46` is the previous one): the fused
   decode attention (one variant per tokens-per-thread setting) against
   `mx.fast.scaled_dot_product_attention`
   on bf16 K/V of the same context, and the encode of one token. Each timed eval runs
   `--layers` independent calls, rotating over `--sets` distinct caches so that the codes do
   not sit in L2 between calls; repeats are interleaved over the arms; median [min, max] per
   call. Bandwidth = bytes of codes read (keys + values, every KV head) / time.

    python benchmarks/bench_kernels.py --contexts 4096 16384 65536 131072 --out results.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn

from veloxquant.codes import code_bytes, unpack_codes
from veloxquant.kernels import backend
from veloxquant.methods.vecinfer import VecInferCache
from veloxquant.methods.vecinfer import kernels as K
from veloxquant.rope import RopeSpec
from _common import fmt


def synthetic_cache(
    h: int,
    d: int,
    n_coded: int,
    *,
    rope: RopeSpec | None,
    center: bool = True,
    value_smooth: bool = True,
    window: int = 46,
    sinks: int = 4,
    key: tuple[int, int] = (6, 2),
    value: tuple[int, int] = (6, 4),
    shared_books: bool = False,
    shared_value_books: bool | None = None,
    seed: int = 0,
) -> VecInferCache:
    """A VecInferCache holding `n_coded` random codes (every byte pattern is a valid code),
    full fp16 sinks and window, and random codebooks, scales and means of the calibrated
    layout: what a long context leaves behind, built without encoding it."""
    mx.random.seed(seed)
    kb, kd = key
    vb, vd = value
    books = 1 if shared_books else h
    vbooks = books if shared_value_books is None else (1 if shared_value_books else h)
    kw = {}
    if center:
        kw.update(
            key_mean=mx.random.normal((h, d)) * 2.0,
            value_mean=mx.random.normal((h, d)) * 0.5,
            rope=rope,
        )
    if value_smooth:
        kw["value_smooth"] = mx.random.uniform(0.5, 2.0, (h, d))
    c = VecInferCache(
        mx.random.uniform(0.5, 2.0, (h, d)),
        mx.random.normal((books, 1 << kb, kd)),
        mx.random.normal((vbooks, 1 << vb, vd)) * 0.5,
        key_bits=kb,
        key_sub_dim=kd,
        value_bits=vb,
        value_sub_dim=vd,
        hadamard=True,
        window=window,
        sinks=sinks,
        **kw,
    )
    if n_coded:
        cap = -(-n_coded // c.CODE_STEP) * c.CODE_STEP
        nk, nv = code_bytes(kb, d // kd), code_bytes(vb, d // vd)
        c._kbuf = mx.random.randint(0, 256, (1, h, cap, nk)).astype(mx.uint8)
        c._vbuf = mx.random.randint(0, 256, (1, h, cap, nv)).astype(mx.uint8)
        c._n_coded = n_coded
    c.sink_keys = (mx.random.normal((1, h, sinks, d)) * 2).astype(mx.float16)
    c.sink_values = mx.random.normal((1, h, sinks, d)).astype(mx.float16)
    c.window_keys = (mx.random.normal((1, h, window, d)) * 2).astype(mx.float16)
    c.window_values = mx.random.normal((1, h, window, d)).astype(mx.float16)
    c.offset = sinks + n_coded + window
    mx.eval(c.state)
    return c


def pending_for(cache: VecInferCache, new: mx.array) -> dict:
    """The pending attention of a decode step that has not encoded anything yet."""
    return {
        "n_coded": cache._n_coded,
        "win": (cache._wk, cache._wv),
        "new": (new[0], new[1]),
    }


def decode_inputs(
    context: int, sets: int = 4, layers: int = 32, h: int = 8, g: int = 4, d: int = 128
):
    """(caches, queries, pending attentions) of one-token decode steps at `context` tokens in
    the default layout (d2b6 keys, d4b8 values per layer, 4 sinks, 26-token window): `sets`
    synthetic caches, `layers` bf16 queries, one pending attention per cache."""
    caches = [
        synthetic_cache(
            h, d, context - 4 - 26 - 1, rope=rope_for(d), seed=i, value=(8, 4),
            shared_value_books=True, window=26,
        )
        for i in range(sets)
    ]  # fmt: skip
    qs = [(mx.random.normal((1, h * g, 1, d)) * 2).astype(mx.bfloat16) for _ in range(layers)]
    news = [
        [mx.random.normal((1, h, 1, d)).astype(mx.bfloat16) for _ in range(2)] for _ in range(sets)
    ]
    mx.eval(qs, news)
    return caches, qs, [pending_for(c, nw) for c, nw in zip(caches, news, strict=True)]


def rope_for(d: int, traditional: bool = False, base: float = 500000.0) -> RopeSpec:
    return RopeSpec.from_module(nn.RoPE(d, traditional=traditional, base=base), d)


# ------------------------------------------------------------------------------ correctness


def check_attention(args, log: list) -> bool:
    ok = True
    configs = [
        ("8B-shape", 8, 4, 128, True, True, False),
        ("64-dim GQA-3", 3, 3, 64, True, True, True),
        ("uncentred", 8, 4, 128, False, False, False),
        ("shared books", 2, 2, 64, True, True, False),
        ("default: d4b8 values per layer", 8, 4, 128, True, True, False),
    ]
    for name, h, g, d, center, vs, trad in configs:
        for n_coded in (0, 700, 5000, 40000):
            extra = {}
            if name.startswith("default"):
                extra = {"value": (8, 4), "shared_value_books": True, "window": 26}
            c = synthetic_cache(
                h,
                d,
                n_coded,
                rope=rope_for(d, traditional=trad),
                center=center,
                value_smooth=vs,
                shared_books=name == "shared books",
                seed=n_coded + d,
                **extra,
            )
            q = (mx.random.normal((1, h * g, 1, d)) * 2).astype(mx.bfloat16)
            new = [mx.random.normal((1, h, 1, d)).astype(mx.bfloat16) for _ in range(2)]
            pend = pending_for(c, new)
            ref = K.reference_attention(c, q.astype(mx.float32), 1 / math.sqrt(d), None, pend)
            default_r = K.TOKENS_PER_THREAD
            for r in (1, 2, 4):
                K.TOKENS_PER_THREAD = r
                out, _ = K.decode_attention(c, q, 1 / math.sqrt(d), pend)
                out32, _ = K.decode_attention(c, q.astype(mx.float32), 1 / math.sqrt(d), pend)
                err = float(mx.abs(out32 - ref).max())
                err16 = float(mx.abs(out.astype(mx.float32) - ref).max())
                scale = float(mx.abs(ref).max())
                good = err <= 1e-3 * max(1.0, scale) and bool(mx.all(mx.isfinite(out)).item())
                ok &= good
                log.append(
                    {
                        "check": "attention kernel vs twin",
                        "config": name,
                        "n_coded": n_coded,
                        "tokens_per_thread": r,
                        "max_abs_err_f32": err,
                        "max_abs_err_bf16_out": err16,
                        "ref_max": scale,
                        "ok": good,
                    }
                )
            K.TOKENS_PER_THREAD = default_r
    return ok


def check_twin_vs_transient(args, log: list) -> bool:
    """The twin (and the kernel) against the transient path on a cache filled for real."""
    h, g, d = 8, 4, 128
    rope = rope_for(d)
    ok = True
    mx.random.seed(3)
    base = synthetic_cache(h, d, 0, rope=rope)

    def empty_like_base() -> VecInferCache:
        return VecInferCache(
            base.smooth,
            base.key_codebook,
            base.value_codebook,
            key_bits=6,
            key_sub_dim=2,
            value_bits=6,
            value_sub_dim=4,
            hadamard=True,
            key_mean=base.key_mean,
            value_mean=base.value_mean,
            rope=rope,
            value_smooth=base.value_smooth,
        )

    a, b = empty_like_base(), empty_like_base()
    b.fused = True
    from veloxquant.attention import _original

    t = 3000
    keys = (mx.random.normal((1, h, t + 8, d)) * 2).astype(mx.bfloat16)
    vals = mx.random.normal((1, h, t + 8, d)).astype(mx.bfloat16)
    steps = [(0, 2048), (2048, t)] + [(i, i + 1) for i in range(t, t + 8)]
    for lo, hi in steps:
        n = hi - lo
        q = (mx.random.normal((1, h * g, n, d)) * 2).astype(mx.bfloat16)
        mask = "causal" if n > 1 else None
        ka, va = a.update_and_fetch(keys[:, :, lo:hi], vals[:, :, lo:hi])
        ref = _original(q, ka, va, cache=a, scale=1 / math.sqrt(d), mask=mask)
        b.update_and_fetch(keys[:, :, lo:hi], vals[:, :, lo:hi])
        out = b.fused_attention(q, 1 / math.sqrt(d), mask)
        err = float(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max())
        same_codes = bool(mx.all(a.key_codes == b.key_codes).item()) and bool(
            mx.all(a.value_codes == b.value_codes).item()
        )
        agree = float(
            (unpack_codes(a.key_codes, 6, 64) == unpack_codes(b.key_codes, 6, 64))
            .astype(mx.float32)
            .mean()
        )
        good = err < 5e-2 and agree > 0.999
        ok &= good
        log.append(
            {
                "check": "fused (bf16 model dtype) vs transient oracle",
                "call": [lo, hi],
                "path": b.last_attention,
                "max_abs_err": err,
                "codes_identical": same_codes,
                "key_code_agreement": agree,
                "ok": good,
            }
        )
    return ok


def check_encode(args, log: list) -> bool:
    ok = True
    for name, h, d, trad, n in (("8B-shape", 8, 128, False, 1), ("64-dim", 3, 64, True, 300)):
        c = synthetic_cache(h, d, 0, rope=rope_for(d, traditional=trad))
        ks = (mx.random.normal((1, h, n + 5, d)) * 3).astype(mx.float16)
        vs = mx.random.normal((1, h, n + 5, d)).astype(mx.float16)
        pos = 70000
        kc, vc = K.encode(c, ks, vs, 5, n, pos)
        rk = c.encode_keys(ks[:, :, 5 : 5 + n].astype(mx.float32), pos)
        rv = c.encode_values(vs[:, :, 5 : 5 + n].astype(mx.float32))
        ka = float((unpack_codes(kc, 6, d // 2) == unpack_codes(rk, 6, d // 2)).mean())
        va = float((unpack_codes(vc, 6, d // 4) == unpack_codes(rv, 6, d // 4)).mean())
        good = ka > 0.999 and va > 0.999
        ok &= good
        log.append(
            {
                "check": "encode kernel vs oracle",
                "config": name,
                "tokens": n,
                "key_agree": ka,
                "value_agree": va,
                "ok": good,
            }
        )
    return ok


# ------------------------------------------------------------------------------------ timing


def time_arms(arms: dict, repeats: int) -> dict:
    for fn in arms.values():  # warm-up: compile, allocate
        fn()
        fn()
    times = {k: [] for k in arms}
    names = list(arms)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            t0 = time.perf_counter()
            arms[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def bench_context(args, n_coded: int) -> dict:
    h, g, d, layers = args.kv_heads, args.group, args.head_dim, args.layers
    rope = rope_for(d)
    scale = 1 / math.sqrt(d)
    layout = {
        "value": (args.value_bits, 4),
        "shared_value_books": args.value_books == "layer",
        "window": args.window,
    }
    caches = [synthetic_cache(h, d, n_coded, rope=rope, seed=i, **layout) for i in range(args.sets)]
    qs = [(mx.random.normal((1, h * g, 1, d)) * 2).astype(mx.bfloat16) for _ in range(layers)]
    news = [
        [mx.random.normal((1, h, 1, d)).astype(mx.bfloat16) for _ in range(2)]
        for _ in range(args.sets)
    ]
    pend = [pending_for(c, nw) for c, nw in zip(caches, news, strict=True)]
    total = n_coded + caches[0].sinks + caches[0].window + 1
    kv = [
        (
            mx.random.normal((1, h, total, d)).astype(mx.bfloat16),
            mx.random.normal((1, h, total, d)).astype(mx.bfloat16),
        )
        for _ in range(args.sets)
    ]
    mx.eval(qs, news, kv)

    def fused(r: int, groups: int | None):
        def run():
            K.TOKENS_PER_THREAD = r
            K.TARGET_GROUPS = groups
            outs = [
                K.decode_attention(caches[i % args.sets], qs[i], scale, pend[i % args.sets])[0]
                for i in range(layers)
            ]
            mx.eval(outs)

        return run

    def prebuilt(r: int):
        # the launches alone, on inputs built (and copied to the GPU) before the clock starts:
        # what the per-call host work costs is the difference to fused_r{r}
        built = [
            K.attention_inputs(caches[i % args.sets], qs[i], scale, pend[i % args.sets], r=r)
            for i in range(layers)
        ]
        mx.eval([b["partial"] + b["combine_extra"] for b in built])

        def run():
            mx.eval([K.launch_attention(built[i], qs[i])[0] for i in range(layers)])

        return run

    def sdpa():
        outs = [
            mx.fast.scaled_dot_product_attention(
                qs[i], kv[i % args.sets][0], kv[i % args.sets][1], scale=scale
            )
            for i in range(layers)
        ]
        mx.eval(outs)

    def reference():
        outs = [
            K.reference_attention(caches[i % args.sets], qs[i], scale, None, pend[i % args.sets])
            for i in range(layers)
        ]
        mx.eval(outs)

    ones = [mx.random.normal((1, h, 1, d)).astype(mx.float16) for _ in range(2)]
    mx.eval(ones)

    def encode():
        outs = [
            K.encode(caches[i % args.sets], ones[0], ones[1], 0, 1, n_coded + i)
            for i in range(layers)
        ]
        mx.eval(outs)

    default_groups = K.TARGET_GROUPS
    arms = {}
    for groups in args.target_groups or [default_groups]:
        tag = "" if groups == default_groups else f"_g{groups}"
        arms.update({f"fused_r{r}{tag}": fused(r, groups) for r in args.tokens_per_thread})
    arms[f"prebuilt_r{args.tokens_per_thread[-1]}"] = prebuilt(args.tokens_per_thread[-1])
    arms["sdpa_bf16"] = sdpa
    arms["encode_1tok"] = encode
    if args.reference:
        arms["reference_mlx"] = reference
    default_r = K.TOKENS_PER_THREAD
    times = time_arms(arms, args.repeats)
    K.TOKENS_PER_THREAD = default_r
    K.TARGET_GROUPS = default_groups
    per_call = {k: [t / layers for t in v] for k, v in times.items()}
    code_bytes_read = n_coded * h * (caches[0].key_codes.shape[3] + caches[0].value_codes.shape[3])
    row = {"n_coded": n_coded, "context": total, "per_layer_s": per_call}
    row["code_bytes_per_layer"] = code_bytes_read
    row["bf16_kv_bytes_per_layer"] = total * h * d * 2 * 2
    caches.clear()
    kv.clear()
    mx.clear_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--value-bits", type=int, default=8, help="d4 value codebook bits")
    p.add_argument("--value-books", choices=["head", "layer"], default="layer")
    p.add_argument("--window", type=int, default=26)
    p.add_argument("--layers", type=int, default=32, help="calls per timed eval")
    p.add_argument("--sets", type=int, default=4, help="distinct caches rotated over")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--tokens-per-thread", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument(
        "--target-groups",
        type=int,
        nargs="+",
        default=None,
        help="threadgroups the split aims for (default: the library's TARGET_GROUPS)",
    )
    p.add_argument("--reference", action="store_true", help="also time the pure-MLX twin")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}, kernel backend {backend()}")
    result = {"mlx": mx.__version__, "backend": backend(), "args": vars(args)}
    if backend() is None:
        raise SystemExit("no GPU kernel backend: the kernels cannot run here")
    if not args.skip_checks:
        log: list = []
        oks = {}
        for name, fn in (
            ("attention", check_attention),
            ("twin_vs_transient", check_twin_vs_transient),
            ("encode", check_encode),
        ):
            try:
                oks[name] = fn(args, log)
            except Exception as e:  # keep going: the timings below are still worth having
                import traceback

                traceback.print_exc()
                oks[name] = f"error: {e!r}"
        result["checks"] = {"ok": oks, "log": log}
        worst = {}
        for e in log:
            key = e["check"]
            v = e.get("max_abs_err_f32", e.get("max_abs_err", 0.0))
            worst[key] = max(worst.get(key, 0.0), v)
        print("checks:", oks, "worst max-abs errors:", worst)
        bad = [e for e in log if not e["ok"]]
        for e in bad[:10]:
            print("  FAILED", e)
    rows = []
    for n in args.contexts:
        n_coded = n - 4 - 46 - 1
        try:
            row = bench_context(args, n_coded)
        except Exception as e:
            import traceback

            traceback.print_exc()
            row = {"n_coded": n_coded, "error": repr(e)}
        rows.append(row)
        if "per_layer_s" in row:
            t = row["per_layer_s"]
            best = min(
                (k for k in t if k.startswith("fused")), key=lambda k: statistics.median(t[k])
            )
            bw = row["code_bytes_per_layer"] / statistics.median(t[best]) / 1e12
            sd = row["bf16_kv_bytes_per_layer"] / statistics.median(t["sdpa_bf16"]) / 1e12
            print(f"context {n}: per layer")
            for k, v in t.items():
                print(f"  {k:14s} {fmt(v, 1e6, ' us')}")
            speedup = statistics.median(t["sdpa_bf16"]) / statistics.median(t[best])
            print(
                f"  best fused {best}: {speedup:.2f}x faster than bf16 SDPA; "
                f"codes {bw:.2f} TB/s, SDPA bf16 K/V {sd:.2f} TB/s"
            )
        if args.out:
            Path(args.out).write_text(json.dumps({**result, "rows": rows}, indent=1))
    result["rows"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
