"""Calibrate a random-weight model of a given shape end to end through the library, stage by
stage: wall time and peak memory (MLX's allocator) of each, against weights + token budget.

The model is built from a config.json with random weights in `--dtype` and saved as a model
dir (timings and memory do not depend on the weight values); the calibration tokens are random
ids. Then, as `dvc repro` would: capture (`--token-budget` tokens), and every calibrated
method of veloxquant.methods.CALIBRATED into one bundle, each with its default hyperparameters.

    # the Llama-3-8B shape on a GPU (MLX CUDA / Metal); the tokenizer files of any model dir
    python benchmarks/bench_calibrate.py --config benchmarks/configs/llama3-8b.json \
        --tokenizer-dir artifacts/smollm2-135m/model --dtype bfloat16 --work /tmp/cal8b
    # one method, with overrides
    python benchmarks/bench_calibrate.py ... --methods ratequant --hp ratequant.fisher_tokens=256

With `--twice`, each method is calibrated a second time into a second bundle, untimed, and its
artifact's bytes are compared with the first's (determinism on this device).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from veloxquant.calibrate import calibrate
from veloxquant.capture import capture_activations
from veloxquant.data import tokens_sha256
from veloxquant.io import save_safetensors_atomic, write_json_atomic
from veloxquant.methods import CALIBRATED

from _common import random_weights_model


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def build_model_dir(config_json: Path, tokenizer_dir: Path, dtype: mx.Dtype, out: Path):
    config = json.loads(config_json.read_text())
    model = random_weights_model(config_json, dtype)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype)[6:]}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return model, sum(v.nbytes for v in weights.values())


def write_random_data(out: Path, vocab: int, n: int, seq_len: int, seed: int) -> np.ndarray:
    tokens = np.random.default_rng(seed).integers(0, vocab, (n, seq_len)).astype(np.int32)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors_atomic(out / "calib.safetensors", {"tokens": tokens})
    info = {
        "source": {"kind": "random", "seed": seed},
        "seq_len": seq_len,
        "calib": {
            "file": "calib.safetensors",
            "n_windows": n,
            "n_tokens": int(tokens.size),
            "sha256": tokens_sha256(tokens),
        },
    }
    write_json_atomic(out / "data.json", info)
    return tokens


def stage(rows: list, name: str, fn, out: Path | None):
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    result = fn()
    mx.synchronize()
    wall = time.perf_counter() - t0
    rows.append({"stage": name, "wall_s": round(wall, 2), "peak_bytes": mx.get_peak_memory()})
    print(f"{name:<12} {wall:8.1f} s   peak {gib(rows[-1]['peak_bytes'])}", flush=True)
    if out is not None:
        out.write_text(json.dumps(rows, indent=1))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--tokenizer-dir", type=Path, required=True)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    p.add_argument("--work", type=Path, required=True, help="scratch dir (model, data, bundle)")
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--methods", nargs="+", default=list(CALIBRATED))
    p.add_argument("--out", type=Path, default=None, help="JSON of the rows, rewritten per stage")
    p.add_argument("--twice", action="store_true", help="calibrate again; compare the bytes")
    p.add_argument(
        "--hp",
        nargs="*",
        default=[],
        metavar="METHOD.NAME=VALUE",
        help="hyperparameter overrides, e.g. ratequant.fisher_tokens=256 (JSON values)",
    )
    args = p.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")

    rows: list = []
    work = args.work
    model_dir, data_dir = work / "model", work / "data"
    acts, bundle = work / "activations", work / "bundle"
    shutil.rmtree(work, ignore_errors=True)
    model, weight_bytes = stage(
        rows,
        "model",
        lambda: build_model_dir(
            args.config, args.tokenizer_dir, getattr(mx, args.dtype), model_dir
        ),
        args.out,
    )
    vocab = json.loads(args.config.read_text())["vocab_size"]
    tokens = write_random_data(data_dir, vocab, args.windows, args.seq_len, seed=0)
    capture = functools.partial(
        capture_activations,
        model,
        tokens,
        acts,
        args.token_budget,
        progress=False,
        data_sha256=tokens_sha256(tokens),
    )
    stage(rows, "capture", capture, args.out)
    del model, capture  # calibration reads the capture and the model dir, as the pipeline does
    overrides: dict = {m: {} for m in args.methods}
    for item in args.hp:
        key, value = item.split("=", 1)
        method, name = key.split(".", 1)
        overrides[method][name] = json.loads(value)
    for method in args.methods:
        run = functools.partial(
            calibrate, method, acts, model_dir, bundle, progress=False, **overrides[method]
        )
        stage(rows, method, run, args.out)
        if args.twice:
            again = work / "bundle-again"
            calibrate(method, acts, model_dir, again, progress=False, **overrides[method])
            a, b = (
                max(d.glob(f"{method}-*.safetensors"), key=lambda f: f.stat().st_mtime)
                for d in (bundle, again)
            )
            same = a.read_bytes() == b.read_bytes()
            rows[-1]["bit_identical_rerun"] = same
            print(f"{'':<12} rerun: {method}.safetensors bit-identical: {same}", flush=True)
    budget_bytes = sum(f.stat().st_size for f in acts.glob("*.safetensors"))
    print(f"weights {gib(weight_bytes)}, capture on disk {gib(budget_bytes)}")
    summary = {"weights_bytes": weight_bytes, "capture_bytes": budget_bytes, "stages": rows}
    summary["bundle_bytes"] = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    print(f"bundle {gib(summary['bundle_bytes'])}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
