"""Model import: GGUF -> mlx-lm dir, RoPE layout, tokenizer, and the real default model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import veloxquant  # noqa: F401
import mlx.core as mx
from mlx_lm import generate
from mlx_lm.models import llama, qwen3

from tests.gguf_util import real_vocab, write_gguf
from veloxquant.model_import import ModelImportError, default_gguf_path, import_model, load_model

VOCAB = 49152
PPL_BOUND = 13.5  # measured 10.5 on the 512-token window below


@pytest.fixture(scope="module")
def vocab():
    return real_vocab(default_gguf_path())


def _tiny(kind: str):
    mx.random.seed(3)
    if kind == "llama":
        args = llama.ModelArgs(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=VOCAB,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        )
        return llama.Model(args), args
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        rope_theta=1e6,
        head_dim=32,
        tie_word_embeddings=True,
    )
    model = qwen3.Model(args)
    # Non-trivial norms so q_norm/k_norm mapping errors show up in the logits.
    for layer in model.layers:
        layer.self_attn.q_norm.weight = mx.random.uniform(0.5, 1.5, (32,))
        layer.self_attn.k_norm.weight = mx.random.uniform(0.5, 1.5, (32,))
    return model, args


def _reference_logits(kind, args, weights, tokens):
    model = (llama.Model if kind == "llama" else qwen3.Model)(args)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model(tokens)


@pytest.mark.parametrize(
    "kind,arch,qtype",
    [("llama", "llama", "F32"), ("llama", "llama", "Q5_0"), ("qwen3", "qwen3", "Q8_0")],
)
def test_gguf_import_reproduces_logits(tmp_path, vocab, kind, arch, qtype):
    """Name mapping, dequantization (incl. Q5_0, which mx.load cannot read) and RoPE layout."""
    model, args = _tiny(kind)
    encoded = write_gguf(model, args, arch, tmp_path / "tiny.gguf", vocab, qtype)
    out = import_model(str(tmp_path / "tiny.gguf"), tmp_path / "mlx")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == kind
    assert config["rope_traditional"] is (arch == "llama")

    tokens = mx.array([[1, 504, 3303, 314, 2114, 28, 2078, 314, 253, 7355, 30, 198, 504, 12]])
    expected = _reference_logits(kind, args, encoded, tokens)
    imported, _ = load_model(out)
    got = imported(tokens)
    assert mx.allclose(got, expected, atol=2e-4, rtol=1e-4).item()

    if arch == "llama":  # the wrong RoPE layout must be visible at this scale
        imported.args.rope_traditional = False
        for layer in imported.model.layers:
            layer.self_attn.rope.traditional = False
        assert not mx.allclose(imported(tokens), expected, atol=1e-2).item()


def test_missing_gguf_is_clear(tmp_path):
    with pytest.raises(ModelImportError, match="GGUF file not found"):
        import_model(str(tmp_path / "nope.gguf"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_named(tmp_path, vocab):
    model, args = _tiny("llama")
    write_gguf(model, args, "phi3", tmp_path / "phi.gguf", vocab)
    with pytest.raises(ModelImportError, match="'phi3'"):
        import_model(str(tmp_path / "phi.gguf"), tmp_path / "out")
    assert not (tmp_path / "out").exists(), "a failed import must leave nothing behind"


def test_garbage_file_is_clear(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelImportError, match="not a readable GGUF"):
        import_model(str(bad), tmp_path / "out")


def test_default_model_config(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (30, 9, 3)
    assert (
        config["head_dim"] == 64
        and config["rope_theta"] == 100000.0
        and config["tie_word_embeddings"]
    )


def test_default_model_answers_chat_question(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    answer = generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer


def test_tokenizer_roundtrip_and_specials(smollm2):
    _, tokenizer = smollm2
    text = "def f(x):\n    return x ** 2  # 12345 naïve café"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.eos_token_id == 2


def _ppl(model, ids) -> float:
    x = mx.array(ids)[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp[0], x[0, 1:, None], axis=-1).mean()
    return math.exp(nll.item())


def test_default_model_perplexity_and_rope_sensitivity(smollm2, eval_text):
    """~12.5 expected on 1024-token windows; this 512-token window reads ~10.5.

    The bound is tight enough that the wrong RoPE layout and a broken tokenizer (7/8 of the
    BPE merges dropped) both fail it, checked below.
    """
    model, tokenizer = smollm2
    ids = tokenizer.encode(eval_text)[:512]
    ppl = _ppl(model, ids)
    assert 8.0 < ppl < PPL_BOUND, ppl
    try:
        for layer in model.model.layers:
            layer.self_attn.rope.traditional = False
        wrong = _ppl(model, ids)
    finally:
        for layer in model.model.layers:
            layer.self_attn.rope.traditional = True
    assert wrong > PPL_BOUND, f"wrong RoPE layout should fail the bound, got {wrong}"
    np.testing.assert_allclose(_ppl(model, ids), ppl, rtol=1e-6)


def test_broken_tokenizer_fails_the_perplexity_bound(smollm2, smollm2_dir, eval_text):
    from tokenizers import Tokenizer

    model, _ = smollm2
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][: len(spec["model"]["merges"]) // 8]
    broken = Tokenizer.from_str(json.dumps(spec))
    assert _ppl(model, broken.encode(eval_text).ids[:512]) > PPL_BOUND
