"""RateQuant and KIVI, measured side by side on this machine (until the stage is wired in).

    # 1. calibrate: writes OUT/tensors.npz and OUT/info.json (hyperparameters, diagnostics)
    python benchmarks/bench_ratequant.py calibrate --artifacts artifacts/smollm2-135m --out OUT \
        [--hp '{"fisher_mode": "plain", "range_weighted": false}']
    # 2. quality: held-out windows through evaluate_rows (prefill 512, chunk 64): uniform KIVI
    #    2/3/4, RateQuant / uniform (uncalibrated) / E‖x‖² proxy at each b̄, mlx-lm
    #    QuantizedKVCache 2/4, and ablation artifacts (--ablation NAME=DIR, at --ablation-bits)
    python benchmarks/bench_ratequant.py eval --artifacts artifacts/smollm2-135m --rq OUT \
        --windows 2 --csv results.csv
    # 3. ground truth for the importance: ΔKL of quantizing one unit alone at --unit-bits
    #    (every other unit at 8 bits) on held-out text, for units spread over the importance
    #    range, against the prediction w·d(b) of each artifact (Spearman)
    python benchmarks/bench_ratequant.py truth --artifacts artifacts/smollm2-135m \
        --rq OUT --compare plain=OUT_PLAIN proxy=OUT:proxy_importance
    # 4. calibration cost: the Fisher gradient pass against a forward pass of the same window
    #    (fed the same way, and in one call), interleaved
    python benchmarks/bench_ratequant.py cost --artifacts artifacts/smollm2-135m --tokens 512
    # 5. decode step and allocation solve: fp16 KVCache vs uniform KIVI vs the mixed-bit
    #    allocation, one-token forward of the real model at a given context, interleaved
    python benchmarks/bench_ratequant.py decode --artifacts artifacts/smollm2-135m --rq OUT
    # 6. on a GPU backend without the weights: random weights of the same architecture and a
    #    synthetic mixed allocation of its shape; `check` compares the fused mx.dequantize path
    #    with the pure-MLX one and both with an fp KVCache on this backend
    python benchmarks/bench_ratequant.py check --random-weights config.json --dtype float16
    python benchmarks/bench_ratequant.py decode --random-weights config.json --dtype float16 \
        --context 16384

Every timing is interleaved over --repeats and reported as median [min, max].
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
import types
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from veloxquant.methods import kivi, ratequant
from veloxquant.methods.base import Artifact, CalibrationInputs, ModelDims
from _common import random_weights_model


def config(**kw):
    base = {
        "method": "ratequant",
        "bits": None,
        "group_size": None,
        "window": None,
        "sinks": None,
        "uncalibrated": False,
        "options": {},
    }
    return types.SimpleNamespace(**{**base, **kw})


def load_artifact(path: str | Path, importance_from: str | None = None) -> Artifact:
    """This script's calibrate output (tensors.npz + info.json), or a bundle dir."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        from veloxquant.bundle import load_bundle

        art = load_bundle(path).artifact("ratequant")
        tensors = {k: np.asarray(v) for k, v in art.tensors.items()}
        if importance_from:
            tensors["importance"] = tensors[importance_from]
        return Artifact("ratequant", tensors, art.hyperparameters, art.diagnostics)
    info = json.loads((path / "info.json").read_text())
    tensors = dict(np.load(path / "tensors.npz"))
    if importance_from:  # e.g. "fisher_sq": allocate from the unweighted Σ g² instead
        tensors["importance"] = tensors[importance_from]
    return Artifact("ratequant", tensors, info["hp"], info["diag"])


def fmt(xs: list[float], scale: float = 1e3, unit: str = "ms") -> str:
    return (
        f"{statistics.median(xs) * scale:.2f} [{min(xs) * scale:.2f}, {max(xs) * scale:.2f}] {unit}"
    )


def get_model(args):
    if getattr(args, "random_weights", None):
        return random_weights_model(args.random_weights, getattr(mx, args.dtype or "float32"))
    from veloxquant.model_import import load_model

    model, _ = load_model(Path(args.artifacts) / "model")
    if getattr(args, "dtype", None):
        model.set_dtype(getattr(mx, args.dtype))
    return model


