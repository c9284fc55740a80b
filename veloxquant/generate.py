"""`veloxquant generate`: mlx-lm's generate with a veloxquant cache, and the numbers it reports.

It mirrors `mlx_lm generate` (same flags and defaults for what matters: --max-tokens, --temp,
--top-p, --top-k, --min-p, --seed, --system-prompt, --ignore-chat-template,
--chat-template-config, --prefill-step-size, --kv-bits, --verbose), streams the text through
`mlx_lm.stream_generate`, and with --verbose prints what mlx-lm prints (prompt and generation
tok/s, peak memory) plus the cache's resident bytes next to what an uncompressed cache would
hold for the same tokens.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veloxquant.config import KVCacheConfig, cache_factory, check_kv_bits


@dataclass(frozen=True)
class KVSummary:
    """What a list of per-layer caches holds: tokens seen, bytes resident, and the bytes an
    uncompressed mlx-lm KVCache in the model's dtype would hold for those tokens."""

    classes: str
    tokens: int
    kv_bytes: int
    uncompressed_bytes: int
    itemsize: int  # bytes per element of the uncompressed cache

    @property
    def bits_per_element(self) -> float:
        elements = self.uncompressed_bytes // self.itemsize
        return 8 * self.kv_bytes / elements if elements else 0.0

    def line(self) -> str:
        ratio = self.uncompressed_bytes / self.kv_bytes if self.kv_bytes else float("nan")
        return (
            f"KV cache: {self.classes}, {self.tokens} tokens, {self.kv_bytes / 1e6:.3f} MB "
            f"resident ({self.bits_per_element:.2f} bits/element; an uncompressed KVCache "
            f"would hold {self.uncompressed_bytes / 1e6:.3f} MB, {ratio:.2f}x)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "classes": self.classes,
            "tokens": self.tokens,
            "kv_bytes": self.kv_bytes,
            "uncompressed_kv_bytes": self.uncompressed_bytes,
            "bits_per_element": self.bits_per_element,
        }


def model_kv_itemsize(model: Any) -> int:
    """Bytes per element of the keys a plain KVCache would store: the activations' dtype,
    which is that of the model's floating-point (norm) weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype.size
    return 2


def kv_summary(model: Any, caches: list) -> KVSummary:
    from veloxquant.methods.base import ModelDims

    dims = ModelDims.of(model)
    offset = caches[0].offset if caches else 0
    tokens = int(offset) if isinstance(offset, int) else int(max(offset.tolist()))
    itemsize = model_kv_itemsize(model)
    names = sorted({type(c).__name__ for c in caches})
    return KVSummary(
        classes=f"{'/'.join(names)} x{len(caches)}",
        tokens=tokens,
        kv_bytes=int(sum(c.nbytes for c in caches)),
        uncompressed_bytes=2 * dims.L * dims.H_kv * dims.D * tokens * itemsize,
        itemsize=itemsize,
    )


def resolve_config(model_dir: str | Path, fields: dict[str, Any]) -> KVCacheConfig:
    """KVCacheConfig from CLI fields; with a bundle (given or shipped in the model dir) and no
    method, refuse rather than run an uncompressed cache."""
    from veloxquant.bundle import BUNDLE_SUBDIR, MANIFEST, load_bundle

    if fields.get("method") is None:
        bundle = fields.get("artifact_dir")
        if bundle is None and (Path(model_dir) / BUNDLE_SUBDIR / MANIFEST).is_file():
            bundle = Path(model_dir) / BUNDLE_SUBDIR
        if bundle is not None:
            methods = load_bundle(bundle).methods
            where = "given" if fields.get("artifact_dir") else "shipped in the model dir"
            raise ValueError(
                f"a bundle is {where} ({bundle}, methods: {', '.join(methods)}) but no "
                f"--method: pick one, e.g. --method {methods[0]}; --method fp16 runs the "
                "uncompressed cache."
            )
        fields = {**fields, "method": "fp16"}
    return KVCacheConfig(**fields)


def build_prompt(tokenizer: Any, args: Any) -> list[int]:
    """The prompt as mlx_lm generate builds it: chat template (with --system-prompt) unless
    --ignore-chat-template or the tokenizer has none; '-' reads stdin."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat = not args.ignore_chat_template and tokenizer.has_chat_template
    if not use_chat:
        return tokenizer.encode(prompt)
    messages = (
        [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
    )
    messages.append({"role": "user", "content": prompt})
    template_kwargs = json.loads(args.chat_template_config) if args.chat_template_config else {}
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def generate_cli(args: Any, fields: dict[str, Any]) -> str:
    """Load the model, build the cache, stream the answer; returns the text."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from veloxquant.model_import import load_model

    config = resolve_config(args.model_dir, fields)  # before loading: fail fast
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = load_model(args.model_dir)
    caches = cache_factory(model, config)()
    check_kv_bits(caches, args.kv_bits)
    prompt = build_prompt(tokenizer, args)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
    if args.verbose:
        print("=" * 10)
    text, response = "", None
    for response in stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        sampler=sampler,
        prompt_cache=caches,
        prefill_step_size=args.prefill_step_size,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
    ):
        print(response.text, end="", flush=True)
        text += response.text
    print()
    if args.verbose and response is not None:
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
        print(f"Method: {config.label()}")
        print(kv_summary(model, caches).line())
    return text
