"""CommVQ calibration variants and their eval rows, on a capture and held-out windows.

Calibrate (writes OUT/NAME/tensors.safetensors + info.json with hyperparameters, diagnostics and
wall time):

    python benchmarks/eval_commvq.py calibrate r11c --out /tmp/cvq
    python benchmarks/eval_commvq.py calibrate r5c key_bits=1 --out /tmp/cvq
    python benchmarks/eval_commvq.py calibrate r11n center=False --out /tmp/cvq

Evaluate rows (evaluate_rows, prefill 512, chunk 64) on the first --windows held-out windows:

    python benchmarks/eval_commvq.py evaluate --out /tmp/cvq --windows 2 \\
        cvq:r11c cvq:r11c:window=16 unc:2 pq:4:8:1:r11c vecinfer

Row specs: cvq:NAME[:window=W][:sinks=S] a calibrated variant; unc:KEY_BITS the uncalibrated
variant; pq:SUB:BITS:CENTER:NAME plain product VQ on pre-RoPE keys (trained here on the same
training tokens, cached in OUT), with NAME's value codebooks; vecinfer the bundle's VecInfer;
fp16. Defaults point at the default pipeline's artifacts (--artifacts).
"""

from __future__ import annotations

import argparse
import ast
import json
import time
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from veloxquant.methods.base import Artifact, CalibrationInputs, ModelDims
from veloxquant.methods.commvq import METHOD, make_caches, pq_baseline
from veloxquant.methods.commvq.cache import DEFAULT_SINKS, DEFAULT_WINDOW

ARTIFACTS = Path("artifacts/smollm2-135m")


def calibrate(args: argparse.Namespace) -> None:
    overrides = {}
    for kv in args.overrides:
        key, value = kv.split("=", 1)
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    hp = METHOD.hyperparameters(overrides)
    out = Path(args.out) / args.name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tensors, diag = METHOD.calibrate(
        CalibrationInputs(args.artifacts / "activations", args.artifacts / "model"),
        ModelDims.of(args.artifacts / "model"),
        hp,
        progress=True,
    )
    wall = time.perf_counter() - t0
    mx.save_safetensors(str(out / "tensors.safetensors"), tensors)
    (out / "info.json").write_text(json.dumps({"hp": hp, "diag": diag, "wall_s": wall}, indent=1))
    print(
        f"{args.name}: {wall:.0f} s, held-out key rel err {diag['stage_key_rel_err'][-1]:.4f}, "
        f"logit rel err {diag['stage_logit_rel_err'][-1]:.4f}"
    )


def _artifact(out: Path, name: str) -> Artifact:
    info = json.loads((out / name / "info.json").read_text())
    return Artifact(
        "commvq", mx.load(str(out / name / "tensors.safetensors")), info["hp"], info["diag"]
    )


def _knobs(parts: list[str]) -> dict[str, int]:
    return {k: int(v) for k, v in (p.split("=") for p in parts)}


def _pq_codebooks(args: argparse.Namespace, sub: int, bits: int, center: bool) -> dict:
    """Pre-RoPE PQ codebooks on the tokens CommVQ trains on (same seed-0 held-out split)."""
    from veloxquant.capture import load_activations, load_capture_info

    path = Path(args.out) / f"pq_d{sub}b{bits}_c{int(center)}.safetensors"
    if not path.exists():
        acts = args.artifacts / "activations"
        dims = ModelDims.of(args.artifacts / "model")
        n = int(load_capture_info(acts)["n_sampled"])
        perm = np.random.default_rng(0).permutation(n)
        n_held = max(1, round(n * METHOD.defaults["heldout_fraction"]))
        train = mx.array(np.sort(perm[n_held:]))
        k = mx.stack([load_activations(acts, i, ["k_pre"])["k_pre"] for i in range(dims.L)])
        k = k.transpose(0, 2, 1, 3).reshape(dims.L * dims.H_kv, n, dims.D)[:, train]
        book, mu = pq_baseline.train_prerope_pq(k, sub, bits, center=center, progress=True)
        tensors = {"key_codebook": book.reshape(dims.L, dims.H_kv, 2**bits, sub)}
        if mu is not None:
            tensors["key_mean"] = mu.reshape(dims.L, dims.H_kv, dims.D)
        mx.save_safetensors(str(path), tensors)
    return mx.load(str(path))


def _row(args: argparse.Namespace, spec: str) -> dict:
    from veloxquant.config import KVCacheConfig

    out = Path(args.out)
    parts = spec.split(":")
    if parts[0] == "cvq":
        art, o = _artifact(out, parts[1]), _knobs(parts[2:])
        cfg = KVCacheConfig(method="commvq", window=o.get("window"), sinks=o.get("sinks"))
        return {"name": spec, "make": lambda m: make_caches(m, cfg, art)}
    if parts[0] == "unc":
        o = _knobs(parts[2:])
        cfg = KVCacheConfig(
            method="commvq",
            uncalibrated=True,
            window=o.get("window"),
            sinks=o.get("sinks"),
            options={"key_bits": int(parts[1])},
        )
        return {"name": spec, "make": lambda m: make_caches(m, cfg, None)}
    if parts[0] == "pq":
        sub, bits, center = int(parts[1]), int(parts[2]), parts[3] == "1"
        books, art, o = (
            _pq_codebooks(args, sub, bits, center),
            _artifact(out, parts[4]),
            _knobs(parts[5:]),
        )
        hp = art.hyperparameters
        return {
            "name": spec,
            "make": lambda m: pq_baseline.make_caches(
                m,
                books["key_codebook"],
                art.tensors["value_codebook"],
                books.get("key_mean"),
                key_bits=bits,
                key_sub_dim=sub,
                value_bits=hp["value_bits"],
                value_sub_dim=hp["value_sub_dim"],
                window=o.get("window", DEFAULT_WINDOW),
                sinks=o.get("sinks", DEFAULT_SINKS),
            ),
        }
    if parts[0] == "vecinfer":
        return {"name": spec, "method": "vecinfer", "artifact_dir": str(args.artifacts / "bundle")}
    if parts[0] == "fp16":
        return {"name": spec, "method": "fp16"}
    raise ValueError(f"unknown row spec {spec!r}")


def evaluate(args: argparse.Namespace) -> None:
    from veloxquant.data import load_tokens
    from veloxquant.evaluate import evaluate_rows
    from veloxquant.model_import import load_model

    model, _ = load_model(args.artifacts / "model")
    windows = load_tokens(args.artifacts / "data" / "eval.safetensors")[: args.windows]
    rows = [_row(args, s) for s in args.rows]
    t0 = time.perf_counter()
    results = evaluate_rows(model, windows, rows, prefill=512, chunk=64, progress=False)
    print(
        f"evaluated {len(rows)} rows x {len(windows)} windows in {time.perf_counter() - t0:.0f} s"
    )
    keep = ("name", "ppl", "ppl_ratio", "kl", "top1", "kv_bits_per_element", "ppl_ref")
    for r in results:
        print(
            "  ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keep)
        )
    (Path(args.out) / "eval.json").write_text(
        json.dumps([{k: r[k] for k in keep} for r in results], indent=1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, default=ARTIFACTS)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("calibrate")
    p.add_argument("name")
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="hyperparameter=value")
    p.set_defaults(func=calibrate)
    p = sub.add_parser("evaluate")
    p.add_argument("--out", required=True)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("rows", nargs="+")
    p.set_defaults(func=evaluate)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
