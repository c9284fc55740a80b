"""KIVI's fused decode attention (veloxquant/methods/kivi/kernels.py), as for VecInfer in
tests/test_kernels.py:
1. the pure-MLX twin (the store dequantized a piece at a time under an online softmax),
   routed in through mlx-lm's attention call, against the transient path on the real model
   (the same greedy tokens), and on one layer against float64 attention over the transient
   path's own keys and values;
2. the generated CUDA and Metal kernels, run on the CPU by tests/kernel_emulator.py, against
   the twin on the same cache: several layouts (bit widths that cross 32-bit words, 1 bit,
   mixed widths per head, group sizes 16-64, head dims 32-256, 1-8 queries per KV head),
   several splits of the store, the exact tokens alone;
3. the contract: the path a cache takes and says it takes, the clear error when the attention
   is not routed, honest nbytes (the fused path keeps nothing more).
"""

from __future__ import annotations

import copy
import os

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

import veloxquant.kernels as vk
from tests import kernel_emulator as emu
from veloxquant import KVCacheConfig, make_cache
from veloxquant.kernels import check_metal_source
from veloxquant.methods.kivi import KIVICache
from veloxquant.methods.kivi import kernels as K

needs_cxx = pytest.mark.skipif(emu.CXX is None, reason="no C++ compiler for the kernel emulator")


def _emulated(backend: str):
    """`veloxquant.kernels.launch` with the emulator (of `backend`'s source) for the GPU."""
    return emu.launch_for(backend)


def _keys(rng, h: int, n: int, d: int) -> np.ndarray:
    """Key-like rows: per-channel scales over a decade and offsets (KIVI's per-channel case)."""
    scale = rng.uniform(0.3, 4.0, size=(1, h, 1, d))
    return (rng.normal(size=(1, h, n, d)) * scale + rng.normal(size=(1, h, 1, d))).astype(
        np.float32
    )


def _pair(head_bits, group_size=32, window=32, sinks=4):
    """A transient and a fused cache of the same layout."""
    a = KIVICache(np.array(head_bits), group_size=group_size, window=window, sinks=sinks)
    b = KIVICache(np.array(head_bits), group_size=group_size, window=window, sinks=sinks)
    b.fused = True
    return a, b


def _feed(caches, k: np.ndarray, v: np.ndarray, chunk: int) -> None:
    for s in range(0, k.shape[2], chunk):
        for c in caches:
            c.update_and_fetch(mx.array(k[:, :, s : s + chunk]), mx.array(v[:, :, s : s + chunk]))
            c._pending = None  # no attention for these calls


