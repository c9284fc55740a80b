"""Every eval row of conf/eval/default.yaml on *all* held-out windows, not the pipeline's first 3.

The pipeline's `evaluate` stage uses 3 windows to stay affordable on a 2-core CPU; this script
checks that its conclusions hold on the whole held-out split (28 windows x 1024 tokens for the
default data), which takes ~2 minutes on a GPU. Same lockstep harness, same rows (plus any
`--extra-row`), artifact dirs resolved like the stage does.

    # windows: the pipeline's data conf, every full window of the eval split (needs `datasets`)
    python benchmarks/eval_all_heldout.py --out benchmarks/results/heldout-gpu-float16
    # on a machine without `datasets`: write the windows first, then pass them
    python benchmarks/eval_all_heldout.py --write-windows /tmp/eval_all.safetensors
    python benchmarks/eval_all_heldout.py --windows /tmp/eval_all.safetensors --dtype float16

mlx-lm's QuantizedKVCache rows are evaluated as their own group and reported as failed where the
backend lacks quantized_matmul for the shape (MLX 0.32.4 on CUDA), without losing the others.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import yaml

from veloxquant.data import load_tokens
from veloxquant.evaluate import evaluate_rows, is_calibrated, write_csv
from veloxquant.io import save_safetensors_atomic
from veloxquant.model_import import import_model, load_model

ROOT = Path(__file__).resolve().parents[1]


def heldout_windows(model_dir: Path) -> np.ndarray:
    """Every full window of the eval split, built exactly as the prepare_data stage builds it."""
    from veloxquant.data import load_text_dataset, split_calib_eval, tokenize_windows
    from veloxquant.model_import import load_tokenizer

    data = yaml.safe_load((ROOT / "params.yaml").read_text())["data"]
    _, eval_ds = split_calib_eval(
        load_text_dataset(data["source"]), data["eval_fraction"], data["seed"]
    )
    return tokenize_windows(load_tokenizer(model_dir), eval_ds, data["seq_len"], None)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="model key under artifacts/")
    p.add_argument(
        "--source", default="default", help="model to import (default: the embedded GGUF)"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="model dtype (default: float32 on CPU, float16 on a GPU)",
    )
    p.add_argument(
        "--windows", default=None, help="token shard [N, seq_len] (default: built from params.yaml)"
    )
    p.add_argument(
        "--write-windows", default=None, help="only write the held-out windows here and exit"
    )
    p.add_argument("--prefill", type=int, default=None)
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument(
        "--extra-row",
        action="append",
        default=[],
        type=json.loads,
        help="another row as JSON, e.g. "
        '\'{"name": "vecinfer-w32", "method": "vecinfer", "window": 32}\'',
    )
    p.add_argument("--out", default="benchmarks/out/heldout")
    a = p.parse_args()

    from veloxquant._platform import default_dtype

    art = ROOT / "artifacts" / a.model
    if a.write_windows:
        w = heldout_windows(art / "model")
        save_safetensors_atomic(a.write_windows, {"tokens": w})
        print(f"wrote {w.shape} to {a.write_windows}")
        return
    dtype = a.dtype or default_dtype()
    model_dir = import_model(a.source, Path("/tmp") / f"veloxquant-{a.model}-{dtype}", dtype=dtype)
    model, _ = load_model(model_dir)
    windows = load_tokens(a.windows) if a.windows else heldout_windows(model_dir)
    conf = yaml.safe_load((ROOT / "conf/eval/default.yaml").read_text())
    prefill, chunk = a.prefill or conf["prefill"], a.chunk or conf["chunk"]
    rows = [dict(r) for r in conf["rows"]] + a.extra_row
    for r in rows:
        if is_calibrated(r):
            r["artifact_dir"] = (
                str(art / r["artifact_dir"]) if r.get("artifact_dir") else str(art / "bundle")
            )
    print(
        f"mlx {mx.__version__} on {mx.default_device()}, model {dtype}, "
        f"{windows.shape[0]} windows x {windows.shape[1]} tokens, prefill {prefill}, chunk {chunk}"
    )

    results: list[dict] = []
    reference = {"name": "fp16", "method": "fp16"}
    quantized = [r for r in rows if r["method"] == "quantized"]
    others = [r for r in rows if r["method"] != "quantized" and r["name"] != "fp16"]
    for group in (others, quantized):
        if not group:
            continue
        t0 = time.perf_counter()
        try:
            res = evaluate_rows(model, windows, [reference] + group, prefill=prefill, chunk=chunk)
        except RuntimeError as e:
            print(f"FAILED: {[r['name'] for r in group]}: {str(e).splitlines()[0]}")
            continue
        print(f"{len(group)} rows: {time.perf_counter() - t0:.0f} s")
        results += res if not results else res[1:]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(results, out / "eval.csv")
    print(f"{'row':32s} {'ppl':>8s} {'x fp16':>7s} {'KL':>7s} {'top-1':>6s} {'bits':>6s}")
    for r in results:
        print(
            f"{r['name']:32s} {r['ppl']:8.3f} {r['ppl_ratio']:7.3f} {r['kl']:7.4f} "
            f"{r['top1']:6.3f} {r['kv_bits_per_element']:6.2f}"
        )
    print(f"wrote {out / 'eval.csv'}")


if __name__ == "__main__":
    main()
