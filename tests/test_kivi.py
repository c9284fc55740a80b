"""KIVI (veloxquant/methods/kivi/): the quantizer against an independent numpy reference, bit-
plane packing, honest nbytes, window flushing, mixed bits across heads, the cache contract and
a prompt-cache round trip on the real model."""

from __future__ import annotations

import types

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np
import pytest

from veloxquant.methods import kivi
from veloxquant.methods.kivi import KIVICache


def config(**kw):
    base = {
        "method": "kivi",
        "bits": None,
        "group_size": None,
        "window": None,
        "sinks": None,
        "uncalibrated": False,
        "options": {},
    }
    return types.SimpleNamespace(**{**base, **kw})


def np_quantize(x: np.ndarray, bits: int, axis: int):
    """Reference asymmetric min/max quantizer over groups along `axis` of a [..., n, G] view."""
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    scale = ((hi - lo) / (2**bits - 1)).astype(np.float16).astype(np.float32)
    zero = lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.round((x - zero) / np.where(scale > 0, scale, 1)), 0, 2**bits - 1)
    q = np.where(scale > 0, q, 0)
    return q, scale, zero, q * scale + zero


def np_keys(x: np.ndarray, bits: int, g: int):
    """Keys [H, T, D]: per channel over blocks of g tokens."""
    h, t, d = x.shape
    q, s, z, rec = np_quantize(x.reshape(h, t // g, g, d), bits, axis=2)
    return q.reshape(h, t, d), s[:, :, 0], rec.reshape(h, t, d)


def np_values(x: np.ndarray, bits: int, g: int):
    """Values [H, T, D]: per token over groups of g channels."""
    h, t, d = x.shape
    q, s, z, rec = np_quantize(x.reshape(h, t, d // g, g), bits, axis=3)
    return q.reshape(h, t, d), s[..., 0], rec.reshape(h, t, d)


def rand(shape, seed=0, outlier=True):
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    if outlier:  # a key-like outlier channel
        x[..., 3] = x[..., 3] * 8 + 5
    return x


@pytest.mark.parametrize("n_codes", [64, 40, 2048])
def test_pack_roundtrip_every_width(n_codes):
    rng = np.random.default_rng(1)
    for bits in kivi.SUPPORTED_BITS:
        codes = rng.integers(0, 2**bits, size=(2, 3, 7, n_codes)).astype(np.uint32)
        words = kivi.pack_codes(mx.array(codes), bits)
        assert words.dtype == mx.uint32
        assert words.shape[-1] == -(-n_codes * bits // 32)  # padded to a whole word only
        if n_codes * bits % 32 == 0:
            assert words.nbytes * 8 == codes.size * bits  # exactly `bits` bits per code
        np.testing.assert_array_equal(np.array(kivi.unpack_codes(words, bits, n_codes)), codes)


@pytest.mark.parametrize("bits", kivi.MX_DEQUANTIZE_BITS)
def test_packing_is_the_mx_quantize_layout(bits):
    # mx.quantize's own words, read back by our unpacker, are its codes; and our packer writes
    # those same words from the codes
    x = mx.array(np.random.default_rng(bits).normal(size=(5, 128)).astype(np.float32))
    w, s, z = mx.quantize(x, group_size=32, bits=bits)
    deq = mx.dequantize(w, s, z, group_size=32, bits=bits)
    codes = np.rint(np.array((deq - mx.repeat(z, 32, -1)) / mx.repeat(s, 32, -1)))
    np.testing.assert_array_equal(np.array(kivi.unpack_codes(w, bits, 128)), codes)
    np.testing.assert_array_equal(
        np.array(kivi.pack_codes(mx.array(codes.astype(np.uint32)), bits)), np.array(w)
    )


@pytest.mark.parametrize("group_size", [32, 64])
def test_fused_dequantize_matches_pure_path(group_size, monkeypatch):
    hb = np.array([[1, 8], [3, 2], [7, 4]])  # 1 and 7 bits always take the pure path
    assert kivi.fused_dequantize_ok(64, 3, group_size) and not kivi.fused_dequantize_ok(64, 7, 32)
    # MLX's CUDA backend decodes 1 bit wrongly (benchmarks/results/mlx-cuda-dequantize-widths.txt)
    assert not kivi.fused_dequantize_ok(64, 1, group_size)
    calls = []
    real = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(k["bits"]) or real(*a, **k))
    outs = {}
    for fused in (True, False):
        monkeypatch.setattr(kivi, "USE_MX_DEQUANTIZE", fused)
        cache = KIVICache(hb, group_size=group_size, window=32, sinks=4)
        _, _, outs[fused] = feed(cache, [300, 1])
        # the fused path really ran, for every width but 1 and 7 (K and V buckets, 2 fetches)
        assert sorted(set(calls)) == ([2, 3, 4, 8] if fused else [])
        calls.clear()
    for a, b in zip(outs[True], outs[False], strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_key_quantizer_matches_numpy_reference(bits):
    g = 32
    x = rand((3, 128, 64), seed=bits)
    codes, scale, zero = kivi.quantize_keys(mx.array(x), bits, g)
    q_ref, s_ref, rec_ref = np_keys(x, bits, g)
    assert scale.dtype == mx.float16 and tuple(scale.shape) == (3, 128 // g, 64)
    np.testing.assert_array_equal(np.array(codes), q_ref)
    rec = np.array(kivi.dequantize_keys(codes, scale, zero, g))
    np.testing.assert_allclose(rec, rec_ref, rtol=1e-6, atol=1e-6)
    # error bound: half a step (of the fp16 step), plus the fp16 rounding of the zero
    step = np.repeat(s_ref, g, axis=1)
    bound = step / 2 + np.abs(x).max() * 2**-10
    assert np.all(np.abs(rec - x) <= bound)
    if bits >= 2:  # not a trivial bound: errors really reach a good part of it
        assert np.abs(rec - x).max() > 0.3 * (step / 2).max()


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_value_quantizer_matches_numpy_reference(bits):
    g = 32
    x = rand((3, 50, 64), seed=10 + bits, outlier=False)
    codes, scale, zero = kivi.quantize_values(mx.array(x), bits, g)
    q_ref, s_ref, rec_ref = np_values(x, bits, g)
    assert tuple(scale.shape) == (3, 50, 64 // g)
    np.testing.assert_array_equal(np.array(codes), q_ref)
    rec = np.array(kivi.dequantize_values(codes, scale, zero, g))
    np.testing.assert_allclose(rec, rec_ref, rtol=1e-6, atol=1e-6)
    step = np.repeat(s_ref, g, axis=-1)
    assert np.all(np.abs(rec - x) <= step / 2 + np.abs(x).max() * 2**-10)


def test_keys_are_grouped_per_channel_and_values_per_token():
    # One huge channel: per-channel key groups keep the other channels fine; a per-token value
    # group containing it loses the others.
    x = rand((1, 64, 64), seed=3, outlier=False)
    x[..., 0] *= 100
    k = np.array(kivi.fake_quantize(mx.array(x), 4, 32, "key"))
    v = np.array(kivi.fake_quantize(mx.array(x), 4, 32, "value"))
    err_k = np.abs(k - x)[..., 1:32].mean()
    err_v = np.abs(v - x)[..., 1:32].mean()
    assert err_v > 10 * err_k
    # a constant group quantizes exactly
    c = np.full((1, 32, 64), 0.5, np.float32)
    np.testing.assert_allclose(
        np.array(kivi.fake_quantize(mx.array(c), 2, 32, "key")), c, atol=1e-3
    )


def feed(cache, sizes, h=3, d=64, seed=0):
    rng = np.random.default_rng(seed)
    ks, vs, out = [], [], None
    for n in sizes:
        k = rng.normal(size=(1, h, n, d)).astype(np.float32)
        v = rng.normal(size=(1, h, n, d)).astype(np.float32)
        ks.append(k)
        vs.append(v)
        out = cache.update_and_fetch(mx.array(k), mx.array(v))
        mx.eval(out)
    return np.concatenate(ks, 2), np.concatenate(vs, 2), out


def test_window_flushes_in_blocks_of_g_and_keeps_window():
    g, window, sinks = 32, 32, 4
    cache = KIVICache(np.full((3, 2), 2), group_size=g, window=window, sinks=sinks)
    rng_sizes = [1] * 70 + [64, 5, 100, 1, 1, 31]
    seen = 0
    for n in rng_sizes:
        feed(cache, [n], seed=seen)
        seen += n
        assert cache.offset == cache.size() == seen
        assert cache.n_quantized % g == 0
        stored = min(seen, sinks) + cache.n_quantized + cache.window_size
        assert stored == seen  # every token is somewhere, once
        if seen >= sinks + window + g:
            assert window <= cache.window_size <= window + g - 1
        else:
            assert cache.n_quantized == 0
    # in one call: prefill 200 → 196 non-sink tokens, flush 160 = 5 blocks, window 36
    c2 = KIVICache(np.full((3, 2), 2), group_size=g, window=window, sinks=sinks)
    feed(c2, [200])
    assert (c2.n_quantized, c2.window_size) == (160, 36)


def test_fetch_returns_sinks_and_window_exactly_and_quantized_past_within_bound():
    g = 32
    cache = KIVICache(np.full((3, 2), 3), group_size=g, window=32, sinks=4)
    k, v, _ = feed(cache, [150])
    # fetch on the next call: sinks, quantized past, window, the new token
    k_new, v_new, (ok, ov) = feed(cache, [1], seed=9)
    ok, ov = np.array(ok)[0], np.array(ov)[0]
    k_all = np.concatenate([k, k_new], 2)[0]
    assert ok.shape == k_all.shape
    n_q = cache.n_quantized
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    np.testing.assert_array_equal(ok[:, :4], f16(k_all[:, :4]))  # sinks: fp16
    np.testing.assert_array_equal(ok[:, 4 + n_q : -1], f16(k_all[:, 4 + n_q : -1]))  # window
    np.testing.assert_array_equal(ok[:, -1], k_all[:, -1])  # the call's own token: as given
    # all of the quantized past was flushed in the first call, straight from float32
    _, _, rec = np_keys(k_all[:, 4 : 4 + n_q], 3, g)
    np.testing.assert_allclose(ok[:, 4 : 4 + n_q], rec, rtol=1e-6, atol=1e-6)
    _, _, rec_v = np_values(v[0][:, 4 : 4 + n_q], 3, g)
    np.testing.assert_allclose(ov[:, 4 : 4 + n_q], rec_v, rtol=1e-6, atol=1e-6)


def test_nbytes_exact_formula_and_resident_arrays():
    hb = np.array([[1, 8], [4, 2], [2, 3]])
    g, d = 32, 64
    cache = KIVICache(hb, group_size=g, window=32, sinks=4)
    assert cache.nbytes == 0
    for sizes in ([100], [1] * 40, [64, 64]):
        feed(cache, sizes)
        n_q, n_fp = cache.n_quantized, cache.window_size + 4
        # by hand: codes b·D/8 bytes per token and head-stream, fp16 scale+zero per group,
        # fp16 window + sinks for 3 heads × K and V
        codes = n_q * d * hb.sum() // 8
        scale_zero = 6 * (n_q * d // g) * 2 * 2
        fp = 6 * n_fp * d * 2
        assert cache.nbytes == codes + scale_zero + fp
        assert cache.nbytes == kivi.resident_bytes(n_q, n_fp, hb, d, g)
        assert cache.nbytes == sum(a.nbytes for a in cache.resident_arrays())
        # the resident arrays are the state's arrays (nothing hidden, nothing extra)
        state_bytes = sum(
            a.nbytes
            for k, a in cache.state.items()
            if k not in ("meta", "head_bits") and a is not None
        )
        assert cache.nbytes == state_bytes
    # about b + 32/G + window share bits per element
    elems = 2 * 3 * d * cache.offset
    assert 8 * cache.nbytes / elems < hb.mean() + 1 + 16 * (n_fp / cache.offset) + 1e-9


def test_mixed_bits_match_uniform_caches_per_head():
    hb = np.array([[1, 8], [4, 2], [8, 3]])
    mixed = KIVICache(hb, group_size=32, window=32, sinks=4)
    _, _, (mk, mv) = feed(mixed, [130, 1, 40])
    assert sorted(b for b, _ in mixed.buckets["key"]) == [1, 4, 8]
    for h in range(3):
        for s, out in enumerate((mk, mv)):
            uni = KIVICache(np.full((3, 2), hb[h, s]), group_size=32, window=32, sinks=4)
            _, _, ref = feed(uni, [130, 1, 40])
            np.testing.assert_array_equal(np.array(out[:, h]), np.array(ref[s][:, h]))
    # and the error per head falls with its bits
    k_all, _, (ok, _) = feed(KIVICache(hb, group_size=32, window=32, sinks=4), [130, 1, 40])
    q = slice(4, 4 + 128)
    errs = [float(np.abs(np.array(ok)[0, h, q] - k_all[0, h, q]).mean()) for h in range(3)]
    assert errs[0] > errs[1] > errs[2]


def test_cache_sizes_and_mask():
    # the mlx-lm contract itself (bits, to_quantized, merge, state) is tests/test_contract.py
    cache = KIVICache(np.full((3, 2), 2))
    assert mlx_cache.KIVICache is KIVICache
    assert cache.empty() and cache.size() == 0
    feed(cache, [70])
    assert cache.size() == cache.offset == 70
    mask = cache.make_mask(5, return_array=True)
    assert tuple(mask.shape) == (5, 75)
    assert cache.make_mask(1) is None
    assert cache.make_mask(3) == "causal"


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="not supported"):
        KIVICache(np.full((3, 2), 9))
    with pytest.raises(ValueError, match=r"\[H_kv, 2\]"):
        KIVICache(np.full((3,), 2))
    with pytest.raises(ValueError, match="divide head_dim"):
        feed(KIVICache(np.full((3, 2), 2), group_size=48), [10])
    with pytest.raises(ValueError, match="covers 2 KV heads"):
        feed(KIVICache(np.full((2, 2), 2)), [10])
    dims_model = types.SimpleNamespace(
        args=types.SimpleNamespace(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            hidden_size=256,
        )
    )
    make = kivi.METHOD.make_caches
    with pytest.raises(ValueError, match="ratequant"):
        make(dims_model, config(bits=2.5), None)
    with pytest.raises(ValueError, match="not supported"):
        make(dims_model, config(bits=0), None)
    with pytest.raises(ValueError, match="needs bits"):
        make(dims_model, config(), None)
    with pytest.raises(ValueError, match="unknown options"):
        make(dims_model, config(bits=2, options={"key_bit": 4}), None)
    with pytest.raises(ValueError, match="no uncalibrated"):
        make(dims_model, config(bits=2, uncalibrated=True), None)
    caches = make(dims_model, config(bits=2, options={"key_bits": 4}), None)
    assert len(caches) == 2 and caches[0].head_bits.tolist() == [[4, 2], [4, 2]]
    assert caches[0].group_size == kivi.DEFAULT_GROUP_SIZE


def test_prompt_cache_round_trip_and_quality_on_real_model(smollm2, eval_text, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model, tok = smollm2
    ids = tok.encode(eval_text)[:300]
    hb = np.tile(np.array([[2, 4], [3, 2], [4, 3]]), (len(model.layers), 1, 1))
    caches = kivi.build_caches(hb, 32, 32, 4)
    x = mx.array([ids[:256]])
    model(x, cache=caches)
    save_prompt_cache(str(tmp_path / "kivi.safetensors"), caches)
    loaded = load_prompt_cache(str(tmp_path / "kivi.safetensors"))
    assert [type(c) for c in loaded] == [KIVICache] * len(model.layers)
    assert loaded[5].nbytes == caches[5].nbytes and loaded[5].offset == 256
    nxt = mx.array([ids[256:260]])
    a, b = model(nxt, cache=caches), model(nxt, cache=loaded)
    np.testing.assert_array_equal(np.array(a), np.array(b))

    # quality: KIVI-4 is close to fp16, KIVI-2 clearly worse, both far from garbage
    from veloxquant.evaluate import evaluate_rows

    windows = np.array([ids[:300]], dtype=np.int32)
    rows = [
        {
            "name": f"kivi{b}",
            "make": (lambda m, b=b: kivi.make_caches(m, config(bits=b, group_size=32), None)),
        }
        for b in (2, 4)
    ]
    res = {
        r["name"]: r
        for r in evaluate_rows(model, windows, rows, prefill=160, chunk=48, progress=False)
    }
    assert res["kivi4"]["kl"] < 0.02
    assert res["kivi2"]["kl"] > 2 * res["kivi4"]["kl"]
    assert res["kivi2"]["top1"] > 0.6
    # same layout, 2 more bits per quantized element: the gap is 2 · (quantized share) < 2
    gap = res["kivi4"]["kv_bits_per_element"] - res["kivi2"]["kv_bits_per_element"]
    assert 1.0 < gap < 2.0