def _attention64(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """float64 attention of one query per head [1, Hq, 1, D] over [1, H, T, D]."""
    h = keys.shape[1]
    g = q.shape[1] // h
    q = q.astype(np.float64).reshape(h, g, -1) * scale
    s = np.einsum("hgd,htd->hgt", q, keys[0].astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hgt,htd->hgd", p, values[0].astype(np.float64)).reshape(1, h * g, 1, -1)


# ------------------------------------------------------------------ 1. twin vs transient

MODEL_CONFIGS = {
    "kivi-2": KVCacheConfig(method="kivi", bits=2),
    # mixed widths over heads and streams (an interleaved 2/4-bit split of b̄ = 3)
    "ratequant-uniform-3": KVCacheConfig(method="ratequant", bits=3, uncalibrated=True),
    "kivi-3-g64": KVCacheConfig(method="kivi", bits=3, group_size=64, window=8, sinks=0),
}


def _model_caches(model, config, fused: bool, monkeypatch) -> list:
    monkeypatch.setenv("VELOXQUANT_FUSED", "1" if fused else "0")
    caches = make_cache(model, config)
    assert all(c.fused == fused for c in caches)
    return caches


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_fused_twin_matches_transient_path_on_the_real_model(name, smollm2, eval_text, monkeypatch):
    model, tok = smollm2
    config = MODEL_CONFIGS[name]
    ref = _model_caches(model, config, False, monkeypatch)
    fused = _model_caches(model, config, True, monkeypatch)
    assert fused[0].attention_path == "reference"  # the CPU: the twin
    prompt = mx.array(tok.encode(eval_text)[:400])[None]
    for s in range(0, prompt.shape[1], 128):  # prefill in chunks: the twin, causal mask
        la = model(prompt[:, s : s + 128], cache=ref)[:, -1]
        lb = model(prompt[:, s : s + 128], cache=fused)[:, -1]
        mx.eval(la, lb)
    assert {c.last_attention for c in fused} == {"reference"}
    flips = 0
    for step in range(64):  # 64 greedy tokens, fed the same to both paths
        # float32 sums in another order, compounded over 30 layers: 0.036 after the prefill
        # at 2 bits (0.002 at 8 bits: a key rounded differently by 1e-6 may land on the
        # other code of a near-tie, and the coarser the codes the larger that step), and a
        # drift up to ~0.4 over the steps; a wrong term in the algebra is O(1) at once
        a, b = np.array(la)[0], np.array(lb)[0]
        diff = np.abs(a - b).max()
        assert diff < (0.1 if step == 0 else 1.0), (step, diff)
        if a.argmax() != b.argmax():
            # only at a near-tie of the transient path's own logits: measured at step 54 of
            # kivi-2, a top-2 margin of 0.033 against a difference of 0.145
            top2 = np.sort(a)[-2:]
            assert top2[1] - top2[0] < diff, (step, top2, diff)
            flips += 1
        tok_a = mx.argmax(la, axis=-1)
        la = model(tok_a[:, None], cache=ref)[:, -1]
        lb = model(tok_a[:, None], cache=fused)[:, -1]
        mx.eval(la, lb)
    assert flips <= 2
    for a, b in zip(ref, fused, strict=True):
        # the same tokens stored the same way: nothing extra is resident on the fused path
        assert a.offset == b.offset and a.n_quantized == b.n_quantized > 0
        assert a.nbytes == b.nbytes
        assert b.last_attention == "reference" and a.last_attention is None


@pytest.mark.parametrize(
    "head_bits,group_size,window,sinks",
    [
        ([[2, 2], [2, 2], [2, 2]], 32, 32, 4),
        ([[2, 4], [4, 1], [3, 2]], 16, 8, 1),
        ([[8, 3], [1, 8], [5, 5]], 64, 0, 0),
    ],
)
def test_twin_matches_float64_attention_over_the_transient_fetch(
    head_bits, group_size, window, sinks
):
    # Both caches get the same calls, so they store the same codes; the transient one's fetch
    # is what mlx-lm's attention would see. Decode steps interleaved with a prefill chunk (the
    # twin with a sliding-window array mask against mx.fast's), across flushes.
    rng = np.random.default_rng(1)
    h, d, gq = 3, 64, 3
    a, b = _pair(head_bits, group_size, window, sinks)
    _feed([a, b], _keys(rng, h, 150, d), rng.normal(size=(1, h, 150, d)).astype(np.float32), 50)
    for step in range(40):
        n = 7 if step == 20 else 1
        k = mx.array(_keys(rng, h, n, d))
        v = mx.array(rng.normal(size=(1, h, n, d)).astype(np.float32))
        q = mx.array(rng.normal(size=(1, h * gq, n, d)).astype(np.float32) * 2)
        keys, values = a.update_and_fetch(k, v)
        b.update_and_fetch(k, v)
        if n == 1:
            got = np.array(b.fused_attention(q, scale=0.125))
            want = _attention64(np.array(q), np.array(keys), np.array(values), 0.125)
            np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)
        else:
            # mlx-lm's array mask of a sliding window: it hides the oldest stored tokens, so
            # each piece's columns must be the right ones
            mask = create_causal_mask(n, a.offset - n, window_size=100)
            got = b.fused_attention(q, scale=0.125, mask=mask)
            want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=0)
        assert b.last_attention == "reference"
    assert a.n_quantized == b.n_quantized >= 128 and a.nbytes == b.nbytes
    # the fused update keeps its window in fp16 between flushes: the same bits stored
    for x, y in zip(a.resident_arrays(), b.resident_arrays(), strict=True):
        assert x.dtype == y.dtype and mx.array_equal(x, y).item()


