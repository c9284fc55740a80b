"""Activation capture: exactness against independent computations, determinism, safety."""

from __future__ import annotations

from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3
from mlx_lm.models.cache import make_prompt_cache

from veloxquant.capture import (
    CaptureError,
    NAMES,
    capture_activations,
    load_activations,
    load_capture_info,
    load_stats,
    record_attention,
    recording_caches,
    sample_token_indices,
)
from veloxquant.io import sha256_file

VOCAB = 256


def tiny_llama(traditional: bool = False) -> nn.Module:
    mx.random.seed(1)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        rope_theta=10000.0,
        rope_traditional=traditional,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_qwen3() -> nn.Module:
    mx.random.seed(2)
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        head_dim=32,
        tie_word_embeddings=True,
        rope_theta=1e6,
    )
    model = qwen3.Model(args)
    # Non-trivial q_norm/k_norm scales, so a capture point before the norm would show.
    for layer in model.layers:
        layer.self_attn.q_norm.weight = mx.random.uniform(0.5, 2.0, (32,))
        layer.self_attn.k_norm.weight = mx.random.uniform(0.5, 2.0, (32,))
    mx.eval(model.parameters())
    return model


def random_tokens(n: int, s: int, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(n, s)).astype(np.int32)


def real_tokens(tokenizer, text: str, n: int, s: int) -> np.ndarray:
    ids = np.array(tokenizer.encode(text), dtype=np.int32)
    assert len(ids) >= n * s
    return ids[: n * s].reshape(n, s)


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2[0]


@pytest.fixture(scope="module")
def smol_capture(smollm2, eval_text, tmp_path_factory):
    """Real model, real text: 2 x 96 tokens, 80 of them sampled."""
    model, tokenizer = smollm2
    tokens = real_tokens(tokenizer, eval_text, 2, 96)
    out = tmp_path_factory.mktemp("smol_capture")
    capture_activations(model, tokens, out, token_budget=80, seed=3, progress=False)
    return model, tokens, out


# --- the forward pass is untouched -------------------------------------------------------------


@pytest.mark.parametrize("make", ["llama", "qwen3", "smollm2"])
def test_logits_bit_identical_and_rope_restored(make, smollm2):
    model = {"llama": tiny_llama, "qwen3": tiny_qwen3, "smollm2": lambda: smollm2[0]}[make]()
    tokens = mx.array(random_tokens(1, 48, vocab=model.args.vocab_size))
    ropes_before = [layer.self_attn.rope for layer in model.layers]
    params_before = [k for k, _ in tree_flatten(model.parameters())]
    plain = model(tokens, cache=make_prompt_cache(model))
    with record_attention(model) as ropes:
        # The recorder's `_inner` must stay out of the parameter tree.
        assert [k for k, _ in tree_flatten(model.parameters())] == params_before
        caches = recording_caches(ropes)
        recorded = model(tokens, cache=caches)
        mx.eval(plain, recorded)
        assert len(caches[0].records) == 1
        head_dim = model.args.head_dim or model.args.hidden_size // model.args.num_attention_heads
        assert caches[0].records[0]["q_post"].shape == (
            1,
            model.args.num_attention_heads,
            48,
            head_dim,
        )
    assert mx.array_equal(plain, recorded)
    restored = zip(model.layers, ropes_before, strict=True)
    assert all(layer.self_attn.rope is r for layer, r in restored)


def test_rope_restored_on_error():
    model = tiny_llama()
    ropes_before = [layer.self_attn.rope for layer in model.layers]
    with pytest.raises(KeyError):
        with record_attention(model):
            raise KeyError("boom")
    restored = zip(model.layers, ropes_before, strict=True)
    assert all(layer.self_attn.rope is r for layer, r in restored)


# --- captured values against independent computations ----------------------------------------


def _rope(x: np.ndarray, positions: np.ndarray, dims: int, traditional: bool, base: float):
    """RoPE each token [n, H, D] at its own position, independent of the model's rope module."""
    x = mx.array(x)[:, :, None, :]  # batch = token, so each gets its own offset
    out = mx.fast.rope(
        x, dims, traditional=traditional, base=base, scale=1.0, offset=mx.array(positions)
    )
    return np.array(out[:, :, 0, :])


