"""Write small GGUF files from mlx-lm models, the way llama.cpp's converter lays them out.

Used by the import tests to check name mapping, dequantization and the RoPE layout
against a model whose logits we know.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import veloxquant  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_flatten

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation: half-split RoPE pairs -> interleaved pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{leaf}"


def real_vocab(gguf_path: Path) -> tuple[list[str], list[str], list[int]]:
    from gguf import GGUFReader

    r = GGUFReader(gguf_path)
    return (
        r.fields["tokenizer.ggml.tokens"].contents(),
        r.fields["tokenizer.ggml.merges"].contents(),
        r.fields["tokenizer.ggml.token_type"].contents(),
    )


def write_gguf(
    model, args, arch: str, path: Path, vocab, qtype_name: str = "F32"
) -> dict[str, np.ndarray]:
    """Write `model` as a GGUF of `arch`; 2-D weights quantized to `qtype_name`.

    Returns the HF-layout float32 weights the GGUF actually encodes (after the quantization
    round trip), to load into a reference model.
    """
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[qtype_name]
    tokens, merges, types = vocab
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(2048)
    w.add_embedding_length(args.hidden_size)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_rope_freq_base(float(args.rope_theta))
    w.add_layer_norm_rms_eps(float(args.rms_norm_eps))
    if args.head_dim:
        w.add_key_length(args.head_dim)
        w.add_value_length(args.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    encoded = {}
    for name, value in tree_flatten(model.parameters()):
        arr = np.array(value.astype(mx.float32))
        if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = args.num_attention_heads if "q_proj" in name else args.num_key_value_heads
            stored = llama_cpp_permute(arr, heads)
        else:
            stored = arr
        if arr.ndim == 2 and qtype_name != "F32":
            data = quantize(stored, qtype)
            w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
            roundtrip = dequantize(data, qtype).reshape(arr.shape)
            if (
                stored is not arr
            ):  # undo the row permutation: it commutes with row-block quantization
                inv = np.argsort(llama_cpp_permute(np.arange(arr.shape[0]), heads))
                roundtrip = roundtrip[inv]
            encoded[name] = roundtrip
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(stored))
            encoded[name] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return encoded