def test_twin_takes_the_store_in_pieces(monkeypatch):
    # A piece of one group: the online softmax merges every block's piece, and the answer is
    # the one-piece answer (the piece size bounds prefill's peak memory, nothing else).
    rng = np.random.default_rng(2)
    h, d = 2, 64
    _, b = _pair([[2, 3], [4, 2]])
    _feed([b], _keys(rng, h, 300, d), rng.normal(size=(1, h, 300, d)).astype(np.float32), 100)
    k = mx.array(_keys(rng, h, 5, d))
    b.update_and_fetch(k, k)
    pending = b._pending
    q = mx.array(rng.normal(size=(1, 2 * h, 5, d)).astype(np.float32))
    whole = np.array(K.reference_attention(b, q, 0.125, "causal", pending))
    monkeypatch.setattr(K, "PIECE_TOKENS", 32)
    pieces = np.array(K.reference_attention(b, q, 0.125, "causal", pending))
    np.testing.assert_allclose(pieces, whole, atol=1e-5, rtol=0)
    assert b.n_quantized // 32 > 4
    # a sliding window hides the first pieces whole: no NaN from a running maximum at -inf
    mask = create_causal_mask(5, b.offset - 5, window_size=50)
    pieces = np.array(K.reference_attention(b, q, 0.125, mask, pending))
    monkeypatch.setattr(K, "PIECE_TOKENS", 16384)
    whole = np.array(K.reference_attention(b, q, 0.125, mask, pending))
    assert np.isfinite(pieces).all()
    np.testing.assert_allclose(pieces, whole, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ 2. emulated kernels


LAYOUTS = {
    # SmolLM2's shape at KIVI-2: D 64, 3 query heads per KV head, G 32
    "d64-g32-k2v2-q3": dict(head_bits=[[2, 2]] * 3, d=64, group_size=32, gq=3),
    # mixed widths: 3 bits crosses words, 1-bit values, two layouts in one layer
    "d64-g32-mixed-q3": dict(head_bits=[[2, 4], [3, 1], [2, 4]], d=64, group_size=32, gq=3),
    # an 8B-like head: D 128, G 64, 4 query heads per KV head, 4/2 bits
    "d128-g64-k4v2-q4": dict(head_bits=[[4, 2]] * 2, d=128, group_size=64, gq=4),
    # D 256 (two channels per thread), 5/7/6/3 bits
    "d256-g32-k5v7-q2": dict(head_bits=[[5, 7], [6, 3]], d=256, group_size=32, gq=2),
    # G 16: eight key blocks per tile, a block row of 48 bits per channel at 3 bits
    "d128-g16-k3v6-q2": dict(head_bits=[[3, 6]], d=128, group_size=16, gq=2),
    # D 32 (four token lanes in the value phase), one query per head, 8 bits
    "d32-g32-k8v8-q1": dict(head_bits=[[8, 8]], d=32, group_size=32, gq=1),
    # 8 query heads per KV head (the most the kernel takes)
    "d64-g64-k2v2-q8": dict(head_bits=[[2, 2]], d=64, group_size=64, gq=8),
    # KIVI-4 at the 8B shape: the tensor cores' kernel holds one tile's codes, not two
    "d128-g64-k4v4-q4": dict(head_bits=[[4, 4]], d=128, group_size=64, gq=4),
}


def _decode_case(rng, head_bits, d, group_size, gq, n_tok, window=32, sinks=4):
    """A fused cache after n_tok tokens and one decode update (pending), and a query. The
    keys grow along the sequence, so a split's running maximum rises from tile to tile and
    its sums are rescaled (a split's tiles walk the sequence in order)."""
    h = len(head_bits)
    _, c = _pair(head_bits, group_size, window, sinks)
    ramp = np.linspace(0.5, 2.5, n_tok, dtype=np.float32)[:, None]
    keys = _keys(rng, h, n_tok, d) * ramp
    _feed([c], keys, rng.normal(size=(1, h, n_tok, d)).astype(np.float32), 97)
    k = mx.array(_keys(rng, h, 1, d))
    c.update_and_fetch(k, mx.array(rng.normal(size=(1, h, 1, d)).astype(np.float32)))
    q = mx.array(rng.normal(size=(1, h * gq, 1, d)).astype(np.float32) * 2)
    return c, q


@needs_cxx
@pytest.mark.parametrize("backend,mma", [("cuda", True), ("cuda", False), ("metal", True)])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_emulated_kernels_match_the_twin(layout, backend, mma, monkeypatch):
    # CUDA: the tensor cores where they take the layout (K.MMA), else the CUDA cores; Metal
    # always the CUDA cores' kernel
    spec = LAYOUTS[layout]
    monkeypatch.setattr(K, "MMA", mma)
    monkeypatch.setattr(K, "MMA_BITS", (2, 4))  # every width the tensor cores' kernel reads
    rng = np.random.default_rng(3)
    c, q = _decode_case(rng, n_tok=600, **spec)
    pending = c._pending
    want = np.array(K.reference_attention(c, q, 0.125, None, pending))
    launched = []
    run = _emulated(backend)
    monkeypatch.setattr(K, "backend", lambda: backend)
    monkeypatch.setattr(K, "launch", lambda src, *a: launched.append(src.name) or run(src, *a))
    # 2 splits of the store's 4-5 tiles (2-3 tiles each, the last tile short), plus the
    # exact split
    assert K.kernels_take(c, q.shape[1])
    heads = K.launch_heads(c, q.shape[1])
    monkeypatch.setattr(K, "TARGET_GROUPS", 2 * heads)
    n_blocks = c.n_quantized // c.group_size
    assert K.split_tiles(n_blocks, c.group_size, heads) >= 2
    got = np.array(K.decode_attention(c, q, 0.125, pending))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    lays = K.layouts(c, q.shape[1])
    tensor = [K.use_mma(lay) for lay in lays]
    assert any(tensor) == (mma and backend == "cuda" and K.mma_takes(lays[0]) is None)
    partial = ["vq_kivi_attn_partial" + ("_mma" if t else "") for t in tensor]
    assert launched == partial + ["vq_kivi_attn_combine"]


def test_the_tensor_cores_take_the_2_and_4_bit_layouts():
    takes = {}
    for name, spec in LAYOUTS.items():
        pairs = sorted({tuple(b) for b in spec["head_bits"]})
        lays = [K.Layout(spec["d"], spec["group_size"], *p, spec["gq"]) for p in pairs]
        takes[name] = [K.mma_takes(lay) is None and K.mma_stages(lay) for lay in lays]
    # the tensor cores' stages of code rows (2: the next tile's copied in during this one), or
    # False: the CUDA cores' kernel only
    assert takes == {
        "d64-g32-k2v2-q3": [2],
        "d64-g32-mixed-q3": [2, False],  # 2/4 bits, then 3/1
        "d128-g64-k4v2-q4": [2],
        "d256-g32-k5v7-q2": [False, False],
        "d128-g16-k3v6-q2": [False],
        "d32-g32-k8v8-q1": [False],
        "d64-g64-k2v2-q8": [2],
        "d128-g64-k4v4-q4": [1],
    }


def test_the_tensor_cores_refuse_a_layout_their_threadgroup_memory_cannot_hold():
    # 8 query heads per KV head at G 32 and D 128: the CUDA cores' kernel fits 48 KB (41184
    # bytes), the tensor cores' even with one stage of code rows does not
    lay = K.Layout(128, 32, 2, 2, 8)
    assert K.unsupported(lay) is None
    assert "59616 bytes of threadgroup memory" in K.mma_takes(lay)
    assert K.mma_takes(K.Layout(128, 64, 2, 2, 8)) is None


def test_by_default_only_2_bit_layouts_take_the_tensor_cores(monkeypatch):
    # a 4-bit side was slower on the tensor cores than on the CUDA cores (K.MMA_BITS)
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    taken = {b: K.use_mma(K.Layout(128, 64, *b, 4)) for b in [(2, 2), (2, 4), (4, 2), (4, 4)]}
    assert taken == {(2, 2): True, (2, 4): False, (4, 2): False, (4, 4): False}
    monkeypatch.setattr(K, "MMA", False)
    assert not K.use_mma(K.Layout(128, 64, 2, 2, 4))


@pytest.mark.parametrize(
    "head_bits", [[[2, 2]] * 8, [[2, 4], [4, 2]] * 4, [[2, 2]] * 6 + [[4, 4]] * 2]
)
@pytest.mark.parametrize("mma", [True, False])
@pytest.mark.parametrize(
    "sms, shared, fit_cores, fit_tensor",  # shared memory: an H100's 228 KB, an RTX 4090's 100,
    [(132, 233472, 6, 4), (128, 102400, 6, 2), (40, 65536, 4, 1)],  # a T4's 64
)
def test_the_largest_partial_launch_is_one_wave(
    head_bits, mma, sms, shared, fit_cores, fit_tensor, monkeypatch
):
    # a tile takes about as long whatever else its multiprocessor runs, so a launch is fastest
    # as one wave of as many threadgroups as fit (KIVI-2 at 64K on an H100: 116.5 us in 704
    # threadgroups, 141.6 in 1032, benchmarks/results/kivi-splits-h100.txt), by registers or,
    # on a card with less shared memory, by that; a mixed allocation's launches each take
    # only their own heads
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(vk, "cuda_multiprocessors", lambda: sms)
    monkeypatch.setattr(vk, "cuda_shared_memory", lambda: (shared, 1024))
    monkeypatch.setattr(K, "MMA", mma)
    grids = []

    def launch(src, inputs, grid, shapes, dtypes):  # the grids decode_attention asks for
        grids.append((src.name, grid))
        return [mx.zeros(sh, dt) for sh, dt in zip(shapes, dtypes, strict=True)]

    monkeypatch.setattr(K, "launch", launch)
    c = KIVICache(np.array(head_bits), group_size=64, window=0, sinks=0)
    c.fused = True
    x = mx.zeros((1, len(head_bits), 1, 128), mx.float16)
    c.update_and_fetch(x, x)
    n_q = 4 * len(head_bits)
    # the tensor cores' kernel holds fewer threadgroups per multiprocessor (by default it takes
    # the 2-bit layouts only: [[2, 4], [4, 2]] stays on the CUDA cores)
    tensor = mma and [2, 2] in head_bits
    slots = (fit_tensor if tensor else fit_cores) * sms
    for n_tok in (65536, 131072):
        # a pending update over n_tok stored tokens: the launches are stubs, so one row of each
        # store array stands in for the rest
        pending = dict(c._pending, n_quantized=n_tok)
        pending["store"] = {
            s: {b: {k: mx.zeros((1, len(idx), 1, 1)) for k in ("codes", "scale", "zero")}
                for b, idx in c.buckets[s]}
            for s in ("key", "value")
        }  # fmt: skip
        grids.clear()
        K.decode_attention(c, mx.zeros((1, n_q, 1, 128), mx.bfloat16), 0.1, pending)
        sizes = [gx * gy for name, (gx, gy, _) in grids if name.startswith("vq_kivi_attn_partial")]
        assert len(sizes) == len({tuple(b) for b in head_bits})
        assert ("vq_kivi_attn_partial_mma" in [name for name, _ in grids]) == tensor
        assert 0.8 * slots < max(sizes) <= slots + len(head_bits), (n_tok, sizes, slots)


@needs_cxx
@pytest.mark.parametrize("n_tok,window,sinks", [(3, 32, 4), (40, 0, 0), (700, 32, 4)])
def test_emulated_kernels_cover_empty_stores_and_single_splits(n_tok, window, sinks, monkeypatch):
    # no quantized token yet (the exact split alone), the exact tokens being only the new one
    # (no window, no sinks), and the default split count
    rng = np.random.default_rng(4)
    c, q = _decode_case(rng, [[2, 2], [4, 4]], 64, 32, 3, n_tok, window, sinks)
    pending = c._pending
    want = np.array(K.reference_attention(c, q, 0.125, None, pending))
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "launch", _emulated("cuda"))
    got = np.array(K.decode_attention(c, q, 0.125, pending))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