def _check_k_post_is_rope_of_k_pre(capture_dir: Path, layers, traditional: bool, base: float):
    for layer in layers:
        a = {k: np.array(v) for k, v in load_activations(capture_dir, layer).items()}
        dims = a["k_pre"].shape[-1]
        scale = np.abs(a["k_post"]).max()
        err = np.abs(_rope(a["k_pre"], a["positions"], dims, traditional, base) - a["k_post"])
        assert err.max() <= 2e-3 * scale, (layer, err.max(), scale)
        # The check can fail: the other RoPE layout is far off.
        wrong = np.abs(_rope(a["k_pre"], a["positions"], dims, not traditional, base) - a["k_post"])
        assert wrong.max() > 0.05 * scale


def test_k_post_is_rope_of_k_pre_real_model(smol_capture):
    model, tokens, out = smol_capture
    assert model.args.rope_traditional is True
    _check_k_post_is_rope_of_k_pre(out, [0, 14, 29], True, model.args.rope_theta)


def test_k_post_is_rope_of_k_pre_qwen3(tmp_path):
    model = tiny_qwen3()
    capture_activations(model, random_tokens(3, 40), tmp_path, token_budget=50, progress=False)
    _check_k_post_is_rope_of_k_pre(tmp_path, [0, 1], False, model.args.rope_theta)


def _reference(model, tokens: np.ndarray, layer: int, qk_norm: bool) -> dict[str, np.ndarray]:
    """q_post/k_pre/k_post/v of `layer` recomputed by hand from the embeddings, [N, S, H, D]."""
    h = model.model.embed_tokens(mx.array(tokens))
    for block in model.layers[:layer]:
        h = block(h, mask="causal", cache=None)
    attn = model.layers[layer].self_attn
    h = model.layers[layer].input_layernorm(h)
    n, s = tokens.shape
    q = attn.q_proj(h).reshape(n, s, attn.n_heads, -1)
    k = attn.k_proj(h).reshape(n, s, attn.n_kv_heads, -1)
    v = attn.v_proj(h).reshape(n, s, attn.n_kv_heads, -1)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    traditional = getattr(model.args, "rope_traditional", False)  # qwen3 has no such field
    rope = lambda x: mx.fast.rope(  # noqa: E731
        x.transpose(0, 2, 1, 3),
        x.shape[-1],
        traditional=traditional,
        base=model.args.rope_theta,
        scale=1.0,
        offset=0,
    ).transpose(0, 2, 1, 3)
    return {
        "q_post": np.array(rope(q)),
        "k_pre": np.array(k),
        "k_post": np.array(rope(k)),
        "v": np.array(v),
    }


def _check_layers(model, tokens, capture_dir, budget, seed, qk_norm, layers):
    for layer in layers:
        _check_layer(model, tokens, capture_dir, budget, seed, qk_norm, layer)


def _check_layer(model, tokens, capture_dir, budget, seed, qk_norm, layer):
    ref = _reference(model, tokens, layer, qk_norm)
    flat = sample_token_indices(tokens.size, budget, seed)
    seq, pos = flat // tokens.shape[1], flat % tokens.shape[1]
    got = load_activations(capture_dir, layer)
    assert np.array_equal(np.array(got["positions"]), pos)
    for name in NAMES:
        want = ref[name][seq, pos]
        err = np.abs(np.array(got[name]) - want).max()
        assert err <= 2e-3 * np.abs(want).max(), (layer, name, err)


def test_matches_independent_recompute_real_model(smol_capture):
    model, tokens, out = smol_capture
    _check_layers(model, tokens, out, budget=80, seed=3, qk_norm=False, layers=[0, 4])


def test_matches_independent_recompute_qwen3(tmp_path):
    model, tokens = tiny_qwen3(), random_tokens(3, 32)
    capture_activations(model, tokens, tmp_path, token_budget=40, seed=5, progress=False)
    _check_layers(model, tokens, tmp_path, budget=40, seed=5, qk_norm=True, layers=[0, 1])


# --- stats, sampling, determinism -------------------------------------------------------------


