"""The `veloxquant` command line: every pipeline step as a verb, plus bundle tools.

veloxquant import-model [SOURCE] OUT_DIR [--dtype float32]
veloxquant prepare-data MODEL_DIR OUT_DIR [--source JSON] [--seq-len 1024] ...
veloxquant capture MODEL_DIR TOKENS.safetensors OUT_DIR [--budget 8192] [--seed 0]
veloxquant calibrate METHOD ACTIVATIONS_DIR MODEL_DIR BUNDLE_DIR [--data-json F] [--params J]
veloxquant eval MODEL_DIR TOKENS.safetensors [--row JSON ...] [--out DIR]
veloxquant generate MODEL_DIR PROMPT [--method M] [--artifact-dir DIR] [--budget B]
veloxquant bundle inspect DIR | verify DIR [--model MODEL_DIR] [--strict] | export DIR MODEL_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
from veloxquant.methods import CALIBRATED, METHODS


def _methods_help(names) -> str:
    return "\n".join(f"  {m:<13} {METHODS[m].summary}" for m in names)


def _import_model(a: argparse.Namespace) -> None:
    from veloxquant.model_import import import_model

    print(import_model(a.source, a.out_dir, dtype=a.dtype))


def _prepare_data(a: argparse.Namespace) -> None:
    from veloxquant.data import prepare_data
    from veloxquant.model_import import load_tokenizer

    info = prepare_data(
        load_tokenizer(a.model_dir),
        source=json.loads(a.source),
        out_dir=a.out_dir,
        seq_len=a.seq_len,
        calib_windows=a.calib_windows,
        eval_windows=a.eval_windows,
        eval_fraction=a.eval_fraction,
        seed=a.seed,
    )
    print(json.dumps(info, indent=2, default=str))


def _capture(a: argparse.Namespace) -> None:
    from veloxquant.capture import capture_activations
    from veloxquant.data import load_tokens
    from veloxquant.model_import import load_model

    model, _ = load_model(a.model_dir)
    summary = capture_activations(
        model, load_tokens(a.tokens), a.out_dir, token_budget=a.budget, seed=a.seed
    )
    print(json.dumps(summary, indent=2, default=str))


def _calibrate(a: argparse.Namespace) -> None:
    from veloxquant.calibrate import calibrate

    params = json.loads(a.params) if a.params else {}
    path = calibrate(
        a.method, a.activations_dir, a.model_dir, a.bundle_dir, data_json=a.data_json, **params
    )
    print(path)


def _eval(a: argparse.Namespace) -> None:
    from veloxquant.data import load_tokens
    from veloxquant.evaluate import evaluate_rows, write_metrics
    from veloxquant.model_import import load_model

    model, _ = load_model(a.model_dir)
    rows = [json.loads(r) for r in a.row] or [{"name": "fp16", "method": "fp16"}]
    results = evaluate_rows(
        model, load_tokens(a.tokens)[: a.windows], rows, prefill=a.prefill, chunk=a.chunk
    )
    if a.out:
        write_metrics(results, Path(a.out) / "metrics.json")
    for r in results:
        print(json.dumps(r, default=str))


def _generate(a: argparse.Namespace) -> None:
    from mlx_lm import generate

    from veloxquant import KVCacheConfig, make_cache
    from veloxquant.model_import import load_model

    model, tokenizer = load_model(a.model_dir)
    cfg = KVCacheConfig(
        method=a.method, artifact_dir=a.artifact_dir, budget=a.budget, uncalibrated=a.uncalibrated
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": a.prompt}], add_generation_prompt=True, tokenize=False
    )
    print(
        generate(
            model, tokenizer, prompt, max_tokens=a.max_tokens, prompt_cache=make_cache(model, cfg)
        )
    )


def _bundle(a: argparse.Namespace) -> None:
    from veloxquant import bundle

    if a.bundle_cmd == "inspect":
        print(render_bundle(bundle.load_bundle(a.dir)))
    elif a.bundle_cmd == "verify":
        bundle.verify_bundle(a.dir, model_dir=a.model, strict=a.strict)
        print(f"OK: {a.dir}")
    else:
        print(bundle.export_bundle(a.dir, a.model_dir))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="veloxquant",
        description=__doc__ + "\nKV-cache methods:\n" + _methods_help(METHODS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"veloxquant {veloxquant.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("import-model", help="GGUF / model dir / repo id -> mlx-lm model dir")
    s.add_argument("source", nargs="?", default="default", help="default = embedded SmolLM2 GGUF")
    s.add_argument("out_dir")
    s.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    s.set_defaults(func=_import_model)

    s = sub.add_parser("prepare-data", help="tokenized calib/eval windows")
    s.add_argument("model_dir")
    s.add_argument("out_dir")
    s.add_argument("--source", default='{"kind": "pydoc_topics"}', help="JSON data source spec")
    s.add_argument("--seq-len", type=int, default=1024)
    s.add_argument("--calib-windows", type=int, default=32)
    s.add_argument("--eval-windows", type=int, default=4)
    s.add_argument("--eval-fraction", type=float, default=0.25)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_prepare_data)

    s = sub.add_parser("capture", help="record q_post/k_pre/k_post/v activations")
    s.add_argument("model_dir")
    s.add_argument("tokens")
    s.add_argument("out_dir")
    s.add_argument("--budget", type=int, default=8192)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_capture)

    s = sub.add_parser(
        "calibrate",
        help="train a method's artifact into a bundle",
        description="Calibrated methods:\n" + _methods_help(CALIBRATED),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("method", choices=CALIBRATED)
    s.add_argument("activations_dir")
    s.add_argument("model_dir")
    s.add_argument("bundle_dir")
    s.add_argument("--data-json", default=None, help="data.json from prepare-data (fingerprint)")
    s.add_argument("--params", default=None, help="JSON of method hyperparameters")
    s.set_defaults(func=_calibrate)

    s = sub.add_parser("eval", help="held-out ppl / KL / top-1 / KV bytes")
    s.add_argument("model_dir")
    s.add_argument("tokens")
    s.add_argument(
        "--row",
        action="append",
        default=[],
        help='JSON, e.g. {"name":"q4","method":"quantized","bits":4}',
    )
    s.add_argument("--windows", type=int, default=4)
    s.add_argument("--prefill", type=int, default=512)
    s.add_argument("--chunk", type=int, default=64)
    s.add_argument("--out", default=None)
    s.set_defaults(func=_eval)

    s = sub.add_parser("generate", help="chat generation through a veloxquant cache")
    s.add_argument("model_dir")
    s.add_argument("prompt")
    s.add_argument("--method", default="fp16", choices=list(METHODS))
    s.add_argument("--artifact-dir", default=None)
    s.add_argument("--budget", type=float, default=None)
    s.add_argument("--uncalibrated", action="store_true")
    s.add_argument("--max-tokens", type=int, default=100)
    s.set_defaults(func=_generate)

    s = sub.add_parser("bundle", help="inspect, verify or export a calibration bundle")
    bsub = s.add_subparsers(dest="bundle_cmd", required=True)
    b = bsub.add_parser("inspect")
    b.add_argument("dir")
    b = bsub.add_parser("verify")
    b.add_argument("dir")
    b.add_argument("--model", default=None, help="model dir to check the fingerprint against")
    b.add_argument(
        "--strict", action="store_true", help="weight/tokenizer digest mismatch is an error"
    )
    b = bsub.add_parser("export")
    b.add_argument("dir")
    b.add_argument("model_dir")
    s.set_defaults(func=_bundle)
    return p


def render_bundle(bundle) -> str:
    """`veloxquant bundle inspect`: model, methods, tensors, data, diagnostics, sizes."""
    from veloxquant.fingerprint import DIGEST_FIELDS

    m = bundle.manifest
    fp = m["model"]
    lines = [
        f"bundle {bundle.path}  ({m['format']} v{m['format_version']})",
        f"model  {fp.get('model_type')} {fp.get('path')}",
        f"       layers={fp.get('num_layers')} heads={fp.get('num_heads')} "
        f"kv_heads={fp.get('num_kv_heads')} head_dim={fp.get('head_dim')} "
        f"rope(theta={fp.get('rope_theta')}, traditional={fp.get('rope_traditional')}, "
        f"scaling={fp.get('rope_scaling')})",
        "       " + "  ".join(f"{k}={str(fp.get(k))[:12]}" for k in DIGEST_FIELDS),
    ]
    total = 0
    for name in bundle.methods:
        e = m["methods"][name]
        total += e["size"]
        lines.append(
            f"method {name}: {e['file']} {_human(e['size'])} sha256={e['sha256'][:12]} "
            f"capture={e.get('capture_point')}"
        )
        lines.append(f"  hyperparameters: {json.dumps(e.get('hyperparameters'), sort_keys=True)}")
        for t, info in e.get("tensors", {}).items():
            lines.append(f"  tensor {t:<18} {info['dtype']:<8} {info['shape']}")
        data = e.get("data") or {}
        lines.append(
            "  data: "
            + ", ".join(
                f"{k}={json.dumps(v, sort_keys=True, separators=(',', ':'))[:80]}"
                for k, v in sorted(data.items())
            )
        )
        for k, v in sorted((e.get("diagnostics") or {}).items()):
            lines.append(f"  diag {k}: {_short(v)}")
        vers = e.get("versions") or {}
        lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in sorted(vers.items())))
    lines.append(f"total {_human(total)} in {len(bundle.methods)} method file(s)")
    return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 6:
        head = ", ".join(_short(x) for x in v[:6])
        return f"[{head}, ...] ({len(v)} values)"
    return json.dumps(v) if not isinstance(v, str) else v


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except Exception as e:  # one clear line for users; full traceback with VELOXQUANT_DEBUG=1
        import os

        if os.environ.get("VELOXQUANT_DEBUG"):
            raise
        print(f"veloxquant {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