@needs_cxx
@pytest.mark.parametrize("name", ["kivi-2", "ratequant-uniform-3"])
def test_emulated_kernels_match_the_twin_on_real_activations(name, smollm2, eval_text, monkeypatch):
    # The real model's own keys, values and queries (SmolLM2, 330 prompt tokens, then 2 decode
    # steps): every layer's decode attention runs in the emulated CUDA kernels, and each call
    # is checked against the twin on the same update. The model goes on with the kernels'
    # output, so later steps attend over what the kernel path itself stored.
    model, tok = smollm2
    caches = _model_caches(model, MODEL_CONFIGS[name], True, monkeypatch)
    ids = tok.encode(eval_text)[:332]
    model(mx.array([ids[:330]]), cache=caches)  # prefill: the twin
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "launch", _emulated("cuda"))
    kernel_attention = K.decode_attention
    errors = []

    def checked(cache, queries, scale, pending):
        got = kernel_attention(cache, queries, scale, pending)
        want = K.reference_attention(cache, queries, scale, None, pending)
        errors.append((mx.abs(got - want).max() / mx.abs(want).max()).item())
        return got

    monkeypatch.setattr(K, "decode_attention", checked)
    for i in range(330, 332):
        model(mx.array([[ids[i]]]), cache=caches)
    assert {c.last_attention for c in caches} == {"kernel"}
    assert len(errors) == 2 * len(caches) and caches[0].n_quantized > 0
    assert max(errors) < 1e-5, max(errors)


