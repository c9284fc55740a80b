"""The vectorized CPU kernels (`veloxquant.cpu_kernels`) and what routes to them
(`veloxquant.attention.cpu_attention`, `cpu_kernels.vectorized()`): MLX's bits, its gradients'
bits, and taken only where they apply. `make setup` builds the extension on x86-64 Linux; there
these tests need it built, so a setup that forgot it fails here."""

from __future__ import annotations

import json
import shutil

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant import attention, cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.wanted_here(), reason="the extension is for x86-64 Linux"
)

LOWEST = float(np.finfo(np.float32).min)


def _bits(x) -> np.ndarray:
    """The float32 bit patterns, every NaN as one: which NaN's payload an x86 operation passes
    on depends on the order the compiler put its operands in, in MLX's build and in ours."""
    a = np.array(x, np.float32)
    return np.where(np.isnan(a), np.uint32(0x7FC00000), a.view(np.uint32))


def test_the_extension_is_built_for_this_mlx_and_runs():
    assert cpu_kernels.is_built(), "run `veloxquant build-cpu-kernels` (make setup does)"
    assert cpu_kernels.available(), cpu_kernels._unavailable_reason


def _exp_sample() -> np.ndarray:
    """A sweep of the float32 bit patterns (every 251st, so every low-bit residue occurs), plus
    every float around the exp's edges: 0, ±1, ±88 (where it saturates) and ±87.33 (where
    2**ipart leaves the normal range), and the special values."""
    sweep = np.arange(0, 1 << 32, 251, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [0.0, 1.0, -1.0, 88.0, -88.0, 87.33654, -87.33654, 0.5 / 1.442695]
    near = []
    for e in edges:
        base = np.array([e], np.float32).view(np.int32)[0]
        near.append((base + np.arange(-4096, 4097, dtype=np.int32)).view(np.float32))
    special = np.array(
        [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, LOWEST],
        np.float32,
    )
    nan_payloads = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0xFF812345], np.uint32)
    x = np.concatenate([sweep, *near, special, nan_payloads.view(np.float32)])
    return np.concatenate([x, np.zeros((-len(x)) % 8, np.float32)])


def test_exp_has_mlx_bits_over_a_sweep_of_every_float32_pattern():
    """The whole 2**32 inputs are compared by benchmarks/check_cpu_kernels.py (minutes)."""
    x = _exp_sample()
    got = np.frombuffer(cpu_kernels._load().exp_float32(x.tobytes()), np.float32)
    want = np.array(mx.exp(mx.array(x)))
    mismatch = np.flatnonzero(_bits(got) != _bits(want))
    assert mismatch.size == 0, (x[mismatch[:5]], got[mismatch[:5]], want[mismatch[:5]])


def test_the_exp_op_has_mlx_bits_on_any_layout_and_inside_compile():
    x = mx.array(_exp_sample()[: 1 << 16].reshape(64, 1024))
    layouts = (x, x.T, x[:, ::3], mx.array(2.5), mx.broadcast_to(x[:1], (5, 1024)))
    for a in layouts:
        np.testing.assert_array_equal(_bits(cpu_kernels.exp(a)), _bits(mx.exp(a)))
    fused = mx.compile(lambda a: cpu_kernels.exp(a - a.max(axis=-1, keepdims=True)) * 2.0)
    want = mx.exp(x - x.max(axis=-1, keepdims=True)) * 2.0
    np.testing.assert_array_equal(_bits(fused(x)), _bits(want))


def _rows() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(n).astype(np.float32) * 4 for n in (1, 2, 7, 8, 9, 15, 64, 67)]
    causal = rng.standard_normal(40).astype(np.float32) * 3
    causal[17:] = LOWEST  # a causal row: masked scores are the lowest float
    big = rng.standard_normal(33).astype(np.float32) * 300  # exps that underflow to 0
    with_nans = rng.standard_normal(21).astype(np.float32)
    with_nans[[3, 11]] = np.array([0x7FC00001, 0xFFC12345], np.uint32).view(np.float32)
    with_inf = rng.standard_normal(12).astype(np.float32)
    with_inf[5] = np.inf
    minus_inf = np.full(10, -np.inf, np.float32)
    minus_inf[2] = 1.0
    zeros = np.array([0.0, -0.0, -0.0, 0.0, 0.0, -0.0, 0.0, -0.0, 0.0], np.float32)
    return rows + [causal, big, with_nans, with_inf, minus_inf, zeros]


