"""Q-Filters calibration on real captured activations, and the shared eviction cache.

Cache mechanics are checked against independent references (a brute-force simulation of the
eviction rule, mlx-lm's RotatingKVCache for StreamingLLM); calibration and quality run on the
real default model and real pydoc text.
"""

from __future__ import annotations

import re

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from veloxquant import KVCacheConfig, make_cache
from veloxquant.methods.eviction import KNormCache, StreamingLLMCache
from veloxquant.methods.qfilters import (
    QFiltersCache,
    calibrate_qfilters,
    key_axis,
    validate_filters,
)

H, D = 3, 8


# ------------------------------------------------------------------------------- cache mechanics


def simulate(scores: np.ndarray, chunks: list[int], budget: int, sinks: int, window: int):
    """Brute-force eviction rule: per head keep sinks, window and the top-scored in between."""
    kept = [[] for _ in range(scores.shape[0])]
    t = 0
    for c in chunks:
        for h, k in enumerate(kept):
            k += range(t, t + c)
            n = len(k)
            if n > budget:
                mid = sorted(k[sinks : n - window], key=lambda p: -scores[h, p])
                kept[h] = k[:sinks] + sorted(mid[: budget - sinks - window]) + k[n - window :]
        t += c
    return kept


def feed(cache, keys: np.ndarray, chunks: list[int]):
    """keys [H, T, D]; values carry each token's position, so kept tokens can be identified."""
    t = 0
    for c in chunks:
        k = mx.array(keys[None, :, t : t + c])
        v = mx.broadcast_to(
            mx.arange(t, t + c, dtype=mx.float32)[None, None, :, None], (1, H, c, D)
        )
        out_k, out_v = cache.update_and_fetch(k, v)
        assert out_k.shape[2] == out_v.shape[2] and out_v[0, 0, -1, 0].item() == t + c - 1
        t += c
    return [list(np.array(cache.values[0, h, :, 0]).astype(int)) for h in range(H)]


CHUNKS = [40, 16, 1, 1, 1, 23, 7, 1, 1]


def test_qfilters_cache_keeps_sinks_window_and_highest_scores():
    rng = np.random.default_rng(0)
    T = sum(CHUNKS)
    scores = rng.standard_normal((H, T))
    keys = rng.standard_normal((H, T, D)).astype(np.float32)
    f = rng.standard_normal((H, D))
    f /= np.linalg.norm(f, axis=-1, keepdims=True)
    keys += ((scores - (keys @ f[:, :, None])[..., 0])[..., None] * f[:, None, :]).astype(
        np.float32
    )
    cache = QFiltersCache(mx.array(f, mx.float32), budget=24, sinks=3, window=5)
    kept = feed(cache, keys, CHUNKS)
    assert kept == simulate(scores, CHUNKS, 24, 3, 5)
    assert len({tuple(k) for k in kept}) == H  # heads really choose differently
    assert cache.offset == T and cache.size() == 24
    assert cache.nbytes == 2 * H * 24 * D * 4 + H * D * 4  # keys + values + filters, float32


def test_knorm_keeps_lowest_norm_and_streamingllm_the_most_recent():
    rng = np.random.default_rng(1)
    T = sum(CHUNKS)
    norms = rng.uniform(0.5, 3.0, (H, T))
    dirs = rng.standard_normal((H, T, D))
    keys = (dirs / np.linalg.norm(dirs, axis=-1, keepdims=True) * norms[..., None]).astype(
        np.float32
    )
    assert feed(KNormCache(20, sinks=2, window=4), keys, CHUNKS) == simulate(
        -norms, CHUNKS, 20, 2, 4
    )
    recency = np.broadcast_to(np.arange(T, dtype=float), (H, T))
    kept = feed(StreamingLLMCache(20, sinks=4, window=1), keys, CHUNKS)
    assert kept == simulate(recency, CHUNKS, 20, 4, 1)
    assert kept[0] == [0, 1, 2, 3] + list(range(T - 16, T))


def test_fraction_budget_grows_with_offset():
    cache = KNormCache(0.25, min_budget=0)  # the bare fraction, without the short-prompt floor
    rng = np.random.default_rng(2)
    for total in (64, 128, 192, 256):
        cache.update_and_fetch(
            mx.array(rng.standard_normal((1, H, 64, D)), mx.float32), mx.zeros((1, H, 64, D))
        )
        assert cache.offset == total
        assert cache.size() == total // 4
    assert cache.nbytes == 2 * H * 64 * D * 4