@needs_cxx
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_cache_decode_takes_the_kernels_and_keeps_the_model_dtype(dtype, monkeypatch):
    # The cache's own decode path with the launches emulated, float16 or bfloat16 model
    # tensors (bfloat16 is what the GPU benchmarks and most checkpoints run): the output comes
    # back in the model's dtype from the combine kernel, within its rounding of the twin's
    # float32 answer; prefill chunks still take the twin.
    rng = np.random.default_rng(5)
    h, d = 2, 64
    _, c = _pair([[2, 2], [3, 4]])
    rtol = {mx.float16: 1e-3, mx.bfloat16: 8e-3}[dtype]  # half a unit in the last place
    k = mx.array(_keys(rng, h, 200, d)).astype(dtype)
    c.update_and_fetch(k, k)
    c._pending = None
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "launch", _emulated("cuda"))
    assert c.attention_path == "kernel"
    for _ in range(3):
        k1 = mx.array(_keys(rng, h, 1, d)).astype(dtype)
        q = mx.array(rng.normal(size=(1, 3 * h, 1, d))).astype(dtype)
        c.update_and_fetch(k1, k1)
        want = np.array(K.reference_attention(c, q.astype(mx.float32), 0.125, None, c._pending))
        got = c.fused_attention(q, scale=0.125)
        assert c.last_attention == "kernel" and got.dtype == dtype
        got = np.array(got.astype(mx.float32))
        np.testing.assert_allclose(got, want, atol=rtol * np.abs(want).max(), rtol=rtol)
    k7 = mx.array(_keys(rng, h, 7, d))
    c.update_and_fetch(k7, k7)
    c.fused_attention(mx.zeros((1, 3 * h, 7, d)), scale=0.125, mask="causal")
    assert c.last_attention == "reference"


