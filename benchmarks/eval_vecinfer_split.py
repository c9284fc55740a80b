"""VecInfer's K/V bit split and window at about 3 resident bits/element: calibrate each variant
of the default hyperparameters on a capture, then evaluate every (variant, window) row in one
`evaluate_rows` call (prefill 512, chunk 64) on the held-out windows.

    python benchmarks/eval_vecinfer_split.py --artifacts artifacts/smollm2-135m --out /tmp/vsplit

--variants NAME=key:value,... overrides the default hyperparameters per variant (the default
list: keys d2b5 / d2b6 / d2b7, values d4b6 / d4b7 / d4b8, per head or per layer); bits are read
from the arrays. Results: benchmarks/results/vecinfer-kv-split-cpu.txt.
"""

from __future__ import annotations

import argparse
import ast
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
from veloxquant.calibrate import calibrate
from veloxquant.data import load_tokens
from veloxquant.evaluate import evaluate_rows
from veloxquant.methods.vecinfer import DEFAULTS
from veloxquant.model_import import load_model

VARIANTS = [
    "k6v6-head=value_bits:6,value_share:head",  # the previous default
    "k5v8-head=key_bits:5,value_bits:8,value_share:head",
    "k6v7-head=value_bits:7,value_share:head",
    "k7v6-head=key_bits:7,value_bits:6,value_share:head",
    "k6v8-head=value_bits:8,value_share:head",
    "k6v8-layer=value_bits:8,share:layer",
    "k6v8=value_bits:8,value_share:layer",  # the default
]


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, body = spec.partition("=")
    overrides = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition(":")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise SystemExit(f"{spec}: unknown vecinfer hyperparameters {unknown}")
    return name, overrides


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--artifacts", type=Path, default=Path("artifacts/smollm2-135m"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--fp16-windows", type=int, nargs="+", default=[18, 26, 30, 38, 46])
    p.add_argument("--variants", nargs="+", default=VARIANTS)
    args = p.parse_args()
    a = args.artifacts
    rows = []
    for spec in args.variants:
        name, overrides = parse_variant(spec)
        t0 = time.perf_counter()
        calibrate(
            "vecinfer",
            a / "activations",
            a / "model",
            args.out / name,
            data_json=a / "data" / "data.json",
            **{**DEFAULTS, **overrides},
        )
        print(f"{name}: calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
        for w in args.fp16_windows:
            rows.append(
                {"name": f"{name}-w{w}", "method": "vecinfer", "artifact_dir": str(args.out / name)}
                | {"window": w}
            )
    model, _ = load_model(a / "model")
    windows = load_tokens(a / "data" / "eval.safetensors")[: args.windows]
    print("row ppl/fp16 KL top1 bits/element")
    for r in evaluate_rows(model, windows, rows, prefill=512, chunk=64):
        print(
            f"{r['name']} {r['ppl_ratio']:.4f} {r['kl']:.4f} {r['top1']:.3f} "
            f"{r['kv_bits_per_element']:.3f}"
        )


if __name__ == "__main__":
    main()