def test_stats_are_exact_over_all_tokens(tmp_path):
    model, tokens = tiny_llama(), random_tokens(3, 32)
    full = capture_activations(model, tokens, tmp_path / "full", token_budget=10**6, progress=False)
    assert full["n_sampled"] == full["tokens_seen"] == 96
    stats = {k: np.array(v) for k, v in load_stats(tmp_path / "full").items()}
    for layer in range(3):
        loaded = load_activations(tmp_path / "full", layer)
        a = {k: np.array(v, np.float64) for k, v in loaded.items()}
        assert np.array_equal(a["positions"], np.tile(np.arange(32), 3))
        for name in NAMES:
            x = a[name]  # every token is sampled here, in float16 storage precision
            tol = 2e-3 * np.abs(x).max()
            assert np.abs(stats[f"{name}.absmax"][layer] - np.abs(x).max(0)).max() <= tol
            assert np.abs(stats[f"{name}.mean"][layer] - x.mean(0)).max() <= tol
            assert (
                np.abs(stats[f"{name}.sq_mean"][layer] - (x * x).mean(0)).max()
                <= tol * np.abs(x).max()
            )
    # A tiny budget sees the same tokens, so its stats file is byte-identical.
    small = capture_activations(model, tokens, tmp_path / "small", token_budget=7, progress=False)
    assert small["n_sampled"] == 7
    assert load_activations(tmp_path / "small", 2)["q_post"].shape == (7, 4, 16)
    assert sha256_file(tmp_path / "small/stats.safetensors") == sha256_file(
        tmp_path / "full/stats.safetensors"
    )


def test_sampling_is_deterministic_and_bounded():
    a = sample_token_indices(1000, 100, seed=7)
    assert np.array_equal(a, sample_token_indices(1000, 100, seed=7))
    assert not np.array_equal(a, sample_token_indices(1000, 100, seed=8))
    assert len(np.unique(a)) == 100 and np.all(np.diff(a) > 0) and a.max() < 1000
    assert np.array_equal(sample_token_indices(50, 100, seed=7), np.arange(50))


def test_same_inputs_and_seed_give_identical_files(tmp_path):
    model, tokens = tiny_qwen3(), random_tokens(4, 24)

    def run(name: str, seed: int, lanes: int = 2, toks: np.ndarray = tokens) -> dict[str, str]:
        capture_activations(
            model,
            toks,
            tmp_path / name,
            30,
            seed=seed,
            progress=False,
            data_sha256="abc",
            lanes=lanes,
        )
        return {p.name: sha256_file(p) for p in sorted((tmp_path / name).iterdir())}

    first, second, other = run("a", 0), run("b", 0), run("c", 1)
    assert len(first) == 2 + 2 and first == second  # 2 layers + stats + capture.json
    # Sequences side by side on two CPU streams write the same bytes as one at a time (an odd
    # number of sequences leaves the last batch with one).
    assert run("one-lane", 0, lanes=1) == first
    odd = random_tokens(5, 24)
    assert run("odd-2", 0, toks=odd) == run("odd-1", 0, lanes=1, toks=odd)
    assert first["stats.safetensors"] == other["stats.safetensors"]
    assert first["layer_00.safetensors"] != other["layer_00.safetensors"]
    info = load_capture_info(tmp_path / "a")
    assert (info["tokens_seen"], info["n_sampled"], info["data_sha256"]) == (96, 30, "abc")
    assert info["files"]["layer_01.safetensors"] == first["layer_01.safetensors"]


# --- bad input and failure safety -------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, budget, match",
    [
        (np.zeros((0, 16), np.int32), 10, "empty"),
        (np.zeros((4, 0), np.int32), 10, "empty"),
        (np.zeros(16, np.int32), 10, "2-D"),
        (np.zeros((1, 16), np.float32), 10, "integer token ids"),
        (np.full((1, 16), VOCAB, np.int32), 10, "token ids must lie"),
        (np.zeros((1, 16), np.int32), 0, "token_budget"),
    ],
)
def test_bad_input_is_rejected(tmp_path, tokens, budget, match):
    with pytest.raises(ValueError, match=match):
        capture_activations(tiny_llama(), tokens, tmp_path, budget, progress=False)
    assert not (tmp_path / "capture.json").exists()


def test_nan_names_layer_and_tensor_and_writes_nothing(tmp_path):
    model, tokens = tiny_llama(), random_tokens(2, 16)
    capture_activations(model, tokens, tmp_path, 8, progress=False)  # an earlier good capture
    w = np.array(model.layers[1].self_attn.k_proj.weight)
    w[5, 3] = np.nan
    model.layers[1].self_attn.k_proj.weight = mx.array(w)
    layer_file = sha256_file(tmp_path / "layer_00.safetensors")
    with pytest.raises(FloatingPointError, match="layer 1 k_pre"):
        capture_activations(model, tokens, tmp_path, 8, seed=1, progress=False)
    assert not (tmp_path / "capture.json").exists()  # the dir no longer claims to be complete
    assert sha256_file(tmp_path / "layer_00.safetensors") == layer_file  # nothing half-written
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert all(isinstance(layer.self_attn.rope, nn.RoPE) for layer in model.layers)
    with pytest.raises(FileNotFoundError, match="no complete capture"):
        load_activations(tmp_path, 0)