def test_layouts_the_kernels_do_not_take_are_named(monkeypatch):
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    assert K.unsupported(K.Layout(96, 48, 2, 2, 1)) == (
        "group_size 48 does not divide the tile of 128 tokens"
    )
    assert "head_dim 96" in K.unsupported(K.Layout(96, 32, 2, 2, 1))
    assert "12 query heads" in K.unsupported(K.Layout(64, 32, 2, 2, 12))
    assert "zero-point sums" in K.unsupported(K.Layout(128, 16, 2, 2, 8))
    # D 256 with G 16: 8 key blocks per tile of query scales is over Metal's 32 KB
    big = K.Layout(256, 16, 2, 2, 2)
    assert K.unsupported(big, "cuda") is None and "bytes" in K.unsupported(big, "metal")
    c = KIVICache(np.array([[2, 2]]), group_size=48, window=0, sinks=0)
    c.fused = True
    k = mx.zeros((1, 1, 1, 96))
    c.update_and_fetch(k, k)
    assert c.attention_path == "reference"  # and it says so
    c.fused_attention(mx.zeros((1, 1, 1, 96)), scale=1.0)
    assert c.last_attention == "reference"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_generated_metal_sources_are_well_formed(layout):
    spec = LAYOUTS[layout]
    for kb, vb in sorted({tuple(b) for b in spec["head_bits"]}):
        lay = K.Layout(spec["d"], spec["group_size"], kb, vb, spec["gq"])
        src = K.partial_kernel_source(lay)
        ins = ["float16", "int32", "uint32", "float16", "float16", "uint32", "float16"]
        ins += ["float16"] * 7 + ["int32", "float32"]
        assert check_metal_source(src, ins, ["float32"] * 3) == []
        assert K.threadgroup_bytes(lay) <= K.THREADGROUP_LIMIT["metal"]
    src = K.combine_kernel_source(spec["d"], spec["gq"], mx.bfloat16)
    assert (
        check_metal_source(src, ["float32", "float32", "float32", "int32", "int32"], ["bfloat16"])
        == []
    )