def mixed_artifact(dims: ModelDims, group_size: int = 64) -> Artifact:
    """A RateQuant artifact of the model's shape from seeded synthetic importance and
    distortion: a realistic mixed allocation for timing a model without a calibration."""
    rng = np.random.default_rng(0)
    shape = (dims.L, dims.H_kv, 2)
    w = np.exp(rng.normal(0, 1.5, size=shape))
    table = np.exp(rng.normal(0, 0.3, size=shape))[..., None] * 4.5 ** -np.arange(1.0, 9.0)
    hp = {**ratequant.DEFAULTS, "group_size": group_size}
    cols = [kivi.SUPPORTED_BITS.index(b) for b in hp["allowed_bits"]]
    a, b, _ = ratequant.alloc.fit_distortion(hp["allowed_bits"], table[..., cols])
    # a response proportional to the second-order prediction, except that 1-bit keys break
    # the model (as measured on both SmolLM2 variants: 3 nats/token)
    pred = np.einsum("lhs,lhsb->sb", w, table[..., cols])
    stream_kl = 0.5 * pred / pred.max()
    stream_kl[0, list(hp["allowed_bits"]).index(1)] = 3.0
    bits, _ = ratequant.solve_from_tensors(
        w,
        table[..., cols],
        stream_kl,
        tuple(hp["allowed_bits"]),
        hp["bits"],
        group_size,
        hp["max_stream_kl"],
    )
    tensors = {
        "stream_kl": stream_kl,
        "importance": w,
        "fisher_sq": w,
        "proxy_importance": w,
        "distortion": table,
        "alpha": a,
        "beta": b,
        "bits": bits.astype(np.int8),
    }
    return Artifact("ratequant", tensors, hp, {})