def test_float16_overflow_is_an_error(tmp_path):
    model = tiny_llama()
    model.layers[0].self_attn.v_proj.weight = model.layers[0].self_attn.v_proj.weight * 1e6
    with pytest.raises(OverflowError, match="layer 0 v"):
        capture_activations(model, random_tokens(1, 16), tmp_path, 8, progress=False)


def test_load_errors(tmp_path):
    capture_activations(tiny_llama(), random_tokens(1, 16), tmp_path, 8, progress=False)
    with pytest.raises(IndexError, match="3 layers"):
        load_activations(tmp_path, 3)
    with pytest.raises(KeyError, match="unknown activation names"):
        load_activations(tmp_path, 0, ["q_pre"])
    assert set(load_activations(tmp_path, 0, ["v"])) == {"v"}


def test_unsupported_model_is_rejected():
    model = tiny_llama()
    model.layers[1].self_attn.rope = None
    with pytest.raises(ValueError, match="layer 1 has no self_attn.rope"):
        with record_attention(model):
            pass


# --- every load is verified (issue 10, case 4) ------------------------------------------------


def _capture(tmp_path: Path) -> Path:
    capture_activations(tiny_llama(), random_tokens(2, 16), tmp_path, 24, progress=False)
    return tmp_path


def _poison(capture_dir: Path, name: str, tensor: str, index: tuple) -> None:
    """Write a NaN into one tensor of a capture file AND fix capture.json's sha256, so the
    finiteness check, not the checksum, has to catch it."""
    import json

    from safetensors.numpy import load_file

    from veloxquant.io import save_safetensors_atomic

    path = capture_dir / name
    arrays = load_file(str(path))
    arrays[tensor][index] = np.nan
    save_safetensors_atomic(path, arrays, metadata={"format": "veloxquant-capture-v1"})
    info = json.loads((capture_dir / "capture.json").read_text())
    info["files"][name] = sha256_file(path)
    (capture_dir / "capture.json").write_text(json.dumps(info))


def test_flipped_byte_in_a_shard_names_the_file(tmp_path):
    d = _capture(tmp_path)
    path = d / "layer_01.safetensors"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(
        CaptureError,
        match=r"layer_01.safetensors: sha256 \w{16}\.\.\. does not match capture.json's "
        r"\w{16}\.\.\.: the file was modified or corrupted. Re-run the capture",
    ):
        load_activations(d, 1, ["v"])
    load_activations(d, 0, ["v"])  # the other shards are fine


def test_truncated_shard_names_the_file(tmp_path):
    d = _capture(tmp_path)
    path = d / "layer_02.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CaptureError, match=r"layer_02.safetensors: .*truncated"):
        load_activations(d, 2)


def test_missing_shard_names_the_file(tmp_path):
    d = _capture(tmp_path)
    (d / "stats.safetensors").unlink()
    with pytest.raises(CaptureError, match=r"stats.safetensors is listed in capture.json but"):
        load_stats(d)


@pytest.mark.parametrize("tensor", ["k_post", "q_post"])
def test_nan_in_a_shard_names_layer_tensor_and_file(tmp_path, tensor):
    d = _capture(tmp_path)
    _poison(d, "layer_01.safetensors", tensor, (5, 1, 3))
    with pytest.raises(
        CaptureError,
        match=rf"layer_01.safetensors: layer 1 tensor '{tensor}' contains NaN or Inf \(first at "
        r"index \[5, 1, 3\]",
    ):
        load_activations(d, 1, [tensor])
    assert set(load_activations(d, 1, ["v"])) == {"v"}  # only what is loaded is checked


def test_nan_in_stats_names_layer_and_tensor(tmp_path):
    d = _capture(tmp_path)
    _poison(d, "stats.safetensors", "k_post.absmax", (2, 0, 7))
    with pytest.raises(CaptureError, match=r"layer 2 stats tensor 'k_post.absmax' contains NaN"):
        load_stats(d)


def test_edited_capture_json_is_refused(tmp_path):
    import json

    d = _capture(tmp_path)
    info = json.loads((d / "capture.json").read_text())
    del info["files"]
    (d / "capture.json").write_text(json.dumps(info))
    with pytest.raises(CaptureError, match=r"field 'files' must map each shard to its sha256"):
        load_activations(d, 0)