@needs_cxx
def test_threadgroup_bytes_are_those_of_the_generated_source():
    for spec in LAYOUTS.values():
        kb, vb = spec["head_bits"][0]
        lay = K.Layout(spec["d"], spec["group_size"], kb, vb, spec["gq"])
        ins = ["float32", "int32", "uint32", "float16", "float16", "uint32", "float16"]
        ins += ["float16"] * 7 + ["int32", "float32"]
        for mma in (False, True) if K.mma_takes(lay) is None else (False,):
            lib = emu.build(K.partial_kernel_source(lay, mma), "cuda", ins, ["float32"] * 3)
            assert emu.threadgroup_bytes(lib) == K.threadgroup_bytes(lay, mma), (lay, mma)


# ------------------------------------------------------------------ 3. contract


def test_an_unattended_fused_update_is_a_clear_error_and_keeps_every_token():
    rng = np.random.default_rng(6)
    a, b = _pair([[2, 2]], window=8, sinks=2)
    k = mx.array(_keys(rng, 1, 60, 64))
    a.update_and_fetch(k, k)
    b.update_and_fetch(k, k)  # its attention never runs
    with pytest.raises(RuntimeError, match="never followed by its attention"):
        b.update_and_fetch(k[:, :, :1], k[:, :, :1])
    a.update_and_fetch(k[:, :, :1], k[:, :, :1])
    b.fused = False
    b.update_and_fetch(k[:, :, :1], k[:, :, :1])
    # the refused call changed nothing; the update before it was kept whole
    assert b.offset == a.offset and b.n_quantized == a.n_quantized > 0
    for x, y in ((a.window_keys, b.window_keys), (a.sink_keys, b.sink_keys)):
        assert mx.array_equal(x, y).item()
    with pytest.raises(RuntimeError, match="no update to attend over"):
        b.fused_attention(mx.zeros((1, 1, 1, 64)), scale=1.0)