def test_fraction_budget_never_goes_below_min_budget():
    cache = KNormCache(0.25)  # default floor: 64 tokens
    rng = np.random.default_rng(2)
    sizes = []
    for _ in range(6):
        cache.update_and_fetch(
            mx.array(rng.standard_normal((1, H, 64, D)), mx.float32), mx.zeros((1, H, 64, D))
        )
        sizes.append(cache.size())
    assert sizes == [64, 64, 64, 64, 80, 96]  # max(64, ceil(0.25 * offset))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budget": 10, "sinks": 4, "window": 8}, r"smaller than sinks \+ window = 4 \+ 8"),
        ({"budget": None}, "need a budget"),
        ({"budget": 1.5}, "neither a token count"),
        ({"budget": -3}, "neither a token count"),
        ({"budget": 64, "sinks": -1}, "sinks must be an integer"),
    ],
)
def test_bad_budget(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KNormCache(**kwargs)


def test_bad_filters():
    f = np.zeros((H, D), np.float32)
    f[:, 0] = 1
    with pytest.raises(ValueError, match=r"shape \[3, 8\] but this model needs \[30, 3, 64\]"):
        validate_filters(f, (30, 3, 64))
    bad = f.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        QFiltersCache(mx.array(bad), budget=32)
    with pytest.raises(ValueError, match="unit-norm"):
        QFiltersCache(mx.array(2 * f), budget=32)
    cache = QFiltersCache(mx.array(f), budget=32)
    with pytest.raises(ValueError, match="made for another model"):
        cache.update_and_fetch(mx.zeros((1, 2, 4, D)), mx.zeros((1, 2, 4, D)))


def test_eviction_mask_and_fallback_axis():
    cache = QFiltersCache(None, budget=16)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        cache.make_mask(4, window_size=8)
    rng = np.random.default_rng(3)
    cache.update_and_fetch(
        mx.array(rng.standard_normal((1, H, 40, D)), mx.float32), mx.zeros((1, H, 40, D))
    )
    assert cache.size() == 16 and cache.offset == 40
    # the kept 16 tokens are all visible to the next chunk, which is causal within itself
    mask = cache.make_mask(5, return_array=True)
    expected = np.concatenate([np.ones((5, 16), bool), np.tril(np.ones((5, 5), bool))], axis=1)
    np.testing.assert_array_equal(np.array(mask), expected)
    # the fallback axis is the keys' unoriented principal axis
    assert cache.fitted_on == 40 and cache.filters.shape == (H, D)
    assert abs(float(mx.linalg.norm(cache.filters[0]).item()) - 1) < 1e-5


def tiny_llama():
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=100,
        rope_traditional=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def test_streamingllm_matches_mlx_lm_rotating_cache():
    """Decode after a prefill: budget B + the current token == RotatingKVCache(B + 1, keep)."""
    model = tiny_llama()
    tokens = mx.array(np.random.default_rng(4).integers(0, 100, (1, 60)))
    ours = [StreamingLLMCache(16, sinks=4) for _ in range(2)]
    ref = [RotatingKVCache(max_size=17, keep=4) for _ in range(2)]
    # a prefill shorter than RotatingKVCache's window, so both attend to all of it
    np.testing.assert_allclose(
        np.array(model(tokens[:, :12], cache=ours)),
        np.array(model(tokens[:, :12], cache=ref)),
        atol=1e-5,
    )
    for t in range(12, 60):
        a = model(tokens[:, t : t + 1], cache=ours)
        b = model(tokens[:, t : t + 1], cache=ref)
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, err_msg=f"step {t}")
    assert ours[0].size() == 16 and ours[0].offset == 60


def test_no_eviction_equals_plain_kvcache():
    model = tiny_llama()
    tokens = mx.array(np.random.default_rng(5).integers(0, 100, (1, 50)))
    ref = model(tokens, cache=[KVCache() for _ in range(2)])
    for cls in (KNormCache, StreamingLLMCache):
        caches = [cls(1000) for _ in range(2)]
        out = mx.concatenate(
            [model(tokens[:, a:b], cache=caches) for a, b in ((0, 20), (20, 21), (21, 50))], axis=1
        )
        np.testing.assert_allclose(np.array(out), np.array(ref), atol=1e-5)


# ------------------------------------------------------------------------------- calibration


@pytest.fixture(scope="module")
def capture_dir(calib_dir):
    return calib_dir / "activations"


@pytest.fixture(scope="module")
def bundle_dir(artifacts_root):
    """What the qfilters stage does: calibrate on the capture (default hyperparameters), write
    the bundle; conftest's artifacts_root does exactly that, shared with the serving tests."""
    return artifacts_root / "artifacts" / "smollm2-135m" / "bundle"


@pytest.fixture(scope="module")
def calibrated(bundle_dir):
    """(tensors, diagnostics) as read back from the bundle."""
    from veloxquant.bundle import load_bundle

    bundle = load_bundle(bundle_dir)
    tensors = {k: np.array(v) for k, v in bundle.tensors("qfilters").items()}
    return tensors, bundle.method_info("qfilters")["diagnostics"]