@pytest.mark.parametrize("row", _rows(), ids=lambda r: f"n{len(r)}")
def test_softmax_has_mlx_bits_on_a_row(row):
    x = mx.array(np.stack([row, row[::-1].copy()]))
    got, want = cpu_kernels.softmax(x), mx.softmax(x, axis=-1, precise=True)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_softmax_has_mlx_bits_on_attention_scores_of_any_layout():
    mx.random.seed(3)
    scores = mx.random.normal((2, 3, 5, 96, 130)) * 5
    for x in (
        scores,
        mx.swapaxes(scores, -1, -2),
        scores[..., ::2],
        mx.broadcast_to(scores[:, :1], scores.shape),
    ):
        np.testing.assert_array_equal(
            _bits(cpu_kernels.softmax(x)), _bits(mx.softmax(x, axis=-1, precise=True))
        )


def test_softmax_gradients_have_mlx_bits():
    mx.random.seed(4)
    x, w = mx.random.normal((4, 6, 77)) * 3, mx.random.normal((4, 6, 77))

    def loss(f):
        return lambda a: (f(a) * w).sum()

    got = mx.grad(loss(cpu_kernels.softmax))(x)
    want = mx.grad(loss(lambda a: mx.softmax(a, axis=-1, precise=True)))(x)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _causal_reference(scores, offset):
    n_q, n_k = scores.shape[-2:]
    seen = mx.arange(offset, offset + n_q)[:, None] >= mx.arange(n_k)[None]
    return mx.softmax(mx.where(seen, scores, mx.array(LOWEST)), axis=-1, precise=True)


@pytest.mark.parametrize("n_queries, n_keys", [(37, 37), (16, 80), (1, 9), (9, 300)])
def test_causal_softmax_has_the_masked_softmax_bits_and_gradients(n_queries, n_keys):
    mx.random.seed(n_keys)
    offset = n_keys - n_queries
    scores = mx.random.normal((2, 3, n_queries, n_keys)) * 6
    w = mx.random.normal(scores.shape)
    got = cpu_kernels.causal_softmax(scores, offset)
    np.testing.assert_array_equal(_bits(got), _bits(_causal_reference(scores, offset)))
    grads = [
        mx.grad(lambda x, f=f: (f(x, offset) * w).sum())(scores)
        for f in (cpu_kernels.causal_softmax, _causal_reference)
    ]
    np.testing.assert_array_equal(_bits(grads[0]), _bits(grads[1]))


def test_causal_softmax_takes_rows_whose_visible_part_is_not_finite_whole():
    """Rows whose visible maximum is NaN, +-inf or the lowest value: the replaced entries'
    exps are not all 0 there, so the row is computed whole, as MLX does."""
    rows = np.random.default_rng(1).standard_normal((6, 12)).astype(np.float32)
    rows[0, 1] = np.nan
    rows[1, 0] = np.inf
    rows[2, :] = -np.inf
    rows[3, :] = LOWEST
    rows[4, 2] = LOWEST
    scores = mx.array(rows[None])  # [1, 6 queries, 12 keys], offset 3: rows see 4..9 keys
    got = cpu_kernels.causal_softmax(scores, 3)
    np.testing.assert_array_equal(_bits(got), _bits(_causal_reference(scores, 3)))