def test_shallow_copies_do_not_share_flushes():
    # BatchedCache.merge / extract and mlx-lm's prompt cache copy caches shallowly: a flush in
    # one copy must not reach the other's store
    rng = np.random.default_rng(7)
    a = KIVICache(np.array([[2, 4], [3, 2]]), group_size=32, window=8, sinks=2)
    k = mx.array(_keys(rng, 2, 50, 64))
    a.update_and_fetch(k, k)
    before = [np.array(x) for x in a.resident_arrays()]
    b = copy.copy(a)
    b.update_and_fetch(k, k)  # flushes into b's store
    assert b.n_quantized > a.n_quantized == 32
    after = [np.array(x) for x in a.resident_arrays()]
    assert len(after) == len(before)
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))


@pytest.mark.parametrize("default", [False, True])
def test_make_cache_fuses_by_the_environment(default, smollm2, monkeypatch):
    # KERNELS_DEFAULT True (the default since the H200 run): auto fuses where MLX runs on a GPU;
    # False would make the fused path opt-in (VELOXQUANT_FUSED=1) everywhere
    from veloxquant.methods import kivi

    monkeypatch.setattr(kivi, "KERNELS_DEFAULT", default)
    model, _ = smollm2
    on_gpu = vk.backend() is not None
    for value, want in (("1", True), ("0", False), ("auto", default and on_gpu)):
        monkeypatch.setenv("VELOXQUANT_FUSED", value)
        for config in MODEL_CONFIGS.values():
            assert {c.fused for c in make_cache(model, config)} == {want}
    assert os.environ["VELOXQUANT_FUSED"] == "auto"


@pytest.mark.parametrize("routed", [True, False])
def test_a_loaded_state_fuses_only_once_its_attention_is_seen_routed(
    routed, smollm2, eval_text, monkeypatch, tmp_path
):
    # a prompt cache loaded in a process that fuses has no model to ask whether its attention
    # is routed: its first update runs transient (right under any attention); it fuses from
    # the next one only if that update's attention came through the dispatch
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from veloxquant import attention

    model, tok = smollm2
    ids = tok.encode(eval_text)[:204]
    config = MODEL_CONFIGS["kivi-2"]
    ref = _model_caches(model, config, False, monkeypatch)
    model(mx.array([ids[:200]]), cache=ref)
    path = str(tmp_path / "kivi.safetensors")
    save_prompt_cache(path, ref)
    monkeypatch.setenv("VELOXQUANT_FUSED", "1")
    loaded = load_prompt_cache(path)
    assert all(c.fused for c in loaded) and attention.installed()
    if not routed:  # the model's attention now calls mlx-lm's own function, not the dispatch
        attention.uninstall()
    diffs = []
    for i in range(200, 204):
        x = mx.array([[ids[i]]])
        want, got = model(x, cache=ref), model(x, cache=loaded)
        diffs.append(mx.abs(want - got).max().item())
    assert diffs[0] == 0.0  # the probing update is the transient path's, bit for bit
    if routed:
        assert all(c.fused and c.last_attention == "reference" for c in loaded)
        assert 0.0 < max(diffs) < 0.2  # the twin from the second token on (near-ties: above)
    else:
        assert diffs == [0.0] * 4  # transient throughout, no error
        assert not any(c.fused for c in loaded)