def test_filters_unit_norm_and_positively_oriented(calibrated):
    tensors, diag = calibrated
    f = tensors["filters"]
    assert f.shape == (30, 3, 64) and f.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(f, axis=-1), 1, atol=1e-5)
    # kappa is measured on held-out queries, so positivity is a finding, not a construction
    assert diag["kappa_positive_fraction"] >= 0.9
    assert (tensors["kappa"] > 0).mean() == diag["kappa_positive_fraction"]
    assert diag["n_heldout_tokens"] == round(0.2 * 1024) and diag["n_train_tokens"] == 1024 - 205


def test_filters_match_a_direct_svd_with_gqa_averaging(calibrated, capture_dir):
    from veloxquant.capture import load_activations
    from veloxquant.methods.qfilters import _split_tokens

    tensors, _ = calibrated
    train, _ = _split_tokens(1024, 0.2, 3000, 0)
    for layer in (0, 17):
        q = np.array(load_activations(capture_dir, layer, ["q_post"])["q_post"], np.float64)[train]
        per_head = []
        for h in range(9):
            _, _, vt = np.linalg.svd(q[:, h], full_matrices=False)
            v = vt[0] if (q[:, h] @ vt[0]).mean() > 0 else -vt[0]
            per_head.append(v)
        for g in range(3):  # repeat_kv order: KV head g owns query heads 3g, 3g+1, 3g+2
            want = np.mean(per_head[3 * g : 3 * g + 3], axis=0)
            want /= np.linalg.norm(want)
            np.testing.assert_allclose(tensors["filters"][layer, g], want, atol=1e-4)


def test_spearman_calibrated_vs_fallback(calibrated):
    tensors, diag = calibrated
    assert diag["spearman_mean"] >= 0.5
    assert diag["spearman_fallback_mean"] < 0.3
    assert diag["spearman_mean"] - diag["spearman_fallback_mean"] > 0.5
    np.testing.assert_allclose(tensors["spearman"].mean(), diag["spearman_mean"], atol=1e-6)


def test_calibration_is_deterministic(calibrated, capture_dir, smollm2):
    again, _ = calibrate_qfilters(capture_dir, smollm2[0], progress=False)  # and via the bundle
    for k, v in calibrated[0].items():
        assert np.array_equal(v, again[k]), k


def test_key_axis_sign_is_not_oriented():
    """The fallback axis is the principal axis; flipping the keys' sign keeps the same axis."""
    k = mx.array(np.random.default_rng(0).standard_normal((2, 50, 8)) + 3.0, mx.float32)
    a, b = np.array(key_axis(k)), np.array(key_axis(-k))
    np.testing.assert_allclose(np.abs((a * b).sum(-1)), 1, atol=1e-5)


def test_bundle_to_generate_gives_coherent_text(bundle_dir, smollm2, eval_text):
    from mlx_lm import generate

    model, tok = smollm2
    context = tok.decode(tok.encode(eval_text)[:300])
    prompt = (
        context + "\n\nQuestion: What is the capital of France?\nAnswer: The capital of France is"
    )
    caches = make_cache(
        model, KVCacheConfig(method="qfilters", artifact_dir=str(bundle_dir), budget=96)
    )
    text = generate(model, tok, prompt, max_tokens=12, prompt_cache=caches)
    assert "Paris" in text, text
    assert caches[0].size() == 96 and caches[0].offset > 300  # it did evict
    assert re.fullmatch(r"[\w\s.,'\"()\-:;!?]+", text), text


def test_small_budget_ordering_on_held_out_text(bundle_dir, smollm2, eval_text):
    """12.5% budget on held-out prose (prefill 256 then 64-token chunks, as the eval harness
    feeds text): calibrated Q-Filters has lower KL and perplexity than its uncalibrated
    fallback, K-norm and StreamingLLM at the same budget and the same sinks/window."""
    from veloxquant.evaluate import evaluate_rows

    model, tok = smollm2
    windows = np.array(tok.encode(eval_text)[:512], np.int32)[None]
    rows = [
        {"name": "qfilters", "method": "qfilters", "artifact_dir": str(bundle_dir), "budget": 64},
        {"name": "fallback", "method": "qfilters", "uncalibrated": True, "budget": 64},
        {"name": "knorm", "method": "knorm", "budget": 64},
        {"name": "streamingllm", "method": "streamingllm", "budget": 64},
    ]
    res = {
        r["name"]: r
        for r in evaluate_rows(model, windows, rows, prefill=256, chunk=64, progress=False)
    }
    table = {k: (round(r["kl"], 4), round(r["ppl"], 3)) for k, r in res.items()}
    for other in ("fallback", "knorm", "streamingllm"):
        assert res["qfilters"]["kl"] < res[other]["kl"], table
        assert res["qfilters"]["ppl"] < res[other]["ppl"], table
    assert res["qfilters"]["kv_bits_per_element"] < 32 * 64 / 512 + 0.1  # 64 of 512 tokens kept
