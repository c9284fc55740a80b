"""Stress variants of a model: the same weights plus a large constant bias on k_proj / v_proj.

DESIGN.md section 11. Many families (qwen2 and others with q/k/v biases, models with outlier
channels) have keys whose per-head mean carries far more of their energy than the default
model's. A calibration that only works on the default model's statistics breaks there. Adding a
constant pre-RoPE bias b_k to every key (and b_v to every value) reproduces that regime on a
model that runs here in seconds: the stress model is judged against its own fp16 output.

The bias of each (layer, KV head) has a fixed random direction (seeded) and a norm of `scale`
times that head's RMS key (value) norm, measured on a fixed offline text (CPython's pydoc
topics). The key bias lives in the slowest-rotating RoPE pairs, where real models keep their key
means: there q·RoPE_m(b) barely changes with the position m, so it shifts a query's logits by
nearly a constant, which softmax ignores, and the model stays a working language model. A key
bias in fast-rotating pairs would add a position-dependent term to every logit and wreck it.
Written as an ordinary mlx-lm model dir (llama with `attention_bias: true`; the q and o biases
are zero), so every stage of the pipeline runs on it unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from veloxquant.io import save_safetensors_atomic, write_json_atomic

PROBE_TOKENS = 256
SLOW_PAIRS = 8  # the RoPE pairs the key bias lives in (the slowest-rotating ones)


def _probe_rms(model: Any, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per (layer, KV head) RMS norm of pre-RoPE keys and of values on `tokens` [1, S]."""
    import mlx.core as mx

    from veloxquant.capture import record_attention, recording_caches

    with record_attention(model) as ropes:
        caches = recording_caches(ropes)
        model(mx.array(tokens), cache=caches)
        k = [c.records[0]["k_pre"][0] for c in caches]  # [H, S, D]
        v = [c.records[0]["v"][0] for c in caches]
        rms_k = np.stack([np.sqrt(np.mean(np.sum(np.array(x) ** 2, -1), -1)) for x in k])
        rms_v = np.stack([np.sqrt(np.mean(np.sum(np.array(x) ** 2, -1), -1)) for x in v])
    return rms_k, rms_v


def write_kv_bias_model(
    src_dir: str | Path,
    out_dir: str | Path,
    key_scale: float = 3.0,
    value_scale: float = 1.0,
    seed: int = 0,
) -> Path:
    """Copy the llama model dir `src_dir` to `out_dir` with constant biases added to k_proj and
    v_proj (norm `key_scale` / `value_scale` × the head's RMS key / value norm)."""
    import mlx.core as mx
    from pydoc_data.topics import topics

    from veloxquant.model_import import load_model

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    config = json.loads((src_dir / "config.json").read_text())
    if config.get("model_type") != "llama" or config.get("attention_bias"):
        raise ValueError(
            f"{src_dir}: the k/v-bias stress variant needs a llama model without attention "
            f"biases; got model_type={config.get('model_type')!r}, "
            f"attention_bias={config.get('attention_bias')!r}"
        )
    model, tokenizer = load_model(src_dir)
    text = "\n\n".join(topics[k] for k in sorted(topics)[:4])
    tokens = np.array(tokenizer.encode(text)[:PROBE_TOKENS], np.int32)[None]
    rms_k, rms_v = _probe_rms(model, tokens)

    n_layers, n_kv = rms_k.shape
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    hidden = config["hidden_size"]
    rng = np.random.default_rng(seed)
    weights = {k: np.array(v) for k, v in mx.load(str(src_dir / "model.safetensors")).items()}
    # Pair j rotates by m·base^(−2j/D): the last pairs are the slowest. Traditional RoPE pairs
    # dims (2j, 2j + 1), the half-split layout (j, j + D/2).
    slow = np.arange(head_dim // 2 - SLOW_PAIRS, head_dim // 2)
    pair_dims = (
        np.concatenate([2 * slow, 2 * slow + 1])
        if config.get("rope_traditional")
        else np.concatenate([slow, slow + head_dim // 2])
    )
    key_support = np.zeros(head_dim)
    key_support[pair_dims] = 1.0
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}.self_attn"
        for proj, rms, scale in (("k_proj", rms_k, key_scale), ("v_proj", rms_v, value_scale)):
            direction = rng.standard_normal((n_kv, head_dim))
            if proj == "k_proj":
                direction *= key_support
            direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
            bias = (scale * rms[layer][:, None] * direction).reshape(-1)
            weights[f"{prefix}.{proj}.bias"] = bias.astype(np.float32)
        weights[f"{prefix}.q_proj.bias"] = np.zeros(heads * head_dim, np.float32)
        weights[f"{prefix}.o_proj.bias"] = np.zeros(hidden, np.float32)

    tmp = out_dir.with_name(f".{out_dir.name}.writing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src_dir.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, tmp / f.name)
    save_safetensors_atomic(tmp / "model.safetensors", weights, metadata={"format": "mlx"})
    stress = {"key_bias_scale": key_scale, "value_bias_scale": value_scale, "seed": seed}
    write_json_atomic(
        tmp / "config.json", {**config, "attention_bias": True, "veloxquant_stress": stress}
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