def cmd_check(args) -> None:
    """Fused vs pure-MLX dequantization, and KIVI vs an fp KVCache, on this backend."""
    from mlx_lm.models.cache import KVCache

    model = get_model(args)
    dims = ModelDims.of(model)
    art = load_artifact(args.rq) if args.rq else mixed_artifact(dims)
    make = ratequant.METHOD.make_caches
    print(
        "backend:",
        "cuda"
        if hasattr(mx, "cuda") and mx.cuda.is_available()
        else "metal"
        if mx.metal.is_available()
        else "cpu",
        "| dtype",
        args.dtype or "float32",
    )
    tokens = mx.array(
        np.random.default_rng(0)
        .integers(0, model.args.vocab_size, size=(1, args.tokens))
        .astype(np.int32)
    )
    outs = {}
    for name in ("fp KVCache", "RateQuant fused", "RateQuant pure"):
        kivi.USE_MX_DEQUANTIZE = name != "RateQuant pure"
        caches = (
            [KVCache() for _ in model.layers]
            if name == "fp KVCache"
            else make(model, config(bits=args.bits), art)
        )
        model(tokens[:, : args.tokens // 2], cache=caches)  # prefill: quantizes most of it
        logits = []
        for t in range(args.tokens // 2, args.tokens):  # decode one token at a time
            logits.append(model(tokens[:, t : t + 1], cache=caches)[0, -1].astype(mx.float32))
        outs[name] = mx.stack(logits)
        mx.eval(outs[name])
        if name != "fp KVCache":
            nbytes = sum(c.nbytes for c in caches)
            elems = 2 * dims.L * dims.H_kv * dims.D * args.tokens
            print(f"  {name}: resident {8 * nbytes / elems:.3f} bits per element")
    kivi.USE_MX_DEQUANTIZE = True
    diff = float(mx.abs(outs["RateQuant fused"] - outs["RateQuant pure"]).max().item())
    ref = outs["fp KVCache"]
    scale = float(mx.abs(ref).max().item())
    print(f"  fused vs pure: max |Δlogit| {diff:.3g} (logits up to {scale:.3g})")
    for name in ("RateQuant fused", "RateQuant pure"):
        lp = outs[name] - mx.logsumexp(outs[name], -1, keepdims=True)
        lr = ref - mx.logsumexp(ref, -1, keepdims=True)
        kl = float((mx.exp(lr) * (lr - lp)).sum(-1).mean().item())
        agree = float((mx.argmax(lp, -1) == mx.argmax(lr, -1)).mean().item())
        print(f"  {name} vs fp KVCache: KL {kl:.4g}, top-1 agreement {agree:.3f}")


def cmd_calibrate(args) -> None:
    root = Path(args.artifacts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hp = ratequant.METHOD.hyperparameters(json.loads(args.hp))
    dims = ModelDims.of(root / "model")
    inputs = CalibrationInputs(
        root / "activations", root / "model", root / "data" / "calib.safetensors"
    )
    t0 = time.perf_counter()
    tensors, diag = ratequant.METHOD.calibrate(inputs, dims, hp, True)
    diag["total_s"] = time.perf_counter() - t0
    np.savez(out / "tensors.npz", **tensors)
    (out / "info.json").write_text(json.dumps({"hp": hp, "diag": diag}, indent=1))
    ratequant.write_heatmap(
        out / "ratequant_heatmap.png",
        tensors["importance"],
        tensors["bits"],
        f"RateQuant importance and bits at b̄={hp['bits']}",
    )
    short = {k: v for k, v in diag.items() if k != "fit_r2"}
    print(json.dumps(short, indent=1))


def cmd_eval(args) -> None:
    from mlx_lm.models.cache import QuantizedKVCache

    from veloxquant.data import load_tokens
    from veloxquant.evaluate import evaluate_rows
    from veloxquant.model_import import load_model

    root = Path(args.artifacts)
    model, _ = load_model(root / "model")
    windows = load_tokens(root / "data" / "eval.safetensors")[: args.windows]
    art = load_artifact(args.rq)
    make = ratequant.METHOD.make_caches
    rows = []
    for b in args.kivi_bits:
        rows.append(
            {
                "name": f"kivi{b}-g32",
                "make": lambda m, b=b: kivi.METHOD.make_caches(
                    m, config(method="kivi", bits=b, group_size=32), None
                ),
            }
        )
    for b in args.mlx_bits:
        rows.append(
            {
                "name": f"mlx-q{b}-g64",
                "make": lambda m, b=b: [QuantizedKVCache(group_size=64, bits=b) for _ in m.layers],
            }
        )
    for bbar in args.bits:
        opts = {"allowed_bits": args.low_allowed} if bbar < 2.5 else {}
        rows += [
            {
                "name": f"ratequant-{bbar:g}",
                "make": lambda m, b=bbar, o=opts: make(m, config(bits=b, options=dict(o)), art),
            },
            {
                "name": f"uniform-{bbar:g}",
                "make": lambda m, b=bbar, o=opts: make(
                    m, config(bits=b, uncalibrated=True, options=dict(o)), None
                ),
            },
            {
                "name": f"proxy-{bbar:g}",
                "make": lambda m, b=bbar, o=opts: make(
                    m, config(bits=b, options={"importance": "proxy", **o}), art
                ),
            },
        ]
    for spec in args.ablation:
        name, _, path = spec.partition("=")
        source, _, field = path.partition(":")
        abl = load_artifact(source, field or None)
        for bbar in args.ablation_bits:
            opts = {"allowed_bits": args.low_allowed} if bbar < 2.5 else {}
            rows.append(
                {
                    "name": f"{name}-{bbar:g}",
                    "make": lambda m, b=bbar, a=abl, o=opts: make(
                        m, config(bits=b, options=dict(o)), a
                    ),
                }
            )
    t0 = time.perf_counter()
    res = evaluate_rows(model, windows, rows, prefill=args.prefill, chunk=args.chunk, progress=True)
    print(
        f"# {len(windows)} held-out windows x {windows.shape[1]} tokens, prefill "
        f"{args.prefill}, chunk {args.chunk}; fp16 ppl {res[0]['ppl_ref']:.4f}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    ref = res[0]["ppl_ref"]
    by = {r["name"]: r for r in res}
    print(
        f"{'row':24s} {'ppl':>8s} {'x fp16':>7s} {'KL':>8s} {'top1':>6s} {'bits/el':>7s} "
        f"{'excess removed vs uniform':>26s}"
    )
    for r in res:
        removed = ""
        if (
            r["name"].startswith(("ratequant-", "proxy-"))
            or "-" in r["name"]
            and r["name"].rsplit("-", 1)[0] in [a.partition("=")[0] for a in args.ablation]
        ):
            uni = by.get("uniform-" + r["name"].rsplit("-", 1)[1])
            if uni:
                removed = f"{100 * (1 - (r['ppl'] - ref) / (uni['ppl'] - ref)):.0f}%"
        print(
            f"{r['name']:24s} {r['ppl']:8.3f} {r['ppl_ratio']:7.4f} {r['kl']:8.4f} "
            f"{r['top1']:6.3f} {r['kv_bits_per_element']:7.3f} {removed:>26s}"
        )
    if args.csv:
        keys = [
            "name",
            "ppl",
            "ppl_ratio",
            "kl",
            "top1",
            "kv_bits_per_element",
            "ppl_ref",
            "n_windows",
        ]
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(res)


def cmd_truth(args) -> None:
    from veloxquant.data import load_tokens
    from veloxquant.evaluate import evaluate_rows
    from veloxquant.methods.ratequant import fisher
    from veloxquant.model_import import load_model

    root = Path(args.artifacts)
    model, _ = load_model(root / "model")
    windows = load_tokens(root / "data" / "eval.safetensors")[: args.windows]
    art = load_artifact(args.rq)
    hp = art.hyperparameters
    g, window, sinks = int(hp["group_size"]), int(hp["window"]), int(hp["sinks"])
    arts = {"ratequant": art}
    for spec in args.compare:
        name, _, path = spec.partition("=")
        source, _, field = path.partition(":")
        arts[name] = load_artifact(source, field or None)
    w = np.asarray(art.tensors["importance"], np.float64)
    units = fisher.stratified_units(w, args.units)
    base = np.full(w.shape, 8)
    rows = [{"name": "all8", "make": lambda m: kivi.build_caches(base, g, window, sinks)}]
    for u in units:
        for b in args.unit_bits:
            a = base.copy()
            a[u] = b
            rows.append(
                {"name": f"{u}-{b}", "make": lambda m, a=a: kivi.build_caches(a, g, window, sinks)}
            )
    res = evaluate_rows(model, windows, rows, prefill=args.prefill, chunk=args.chunk, progress=True)
    kl = {r["name"]: r["kl"] for r in res}
    table = np.asarray(art.tensors["distortion"], np.float64)
    print(
        f"# {len(units)} units, {len(windows)} held-out windows, prefill {args.prefill}, "
        f"chunk {args.chunk}; ΔKL against all units at 8 bits (KL {kl['all8']:.2e})"
    )
    for b in args.unit_bits:
        truth = np.array([kl[f"{u}-{b}"] - kl["all8"] for u in units])
        col = kivi.SUPPORTED_BITS.index(b)
        line = [f"{b}-bit:"]
        for name, a in arts.items():
            imp = np.asarray(a.tensors["importance"], np.float64)
            pred = np.array([imp[u] * table[u][col] for u in units])
            line.append(f"{name} {fisher.spearman(truth, pred):.3f}")
        print("  Spearman(ΔKL, w·d):", "  ".join(line))


def cmd_cost(args) -> None:
    from veloxquant.data import load_tokens
    from veloxquant.methods.ratequant import fisher
    from veloxquant.model_import import load_model

    root = Path(args.artifacts)
    model, _ = load_model(root / "model")
    tokens = mx.array(load_tokens(root / "data" / "calib.safetensors")[0, : args.tokens])
    hp = ratequant.DEFAULTS
    layout = {
        "mode": "runtime",
        "window": hp["window"],
        "sinks": hp["sinks"],
        "group_size": hp["group_size"],
    }
    none = [None] * (2 * len(model.layers))
    arms = {
        "forward, one call": lambda: mx.eval(fisher.window_nll(model, tokens, none)[0]),
        "forward, chunks of 64": lambda: mx.eval(
            fisher.window_nll(model, tokens, none, hp["fisher_chunk"], **layout)[0]
        ),
        "Fisher pass (runtime, chunks of 64)": lambda: fisher.window_gradients(
            model, tokens, hp["fisher_chunk"], **layout
        ),
        "Fisher pass (plain, one call)": lambda: fisher.window_gradients(model, tokens),
    }
    times = {k: [] for k in arms}
    for fn in arms.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = times["forward, one call"]
    print(f"{args.tokens}-token window, {args.repeats} interleaved repeats:")
    for name, ts in times.items():
        ratio = [t / b for t, b in zip(ts, base, strict=True)]
        print(f"  {name:38s} {fmt(ts, 1, 's')}   x forward {fmt(ratio, 1, '')}")


def cmd_decode(args) -> None:
    from mlx_lm.models.cache import KVCache

    model = get_model(args)
    dims = ModelDims.of(model)
    art = load_artifact(args.rq) if args.rq else mixed_artifact(dims)
    make = ratequant.METHOD.make_caches
    dtype = model.model.embed_tokens.weight.dtype

    # allocation solve at load time
    solve = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ratequant.solve_allocation(art, args.bits)
        solve.append(time.perf_counter() - t0)
    print(f"allocation solve (b̄={args.bits}, {dims.L * dims.H_kv * 2} units): {fmt(solve)}")

    arms = {
        "fp16 KVCache": lambda: [KVCache() for _ in model.layers],
        f"uniform KIVI b̄={args.bits:g}": lambda: make(
            model, config(bits=args.bits, uncalibrated=True), None
        ),
        f"RateQuant b̄={args.bits:g}": lambda: make(model, config(bits=args.bits), art),
        "RateQuant, pure unpack": lambda: make(model, config(bits=args.bits), art),
    }
    rng = np.random.default_rng(0)
    caches = {}
    for name, mk in arms.items():
        c = mk()
        # fill through update_and_fetch (timing does not depend on the values)
        for start in range(0, args.context, 512):
            n = min(512, args.context - start)
            for layer in c:
                k = mx.array(rng.normal(size=(1, dims.H_kv, n, dims.D))).astype(dtype)
                layer.update_and_fetch(k, k)
            mx.eval([layer.state for layer in c])
        caches[name] = c
    tok = mx.array([[1]])
    times = {name: [] for name in arms}

    def step(name, c):
        kivi.USE_MX_DEQUANTIZE = "pure" not in name  # read when the graph is built
        try:
            mx.eval(model(tok, cache=c))
        finally:
            kivi.USE_MX_DEQUANTIZE = True

    for name, c in caches.items():  # warm-up
        step(name, c)
    for _ in range(args.repeats):
        for name, c in caches.items():  # interleaved
            t0 = time.perf_counter()
            step(name, c)
            times[name].append(time.perf_counter() - t0)
    base = times["fp16 KVCache"]
    print(
        f"decode step, context {args.context} (+{args.repeats} steps), {args.repeats} "
        "interleaved repeats:"
    )
    for name, ts in times.items():
        ratio = [t / b for t, b in zip(ts, base, strict=True)]
        nbytes = sum(layer.nbytes for layer in caches[name])
        print(
            f"  {name:24s} {fmt(ts)}   x fp16 {fmt(ratio, 1, '')}   resident "
            f"{nbytes / 2**20:.2f} MiB"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--artifacts", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--hp", default="{}")
    e = sub.add_parser("eval")
    e.add_argument("--artifacts", required=True)
    e.add_argument("--rq", required=True)
    e.add_argument("--windows", type=int, default=2)
    e.add_argument("--prefill", type=int, default=512)
    e.add_argument("--chunk", type=int, default=64)
    e.add_argument("--bits", type=float, nargs="*", default=[2.0, 2.5, 3.0, 4.0])
    e.add_argument("--kivi-bits", type=int, nargs="*", default=[2, 3, 4])
    e.add_argument("--mlx-bits", type=int, nargs="*", default=[2, 4])
    e.add_argument(
        "--low-allowed",
        type=int,
        nargs="*",
        default=[1, 2, 3, 4, 8],
        help="allowed widths for b̄ < 2.5 (needs 1-bit at G=64)",
    )
    e.add_argument(
        "--ablation",
        nargs="*",
        default=[],
        help="NAME=DIR[:tensor] artifacts to allocate from (tensor replaces importance)",
    )
    e.add_argument("--ablation-bits", type=float, nargs="*", default=[3.0])
    e.add_argument("--csv")
    t = sub.add_parser("truth")
    t.add_argument("--artifacts", required=True)
    t.add_argument("--rq", required=True)
    t.add_argument("--compare", nargs="*", default=[])
    t.add_argument("--units", type=int, default=16)
    t.add_argument("--unit-bits", type=int, nargs="*", default=[2])
    t.add_argument("--windows", type=int, default=1)
    t.add_argument("--prefill", type=int, default=512)
    t.add_argument("--chunk", type=int, default=64)
    o = sub.add_parser("cost")
    o.add_argument("--artifacts", required=True)
    o.add_argument("--tokens", type=int, default=512)
    o.add_argument("--repeats", type=int, default=3)
    for name in ("check", "decode"):
        x = sub.add_parser(name)
        x.add_argument("--artifacts", help="the model dir's parent (real weights)")
        x.add_argument(
            "--random-weights",
            metavar="CONFIG_JSON",
            help="build the model from a config.json with random weights",
        )
        x.add_argument("--dtype", help="e.g. float16 or bfloat16 (default: float32)")
        x.add_argument(
            "--rq",
            help="RateQuant artifact dir or bundle dir (default: a synthetic mixed "
            "allocation of the model's shape)",
        )
        x.add_argument("--bits", type=float, default=3.0)
    sub.choices["check"].add_argument("--tokens", type=int, default=256)
    d = sub.choices["decode"]
    d.add_argument("--context", type=int, default=1024)
    d.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    {
        "calibrate": cmd_calibrate,
        "eval": cmd_eval,
        "truth": cmd_truth,
        "cost": cmd_cost,
        "check": cmd_check,
        "decode": cmd_decode,
    }[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