@pytest.mark.parametrize(
    "row", _rows() + [np.full(49152, -3.0, np.float32)], ids=lambda r: f"n{len(r)}"
)
def test_logsumexp_has_mlx_bits_on_a_row(row):
    x = mx.array(np.stack([row, row[::-1].copy()]))
    got, want = cpu_kernels.logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True)
    assert got.shape == want.shape == (2, 1)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_logsumexp_over_a_vocabulary_and_its_gradients_have_mlx_bits():
    mx.random.seed(5)
    logits = mx.random.normal((2, 7, 49152)) * 4
    w = mx.random.normal((2, 7, 1))

    def loss(f):
        return lambda x: (f(x) * w).sum()

    np.testing.assert_array_equal(
        _bits(cpu_kernels.logsumexp(logits)),
        _bits(mx.logsumexp(logits, axis=-1, keepdims=True)),
    )
    got = mx.grad(loss(cpu_kernels.logsumexp))(logits)
    want = mx.grad(loss(lambda x: mx.logsumexp(x, axis=-1, keepdims=True)))(logits)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_swiglu_has_mlx_lm_bits_and_gradients():
    from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

    mx.random.seed(6)
    gate = mx.random.normal((3, 50, 67)) * 8
    up = mx.random.normal((3, 50, 67))
    special = mx.array([0.0, -0.0, 100.0, -100.0, 88.5, -88.5, np.inf, -np.inf, np.nan, 1e-40])
    for g, u in ((gate, up), (special, mx.ones_like(special) * 3)):
        np.testing.assert_array_equal(_bits(cpu_kernels.swiglu(g, u)), _bits(mlx_lm_swiglu(g, u)))
    w = mx.random.normal(gate.shape)
    grads = [
        mx.grad(lambda g, u, f=f: (f(g, u) * w).sum(), argnums=(0, 1))(gate, up)
        for f in (cpu_kernels.swiglu, mlx_lm_swiglu)
    ]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized_matmul_has_mlx_bits_both_ways(bits, group_size):
    mx.random.seed(bits * 1000 + group_size)
    # a cache of 2 sequences x 3 KV heads, shared by 2 query heads each (broadcast), with query
    # and key counts that leave every tail of the kernel something to do
    cached = mx.random.normal((2, 3, 1, 2 * group_size + 8 * 3 + 5, 128)) * 4
    w, scales, biases = mx.quantize(cached, group_size=group_size, bits=bits)
    queries = mx.random.normal((2, 3, 2, 37, 128))
    probs = mx.softmax(mx.random.normal((2, 3, 2, 37, cached.shape[-2])), axis=-1)
    # the scores' matmul (transposed) and the probabilities' with the values (not)
    for x, transpose in ((queries, True), (probs, False)):
        args = dict(transpose=transpose, group_size=group_size, bits=bits)
        got = cpu_kernels.quantized_matmul(x, w, scales, biases, **args)
        want = mx.quantized_matmul(x, w, scales, biases, **args)
        assert got.shape == want.shape
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_quantized_matmul_takes_non_finite_inputs_and_gradients_as_mlx_does():
    mx.random.seed(3)
    w, scales, biases = mx.quantize(mx.random.normal((3, 96, 64)), group_size=64, bits=4)
    x = mx.random.normal((3, 20, 64))
    x[0, 0, 0], x[1, 2, 5], x[2, 3, 7], x[2, 4, 0] = np.nan, np.inf, -np.inf, -0.0
    args = dict(transpose=True, group_size=64, bits=4)
    np.testing.assert_array_equal(
        _bits(cpu_kernels.quantized_matmul(x, w, scales, biases, **args)),
        _bits(mx.quantized_matmul(x, w, scales, biases, **args)),
    )
    cot = mx.random.normal((3, 19, 96))
    grads = [
        mx.grad(lambda x, f=f: (f(x, w, scales, biases, **args) * cot).sum())(x[:, 1:])
        for f in (cpu_kernels.quantized_matmul, mx.quantized_matmul)
    ]
    np.testing.assert_array_equal(_bits(grads[0]), _bits(grads[1]))


def test_softmax_leaves_other_dtypes_and_devices_to_mlx():
    x = mx.random.normal((3, 20)).astype(mx.bfloat16)
    got = cpu_kernels.softmax(x)
    assert got.dtype == mx.bfloat16
    np.testing.assert_array_equal(
        np.array(got.astype(mx.float32)),
        np.array(mx.softmax(x, axis=-1, precise=True).astype(mx.float32)),
    )


