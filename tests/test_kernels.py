"""VecInfer's fused decode attention (methods/vecinfer/kernels.py, veloxquant/attention.py).

Three layers of checks, all on the real model with a real (tiny) calibration:
1. the pure-MLX twin of the kernels, routed in through mlx-lm's attention call, against the
   transient path (decode every code, then mlx-lm's attention): same codes, same logits, same
   greedy tokens;
2. the generated CUDA and Metal kernel sources, run on the CPU by tests/kernel_emulator.py,
   against the twin on the same cache (decode attention over several splits, and the encoder);
3. the dispatch's contract: which path a cache takes, and the clear errors when it cannot.
On a GPU (MLX's CUDA or Metal backend) benchmarks/bench_kernels.py runs the same comparisons on
the real kernels; its results are in benchmarks/results/.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from tests import kernel_emulator as emu
from veloxquant import KVCacheConfig, attention, make_cache
from veloxquant.calibrate import calibrate
from veloxquant.codes import unpack_codes
from veloxquant.kernels import KernelSource, backend, check_metal_source
from veloxquant.kernels import cuda_multiprocessors as driver_multiprocessors  # conftest stubs it
from veloxquant.kernels import cuda_shared_memory as driver_shared_memory  # ... and this
from veloxquant.methods.vecinfer import VecInferCache
from veloxquant.methods.vecinfer import kernels as K

needs_cxx = pytest.mark.skipif(emu.CXX is None, reason="no C++ compiler for the kernel emulator")


@pytest.fixture(scope="module")
def bundle(calib_dir, smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("kernels")
    calibrate(
        "vecinfer",
        calib_dir / "activations",
        smollm2_dir,
        root / "bundle",
        progress=False,
        iters=4,
        max_vectors=4096,
    )
    return root / "bundle"


@pytest.fixture(scope="module")
def prompt(smollm2, eval_text):
    _, tok = smollm2
    return mx.array(tok.encode(eval_text)[:700])[None]


def _caches(model, config, fused: bool, monkeypatch) -> list:
    monkeypatch.setenv("VELOXQUANT_FUSED", "1" if fused else "0")
    caches = make_cache(model, config)
    assert all(c.fused == fused for c in caches)
    return caches


def _prefill(model, caches, tokens: mx.array, chunk: int = 256) -> mx.array:
    for s in range(0, tokens.shape[1], chunk):
        logits = model(tokens[:, s : s + chunk], cache=caches)
        mx.eval(logits)
    return logits[:, -1]


CONFIGS = {
    # the calibrated default layout: d2b6 keys, d4b8 layer-shared values, key/value means,
    # value scales
    "calibrated": {},
    # upstream's uncentred d4b8 Gaussian codebooks, no value transform, a short window
    "uncalibrated-d4b8": {"uncalibrated": True, "window": 8, "sinks": 1},
    # more exact tokens (sinks, window, the new one) than a tile of the partial kernel: its
    # exact threadgroup walks them in two tiles
    "calibrated-long-window": {"window": 140},
}


def _config(name: str, bundle) -> KVCacheConfig:
    kw = dict(CONFIGS[name])
    if not kw.pop("uncalibrated", False):
        return KVCacheConfig(method="vecinfer", artifact_dir=str(bundle), **kw)
    opts = {"key_sub_dim": 4, "key_bits": 8, "value_sub_dim": 4, "value_bits": 8}
    return KVCacheConfig(method="vecinfer", uncalibrated=True, options=opts, **kw)


# ------------------------------------------------------------------ 1. twin vs transient


# how fused caches attend on this machine's CPU: the CPU extension's kernel where it is built
CPU_FUSED = "cpu-kernel" if K.cpu_kernels.available() else "reference"


# every configuration on the CPU kernel (where the extension is built; the twin elsewhere), and
# the calibrated one on the twin too (what a mask array, and a CPU without the extension, take)
@pytest.mark.parametrize(
    "name, cpu_kernel",
    [(name, True) for name in sorted(CONFIGS)] + [("calibrated", False)],
    ids=[f"{name}-cpu-kernel" for name in sorted(CONFIGS)] + ["calibrated-twin"],
)
def test_fused_twin_matches_transient_path_on_the_real_model(
    name, cpu_kernel, smollm2, bundle, prompt, monkeypatch
):
    model, _ = smollm2
    monkeypatch.setattr(K, "CPU_KERNEL", cpu_kernel)
    cpu_path = CPU_FUSED if cpu_kernel else "reference"
    config = _config(name, bundle)
    ref = _caches(model, config, False, monkeypatch)
    fused = _caches(model, config, True, monkeypatch)
    # prefill in chunks (the twin or the CPU kernel, with a causal mask), then greedy decode
    # (one query)
    la, lb = _prefill(model, ref, prompt), _prefill(model, fused, prompt)
    assert all(c.last_attention == cpu_path for c in fused)
    assert all(c.last_attention == "transient" for c in ref)
    for step in range(64):  # 64 greedy tokens, the same on both paths
        # float32 rounding of two algebraically equal sums, compounded over 30 layers and
        # 700 tokens, is ~1e-3 on logits of ~20 after prefill and drifts over 64 steps (each
        # token's keys carry it, and a drifted value may flip a near-tie code: about 0.1% of
        # the codes differ from the transient path's by step 40, on the twin and the CPU
        # kernel alike): measured 0.23 with the default d4b8 values, up to 0.80 on the twin
        # with the uncalibrated codebooks, and 2.01 at step 47 (0.017 at step 0) on the CPU
        # kernel with them; a wrong term in the algebra is O(1) at step 0, and the tokens
        # must agree at every step
        atol = 5e-2 if step == 0 else 3.0
        np.testing.assert_allclose(np.array(lb), np.array(la), atol=atol, rtol=0)
        tok = mx.argmax(la, axis=-1)
        assert mx.array_equal(tok, mx.argmax(lb, axis=-1)), step
        la = model(tok[:, None], cache=ref)[:, -1]
        lb = model(tok[:, None], cache=fused)[:, -1]
        mx.eval(la, lb)
    # decode: the real kernels where MLX runs on a GPU, the twin or the CPU kernel on the CPU
    decode_path = "kernel" if backend() else cpu_path
    assert all(c.last_attention == decode_path for c in fused)
    for i, (a, b) in enumerate(zip(ref, fused, strict=True)):
        assert a.offset == b.offset and a.key_codes.shape == b.key_codes.shape
        # layer 0's prompt keys are the model's input projections, so its codes are the same;
        # deeper layers' keys carry the rounding above, which may flip a near-tie code
        n = prompt.shape[1] - a.window - a.sinks
        kb, vb = a.key_bits, a.value_bits
        ka = np.array(unpack_codes(a.key_codes[:, :, :n], kb, 64 // a.key_sub_dim))
        kf = np.array(unpack_codes(b.key_codes[:, :, :n], kb, 64 // a.key_sub_dim))
        va = np.array(unpack_codes(a.value_codes[:, :, :n], vb, 64 // a.value_sub_dim))
        vf = np.array(unpack_codes(b.value_codes[:, :, :n], vb, 64 // a.value_sub_dim))
        floor = 1.0 if i == 0 else 0.98
        assert (ka == kf).mean() >= floor and (va == vf).mean() >= floor, i
        # the ring, back in order: a misordered ring is O(1) off almost everywhere, while the
        # drift above moves some of the newest tokens' deep-layer keys by up to ~0.15 (more
        # with OpenBLAS's generic kernels than with OPENBLAS_CORETYPE=Haswell)
        diff = np.abs(np.array(a.window_keys) - np.array(b.window_keys))
        assert (diff <= 0.05).mean() >= 0.9 and diff.max() < 0.5, (i, diff.max())
    # resident bytes: the fused cache's growth buffer holds at most CODE_STEP spare tokens
    spare = sum(b.nbytes - a.nbytes for a, b in zip(ref, fused, strict=True))
    per_token = sum(a.key_codes[0, :, :1].nbytes + a.value_codes[0, :, :1].nbytes for a in ref)
    assert 0 <= spare < VecInferCache.CODE_STEP * per_token

    # one layer in isolation on the same contents (the transient cache's, copied onto the
    # fused path): both paths against float64 attention over the transient K/V
    from veloxquant.attention import _original

    rng = np.random.default_rng(0)
    for a in ref:
        h, d = a.smooth.shape
        b = copy.copy(a)
        b.fused = True
        k, v = (mx.array(rng.normal(size=(1, h, 1, d)).astype(np.float32)) for _ in range(2))
        q = mx.array(rng.normal(size=(1, 3 * h, 1, d)).astype(np.float32) * 2)
        ka, va = a.update_and_fetch(k, v)
        want = _original(q, ka, va, cache=a, scale=d**-0.5, mask=None)
        b.update_and_fetch(k, v)
        got = b.fused_attention(q, scale=d**-0.5)
        q64 = np.array(q, np.float64).reshape(h, 3, d) * d**-0.5
        s64 = np.einsum("hgd,htd->hgt", q64, np.array(ka, np.float64)[0])
        p64 = np.exp(s64 - s64.max(-1, keepdims=True))
        o64 = np.einsum("hgt,htd->hgd", p64 / p64.sum(-1, keepdims=True), np.array(va)[0])
        o64 = o64.reshape(1, 3 * h, 1, d)
        for out in (want, got):
            np.testing.assert_allclose(np.array(out), o64, atol=1e-5 * np.abs(o64).max())


# ------------------------------------------------------ 2. the kernel sources, emulated


def _pending_after_one_token(caches: list, layer: int, seed: int, steps: int = 0):
    """`steps` fused one-token decode steps of `layer` (update, then its attention), then one
    more update; returns (cache, that update's pending attention, a query)."""
    c = caches[layer]
    h, d = c.smooth.shape
    rng = np.random.default_rng(seed)

    def one():
        return [mx.array(rng.normal(size=(1, h, 1, d)).astype(np.float32)) for _ in range(2)]

    for _ in range(steps):
        c.update_and_fetch(*one())
        mx.eval(c.fused_attention(mx.repeat(one()[0], 3, axis=1), scale=0.125))
    c.update_and_fetch(*one())
    pending, c._pending = c._pending, None
    q = mx.array(rng.normal(size=(1, 3 * h, 1, d)).astype(np.float32) * 2)
    return c, pending, q


def _emulated_attention(
    backend: str, cache, q, pending, r: int, launches: int = 2, reverse: bool = False
):
    """(output [1, H_q, 1, D], the leaving token's (key, value) codes or None, the window ring
    (keys, values) after the launch), as `K.launch_attention` computes them, with the kernels
    run by the emulator: the partial and the combine, or with `launches` 1 the one-launch
    kernel (its threadgroups run in descending order with `reverse`, so that a coded split,
    not the exact threadgroup, is the last to finish). In place (K.WRITE_IN_PLACE), the codes
    are read back from the code buffers the launch wrote, at row pending["n_coded"]; every
    other row must be unchanged."""
    a = K.attention_inputs(
        cache, q, 1 / math.sqrt(q.shape[-1]), pending, r=r, one_launch=launches == 1
    )
    lay = a["layout"]
    if launches == 1:
        return _emulated_one_launch(backend, a, q, pending, reverse)
    partial, second = a["sources"]  # what launch_attention launches
    fresh = K.attention_kernel_sources(lay, mx.float32, r)
    if a["encode"]:
        win_dtype = pending["win"][0].dtype if a["in_place"] else None
        fresh = (fresh[0], K.combine_encode_kernel_source(lay, mx.float32, win_dtype))
    assert (partial.kernel_name, second.kernel_name) == tuple(k.kernel_name for k in fresh)
    n_q, d = q.shape[1], q.shape[3]
    shapes = K.part_shapes(a, n_q, d)
    parts = emu.run(
        partial, backend, [np.array(x) for x in a["partial"]], a["groups"], shapes, ["float32"] * 3
    )
    extra = [np.array(x) for x in a["combine_extra"]]
    if not a["encode"]:
        (out,) = emu.run(second, backend, parts + extra, (n_q, 1, 1), [(n_q * d,)], ["float32"])
        return out.reshape(1, n_q, 1, d), None, None
    h = lay.n_kv_heads
    ring = extra[3:5]  # the combine's k_in / v_in
    if a["in_place"]:
        kbuf, vbuf = extra[-4:-2]
        before = [x.copy() for x in (kbuf, vbuf)]
        (out,) = emu.run(second, backend, parts + extra, (n_q + h, 1, 1), [(n_q * d,)], ["float32"])
        codes = _written_row(kbuf, vbuf, before, pending["n_coded"])
        return out.reshape(1, n_q, 1, d), codes, ring
    out, kc, vc = emu.run(
        second,
        backend,
        parts + extra,
        (n_q + h, 1, 1),
        [(n_q * d,), (1, h, 1, lay.key_bytes), (1, h, 1, lay.value_bytes)],
        ["float32", "uint8", "uint8"],
    )
    return out.reshape(1, n_q, 1, d), (kc, vc), ring


def _emulated_one_launch(backend: str, a: dict, q, pending, reverse: bool):
    (src,) = a["sources"]
    assert src.name == "vq_vecinfer_attn_one_launch"
    n_q, d = q.shape[1], q.shape[3]
    shapes = [K.one_launch_shapes(a, n_q, d)[0], (n_q * d,)]
    ins = [np.array(x) for x in a["partial"]]
    at = {name: ins[i] for i, name in enumerate(src.inputs)}
    before = [at[name].copy() for name in ("key_codes", "value_codes", "win_k", "win_v")]
    pack = at["layer_pack"].copy()
    _, out = emu.run(src, backend, ins, a["groups"], shapes, ["float32"] * 2, reverse=reverse)
    # the pack as it was: every launch leaves the count (in it) at zero for the next
    np.testing.assert_array_equal(at["layer_pack"], pack)
    if not a["encode"]:
        for name, old in zip(("key_codes", "value_codes", "win_k", "win_v"), before, strict=True):
            np.testing.assert_array_equal(at[name], old)
        return out.reshape(1, n_q, 1, d), None, None
    codes = _written_row(at["key_codes"], at["value_codes"], before[:2], pending["n_coded"])
    return out.reshape(1, n_q, 1, d), codes, (at["win_k"], at["win_v"])


def _written_row(kbuf, vbuf, before: list, row: int) -> tuple:
    """The (key, value) codes an in-place launch wrote at `row` of the code buffers, after
    checking that every other row is as `before`."""
    for buf, old in zip((kbuf, vbuf), before, strict=True):
        np.testing.assert_array_equal(np.delete(buf, row, axis=2), np.delete(old, row, axis=2))
    return kbuf[:, :, row : row + 1], vbuf[:, :, row : row + 1]


def _one_launch_tolerance(lay: K.Layout, r: int, want: np.ndarray) -> dict:
    """How close the one launch's output must come to the two launches' (or the twin's): the
    same sums in another order (1e-5), or, with its coded tokens on the tensor cores, f16
    operands (q~, the phase coefficients and table, the probabilities: each within 2^-11 of
    its value; the output moved by up to ~7e-4 of its scale here). A wrong fragment, dim or
    pair moves it by 0.1-1.5 of its scale (tried); a token counted or dropped at a block's
    edge is caught bit for bit instead (`test_tensor_core_kernel_needs_whole_blocks...`)."""
    if K.mma_takes(lay, r):
        return {"rtol": 0, "atol": 2e-3 * max(1.0, np.abs(want).max())}
    return {"rtol": 1e-5, "atol": 1e-6}


def _code_agreement(got: np.ndarray, want: mx.array, bits: int, n_sub: int) -> float:
    got_codes = np.array(unpack_codes(mx.array(got), bits, n_sub))
    return float((got_codes == np.array(unpack_codes(want, bits, n_sub))).mean())


@needs_cxx
# both sources in place (the default); the slice-update variant (the same source but its last
# writes) on one of them; and CUDA's one-launch kernel against the two launches, its coded
# tokens on the CUDA cores (the default) and on the tensor cores (MMA; two launches have no
# such variant)
@pytest.mark.parametrize(
    "backend,in_place,launches,mma",
    [
        ("cuda", True, 2, False),
        ("metal", True, 2, False),
        ("cuda", False, 2, False),
        ("cuda", True, 1, False),
        ("cuda", True, 1, True),
    ],
)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_emulated_decode_kernels_match_the_twin(
    backend, name, in_place, launches, mma, smollm2, bundle, prompt, monkeypatch
):
    model, _ = smollm2
    caches = _caches(model, _config(name, bundle), True, monkeypatch)
    _prefill(model, caches, prompt)
    monkeypatch.setattr(K, "MIN_SPLIT", 128)  # several splits from a short context
    monkeypatch.setattr(K, "WRITE_IN_PLACE", in_place)
    monkeypatch.setattr(K, "MMA", mma)
    for layer, r, steps in ((0, 1, 3), (7, 2, 5)):  # 2: K.TOKENS_PER_THREAD; 4 below
        # decode steps first, so the ring has turned: the token leaving the window is not in
        # slot 0 (the slot and the position are checked against the cache's own counters)
        c = caches[layer]
        want_slot = (c._ring + steps) % c.window
        want_pos = c.sinks + c.compressed_tokens + steps
        c, pending, q = _pending_after_one_token(caches, layer, seed=layer, steps=steps)
        assert pending["encode"] == (want_slot, want_pos) and want_slot != 0
        lay = K.layout_of(c, q.shape[1])
        assert lay.unsupported() is None
        assert K.attention_inputs(c, q, 1.0, pending, r=r)["n_splits"] >= 2
        ref = np.array(K.reference_attention(c, q, 1 / math.sqrt(q.shape[-1]), None, pending))
        slot, pos = pending["encode"]
        wk, wv = (np.array(x) for x in pending["win"])
        c._reserve_codes(1)  # as fused_attention does before an in-place launch
        reverse = layer > 0  # the one launch: a coded split finishes last, or the exact group
        out, codes, ring = _emulated_attention(backend, c, q, pending, r, launches, reverse)
        assert np.isfinite(out).all()
        tol = {"atol": 1e-4 * max(1.0, np.abs(ref).max()), "rtol": 0}
        if launches == 1:  # the two launches' output (their combine sums a head's weights
            # serially, the one launch's by a SIMD group), codes and ring to the bit
            assert K.mma_takes(lay, r) is mma  # the real model's layouts take either path
            two = _emulated_attention(backend, c, q, pending, r, 2)
            np.testing.assert_allclose(out, two[0], **_one_launch_tolerance(lay, r, two[0]))
            for got, want in zip((*codes, *ring), (*two[1], *two[2]), strict=True):
                np.testing.assert_array_equal(got, want)
            tol = tol if not mma else _one_launch_tolerance(lay, r, ref)
        np.testing.assert_allclose(out, ref, **tol)
        # the window was full: the same launch encoded the token leaving it (ring slot, at its
        # absolute position) as the cache's encoder does
        old_k, old_v = (mx.array(x[:, :, slot : slot + 1]).astype(mx.float32) for x in (wk, wv))
        d = lay.head_dim
        kc, vc = codes
        # float32 sums in another order may flip a near-tie code (one of ~100 here); a wrong
        # token or position agrees on a few percent
        assert (
            _code_agreement(kc, c.encode_keys(old_k, pos), lay.key_bits, d // lay.key_sub_dim)
            > 0.97
        )
        want_v = c.encode_values(old_v)
        assert _code_agreement(vc, want_v, lay.value_bits, d // lay.value_sub_dim) > 0.97
        if in_place:  # and wrote the new token over its ring slot, nothing else
            for got, old, new in zip(ring, (wk, wv), pending["new"], strict=True):
                np.testing.assert_array_equal(
                    got[:, :, slot], np.array(new.astype(mx.float32)).astype(got.dtype)[:, :, 0]
                )
                np.testing.assert_array_equal(np.delete(got, slot, 2), np.delete(old, slot, 2))
        else:
            for got, old in zip(ring, (wk, wv), strict=True):
                np.testing.assert_array_equal(got, old)
        # without a token to encode, the plain combine (the attention does not read the slot's
        # new contents: the ring as it was before this launch)
        plain = {**pending, "encode": None, "win": tuple(mx.array(x) for x in (wk, wv))}
        out2, none, _ = _emulated_attention(backend, c, q, plain, r, launches, reverse)
        assert none is None
        np.testing.assert_array_equal(out2, out)


# Layouts the real model's caches do not have: (head_dim, query heads per KV head, key
# (bits, sub_dim), value (bits, sub_dim)). Codes that cross 32-bit words (keys of 5 bits, values
# of 6 and 10), one query head per KV head and G * D below a tile, the smallest and the largest
# head_dim, and every sub_dim of keys and values; and the default layout at Llama-3-8B's shape,
# whose G * D is a whole tile's worth of float4s for the merge.
OTHER_LAYOUTS = [
    (128, 4, (6, 2), (8, 4)),
    (128, 1, (6, 2), (6, 1)),
    (32, 5, (4, 4), (10, 2)),
    (256, 2, (8, 4), (8, 4)),
    (64, 4, (5, 1), (8, 4)),
]


def _random_cache(layout: tuple, window: int = 20, h: int = 2) -> tuple:
    """A fused VecInferCache of `layout` (as OTHER_LAYOUTS) with random transforms and
    codebooks, 3 sinks, and its `normal(*shape, scale)` for random inputs."""
    import mlx.nn as nn

    from veloxquant.rope import RopeSpec

    d, g, (kb, kd), (vb, vd) = layout
    rng = np.random.default_rng(d + g)

    def normal(*shape, scale=1.0):
        return mx.array((rng.normal(size=shape) * scale).astype(np.float32))

    c = VecInferCache(
        mx.array(rng.uniform(0.5, 2.0, (h, d)).astype(np.float32)),
        normal(h, 2**kb, kd),
        normal(1, 2**vb, vd, scale=0.5),
        key_bits=kb,
        key_sub_dim=kd,
        value_bits=vb,
        value_sub_dim=vd,
        hadamard=True,
        window=window,
        sinks=3,
        key_mean=normal(h, d, scale=2.0),
        value_mean=normal(h, d, scale=0.5),
        rope=RopeSpec.from_module(nn.RoPE(d, base=10000.0), d),
        value_smooth=mx.array(rng.uniform(0.5, 2.0, (h, d)).astype(np.float32)),
    )
    c.fused = True
    return c, normal


@needs_cxx
@pytest.mark.parametrize("backend", ["cuda", "metal"])
@pytest.mark.parametrize("layout", OTHER_LAYOUTS, ids=lambda x: f"d{x[0]}g{x[1]}")
def test_emulated_decode_kernels_match_the_twin_on_other_layouts(backend, layout, monkeypatch):
    d, g, (kb, kd), (vb, vd) = layout
    h = 2
    c, normal = _random_cache(layout, h=h)
    n = 700  # several splits of one whole or partial tile at r = 1 and 4 (MIN_SPLIT 128),
    # then two splits of three tiles each at r = 1 (MIN_SPLIT 384): the tiles of a split
    # carry its running softmax and phase coefficients from one to the next
    c.update_and_fetch(normal(1, h, n, d, scale=2.0), normal(1, h, n, d))
    mx.eval(c.fused_attention(normal(1, h * g, n, d), scale=0.1))
    c.update_and_fetch(normal(1, h, 1, d, scale=2.0), normal(1, h, 1, d))
    pending, c._pending = c._pending, None
    assert pending["encode"] is not None
    q = normal(1, h * g, 1, d, scale=2.0)
    lay = K.layout_of(c, h * g)
    assert lay.unsupported(backend) is None
    assert lay.value_bits == vb and lay.group == g
    monkeypatch.setattr(K, "MMA", True)
    c._reserve_codes(1)
    for r, min_split in ((1, 128), (4, 128), (1, 384)):
        monkeypatch.setattr(K, "MIN_SPLIT", min_split)
        n_splits = K.attention_inputs(c, q, 1.0, pending, r=r)["n_splits"]
        assert n_splits >= 2
        assert (-(-pending["n_coded"] // n_splits) > 2 * K.TILE * r) is (min_split == 384)
        ref = np.array(K.reference_attention(c, q, 1 / math.sqrt(d), None, pending))
        plain = {**pending, "encode": None}
        out, _, _ = _emulated_attention(backend, c, q, plain, r)
        np.testing.assert_allclose(out, ref, atol=1e-4 * max(1.0, np.abs(ref).max()), rtol=0)
        if backend == "cuda" and d <= K.TILE:  # one launch, in either order, its merge
            # taking the splits 2 at a time (several chunks), with and without the encode
            chunk = K.COMBINE_CHUNK
            monkeypatch.setattr(K, "COMBINE_CHUNK", 2)
            one, _, _ = _emulated_attention(backend, c, q, plain, r, 1, reverse=r == 4)
            one_e = _emulated_attention(backend, c, q, pending, r, 1, reverse=r == 1)
            # the merge's rows as scalars, not float4s: the same sums in the same order
            assert K.COMBINE_FLOAT4
            monkeypatch.setattr(K, "COMBINE_FLOAT4", False)
            one_scalar, _, _ = _emulated_attention(backend, c, q, plain, r, 1, reverse=r == 4)
            monkeypatch.setattr(K, "COMBINE_FLOAT4", True)
            np.testing.assert_array_equal(one_scalar, one)
            assert K.mma_takes(lay, r)  # these layouts take the tensor cores ...
            monkeypatch.setattr(K, "MMA", False)  # ... and the CUDA cores without them
            one_fma, _, _ = _emulated_attention(backend, c, q, plain, r, 1, reverse=r == 4)
            monkeypatch.setattr(K, "MMA", True)
            monkeypatch.setattr(K, "COMBINE_CHUNK", chunk)
            np.testing.assert_allclose(one, out, **_one_launch_tolerance(lay, r, out))
            np.testing.assert_allclose(one_fma, out, rtol=1e-5, atol=1e-6)
            two_e = _emulated_attention(backend, c, q, pending, r, 2)
            np.testing.assert_allclose(one_e[0], two_e[0], **_one_launch_tolerance(lay, r, out))
            for got, want in zip((*one_e[1], *one_e[2]), (*two_e[1], *two_e[2]), strict=True):
                np.testing.assert_array_equal(got, want)


def _rope_step(layout: tuple, traditional: bool, llama3: bool = False) -> tuple:
    """A random cache of `layout` (2 KV heads) with RoPE (nn.RoPE's from a base, or with
    `llama3` Llama-3's scaled frequencies), 300 tokens attended, then one decode update whose
    key the model rotated: (cache, its pending step with room for the leaving token's codes, the
    same with the step's unrotated query and key (`rotate`), the rotated query)."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE

    from veloxquant.rope import RopeSpec

    d, g = layout[:2]
    h = 2
    c, normal = _random_cache(layout, h=h)
    if llama3:
        scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        scaling["original_max_position_embeddings"] = 64
        rope = Llama3RoPE(d, traditional=traditional, base=10000.0, scaling_config=scaling)
    else:
        rope = nn.RoPE(d, traditional=traditional, base=10000.0)
    c.rope = RopeSpec.from_module(rope, d)
    assert (c.rope.freqs is not None) is llama3
    c.update_and_fetch(normal(1, h, 300, d, scale=2.0), normal(1, h, 300, d))
    mx.eval(c.fused_attention(normal(1, h * g, 300, d), scale=0.1))
    pos = c.offset
    k_pre, v = normal(1, h, 1, d, scale=2.0), normal(1, h, 1, d)
    c.update_and_fetch(c.rope.apply(k_pre, pos), v)
    pending, c._pending = c._pending, None
    q_pre = normal(1, h * g, 1, d, scale=2.0)
    q_rot = c.rope.apply(q_pre, pos)
    c._reserve_codes(1)
    return c, pending, {**pending, "rotate": (q_pre, k_pre, pos)}, q_rot


@needs_cxx
@pytest.mark.parametrize(
    "traditional, llama3", [(False, False), (True, False), (False, True)],
    ids=["halves", "traditional", "llama3-freqs"],
)  # fmt: skip
@pytest.mark.parametrize("mma", [False, True], ids=["cuda-cores", "tensor-cores"])
@pytest.mark.parametrize("layout", [OTHER_LAYOUTS[0], OTHER_LAYOUTS[2]], ids=["d128", "d32"])
def test_one_launch_rotates_the_step_s_own_query_and_key(
    layout, mma, traditional, llama3, monkeypatch
):
    # With the model's rope tapped, a decode step hands the one-launch kernel its query and new
    # key unrotated, with their position (pending["rotate"]). The launch must give what it gives
    # on the rows mx.fast.rope rotated: the output (to float32 rounding of the rotation, or the
    # tensor cores' f16 operands), the leaving token's codes, and the ring row it writes (the
    # rotated key, to a float16 step of the row's largest element: the rotation cancels), every
    # other ring row untouched.
    # (the RoPE table takes a base's frequencies as exp2f of the base, a model's own from the
    # layer pack: `_ROPE_IN_TABLE`)
    c, pending, rotate, q_rot = _rope_step(layout, traditional, llama3)
    h, g = 2, layout[1]
    monkeypatch.setattr(K, "MMA", mma)
    monkeypatch.setattr(K, "MIN_SPLIT", 128)  # several splits
    r = K.TOKENS_PER_THREAD
    assert K.attention_inputs(c, q_rot, 1.0, rotate, r=r, one_launch=True)["rope_in"]
    assert not K.attention_inputs(c, q_rot, 1.0, pending, r=r, one_launch=True)["rope_in"]
    want = _emulated_attention("cuda", c, q_rot, pending, r, 1, reverse=True)
    got = _emulated_attention("cuda", c, q_rot, rotate, r, 1, reverse=True)
    lay = K.layout_of(c, h * g)
    assert K.mma_takes(lay, r) is mma
    scale = max(1.0, np.abs(want[0]).max())
    tol = _one_launch_tolerance(lay, r, want[0]) if mma else {"rtol": 0, "atol": 1e-5 * scale}
    np.testing.assert_allclose(got[0], want[0], **tol)
    for got_codes, want_codes in zip(got[1], want[1], strict=True):
        np.testing.assert_array_equal(got_codes, want_codes)
    slot = pending["encode"][0]
    for got_ring, want_ring in zip(got[2], want[2], strict=True):
        np.testing.assert_array_equal(np.delete(got_ring, slot, 2), np.delete(want_ring, slot, 2))
        row = want_ring[:, :, slot].astype(np.float32)
        step = 2**-10 * np.abs(row).max(axis=-1, keepdims=True)
        assert (np.abs(got_ring[:, :, slot].astype(np.float32) - row) <= step).all()


_ROPE_ROWS = """
  VQ_SHARED float s_rope[D];
  if ((int)vq_tid < D) s_rope[vq_tid] = table[vq_tid];
  VQ_BARRIER();
  for (int i = (int)vq_tid; i < ROWS * D; i += D) {
    out[i] = vq_rope_in<float, D, TRAD>(x + (i / D) * D, i % D, s_rope);
  }
"""


def _round_f32(exact: Fraction) -> np.float32:
    """`exact` rounded once to float32, to nearest, ties to even."""
    near = np.float32(float(exact))
    steps = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(steps, key=lambda f: (abs(Fraction(float(f)) - exact), int(f.view(np.uint32)) & 1))


@needs_cxx
@pytest.mark.parametrize("traditional", [False, True], ids=["halves", "traditional"])
def test_the_kernel_s_rotation_rounds_where_mlx_s_cuda_rope_does(traditional):
    # The one-launch kernel's rotation (vq_rope_in) must give the model's rotated rows bit for
    # bit: MLX 0.32.4's CUDA rope kernels compute fma(x1, c, -(x2 s)) and fma(x1, s, x2 c) (their
    # SASS), each rounded once to float32. Left to the compiler, x1 s + x2 c became
    # fma(x2, c, x1 s) in NVRTC's code, a float32 rounding away on about a third of the
    # elements. Float32 rows and a table of arbitrary cosines and sines show every rounding.
    d, rows = 64, 6
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    table = rng.uniform(-1, 1, d).astype(np.float32)  # D/2 cosines, then D/2 sines
    src = KernelSource(name="rope_probe", inputs=("x", "table"), outputs=("out",),
                         body=_ROPE_ROWS, constants={"D": d, "ROWS": rows, "TRAD": traditional},
                         threads=d, helpers=K._ROPE_IN_HELPER, backends=("cuda",))  # fmt: skip
    (got,) = emu.run(src, "cuda", [x, table], (1, 1, 1), [(rows * d,)], ["float32"])
    got = got.reshape(rows, d)

    def fma(a, b, c) -> np.float32:  # a * b + c, rounded once
        return _round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))

    want, other = np.empty_like(x), np.empty_like(x)
    for i in range(rows):
        for n in range(d):
            first = n % 2 == 0 if traditional else n < d // 2
            mate = n ^ 1 if traditional else (n + d // 2 if first else n - d // 2)
            j = n // 2 if traditional else min(n, mate)
            x1, x2 = (x[i, n], x[i, mate]) if first else (x[i, mate], x[i, n])
            c, s = table[j], table[d // 2 + j]
            if first:
                want[i, n] = fma(x1, c, -fma(x2, s, 0))
                other[i, n] = fma(-x2, s, fma(x1, c, 0))
            else:
                want[i, n] = fma(x1, s, fma(x2, c, 0))
                other[i, n] = fma(x2, c, fma(x1, s, 0))
    assert (other != want).mean() > 0.1  # the inputs tell the two contractions apart
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mma", [False, True], ids=["cuda-cores", "tensor-cores"])
def test_the_launch_rotates_only_where_its_rope_table_fits(mma, monkeypatch):
    # the rotating launch holds a RoPE table in threadgroup memory (4·D bytes more); where that
    # passes CUDA's static limit the step keeps the model's rotation. The tensor-core kernel's
    # arrays are dynamic shared memory, sized to fit the card (`_mma_value_copies`): it rotates
    # wherever it runs at all (its compact arrays within the limit, `mma_takes`)
    c, _, rotate, q_rot = _rope_step(OTHER_LAYOUTS[0], False)
    monkeypatch.setattr(K, "MMA", mma)
    lay = K.layout_of(c, q_rot.shape[1])
    r = K.TOKENS_PER_THREAD
    plain = K.threadgroup_bytes(lay, r, True)
    assert K.threadgroup_bytes(lay, r, True, True) == plain + 4 * lay.head_dim
    cases = [(plain + 4 * lay.head_dim - 1, False), (plain + 4 * lay.head_dim, True)]
    if mma:
        assert plain > 49152  # the 8B shape's conflict-free value book on the timed card
        cases = [(K._mma_compact_bytes(lay, r), True), (plain + 4 * lay.head_dim, True)]
    for limit, rotates in cases:
        monkeypatch.setitem(K.THREADGROUP_LIMIT, "cuda", limit)
        a = K.attention_inputs(c, q_rot, 1.0, rotate, r=r, one_launch=True)
        assert (a["rope_in"], a["in_place"]) == (rotates, True)
        assert a["sources"][0].name == "vq_vecinfer_attn_one_launch"


def test_a_step_s_launch_inputs_follow_switches_flipped_between_steps(monkeypatch):
    # attention_inputs keeps what the kind of step decides (kernels, in place, rotation, the
    # layer pack) on the cache (_step_kind); a module switch flipped between two steps of the
    # same cache must give what a cache that never saw the other setting gives
    c, _, rotate, q_rot = _rope_step(OTHER_LAYOUTS[0], False)

    def inputs(scale=1.0):
        a = K.attention_inputs(c, q_rot, scale, rotate, one_launch=True)
        kinds = (a["rope_in"], a["in_place"], a["groups"], a["encode"])
        names = [src.kernel_name for src in a["sources"]]
        arrays = [np.array(x.astype(mx.float32)) for x in a["partial"] + a["combine_extra"]]
        return kinds, names, arrays

    settings = [
        {},
        {"ROPE_IN_KERNEL": False},
        {"MMA": False},
        {"WRITE_IN_PLACE": False},
        {"COMBINE_FLOAT4": False},
        {"COMBINE_LOADS4": 8},
        {"KEY_ROWS_AHEAD": False},
        {"MMA_MIN_THREADGROUPS": 0},
        {"scale": 0.5},
    ]
    seen = set()
    for setting in settings + settings[::-1]:
        with monkeypatch.context() as m:
            for name, value in setting.items():
                if name != "scale":
                    m.setattr(K, name, value)
            warm = inputs(setting.get("scale", 1.0))  # the memo holds every other setting
            memo = c.__dict__.pop("_kernel_memo")
            fresh = inputs(setting.get("scale", 1.0))
            c._kernel_memo = memo
        assert warm[:2] == fresh[:2], setting
        for got, want in zip(warm[2], fresh[2], strict=True):
            np.testing.assert_array_equal(got, want)
        seen.add((warm[0], tuple(warm[1]), tuple(x.tobytes() for x in warm[2])))
    assert len(seen) == len(settings)  # each setting a launch of its own


_BARRIER_PROBE = """
  VQ_SHARED float s_x[64];
  s_x[vq_tid] = x[vq_tid];
  if (vq_tid < LIVE) VQ_BARRIER();
  y[vq_tid] = s_x[63 - vq_tid] + vq_simd_sum(x[vq_tid]);
"""


@needs_cxx
@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_the_emulator_runs_threads_to_their_barriers_and_stops_at_a_divergent_one(backend):
    """The emulator's threads are fibers that run until they wait at a barrier: what a thread
    wrote before the threadgroup's barrier every thread reads after it, and a SIMD group's sum
    waits for its 32 lanes. A barrier that only some threads reach (a hang or undefined on a
    GPU) stops the process with a message, here a child's."""
    import subprocess
    import sys

    import veloxquant.kernels as vk

    x = np.arange(64, dtype=np.float32)
    whole = vk.KernelSource(
        name="probe", inputs=("x",), outputs=("y",), body=_BARRIER_PROBE, threads=64
    )
    (y,) = emu.run(dataclasses.replace(whole, constants={"LIVE": 64}), backend, [x], (1, 1, 1),
                   [(64,)], ["float32"])  # fmt: skip
    sums = np.repeat([x[:32].sum(), x[32:].sum()], 32)
    np.testing.assert_array_equal(y, x[::-1] + sums)
    child = f"""
import dataclasses, numpy as np, veloxquant.kernels as vk
from tests import kernel_emulator as emu
from tests.test_kernels import _BARRIER_PROBE
src = vk.KernelSource(name="probe", inputs=("x",), outputs=("y",), body=_BARRIER_PROBE,
                      threads=64, constants={{"LIVE": 32}})
emu.run(src, "{backend}", [np.zeros(64, np.float32)], (1, 1, 1), [(64,)], ["float32"])
print("returned")
"""
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=root)
    assert res.returncode != 0 and "returned" not in res.stdout
    assert "kernel emulator: a barrier that some threads of the threadgroup have left" in res.stderr


@needs_cxx
@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_emulated_encode_kernel_matches_the_cache_encoder(
    backend, smollm2, bundle, prompt, monkeypatch
):
    model, _ = smollm2
    caches = _caches(model, _config("calibrated", bundle), False, monkeypatch)
    _prefill(model, caches, prompt[:, :300])
    c = caches[3]
    src_k = c.window_keys.astype(mx.float32)  # real keys and values of the model
    src_v = c.window_values.astype(mx.float32)
    first, n, pos = 2, 20, 5000  # rows 2..21 at a far position: RoPE of the mean matters
    lay = K.layout_of(c, c.smooth.shape[0])
    h = lay.n_kv_heads
    kc, vc = emu.run(
        K.encode_kernel_source(lay),
        backend,
        [np.array(x) for x in K.encode_inputs(c, src_k, src_v, first, n, pos)],
        (n, h, 1),
        [(1, h, n, lay.key_bytes), (1, h, n, lay.value_bytes)],
        ["uint8", "uint8"],
    )
    want_k = c.encode_keys(src_k[:, :, first : first + n], pos)
    want_v = c.encode_values(src_v[:, :, first : first + n])
    d = lay.head_dim
    for got, want, bits, sub in (
        (kc, want_k, lay.key_bits, lay.key_sub_dim),
        (vc, want_v, lay.value_bits, lay.value_sub_dim),
    ):
        # float32 sums in another order may flip an exact near-tie, nothing more
        assert _code_agreement(got, want, bits, d // sub) >= 0.998


def _emulated_launch(source, inputs, grid, output_shapes, output_dtypes):
    """`veloxquant.kernels.launch` with the emulator for the GPU: the kernel gets numpy views
    of the MLX arrays' own memory, so its in-place writes land in the cache's buffers as a
    GPU's do (and, as with MLX's copy of a non-contiguous input, are lost on a strided one)."""
    mx.eval(inputs)
    arrays = [np.array(x, copy=False) for x in inputs]
    names = [str(dt).rsplit(".", 1)[-1] for dt in output_dtypes]
    outs = emu.run(source, "cuda", arrays, grid, [tuple(s) for s in output_shapes], names)
    return [mx.array(o) for o in outs]


def _recording(run, names: list):
    """emu.run, appending each launched kernel's name to `names`."""

    def recorded(source, *a, **kw):
        names.append(source.name)
        return run(source, *a, **kw)

    return recorded


def _emulated_launcher(source, input_dtypes):
    """`veloxquant.kernels.launcher` with the emulator for the GPU."""
    return lambda *args: _emulated_launch(source, *args)


@needs_cxx
@pytest.mark.parametrize("one_launch,mma", [(True, False), (False, False), (True, True)])
def test_cache_kernel_path_writes_the_cache_in_place(
    one_launch, mma, smollm2, bundle, prompt, monkeypatch
):
    # The cache's own decode path with the kernels (launches emulated, writing into the
    # cache's buffers in place as on a GPU) against a copy of the cache on the twin, step for
    # step: the ring turns, the code buffers grow (CODE_STEP 8 here, 16 for the tensor cores'
    # whole blocks), and every output, the coded count, the codes and the window stay the
    # twin's. With one launch per step (CUDA's default), the finished-threadgroup count is the
    # cache's own buffer, kept across steps.
    import veloxquant.kernels as vk

    model, _ = smollm2
    monkeypatch.setattr(K, "CPU_KERNEL", False)  # the twin is the oracle
    monkeypatch.setattr(VecInferCache, "CODE_STEP", 16 if mma else 8)
    monkeypatch.setattr(K, "ONE_LAUNCH", one_launch)
    monkeypatch.setattr(K, "MMA", mma)
    launched = []
    monkeypatch.setattr(emu, "run", _recording(emu.run, launched))
    caches = _caches(model, _config("calibrated", bundle), True, monkeypatch)
    _prefill(model, caches, prompt[:, :120])
    kern = caches[5]
    twin = copy.copy(kern)  # buffers of its own
    h, d = kern.smooth.shape
    rng = np.random.default_rng(0)
    for _ in range(20):
        k, v = (mx.array(rng.normal(size=(1, h, 1, d)).astype(np.float32)) for _ in range(2))
        q = mx.array(rng.normal(size=(1, 3 * h, 1, d)).astype(np.float32) * 2)
        twin.update_and_fetch(k, v)
        want = np.array(twin.fused_attention(q, scale=0.125))
        assert twin.last_attention == "reference"
        with monkeypatch.context() as m:
            m.setattr(vk, "backend", lambda: "cuda")
            m.setattr(vk, "launch", _emulated_launch)
            m.setattr(vk, "launcher", _emulated_launcher)
            kern.update_and_fetch(k, v)
            got = np.array(kern.fused_attention(q, scale=0.125))
            assert kern.last_attention == "kernel" and kern._last_write is not None
        lay = K.layout_of(kern, 3 * h)
        tol = {"atol": 1e-4 * max(1.0, np.abs(want).max()), "rtol": 0}
        tol = _one_launch_tolerance(lay, K.TOKENS_PER_THREAD, want) if mma else tol
        np.testing.assert_allclose(got, want, **tol)
    assert K.mma_takes(lay) is mma
    assert kern.compressed_tokens == twin.compressed_tokens == 120 - 4 - 26 + 20
    assert kern._kbuf.shape[2] == 112  # grown in CODE_STEPs on the way
    for side in ("window_keys", "window_values"):
        assert mx.array_equal(getattr(kern, side), getattr(twin, side)).item()
    assert kern._last_write is None  # reading the window waited for the last write
    one = "vq_vecinfer_attn_one_launch"
    assert launched.count(one) == (20 if one_launch else 0)
    assert launched.count("vq_vecinfer_attn_partial") == (0 if one_launch else 20)
    lay = K.layout_of(kern, 3 * h)
    agree = _code_agreement(np.array(kern.key_codes), twin.key_codes, lay.key_bits, d // 2)
    assert agree > 0.97
    agree = _code_agreement(np.array(kern.value_codes), twin.value_codes, lay.value_bits, d // 4)
    assert agree > 0.97


@needs_cxx
def test_deferring_the_rotation_changes_nothing_but_the_graph(smollm2, bundle, prompt, monkeypatch):
    # With rope.DEFER the tapped rope builds no rope op for a cache whose kernel rotates; the
    # kernel gets the same unrotated rows either way, so the logits, codes and window must be
    # bit for bit those of copies of the caches that do build them (DEFER off).
    import veloxquant.kernels as vk
    from veloxquant import rope
    from veloxquant.rope import DeferredPosition

    model, _ = smollm2
    monkeypatch.setattr(VecInferCache, "CODE_STEP", 16)
    caches = _caches(model, _config("calibrated", bundle), True, monkeypatch)
    try:
        token = mx.argmax(_prefill(model, caches, prompt[:, :100]), axis=-1)[:, None]
        copies = [copy.copy(c) for c in caches]
        with monkeypatch.context() as m:
            m.setattr(vk, "backend", lambda: "cuda")
            m.setattr(vk, "launch", _emulated_launch)
            m.setattr(vk, "launcher", _emulated_launcher)
            for step in range(2):  # the caches' second step deferred
                m.setattr(rope, "DEFER", True)
                got = model(token, cache=caches)[:, -1]
                m.setattr(rope, "DEFER", False)
                want = model(token, cache=copies)[:, -1]
                assert all(isinstance(c.offset, DeferredPosition) for c in caches)
                assert not any(isinstance(c.offset, DeferredPosition) for c in copies)
                assert {c.last_rope for c in caches + copies} == {"kernel"}
                assert mx.array_equal(got, want).item(), step
                token = mx.argmax(want, axis=-1)[:, None]
        for c, twin in zip(caches, copies, strict=True):
            assert mx.array_equal(c.key_codes, twin.key_codes).item()
            assert mx.array_equal(c.window_keys, twin.window_keys).item()
    finally:
        attention.uninstall()


def test_rows_handed_on_unrotated_are_rotated_on_every_other_path():
    # A cache whose offset defers (rope.DeferredPosition) gets its step's query and key from
    # the model's tapped rope unrotated. Where no kernel rotates them, the cache rotates them
    # with the model's own module: the pure-MLX twin's output, and the ring row an unattended
    # update leaves, must be those of the rows the module rotated.
    import mlx.nn as nn

    from veloxquant.rope import DeferredPosition, RopeSpec, RopeTap

    layout = OTHER_LAYOUTS[0]
    d, g = layout[:2]
    h = 2
    module = nn.RoPE(d, base=10000.0)
    tap = RopeTap(module)
    arms = []
    for deferring in (True, False):
        c, normal = _random_cache(layout, h=h)
        c.rope = RopeSpec.from_module(module, d)
        c.update_and_fetch(normal(1, h, 300, d, scale=2.0), normal(1, h, 300, d))
        mx.eval(c.fused_attention(normal(1, h * g, 300, d), scale=0.1))
        if deferring:
            c.offset = DeferredPosition(c.offset)
        pos = int(c.offset)
        q, k, v = normal(1, h * g, 1, d), normal(1, h, 1, d), normal(1, h, 1, d)
        q_in, k_in = tap(q, offset=c.offset), tap(k, offset=c.offset)
        assert (q_in is q and k_in is k) is deferring  # handed on unrotated, or rotated
        c.update_and_fetch(k_in, v)
        assert (c._pending["deferral"] is not None) is deferring
        out = c.fused_attention(q_in, scale=0.1)
        assert c.last_attention == CPU_FUSED
        slot = (c._ring - 1) % c.window  # the new token's ring slot
        ring = c._wk[:, :, slot]
        # an update whose attention never runs: the cache keeps the rotated key, then raises
        for _ in range(2):
            if deferring:
                c.offset = DeferredPosition(c.offset)
            k_in = tap(k, offset=c.offset)
            assert (k_in is k) is deferring
            if c._pending is None:
                c.update_and_fetch(k_in, v)
                continue
            with pytest.raises(RuntimeError, match="never followed by its attention"):
                c.update_and_fetch(k_in, v)
        left = c._wk[:, :, (c._ring - 1) % c.window]
        if deferring:  # a query changed between the rope and the attention: refused
            twin = copy.copy(c)
            twin.offset = DeferredPosition(twin.offset)
            twin.update_and_fetch(tap(k, offset=twin.offset), v)
            with pytest.raises(RuntimeError, match="changed the query"):
                twin.fused_attention(tap(q, offset=twin.offset) * 1.0, scale=0.1)
            assert twin._pending is None  # and the cache kept the key, rotated
            np.testing.assert_array_equal(
                np.array(twin._wk[:, :, (twin._ring - 1) % twin.window]),
                np.array(module(k, offset=int(twin.offset) - 1).astype(twin._wk.dtype))[:, :, 0],
            )
        # the transient path (fused off): the cache rotates the key, mlx-lm's attention
        # (through the dispatch) the query
        c.fused = False
        if deferring:
            c.offset = DeferredPosition(c.offset)
        q_in, k_in = tap(q, offset=c.offset), tap(k, offset=c.offset)
        keys, values = c.update_and_fetch(k_in, v)
        transient = attention.dispatch(q_in, keys, values, cache=c, scale=0.1, mask=None)
        arms.append((out, ring, left, transient, pos))
    (
        (out, ring, left, transient, pos),
        (want_out, want_ring, want_left, want_transient, want_pos),
    ) = arms
    np.testing.assert_array_equal(np.array(transient), np.array(want_transient))
    assert pos == want_pos
    np.testing.assert_array_equal(np.array(out), np.array(want_out))
    np.testing.assert_array_equal(np.array(ring), np.array(want_ring))
    np.testing.assert_array_equal(np.array(left), np.array(want_left))
    np.testing.assert_array_equal(
        np.array(want_ring), np.array(module(k, offset=pos).astype(want_ring.dtype))[:, :, 0]
    )


@needs_cxx
def test_a_tapped_model_s_decode_steps_rotate_inside_the_kernel(
    smollm2, bundle, prompt, monkeypatch
):
    # make_cache taps the model's rope modules when it fuses caches that know the model's RoPE
    # (the calibrated key mean): a decode step's query and key then reach the one-launch kernel
    # unrotated and it rotates them (last_rope "kernel"), and from then on the tap hands them
    # on without building the model's rotation. Through the real model, step for step, the
    # logits must be those of copies of the caches whose launches take the model's own
    # rotation (ROPE_IN_KERNEL off), to float32 rounding of the rotation and f16 operands, with
    # the same greedy token; attention.uninstall puts the model's rope modules back.
    import veloxquant.kernels as vk
    from veloxquant.rope import DeferredPosition, RopeTap

    model, _ = smollm2
    monkeypatch.setattr(VecInferCache, "CODE_STEP", 16)
    caches = _caches(model, _config("calibrated", bundle), True, monkeypatch)
    assert all(isinstance(layer.self_attn.rope, RopeTap) for layer in model.layers)
    try:
        logits = _prefill(model, caches, prompt[:, :100])
        copies = [copy.copy(c) for c in caches]
        token = mx.argmax(logits, axis=-1)[:, None]
        with monkeypatch.context() as m:
            m.setattr(vk, "backend", lambda: "cuda")
            m.setattr(vk, "launch", _emulated_launch)
            m.setattr(vk, "launcher", _emulated_launcher)
            # step 1 on: the caches' offsets defer (the tap hands the rows on unrotated and
            # builds no rotation); step 2: a deferred step whose kernel does not rotate (the
            # switch off for the caches too), so the cache rotates with the model's module
            for step in range(3):
                rotate_in_kernel = step != 2
                assert all(isinstance(c.offset, DeferredPosition) for c in caches) is (step > 0)
                m.setattr(K, "ROPE_IN_KERNEL", rotate_in_kernel)
                got = model(token, cache=caches)[:, -1]
                assert {c.last_rope for c in caches} == {"kernel" if rotate_in_kernel else "model"}
                m.setattr(K, "ROPE_IN_KERNEL", False)
                want = model(token, cache=copies)[:, -1]
                m.setattr(K, "ROPE_IN_KERNEL", True)
                assert {c.last_rope for c in copies} == {"model"}
                scale = float(mx.abs(want).max())
                np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-3 * scale)
                assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item()
                token = mx.argmax(want, axis=-1)[:, None]
        for c, twin in zip(caches, copies, strict=True):
            assert mx.array_equal(c.key_codes, twin.key_codes).item()
    finally:
        attention.uninstall()
    assert not any(isinstance(layer.self_attn.rope, RopeTap) for layer in model.layers)


def test_splits_fill_one_wave_of_the_gpu_s_multiprocessors(monkeypatch):
    """One decode query's splits aim for GROUPS_PER_MULTIPROCESSOR threadgroups per CUDA
    multiprocessor, as counted by the driver: 528 on an H100 / H200's 132 (the count timed
    there), one wave on a card with fewer, where 528 would leave a fifth of a wave running alone.
    An int TARGET_GROUPS overrides it; Metal keeps 528, KIVI 8 per multiprocessor."""
    import veloxquant.kernels as vk
    import veloxquant.methods.kivi.kernels as kivi

    assert K.TARGET_GROUPS is None and kivi.TARGET_GROUPS is None
    monkeypatch.setattr(vk, "backend", lambda: "metal")
    assert K.target_groups() == 528
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    n_coded, h = 65536 - 132, 8
    for sms in (132, 108, 142):
        monkeypatch.setattr(vk, "cuda_multiprocessors", lambda n=sms: n)
        slots = K.GROUPS_PER_MULTIPROCESSOR * sms
        assert K.target_groups() == slots
        groups = (-(-n_coded // K.split_tokens(n_coded, h, 2)) + 1) * h  # + the exact group
        assert 0.9 * slots < groups <= slots, (sms, groups)
        tiles = kivi.split_tiles(n_coded // 32, 32, h)
        groups = -(-(n_coded // 32 * 32) // kivi.TILE // tiles) * h
        assert groups <= kivi.GROUPS_PER_MULTIPROCESSOR * sms
    monkeypatch.setattr(K, "TARGET_GROUPS", 1056)
    assert K.target_groups() == 1056
    # the driver's count and shared memory: positive ints on a CUDA machine, else an error
    # that names the fix
    for ask in (driver_multiprocessors, lambda: min(driver_shared_memory()) + 1):
        try:
            assert ask() > 0
        except RuntimeError as e:
            assert "TARGET_GROUPS" in str(e)


@pytest.mark.parametrize(
    "card, sms, shared, vecinfer, kivi_cores, kivi_tensor",
    [  # threadgroups per multiprocessor the card's shared memory holds (228 / 164 / 100 KB)
        ("H100", 132, 233472, 4, 6, 4),
        ("A100", 108, 167936, 3, 6, 4),
        ("RTX 4090", 128, 102400, 2, 4, 2),
    ],
)
def test_splits_fit_the_card_s_shared_memory(
    card, sms, shared, vecinfer, kivi_cores, kivi_tensor, monkeypatch
):
    """One wave is as many threadgroups as a multiprocessor holds at once: the launch bounds'
    count (4 for VecInfer's one launch, KIVI's 6 or 4), or fewer where the card's shared memory
    holds fewer of the kernel's threadgroups (43 KB for the 8B shape's VecInfer layout with the
    compact value book, which such cards keep): aimed at 4, an A100 would run a quarter of them
    in a second wave, an RTX 4090 half."""
    import veloxquant.kernels as vk
    import veloxquant.methods.kivi.kernels as kivi

    c, normal = _random_cache(OTHER_LAYOUTS[0])  # the 8B shape's default layout
    h, d = c.smooth.shape
    c.update_and_fetch(normal(1, h, 300, d), normal(1, h, 300, d))
    mx.eval(c.fused_attention(normal(1, h, 300, d), scale=0.1))
    monkeypatch.setattr(vk, "backend", lambda: "cuda")  # a CUDA card's decode step, from here
    monkeypatch.setattr(vk, "cuda_multiprocessors", lambda: sms)
    monkeypatch.setattr(vk, "cuda_shared_memory", lambda: (shared, 1024))
    c.update_and_fetch(normal(1, h, 1, d), normal(1, h, 1, d))
    c._reserve_codes(1)
    r = K.TOKENS_PER_THREAD
    lay = K.layout_of(c, 4 * h)
    nbytes = K.threadgroup_bytes(lay, r, True)
    # the 8B shape's arrays: 43 KB with 8 copies of the value book; with its 16 conflict-free
    # copies 56 KB (over CUDA's 48 KB of static arrays: dynamic shared memory), where 4 such
    # threadgroups, RoPE table included, still fit the card (an H100's 228 KB)
    assert K.mma_takes(lay, r)
    if vecinfer == 4:
        assert nbytes > 49152 and 4 * (nbytes + 4 * d + 1024) <= shared
    else:
        assert 40000 < nbytes < 45000
    assert K.target_groups(nbytes) == vecinfer * sms
    assert K.target_groups() == K.GROUPS_PER_MULTIPROCESSOR * sms  # no bytes: the bounds
    # a decode step aims its splits at the one-launch kernel's own threadgroup bytes
    asked = []
    monkeypatch.setattr(K, "target_groups", lambda b=0: asked.append(b) or 528)
    a = K.attention_inputs(c, normal(1, 4 * h, 1, d), 0.1, c._pending)
    assert len(a["sources"]) == 1 and asked == [nbytes]
    # KIVI's partial launches, on the CUDA cores and on the tensor cores (2-bit keys and values)
    klay = kivi.Layout(head_dim=128, group_size=32, key_bits=2, value_bits=2, queries_per_kv=4)
    n_blocks, heads = 65536 // 32, 8
    for mma, per, bound in ((False, kivi_cores, 6), (True, kivi_tensor, 4)):
        tiles = kivi.split_tiles(
            n_blocks, 32, heads, None, bound, kivi.threadgroup_bytes(klay, mma)
        )
        assert -(-n_blocks * 32 // kivi.TILE // tiles) * heads <= per * sms
        assert kivi.split_tiles(n_blocks, 32, heads, per * sms) == tiles, card


def test_each_launch_takes_the_cache_s_previous_output(monkeypatch):
    # MLX orders kernels only by the arrays they take: the one-launch kernel counts its
    # threadgroups in the cache's own buffer, so two launches of one cache must never run at
    # once, and each takes the previous one's output (`after`), encoding or not (here the
    # window is still filling, so no step encodes and nothing is written in place).
    import veloxquant.kernels as vk

    launched = []

    def recording_launcher(source, input_dtypes):
        def run(inputs, grid, output_shapes, output_dtypes):
            launched.append(dict(zip(source.inputs, inputs, strict=True)))
            return [mx.zeros(s, t) for s, t in zip(output_shapes, output_dtypes, strict=True)]

        return run

    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    monkeypatch.setattr(vk, "launcher", recording_launcher)
    c, normal = _random_cache(OTHER_LAYOUTS[0], window=64)
    h, d = c.smooth.shape
    c.update_and_fetch(normal(1, h, 40, d), normal(1, h, 40, d))
    mx.eval(c.fused_attention(normal(1, h, 40, d), scale=0.1))  # the twin (a prefill)
    outs = []
    for _ in range(3):
        c.update_and_fetch(normal(1, h, 1, d), normal(1, h, 1, d))
        outs.append(c.fused_attention(normal(1, h, 1, d), scale=0.1))
        assert c.last_attention == "kernel" and c._last_write is None
    assert all(a["layer_pack"] is launched[0]["layer_pack"] for a in launched)  # one count
    assert launched[0]["after"].shape == (8,)  # no launch before: a placeholder
    assert launched[1]["after"] is outs[0] and launched[2]["after"] is outs[1]
    twin = copy.copy(c)
    r = K.TOKENS_PER_THREAD
    assert K.layer_pack(c, h, r, 0.1) is launched[0]["layer_pack"]
    assert K.layer_pack(twin, h, r, 0.1) is not K.layer_pack(c, h, r, 0.1)  # a count of its own


def test_tensor_core_kernel_needs_whole_blocks_of_code_rows(monkeypatch):
    # the tensor-core kernel reads whole 16-token blocks of code rows: buffers set whole (a
    # saved state's) are refused by name, and the cache regrows them to CODE_STEP steps
    monkeypatch.setattr(K, "MMA", True)
    c, normal = _random_cache(OTHER_LAYOUTS[0])
    h, d = c.smooth.shape
    c.update_and_fetch(normal(1, h, 300, d), normal(1, h, 300, d))
    mx.eval(c.fused_attention(normal(1, h, 300, d), scale=0.1))
    kc, vc = np.array(c.key_codes), np.array(c.value_codes)
    assert kc.shape[2] % 16  # 300 - 3 sinks - 20 in the window
    c.key_codes, c.value_codes = mx.array(kc), mx.array(vc)  # buffers of exactly that size
    c.update_and_fetch(normal(1, h, 1, d), normal(1, h, 1, d))
    pending = c._pending
    with pytest.raises(ValueError, match="not a multiple of 16"):
        K.attention_inputs(c, normal(1, h, 1, d), 0.1, pending, one_launch=True)
    c._reserve_codes(0)
    assert c._kbuf.shape[2] == c._vbuf.shape[2] == c.CODE_STEP * 2
    np.testing.assert_array_equal(np.array(c.key_codes), kc)
    np.testing.assert_array_equal(np.array(c.value_codes), vc)
    a = K.attention_inputs(c, normal(1, h, 1, d), 0.1, pending, one_launch=True)
    assert a["n_splits"] >= 1 and K.mma_takes(a["layout"], a["r"])
    # the rows past the last token (here within its 16-token block, and whole blocks after
    # it) are read but count for nothing: the same output to the bit whatever they hold
    monkeypatch.setattr(K, "MIN_SPLIT", 128)  # two splits, the last one short
    n, q = kc.shape[2], normal(1, h, 1, d, scale=2.0)
    plain = {**pending, "encode": None}
    outs = []
    for fill in (0, 255):
        for name in ("_kbuf", "_vbuf"):
            buf = getattr(c, name)
            rest = mx.full((1, h, buf.shape[2] - n, buf.shape[3]), fill, mx.uint8)
            setattr(c, name, mx.concatenate([buf[:, :, :n], rest], axis=2))
        outs.append(_emulated_attention("cuda", c, q, plain, K.TOKENS_PER_THREAD, 1)[0])
    assert K.attention_inputs(c, q, 0.1, plain, one_launch=True)["n_splits"] == 2
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("mma", [False, True])
def test_layer_pack_holds_the_cache_s_constants(mma, monkeypatch):
    # the one-launch kernel reads a layer's constants from one buffer: each segment must hold
    # the cache's array bit for bit, at the offset the kernel source is compiled with
    monkeypatch.setattr(K, "MMA", mma)
    c, _ = _random_cache(OTHER_LAYOUTS[0])
    h, d = c.smooth.shape
    r, scale = K.TOKENS_PER_THREAD, 0.25
    lay = K.layout_of(c, 2 * h)
    assert K.mma_takes(lay, r) is mma
    segments = K.pack_segments(lay)
    before = c.nbytes
    pack = np.array(K.layer_pack(c, 2 * h, r, scale)).view(np.uint8)
    assert pack.size == 4 * segments["end"][0] == c.nbytes - before  # resident, so counted
    const = K.layer_constants(c, r)
    want = {
        "fparams": np.array(
            [scale * K.LOG2E, const["rscale"], math.log2(c.rope.base)] + [0] * 5, np.float32
        ),
        "counter": np.zeros(8, np.uint32),
        "key_book": np.array(c.key_codebook),
        "value_book": np.array(c.value_codebook),
        "smooth": np.array(c.smooth),
        "key_mean": np.array(c.key_mean),
        "value_smooth": np.array(c.value_smooth),
        "value_mean": np.array(c.value_mean),
        "inv_freq": np.array(const["inv_freq"]),
    }
    if mma:  # the tensor cores' phase operand instead of the CUDA cores' table
        want["phase_frags"] = K.phase_fragments(c.rope, lay, r)
        want["poly_frags"] = K.poly_fragments(c.rope, lay, r)
        want["slot_pairs"] = K.phase_slot_pairs(lay).astype(np.int32)
        assert lay.poly_pairs > 0  # this RoPE has slow pairs: the table is packed too
        assert want["poly_frags"].shape == (-(-lay.poly_pairs // 8), 32, 4)
        assert segments["phase_table"][1] == 0
    else:
        want["phase_table"] = np.array(const["table"])
        assert segments["phase_frags"][1] == 0
    src = K.one_launch_kernel_source(lay, mx.float16, mx.float16, r)
    for name, x in want.items():
        off, n, dtype = segments[name]
        assert off % 4 == 0 and src.constants[f"OFF_{name.upper()}"] == off
        assert x.dtype == np.dtype(K.PACK_TYPES[dtype]) and x.size <= n
        got = pack[4 * off : 4 * off + x.nbytes].view(x.dtype)
        np.testing.assert_array_equal(got, x.reshape(-1))
    # a cache whose arrays do not match its layout is refused by name, not packed short
    c2, _ = _random_cache(OTHER_LAYOUTS[0])
    K.layout_of(c2, 2 * h)
    c2.smooth = c2.smooth[:1]
    with pytest.raises(ValueError, match="smooth has"):
        K.layer_pack(c2, 2 * h, r, scale)


def _layout(**kw) -> K.Layout:
    """The 8B shape's default layout (d2b6 keys per head, d4b8 shared values, Llama-3's RoPE
    base: 31 slow pairs in the phase polynomial), changed by kw."""
    base = dict(head_dim=128, n_kv_heads=8, group=4, key_bits=6, key_sub_dim=2, value_bits=8)
    base.update(value_sub_dim=4, key_books=8, value_books=1, hadamard=True, center=True)
    base.update(value_mean=True, value_smooth=True, rope_traditional=False, poly_pairs=31)
    return K.Layout(**{**base, **kw})


# the default layout and three others: a 64-dim head, one-dim 4-bit keys with 7 query heads per
# KV head (the most threadgroup memory), no key mean
LAYOUT_CHANGES = [
    {},
    {"head_dim": 64, "group": 3, "poly_pairs": 13},
    {"key_sub_dim": 1, "key_bits": 4, "group": 7},
    {"center": False, "group": 5, "poly_pairs": 0},
]


@needs_cxx
@pytest.mark.parametrize("changes", LAYOUT_CHANGES)
def test_threadgroup_bytes_are_those_of_the_generated_sources(changes, monkeypatch):
    # Layout.unsupported() refuses layouts over THREADGROUP_LIMIT by these two counts, so they
    # must be the arrays the sources declare (read back from the compiled emulator library)
    lay = _layout(**changes)
    partial, _ = K.attention_kernel_sources(lay, mx.float16, K.TOKENS_PER_THREAD)
    lib = emu.build(partial, "cuda", ["float32"] * len(partial.inputs), ["float32"] * 3)
    assert emu.threadgroup_bytes(lib) == K.threadgroup_bytes(lay, K.TOKENS_PER_THREAD)
    for src in (K.encode_kernel_source(lay), K.combine_encode_kernel_source(lay, mx.float16)):
        outs = ["float32"] * len(src.outputs)
        lib = emu.build(src, "metal", ["float32"] * len(src.inputs), outs)
        assert emu.threadgroup_bytes(lib) == K.encode_threadgroup_bytes(lay)
    for mma in (False, True):  # the one launch: the partial's arrays and its count flag, or
        # its tensor-core variant's
        monkeypatch.setattr(K, "MMA", mma)
        if lay.head_dim > K.TILE:
            continue
        assert K.mma_takes(lay) is mma
        # and, rotating the step's query and key itself, its RoPE table
        for rope_in in (False, True) if lay.center else (False,):
            one = K.one_launch_kernel_source(lay, mx.float16, mx.float16, rope_in=rope_in)
            ins = ["float16", "int32", "uint8", "uint8", "uint32"] + ["float16"] * 7
            lib = emu.build(one, "cuda", ins, ["float32"] * 2)
            want = K.threadgroup_bytes(lay, K.TOKENS_PER_THREAD, True, rope_in)
            assert emu.threadgroup_bytes(lib) == want


def test_the_tensor_cores_follow_the_switch_and_the_threadgroup_limit(monkeypatch):
    """mma_takes is memoised (a decode step asks per layer); the answer still follows MMA and
    CUDA's threadgroup limit as they change."""
    lay = K.Layout(128, 8, 4, 6, 2, 8, 4, 64, 1, True, True, True, True, False)
    r = K.TOKENS_PER_THREAD
    monkeypatch.setattr(K, "MMA", True)
    assert K.mma_takes(lay, r)
    # the phase polynomial's pairs are chosen for tiles of up to POLY_TOKENS tokens
    slow = dataclasses.replace(lay, poly_pairs=31)
    assert K.mma_takes(slow, K.POLY_TOKENS // K.TILE)
    assert K.mma_takes(lay, 2 * K.POLY_TOKENS // K.TILE)
    assert not K.mma_takes(slow, 2 * K.POLY_TOKENS // K.TILE)
    need = K._mma_compact_bytes(lay, r)  # the conflict-free value book only where it fits
    monkeypatch.setitem(K.THREADGROUP_LIMIT, "cuda", need - 1)
    assert not K.mma_takes(lay, r)
    monkeypatch.setitem(K.THREADGROUP_LIMIT, "cuda", need)
    assert K.mma_takes(lay, r)
    assert not K.mma_takes(dataclasses.replace(lay, group=16), r)  # more heads than mma's N
    monkeypatch.setattr(K, "MMA", False)
    assert not K.mma_takes(lay, r)


def test_layouts_over_the_threadgroup_limit_are_refused(monkeypatch):
    import veloxquant.kernels as vk

    def takes(lay: K.Layout, which: str) -> bool:
        monkeypatch.setattr(vk, "backend", lambda: which)
        return K.kernels_take(SimpleNamespace(_kernel_memo={9: lay}), 9)

    assert takes(_layout(), "cuda") and takes(_layout(), "metal")
    # Qwen2.5-0.5B's shape (head_dim 64, 7 query heads per KV head): 37 KB, which CUDA's static
    # shared memory holds (48 KB) and an Apple GPU's threadgroup (32 KB) does not
    lay = _layout(head_dim=64, group=7)
    assert takes(lay, "cuda") and not takes(lay, "metal")
    assert "more than metal's 32768" in lay.unsupported() and lay.unsupported("cuda") is None
    # 4096 four-dim key codewords: a 64 KB codebook, copies of it in the partial kernel
    lay = _layout(key_sub_dim=4, key_bits=12)
    assert not takes(lay, "cuda") and not takes(lay, "metal")
    need = K.threadgroup_bytes(lay, K.TOKENS_PER_THREAD)
    assert need > 65536 and f"partial attention kernel needs {need} B" in lay.unsupported("cuda")
    assert K.encode_threadgroup_bytes(lay) > 65536


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_generated_metal_sources_are_well_formed(name, smollm2, bundle, monkeypatch):
    model, _ = smollm2
    c = _caches(model, _config(name, bundle), False, monkeypatch)[0]
    lay = K.layout_of(c, 3 * c.smooth.shape[0])
    partial, combine = K.attention_kernel_sources(lay, mx.float16)
    f32, i32, u8, f16 = "float32", "int32", "uint8", "float16"
    partial_in = [f32, i32, f32, u8, u8, f16, f16, f16, f16, f32, f32] + [f16] * 7
    assert check_metal_source(partial, partial_in, [f32] * 3) == []
    assert check_metal_source(combine, [f32, f32, f32, i32, f16, f16], [f16]) == []
    both = K.combine_encode_kernel_source(lay, mx.float16)
    both_in = [f32, f32, f32, i32, f16, f16] + [f16, f16, f32, f16, f16, f32, f16, f16]
    assert check_metal_source(both, both_in, [f16, u8, u8]) == []
    # in place: the code buffers and the new token are inputs the kernel writes through
    in_place = K.combine_encode_kernel_source(lay, mx.float16, mx.float16)
    assert check_metal_source(in_place, both_in + [u8, u8, f16, f16], [f16]) == []
    body = in_place.metal_body()
    for target in ("uint8_t*>(key_codes)", "uint8_t*>(value_codes)", "WIN_T*>(k_in)"):
        assert f"const_cast<VQ_GLOBAL {target}" in body
    enc_in = [f16, f16, i32, f32, f16, f16, f32, f16, f16, f16, f16]
    assert check_metal_source(K.encode_kernel_source(lay), enc_in, [u8, u8]) == []
    broken = dataclasses.replace(partial, body=partial.body + "\n{")
    assert check_metal_source(broken, partial_in, [f32] * 3) != []


# ------------------------------------------------------------------- 3. the dispatch


def test_path_selection_and_errors(smollm2, bundle, monkeypatch):
    model, _ = smollm2
    config = _config("calibrated", bundle)
    # auto: fused where a kernel runs (a GPU; the CPU with the extension built), else the
    # transient path, not the twin
    monkeypatch.setenv("VELOXQUANT_FUSED", "auto")
    kernel_here = backend() is not None or K.cpu_kernels.available()
    assert all(c.fused == kernel_here for c in make_cache(model, config))
    monkeypatch.setattr(K, "CPU_KERNEL", False)
    assert all(c.fused == (backend() is not None) for c in make_cache(model, config))
    monkeypatch.setattr(K, "CPU_KERNEL", True)
    monkeypatch.setenv("VELOXQUANT_FUSED", "yes please")
    with pytest.raises(ValueError, match="VELOXQUANT_FUSED"):
        make_cache(model, config)

    caches = _caches(model, config, True, monkeypatch)
    assert attention.installed() and attention.routes(model)
    assert all(c.attention_path == ("kernel" if backend() else CPU_FUSED) for c in caches)
    # an update whose attention never came (the model's attention was not routed) fails loudly
    k = mx.zeros((1, 3, 1, 64))
    caches[0].update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match="never followed by its attention"):
        caches[0].update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match="no update to attend over"):
        caches[0].fused_attention(mx.zeros((1, 9, 1, 64)), scale=0.125)

    # a batch of fused caches is attended by mlx-lm on the concatenated rows: transient
    from veloxquant.batch import BatchedCache

    rows = [_caches(model, config, True, monkeypatch)[0] for _ in range(2)]
    BatchedCache(rows)
    assert not any(r.fused for r in rows)


def test_other_methods_read_a_tapped_model_s_own_rope(smollm2, bundle, monkeypatch):
    # fused VecInfer caches with the key mean tap the model's rope modules (rope.RopeTap), by
    # default on the CPU too: CommVQ's caches made afterwards for the same model, and a capture's
    # summary, must still see the model's nn.RoPE (they raised on the tap's class)
    from veloxquant.capture import _model_summary as model_summary
    from veloxquant.methods.commvq.cache import rope_params
    from veloxquant.rope import RopeTap

    model, _ = smollm2
    before = (rope_params(model), model_summary(model)["rope"])
    _caches(model, _config("calibrated", bundle), True, monkeypatch)
    assert isinstance(model.layers[0].self_attn.rope, RopeTap)
    assert (rope_params(model), model_summary(model)["rope"]) == before


@pytest.mark.parametrize("routed", [True, False])
def test_a_loaded_state_fuses_only_once_its_attention_is_seen_routed(
    routed, smollm2, bundle, prompt, monkeypatch, tmp_path
):
    # (as for KIVI in test_kivi_kernels.py) a loaded prompt cache's first update is the
    # transient path's; the cache fuses from the next update only if that update's attention
    # came through the dispatch, and otherwise stays transient instead of attending only its
    # own tokens
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model, _ = smollm2
    ref = _caches(model, _config("calibrated", bundle), False, monkeypatch)
    _prefill(model, ref, prompt[:, :200])
    path = str(tmp_path / "vecinfer.safetensors")
    save_prompt_cache(path, ref)
    monkeypatch.setenv("VELOXQUANT_FUSED", "1")
    loaded = load_prompt_cache(path)
    assert all(c.fused for c in loaded) and attention.installed()
    if not routed:
        attention.uninstall()
    diffs = []
    for i in range(200, 204):
        x = prompt[:, i : i + 1]
        diffs.append(mx.abs(model(x, cache=ref) - model(x, cache=loaded)).max().item())
    assert diffs[0] == 0.0
    if routed:
        assert all(c.fused and c.last_attention == CPU_FUSED for c in loaded)
        assert 0.0 < max(diffs) < 0.2
    else:
        assert diffs == [0.0] * 4 and not any(c.fused for c in loaded)


def test_an_unattended_update_still_keeps_every_token(smollm2, bundle, prompt, monkeypatch):
    # a full window's leaving token is encoded with its attention; when that attention never
    # comes (the error below), the token must still be written, so the cache the user then
    # switches to the transient path holds every token at the right position
    model, _ = smollm2
    caches = _caches(model, _config("calibrated", bundle), True, monkeypatch)
    _prefill(model, caches, prompt[:, :300])
    c = caches[2]
    held = c.compressed_tokens + c.window_keys.shape[2] + c.sink_keys.shape[2]
    assert held == c.offset == 300
    k = mx.zeros((1, 3, 1, 64))
    c.update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match="never followed by its attention"):
        c.update_and_fetch(k, k)
    assert c.compressed_tokens + c.window_keys.shape[2] + c.sink_keys.shape[2] == c.offset == 301


def test_twin_survives_a_piece_the_mask_hides_whole(smollm2, bundle, prompt, monkeypatch):
    # A sliding window hides the oldest coded tokens: with small pieces, the first pieces are
    # masked whole, and a running maximum starting at -inf gave NaN (exp(-inf - -inf)).
    from mlx_lm.models.base import create_causal_mask

    model, _ = smollm2
    caches = _caches(model, _config("calibrated", bundle), True, monkeypatch)
    _prefill(model, caches, prompt[:, :300])
    c = caches[3]
    k = mx.array(np.random.default_rng(0).normal(size=(1, 3, 1, 64)).astype(np.float32))
    c.update_and_fetch(k, k)
    pending = c._pending
    c._pending = None
    q = mx.array(np.random.default_rng(1).normal(size=(1, 9, 1, 64)).astype(np.float32))
    mask = create_causal_mask(1, c.offset - 1, window_size=100)
    whole = np.array(K.reference_attention(c, q, 0.125, mask, pending))
    monkeypatch.setattr(K, "PIECE_TOKENS", 32)
    monkeypatch.setattr(K, "TILE", 32)
    pieces = np.array(K.reference_attention(c, q, 0.125, mask, pending))
    assert np.isfinite(pieces).all()
    np.testing.assert_allclose(pieces, whole, atol=1e-5, rtol=0)


def test_shallow_copies_do_not_share_writes(smollm2, bundle, prompt, monkeypatch):
    # mlx-lm's prompt cache and BatchedCache.merge copy caches shallowly, and the fused path
    # appends codes and writes the window ring in place: two copies decoding on must not
    # write into each other's buffers
    model, _ = smollm2
    caches = _caches(model, _config("calibrated", bundle), True, monkeypatch)
    _prefill(model, caches, prompt[:, :300])
    saved = [copy.copy(c) for c in caches]
    for tok in (5, 6, 7):
        mx.eval(model(mx.array([[tok]]), cache=caches))
    after = [(np.array(c.key_codes), np.array(c.window_keys)) for c in caches]
    for tok in (8, 9):
        mx.eval(model(mx.array([[tok]]), cache=saved))
    for c, s, (kc, wk) in zip(caches, saved, after, strict=True):
        assert c.offset == s.offset + 1
        np.testing.assert_array_equal(np.array(c.key_codes), kc)
        np.testing.assert_array_equal(np.array(c.window_keys), wk)


def test_one_launch_is_cuda_only_and_within_a_tile_of_threads(monkeypatch):
    # The one-launch kernel's threadgroups hand their parts over through a device-scope fence,
    # which Metal lacks: on Metal a step stays two launches, and nothing builds its Metal body;
    # the merge and the encoder take D of the TILE threads, so larger heads take two launches.
    import veloxquant.kernels as vk

    lay = _layout()
    src = K.one_launch_kernel_source(lay, mx.float16, mx.float16)
    assert src.backends == ("cuda",) and "vq_atomic_inc" in src.cuda_body()
    with pytest.raises(ValueError, match="written for cuda only"):
        src.metal_body()
    for which, head_dim, want in (("cuda", 128, True), ("metal", 128, False), ("cuda", 256, False)):
        monkeypatch.setattr(vk, "backend", lambda w=which: w)
        assert K.takes_one_launch(dataclasses.replace(lay, head_dim=head_dim)) is want
        if which == "metal":
            with pytest.raises(ValueError, match="written for cuda only"):
                vk.compiled(src, ("float16",) * len(src.inputs))
    # its arrays (the partial's, grown for the merge and the encoder) over CUDA's limit, where
    # the partial alone fits: two launches
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    two = K.threadgroup_bytes(lay, K.TOKENS_PER_THREAD)
    assert K.threadgroup_bytes(lay, K.TOKENS_PER_THREAD, True) > two
    monkeypatch.setitem(K.THREADGROUP_LIMIT, "cuda", two)
    K.clear_memos()
    assert not K.takes_one_launch(lay) and lay.unsupported("cuda") is None
    monkeypatch.undo()
    K.clear_memos()
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    assert K.takes_one_launch(lay)
    monkeypatch.setattr(K, "ONE_LAUNCH", False)
    assert not K.takes_one_launch(lay)


@pytest.mark.parametrize("which", ["cuda", "metal"])
def test_one_compiled_kernel_per_input_dtype_set(which, monkeypatch):
    """MLX caches a custom kernel's compiled module by its name only (not by the signature,
    which spells the input types), so a window in bfloat16 and a float16 placeholder must reach
    MLX under two names. Recorded on the MLX side: which names it is asked to compile."""
    import veloxquant.kernels as vk

    names = []

    def fake_kernel(*, name, **_):
        names.append(name)
        return lambda **kw: [
            mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"], strict=True)
        ]

    monkeypatch.setattr(vk, "backend", lambda: which)
    monkeypatch.setattr(vk, "_COMPILED", {})
    monkeypatch.setattr(vk, "_LAUNCHERS", {})
    monkeypatch.setattr(mx.fast, f"{which}_kernel", fake_kernel)
    src = vk.KernelSource(name="probe", inputs=("x",), outputs=("y",), body="  y[0] = x[0];\n")
    x16, xbf = mx.zeros((8,), mx.float16), mx.zeros((8,), mx.bfloat16)
    for x in (x16, xbf, x16, xbf):
        vk.launch(src, [x], (1, 1, 1), [(8,)], [mx.float32])
    assert len(names) == 2 and len(set(names)) == 2  # built once per dtype set, never shared
    assert all(n.startswith(src.kernel_name) for n in names)


def test_cuda_kernels_reach_mlx_as_an_include_of_their_source(monkeypatch):
    """MLX copies and hashes a CUDA kernel's source at every call: it gets one #include line of
    a file holding the body (and one of the header), unless CUDA_SOURCE_FILES is off. What MLX
    is asked to compile is recorded on its side."""
    import veloxquant.kernels as vk

    calls = []

    def fake_kernel(**kw):
        calls.append(kw)
        return lambda **k: [mx.zeros(s, mx.float32) for s in k["output_shapes"]]

    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    monkeypatch.setattr(vk, "_COMPILED", {})
    monkeypatch.setattr(vk, "_LAUNCHERS", {})
    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_kernel)
    monkeypatch.setattr(vk, "_SOURCE_DIR", [])  # a directory of this test's own
    src = vk.KernelSource(name="probe", inputs=("x",), outputs=("y",), body="  y[0] = x[0];\n")
    x = mx.zeros((8,))
    for files in (True, False, True):
        monkeypatch.setattr(vk, "CUDA_SOURCE_FILES", files)
        vk.launch(src, [x], (1, 1, 1), [(8,)], [mx.float32])
    assert len(calls) == 2  # one kernel per way of handing the source, each built once
    included, inline = calls
    assert inline["source"] == src.cuda_body() and inline["header"] == src.header("cuda")
    for key, text in (("source", src.cuda_body()), ("header", src.header("cuda"))):
        line = included[key]
        path = re.fullmatch(r'#include "(/[^"]+\.cuh)"\n', line).group(1)
        assert Path(path).read_text() == text
    assert included["name"] == inline["name"]  # the same kernel, handed over two ways
    # the files live until the process that wrote them exits (not a forked child)
    folder = Path(path).parent
    vk._remove_source_dir(folder, os.getpid() + 1)
    assert Path(path).exists()
    vk._remove_source_dir(folder, os.getpid())
    assert not folder.exists()
    # a body that reads an input's shape needs MLX to see the name: refused by name
    shaped = vk.KernelSource(
        name="shaped", inputs=("x",), outputs=("y",), body="y[0] = x_shape[0];"
    )
    monkeypatch.setattr(vk, "CUDA_SOURCE_FILES", True)
    with pytest.raises(ValueError, match="x_shape.*CUDA_SOURCE_FILES"):
        vk.cuda_kernel_text(shaped)
    # launch bounds: MLX writes the signature, so they reach it as a macro of the kernel's
    # name, defined by the header and gone after the body (MLX's name expression follows)
    bounded = dataclasses.replace(src, min_threadgroups=4)
    assert bounded.kernel_name != src.kernel_name
    # so do the helpers: MLX would give a second revision's kernel the first one's binary
    helped = dataclasses.replace(src, helpers=src.helpers + "\n// another revision's helpers\n")
    assert helped.kernel_name != src.kernel_name
    monkeypatch.setattr(vk, "CUDA_SOURCE_FILES", False)
    vk.launch(bounded, [x], (1, 1, 1), [(8,)], [mx.float32])
    name = "custom_kernel_" + calls[-1]["name"]
    assert calls[-1]["header"].endswith(f"#define {name} __launch_bounds__(128, 4) {name}\n")
    assert calls[-1]["source"] == bounded.cuda_body() + f"\n#undef {name}\n"
    tu = bounded.cuda_translation_unit(["float32"], ["float32"])
    assert f"void __launch_bounds__(128, 4) custom_kernel_{bounded.kernel_name}(" in tu
    with pytest.raises(ValueError, match="launch bounds need the name"):
        vk.cuda_kernel_text(bounded)


def test_layer_constants_are_the_caches_and_a_state_load_forgets_them(
    smollm2, bundle, prompt, monkeypatch
):
    model, _ = smollm2
    caches = _caches(model, _config("calibrated", bundle), True, monkeypatch)
    _prefill(model, caches, prompt[:, :100])
    c = caches[3]
    const = K.layer_constants(c, 4)
    assert K.layer_constants(c, 4) is const
    assert const["key_mean"] is c.key_mean and const["value_smooth"] is c.value_smooth
    assert const["value_mean"] is c.value_mean
    other = caches[4]  # another layer's arrays, loaded into this cache: nothing stale is kept
    c.state = other.state
    assert K.layer_constants(c, 4)["key_mean"] is c.key_mean is not const["key_mean"]


@pytest.mark.parametrize("base, head_dim", [(500000.0, 128), (100000.0, 64), (10000.0, 128)])
def test_slow_rope_pairs_go_to_the_phase_polynomial(base, head_dim):
    # the partial kernel sums pairs exact_pairs.. as a polynomial: exactly the trailing pairs
    # whose angle turns by at most PHASE_TAYLOR_ANGLE over a tile, so its error stays bounded
    import mlx.nn as nn

    from veloxquant.rope import RopeSpec

    rope = RopeSpec.from_module(nn.RoPE(head_dim, base=base), head_dim)
    turn = K.rope_inv_freq(rope, head_dim).astype(np.float64) * (K.TILE * 4 - 1)
    n = K.exact_pairs(rope, head_dim, 4)
    assert 0 < n < head_dim // 2  # some pairs each way at these bases
    assert (turn[n:] <= K.PHASE_TAYLOR_ANGLE).all() and turn[n - 1] > K.PHASE_TAYLOR_ANGLE
    assert K.exact_pairs(rope, head_dim, 1) <= n  # shorter tiles: no more exact pairs
    assert K.exact_pairs(None, head_dim, 4) == head_dim // 2
    # the tensor-core path: the trailing pairs turning by at most POLY_ANGLE over its longest
    # tile (POLY_TOKENS), within its order's bound, when that saves chunks of its phase operand
    assert K.POLY_TOKENS == 4 * K.TILE
    poly = K.poly_pairs(rope, head_dim)
    turn = K.rope_inv_freq(rope, head_dim).astype(np.float64) * (K.POLY_TOKENS - 1)
    assert 0 < poly < head_dim // 2
    assert (turn[-poly:] <= K.POLY_ANGLE).all() and turn[-poly - 1] > K.POLY_ANGLE
    assert K.POLY_ANGLE ** (K.POLY_ORDER + 1) / math.factorial(K.POLY_ORDER + 1) <= 5e-7
    lay = _layout(head_dim=head_dim, poly_pairs=poly)
    assert K._phase_plan(lay)[2] < K._phase_plan(dataclasses.replace(lay, poly_pairs=0))[2]
    assert K.poly_pairs(None, head_dim) == 0
    # too few slow pairs to save a chunk at base 1e4 and D = 64: none
    few = RopeSpec.from_module(nn.RoPE(64, base=10000.0), 64)
    assert K.exact_pairs(few, 64, 4) < 32 and K.poly_pairs(few, 64) == 0
    # the truncation bound the constants promise
    order = K.PHASE_TAYLOR_ORDER
    assert K.PHASE_TAYLOR_ANGLE ** (order + 1) / math.factorial(order + 1) <= 1.1e-6


def test_tensor_core_token_order_gives_each_value_row_load_one_line():
    # the tile loop's mma k index stands for token block_token(k) of a 16-token block, in the
    # scores' rows, P's k rows and the phase operand alike; the order is what makes the value
    # rows a SIMD group loads at once (P's k = 2 l4 + (u & 1) + 8 (u >> 1), lanes l4 = 0..3) four
    # consecutive rows: one 128-byte line of the default layout's 32-byte rows
    order = [K.block_token(k) for k in range(16)]
    assert sorted(order) == list(range(16))
    for u in range(4):
        rows = [K.block_token(2 * l4 + (u & 1) + 8 * (u >> 1)) for l4 in range(4)]
        assert rows == [4 * u + l4 for l4 in range(4)]
    # the scores' rows quad and quad + 8 are the same permutation's
    assert [K.block_token(q + 8) - K.block_token(q) for q in range(8)] == [8] * 8
    # the phase operand's rows follow it: row quad of block 0, slot of pair 0, is that token's
    # offset times pair 0's angle
    import mlx.nn as nn

    from veloxquant.rope import RopeSpec

    rope = RopeSpec.from_module(nn.RoPE(128, base=500000.0), 128)
    lay = _layout(head_dim=128, poly_pairs=K.poly_pairs(rope, 128))
    frags = K.phase_fragments(rope, lay, 2).astype(np.float64)
    phi = float(rope.scale) * K.rope_inv_freq(rope, 128)[0]
    for quad in range(8):
        lane = 4 * quad  # l4 = 0, slot 0 of chunk 0: pair 0
        for row8, at in ((0, 0), (1, 2)):
            angle = phi * K.block_token(quad + 8 * row8)
            assert frags[0, 0, lane, at] == pytest.approx(math.cos(angle), abs=1e-3)
            assert frags[0, 0, lane, at + 1] == pytest.approx(-math.sin(angle), abs=1e-3)


def _value_gather_wavefronts(c: dict, codes: np.ndarray) -> int:
    """Shared-memory wavefronts of one SIMD group's gather of f16 value-book entries (`codes`
    [32], one per lane) as the tensor-core loop addresses them: lane L reads VEW words from word
    (code · VR16 + L % VR16) · VEW of the copies. A wavefront serves 32 banks of 4 bytes; lanes
    reading distinct words of one bank take one each."""
    banks: dict[int, set[int]] = {}
    for lane, code in enumerate(codes.tolist()):
        first = (code * c["VR16"] + lane % c["VR16"]) * c["VEW"]
        for word in range(first, first + c["VEW"]):
            banks.setdefault(word % 32, set()).add(word)
    words = sum(len(w) for w in banks.values())
    return max(-(-words // 32), max(len(w) for w in banks.values()))


def test_tensor_core_value_gathers_are_free_of_bank_conflicts_where_the_book_fits(monkeypatch):
    # the 8B shape's d4b8 value book (8-byte entries): 16 copies, one per lane of a half-warp,
    # make every gather of random codes two wavefronts (the least for 256 bytes); they fit 4
    # threadgroups per multiprocessor of an H100 (228 KB) and not of an A100 (164 KB), which
    # keeps the 8 copies of MMA_VALUE_BOOK_BYTES, and their 2-way conflicts
    import mlx.nn as nn

    import veloxquant.kernels as vk
    from veloxquant.rope import RopeSpec

    rope = RopeSpec.from_module(nn.RoPE(128, base=500000.0), 128)
    lay = _layout(head_dim=128, poly_pairs=K.poly_pairs(rope, 128))
    r = K.TOKENS_PER_THREAD
    rng = np.random.default_rng(0)
    draws = [rng.integers(0, 1 << lay.value_bits, 32) for _ in range(200)]
    monkeypatch.setattr(vk, "backend", lambda: "cuda")  # the card's shared memory decides
    for card, shared, copies, late in (("H100", 233472, 16, True), ("A100", 167936, 8, False)):
        monkeypatch.setattr(vk, "cuda_shared_memory", lambda shared=shared: (shared, 1024))
        c = K._mma_constants(lay, r)
        assert (c["VR16"], c["VBLATE"]) == (copies, late), card
        fronts = [_value_gather_wavefronts(c, codes) for codes in draws]
        if late:
            assert set(fronts) == {2}
        else:  # four lanes share each copy: 3 or 4 wavefronts at nearly every gather
            assert np.mean(fronts) > 3 and max(fronts) == 4
        one = K.one_launch_kernel_source(lay, mx.float16, mx.float16, r, rope_in=True)
        assert one.constants["VR16"] == copies and one.dynamic_shared == K.mma_bytes(lay, r) - 4
        tg = K.threadgroup_bytes(lay, r, True, True)
        assert (shared // (tg + 1024) >= K.MMA_MIN_THREADGROUPS) is late, card


def test_the_value_book_asks_the_card_only_for_the_tensor_cores(monkeypatch):
    # the conflict-free value book is sized to the card's shared memory; where the driver cannot
    # say, the error names the switches that run without asking, and they do
    import veloxquant.kernels as vk

    def no_driver():
        raise RuntimeError("cannot load the CUDA driver to read the shared memory per SM")

    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    monkeypatch.setattr(vk, "cuda_shared_memory", no_driver)
    monkeypatch.setattr(K, "MMA", True)
    lay = _layout()
    with pytest.raises(RuntimeError, match="set MMA = False"):
        K.one_launch_kernel_source(lay, mx.float16, mx.float16)
    monkeypatch.setattr(K, "MMA", False)
    src = K.one_launch_kernel_source(lay, mx.float16, mx.float16)
    assert src.dynamic_shared == 0 and "VR16" not in src.constants


def test_launch_constants_are_built_once():
    # every fresh array would cost each layer's launch a host-to-device copy or a fill kernel
    inv, table, _ = K._rope_arrays(None, 64)
    again = K._rope_arrays(None, 64)
    assert again[0] is inv and again[1] is table
    params = K._int_params([300, 4, 512])
    assert K._int_params([300, 4, 512]) is params
    assert np.array(params).tolist() == [300, 4, 512] + [0] * (K.PARAMS - 3)


@pytest.mark.parametrize("on_gpu", [True, False], ids=["chained", "host"])
def test_decode_step_launch_params_hold_their_values(on_gpu, monkeypatch):
    # on CUDA a new value set is a recent one plus the difference (added by MLX, here on the
    # CPU), so that no host array is made at every step; each set must still read its values
    import collections

    import veloxquant.kernels as vk

    monkeypatch.setattr(vk, "backend", lambda: "cuda" if on_gpu else None)
    monkeypatch.setattr(vk, "_PARAMS", collections.OrderedDict())
    monkeypatch.setattr(vk, "_STEPS", {})
    monkeypatch.setattr(vk, "_LATEST_PARAMS", (None, None))
    window, sinks, made = 26, 4, []
    for t in range(300, 360):  # decode: a token more, the ring a slot on, tps grows at 320
        tps = 512 if t < 320 else 768
        values = [t, sinks, tps, 4, window, 1, 384, window, 1, t % window, window, sinks + t]
        params = K._int_params(values)
        assert np.array(params).tolist() == values + [0] * (K.PARAMS - len(values))
        assert K._int_params(values) is params  # every layer of the step: one array
        other = K._int_params([7, 0, 256] + values[3:])  # another model's layers between
        assert np.array(other).tolist()[:3] == [7, 0, 256]
        made.append(params)
    assert K._int_params([t, sinks, tps] + values[3:]) is made[-1]
    # the differences repeat (a token more, the ring's wrap, per model), not one new per step
    assert 0 < len(vk._STEPS) <= 8 if on_gpu else not vk._STEPS
    with pytest.raises(ValueError, match="int32"):  # not wrapped around by a difference
        K._int_params([2**31] + values[1:])


def test_device_resident_copies_only_on_cuda(monkeypatch):
    import veloxquant.kernels as vk

    x = mx.array([1, 2, 4_000_000_000], mx.uint32)
    for where in ("metal", None):
        monkeypatch.setattr(vk, "backend", lambda w=where: w)
        assert vk.device_resident(x) is x
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    copy = vk.device_resident(x)
    assert copy is not x and copy.dtype == mx.uint32
    assert copy.tolist() == [1, 2, 4_000_000_000]


def test_launch_refuses_small_inputs_and_a_wrong_input_count(monkeypatch):
    # Metal passes inputs under 8 elements in the constant address space, which the kernels'
    # casts do not expect: refused by name, as is a call with the wrong number of inputs
    import veloxquant.kernels as vk

    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    monkeypatch.setattr(vk, "_LAUNCHERS", {})
    monkeypatch.setattr(vk, "compiled", lambda *a: lambda **kw: [mx.zeros((8,))])
    src = vk.KernelSource(name="probe", inputs=("x", "y"), outputs=("z",), body="")
    big, small = mx.zeros((8,)), mx.zeros((4,))
    assert vk.launch(src, [big, big], (1, 1, 1), [(8,)], [mx.float32])[0].shape == (8,)
    with pytest.raises(ValueError, match="input y has 4 < 8 elements"):
        vk.launch(src, [big, small], (1, 1, 1), [(8,)], [mx.float32])
    with pytest.raises(ValueError, match="zip"):
        vk.launch(src, [big], (1, 1, 1), [(8,)], [mx.float32])