@pytest.mark.parametrize(
    "batch, q_heads, kv_heads, queries, keys, mask",
    [
        (1, 9, 3, 256, 256, "causal"),  # SmolLM2's heads
        (2, 4, 4, 200, 200, "causal"),  # no GQA
        (1, 8, 2, 130, 700, "causal"),  # a chunk after 570 cached tokens
        (1, 8, 2, 1, 300, None),  # one decoded token
        (2, 4, 2, 33, 33, None),
    ],
)
def test_cpu_attention_is_mlx_attention_bit_for_bit_with_its_gradients(
    batch, q_heads, kv_heads, queries, keys, mask
):
    mx.random.seed(queries + keys)
    q = mx.random.normal((batch, q_heads, queries, 64)) * 2
    k = mx.random.normal((batch, kv_heads, keys, 64)) * 2
    v = mx.random.normal((batch, kv_heads, keys, 64))
    w = mx.random.normal((batch, q_heads, queries, 64))

    def mlx_attn(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

    def ours(q, k, v):
        return attention.cpu_attention(q, k, v, 0.125, mask)

    np.testing.assert_array_equal(_bits(ours(q, k, v)), _bits(mlx_attn(q, k, v)))
    grads = [
        mx.grad(lambda *a, f=f: (f(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
        for f in (ours, mlx_attn)
    ]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize(
    "queries, keys, mask", [(64, 64, "causal"), (16, 300, "causal"), (1, 70, None)]
)
def test_quantized_attention_is_mlx_lms_bit_for_bit(queries, keys, mask):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    mx.random.seed(keys)
    q = mx.random.normal((1, 9, queries, 64))
    k, v = (mx.quantize(mx.random.normal((1, 3, keys, 64)), 64, 4) for _ in range(2))
    got = attention.cpu_quantized_attention(q, k, v, 0.125, mask, 64, 4)
    # (mlx-lm's scales its queries argument in place: give it its own)
    want = quantized_scaled_dot_product_attention(
        mx.array(q), k, v, 0.125, mask, group_size=64, bits=4
    )
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_a_forward_pass_under_vectorized_routes_each_layer_and_keeps_the_logits(
    smollm2, monkeypatch
):
    import mlx_lm.models.llama as llama
    from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

    model, _ = smollm2
    taken, quantized, mlps = [], [], []
    routed, native_swiglu = attention.cpu_attention, cpu_kernels.swiglu
    routed_q = attention.cpu_quantized_attention
    monkeypatch.setattr(
        attention, "cpu_attention", lambda *a, **k: taken.append(1) or routed(*a, **k)
    )
    monkeypatch.setattr(
        attention,
        "cpu_quantized_attention",
        lambda *a, **k: quantized.append(1) or routed_q(*a, **k),
    )
    monkeypatch.setattr(cpu_kernels, "swiglu", lambda *a: mlps.append(1) or native_swiglu(*a))
    tokens = mx.array(np.random.default_rng(0).integers(0, 40000, (1, 200)), mx.int32)

    def logits(make_cache):
        caches = [make_cache() for _ in model.layers]
        first = model(tokens[:, :150], cache=caches)  # a causal prefill
        out = model(tokens[:, 150:], cache=caches)  # a chunk after it
        mx.eval(first, out)
        return out

    want = logits(KVCache)
    want_q = logits(lambda: QuantizedKVCache(bits=8))
    assert not taken and not mlps and not attention.installed()
    with cpu_kernels.vectorized():
        got = logits(KVCache)
        assert len(taken) == len(mlps) == 2 * len(model.layers) and not quantized
        got_q = logits(lambda: QuantizedKVCache(bits=8))  # mlx-lm's quantized attention
        assert len(taken) == 2 * len(model.layers) and len(quantized) == 2 * len(model.layers)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(got_q), _bits(want_q))
    assert not attention.installed() and not attention._cpu_softmax_on
    assert llama.swiglu is mlx_lm_swiglu


def test_native_softmax_leaves_an_installed_dispatch_installed():
    with attention.fused():
        with attention.native_softmax():
            assert attention._cpu_softmax_on
        assert attention.installed() and not attention._cpu_softmax_on
    assert not attention.installed()


def test_a_stale_build_is_not_loaded_and_says_how_to_rebuild(tmp_path, monkeypatch, caplog):
    library = tmp_path / cpu_kernels.LIBRARY.name
    stamp = tmp_path / cpu_kernels.STAMP.name
    shutil.copy(cpu_kernels.LIBRARY, library)
    stamp.write_text(json.dumps({**cpu_kernels._stamp(), "mlx": "0.0.1"}))
    monkeypatch.setattr(cpu_kernels, "LIBRARY", library)
    monkeypatch.setattr(cpu_kernels, "STAMP", stamp)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_unavailable_reason", None)
    with caplog.at_level("WARNING", logger="veloxquant"):
        assert not cpu_kernels.available()
    assert "veloxquant build-cpu-kernels" in caplog.text
    x = mx.random.normal((4, 50))
    np.testing.assert_array_equal(
        _bits(cpu_kernels.softmax(x)), _bits(mx.softmax(x, axis=-1, precise=True))
    )


def test_where_it_is_not_needed_the_fallback_is_quiet(monkeypatch, caplog):
    """Off x86-64 Linux MLX's CPU exp is vectorized: MLX's ops run without a warning."""
    monkeypatch.setattr(cpu_kernels, "wanted_here", lambda: False)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_unavailable_reason", None)
    with caplog.at_level("DEBUG", logger="veloxquant"):
        assert not cpu_kernels.available()
    assert [r.levelname for r in caplog.records] == ["DEBUG"]
    assert "not x86-64 Linux" in caplog.text


@pytest.mark.parametrize("k", [64, 13])  # CommVQ's 64 atoms, and a width with a scalar tail
def test_nearest_pair_codeword_is_the_score_blocks_argmin(k):
    from veloxquant.methods.commvq.codebook import partial_sq_distances

    mx.random.seed(k)
    u, v = mx.random.normal((2, 3, 800, k)) * 3  # enough rows for two threads at k = 64
    cross = mx.random.normal((3, k, k))
    v = mx.concatenate([v[:, :, : k // 2], v[:, :, : k - k // 2]], axis=-1)  # exact ties
    cross = cross * 0 if k == 13 else cross
    codes, best = cpu_kernels.nearest_pair_codeword(u, v, cross)
    scores = partial_sq_distances(u, v, cross)
    want = mx.argmin(scores, axis=-1)
    np.testing.assert_array_equal(np.array(codes), np.array(want))
    np.testing.assert_array_equal(
        _bits(best), _bits(mx.take_along_axis(scores, want[..., None], axis=-1)[..., 0])
    )
    u[1, 7, 3] = np.nan
    with pytest.raises(RuntimeError, match="NaN"):
        mx.eval(cpu_kernels.nearest_pair_codeword(u, v, cross))
