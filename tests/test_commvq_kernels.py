"""CommVQ's fused decode kernels (veloxquant/methods/commvq/kernels.py), run on the CPU by
tests/kernel_emulator.py (the generated CUDA and Metal sources compiled as C++), against the
pure-MLX twin on the same cache:
1. random caches of several layouts (head_dim 32-256, 1-8 query heads per KV head, 3-21 stages,
   int8 and fp16 atoms per head or per layer, gains per head or per layer, both RoPE pair
   layouts, with and without the key mean, value codes of 4-10 bits that cross bytes), several
   splits of the coded past, the exact tokens alone;
2. the real model's own activations (SmolLM2, uncalibrated caches), every layer's decode
   attention through the cache's dispatch, and the model's dtype coming back;
3. the contract: what the kernels do not take is named and takes the twin, the generated
   Metal source is well formed, the threadgroup bytes the host plans with are the source's;
4. the CPU extension's one-pass kernel (`cpu_kernel_attention`) against the twin: every layout
   in both pair layouts, head_dims 48 and 96 (its generic loops), prefill rows under the causal
   mask, batches of two, segments longer than a block; the same bytes on one core and on all;
   the cache's dispatch; the real model's greedy tokens as the transient path's.
"""

from __future__ import annotations

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from tests import kernel_emulator as emu
from veloxquant import KVCacheConfig, make_cache
from veloxquant.kernels import check_metal_source
from veloxquant.methods.commvq import CommVQCache
from veloxquant.methods.commvq import codebook as cb
from veloxquant.methods.commvq import kernels as K

needs_cxx = pytest.mark.skipif(emu.CXX is None, reason="no C++ compiler for the kernel emulator")


def _emulated(backend: str):
    """`veloxquant.kernels.launch` with the emulator (of `backend`'s source) for the GPU."""
    return emu.launch_for(backend)


def _on_emulated_gpu(monkeypatch, backend: str = "cuda", launched: list | None = None) -> None:
    """K's launches emulated for `backend`, and no CPU kernel (MLX on a GPU runs none)."""
    run = _emulated(backend)
    monkeypatch.setattr(K, "backend", lambda: backend)
    monkeypatch.setattr(K, "CPU_KERNEL", False)
    if launched is None:
        monkeypatch.setattr(K, "launch", run)
    else:
        monkeypatch.setattr(K, "launch", lambda src, *a: launched.append(src.name) or run(src, *a))


def _cache(h, d, r, trad, center, atom_sets, atom_bits, gain_sets, vbits, vsub, vbooks, **kw):
    """A CommVQCache of the shared-atom form with complex gains (random, as training leaves
    them: not the data-free real ones) and random value codebooks."""
    k1, k2, k3, k4 = mx.random.split(mx.random.key(h * 1000 + d + r), 4)
    atoms, gains = cb.gaussian_shared(k1, atom_sets, gain_sets, r, d // 2)
    gains = gains + 0.2 * mx.random.normal(gains.shape, key=k2)
    return CommVQCache(
        atoms,
        mx.random.normal((vbooks, 2**vbits, vsub), key=k3),
        mx.random.normal((h, d), key=k4) * 0.5 if center else None,
        key_gain=gains,
        atom_bits=atom_bits,
        rope_base=1e4,
        rope_traditional=trad,
        value_bits=vbits,
        value_sub_dim=vsub,
        window=kw.get("window", 8),
        sinks=kw.get("sinks", 2),
    )


LAYOUTS = {
    # SmolLM2's shape at 2 bits: D 64, R 11 (17-byte code rows, read byte by byte), 3 query
    # heads per KV head, int8 atoms per head, one d4b8 value codebook per layer (the defaults)
    "d64-r11-q3": dict(h=2, d=64, r=11, gq=3, trad=False, center=True, atom_sets=2,
                       atom_bits=8, gain_sets=2, vbits=8, vsub=4, vbooks=1),
    # an 8B head: D 128 (two RoPE pairs per lane), R 21 (32-byte rows, read as words), 4 query
    # heads, value codebooks per head
    "d128-r21-q4": dict(h=2, d=128, r=21, gq=4, trad=False, center=True, atom_sets=2,
                        atom_bits=8, gain_sets=2, vbits=8, vsub=4, vbooks=2),
    # D 32 (lanes past the 16 pairs idle), interleaved pairs, fp16 atoms shared by the layer,
    # no key mean, 4-bit values of 2 elements
    "d32-r5-trad-q2": dict(h=2, d=32, r=5, gq=2, trad=True, center=False, atom_sets=1,
                           atom_bits=16, gain_sets=2, vbits=4, vsub=2, vbooks=1),
    # 10-bit value codes (crossing bytes) of 8 elements, one query per KV head, odd R
    "d64-r7-v10-q1": dict(h=1, d=64, r=7, gq=1, trad=False, center=True, atom_sets=1,
                          atom_bits=8, gain_sets=1, vbits=10, vsub=8, vbooks=1),
    # D 256 (4 pairs and 2 value sub-vectors per lane): float16 atoms in threadgroup memory
    "d256-r3-q2": dict(h=1, d=256, r=3, gq=2, trad=True, center=True, atom_sets=1,
                       atom_bits=8, gain_sets=1, vbits=8, vsub=4, vbooks=1),
    # 8 query heads per KV head (the most the kernels take); atoms and gains shared by the
    # layer's two KV heads
    "d64-r11-q8": dict(h=2, d=64, r=11, gq=8, trad=False, center=True, atom_sets=1,
                       atom_bits=8, gain_sets=1, vbits=8, vsub=4, vbooks=1),
}  # fmt: skip


def _decode_case(rng, spec: dict, n_tok: int, dtype=mx.float32):
    """A fused cache after n_tok tokens (fed in chunks, no attention) and one decode update
    (pending), and a query. The keys grow along the sequence, so a SIMD group's running max
    rises from token to token and its sums are rescaled."""
    h, d, gq = spec["h"], spec["d"], spec["gq"]
    c = _cache(**spec)
    c.fused = True
    ramp = np.linspace(0.5, 2.5, n_tok, dtype=np.float32)[None, None, :, None]
    keys = rng.normal(size=(1, h, n_tok, d)).astype(np.float32) * ramp
    values = rng.normal(size=(1, h, n_tok, d)).astype(np.float32)
    for s in range(0, n_tok, 97):
        c.update_and_fetch(mx.array(keys[:, :, s : s + 97]), mx.array(values[:, :, s : s + 97]))
        c._pending = None  # no attention for these calls
    k1, v1 = (mx.array(rng.normal(size=(1, h, 1, d)).astype(np.float32)) for _ in range(2))
    c.update_and_fetch(k1.astype(dtype), v1.astype(dtype))
    q = mx.array(rng.normal(size=(1, h * gq, 1, d)).astype(np.float32) * 2).astype(dtype)
    return c, q


# ------------------------------------------------------------------ 1. random caches


@needs_cxx
@pytest.mark.parametrize("backend", ["cuda", "metal"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_emulated_kernels_match_the_twin(layout, backend, monkeypatch):
    spec = LAYOUTS[layout]
    c, q = _decode_case(np.random.default_rng(3), spec, n_tok=420)
    if K.unsupported(c, q.shape[1], backend):  # D 256 fits CUDA's 48 KB, not Metal's 32
        assert layout == "d256-r3-q2" and backend == "metal"
        return
    pending = c._pending
    want = np.array(K.reference_attention(c, q, 0.3, None, pending))
    launched = []
    _on_emulated_gpu(monkeypatch, backend, launched)
    # 3 splits of the ~400 coded tokens (each SIMD group's share uneven), plus the exact split
    monkeypatch.setattr(K, "TARGET_GROUPS", 3 * spec["h"])
    monkeypatch.setattr(K, "MIN_SPLIT", 16)
    assert -(-c.compressed_tokens // K.split_tokens(c.compressed_tokens, spec["h"])) == 3
    got = np.array(K.decode_attention(c, q, 0.3, pending))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)
    assert launched == ["vq_commvq_attn_partial", "vq_commvq_attn_combine"]


@needs_cxx
@pytest.mark.parametrize("code_words", [True, False])
@pytest.mark.parametrize("atom_size", [4, 2])
def test_the_kernels_switches_give_the_same_attention(code_words, atom_size, monkeypatch):
    # the key code rows read as words or byte by byte, the atoms held as float32 or float16
    # (exact: int8 atoms) in threadgroup memory: the same sums
    spec = LAYOUTS["d128-r21-q4"]
    c, q = _decode_case(np.random.default_rng(4), spec, n_tok=300)
    want = np.array(K.reference_attention(c, q, 0.2, None, c._pending))
    _on_emulated_gpu(monkeypatch)
    monkeypatch.setattr(K, "CODE_WORDS", code_words)
    monkeypatch.setattr(K, "ATOM_BYTES", atom_size)
    got = np.array(K.decode_attention(c, q, 0.2, c._pending))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)


@needs_cxx
@pytest.mark.parametrize("n_tok,window,sinks", [(5, 8, 2), (10, 8, 2), (40, 0, 0), (1, 4, 0)])
def test_emulated_kernels_cover_empty_pasts_and_single_splits(n_tok, window, sinks, monkeypatch):
    # nothing coded yet (the exact split alone), or one split; no sinks, no window
    spec = {**LAYOUTS["d64-r11-q3"], "window": window, "sinks": sinks}
    c, q = _decode_case(np.random.default_rng(5), spec, n_tok=n_tok)
    want = np.array(K.reference_attention(c, q, 0.3, None, c._pending))
    _on_emulated_gpu(monkeypatch)
    got = np.array(K.decode_attention(c, q, 0.3, c._pending))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)


# ------------------------------------------------------------------ 2. the real model


@needs_cxx
def test_emulated_kernels_match_the_twin_on_real_activations(smollm2, eval_text, monkeypatch):
    # SmolLM2's own keys, values and queries (300 prompt tokens, then 2 decode steps): every
    # layer's decode attention runs in the emulated CUDA kernels through the cache's dispatch,
    # each call checked against the twin on the same update; the model goes on with the
    # kernels' output, so the second step attends over what the kernel path stored
    model, tok = smollm2
    monkeypatch.setenv("VELOXQUANT_FUSED", "1")
    caches = make_cache(model, KVCacheConfig(method="commvq", uncalibrated=True))
    ids = tok.encode(eval_text)[:302]
    model(mx.array([ids[:300]]), cache=caches)  # prefill: the CPU kernel or the twin
    assert {c.last_attention for c in caches} == {
        "cpu-kernel" if K.cpu_kernel_here() else "reference"
    }
    _on_emulated_gpu(monkeypatch)
    kernel_attention, errors = K.decode_attention, []

    def checked(cache, queries, scale, pending):
        got = kernel_attention(cache, queries, scale, pending)
        want = K.reference_attention(cache, queries, scale, None, pending)
        errors.append((mx.abs(got - want).max() / mx.abs(want).max()).item())
        return got

    monkeypatch.setattr(K, "decode_attention", checked)
    for i in range(300, 302):
        model(mx.array([[ids[i]]]), cache=caches)
    assert {c.last_attention for c in caches} == {"kernel"}
    assert caches[0].attention_path == "kernel"
    assert len(errors) == 2 * len(caches) and caches[0].compressed_tokens > 200
    assert max(errors) < 1e-5, max(errors)


@needs_cxx
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_cache_decode_takes_the_kernels_and_keeps_the_model_dtype(dtype, monkeypatch):
    # the cache's own decode path in float16 or bfloat16: the output comes back in the model's
    # dtype from the combine, within its rounding of the twin's float32 answer; a prefill chunk
    # (a mask) still takes the twin
    spec = LAYOUTS["d64-r11-q3"]
    rng = np.random.default_rng(6)
    c, _ = _decode_case(rng, spec, n_tok=150, dtype=dtype)
    c._pending = None
    _on_emulated_gpu(monkeypatch)
    assert c.attention_path == "kernel"
    rtol = {mx.float16: 1e-3, mx.bfloat16: 8e-3}[dtype]  # half a unit in the last place
    for _ in range(3):
        k1 = mx.array(rng.normal(size=(1, 2, 1, 64)).astype(np.float32)).astype(dtype)
        q = mx.array(rng.normal(size=(1, 6, 1, 64)).astype(np.float32)).astype(dtype)
        c.update_and_fetch(k1, k1)
        want = np.array(K.reference_attention(c, q.astype(mx.float32), 0.125, None, c._pending))
        got = c.fused_attention(q, scale=0.125)
        assert c.last_attention == "kernel" and got.dtype == dtype
        got = np.array(got.astype(mx.float32))
        np.testing.assert_allclose(got, want, atol=rtol * np.abs(want).max(), rtol=rtol)
    k7 = mx.array(rng.normal(size=(1, 2, 7, 64)).astype(np.float32)).astype(dtype)
    c.update_and_fetch(k7, k7)
    c.fused_attention(mx.zeros((1, 6, 7, 64), dtype), scale=0.125, mask="causal")
    assert c.last_attention == "reference"


# ------------------------------------------------------------------ 3. contract


@needs_cxx
def test_nbytes_counts_the_arrays_the_gpu_kernels_keep(monkeypatch):
    # after a decode step in the (emulated) kernels the cache holds the codebook laid out for
    # them and the combine's head table beside its own arrays: nbytes counts each array once
    from mlx.utils import tree_flatten

    c, q = _decode_case(np.random.default_rng(9), LAYOUTS["d64-r11-q3"], n_tok=200)
    before = c.nbytes
    _on_emulated_gpu(monkeypatch)
    c.fused_attention(q, scale=0.2)
    assert c.last_attention == "kernel"
    leaves = tree_flatten(vars(c), is_leaf=lambda x: isinstance(x, mx.array))
    held = {id(x): x.nbytes for _, x in leaves if isinstance(x, mx.array)}
    assert c.nbytes == sum(held.values()) > before


def test_what_the_kernels_do_not_take_is_named_and_takes_the_twin(monkeypatch):
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    free = CommVQCache(
        cb.gaussian_theta(mx.random.key(0), 2, 3, 8),  # the paper's free θ per stage
        mx.zeros((1, 256, 4)),
        rope_base=1e4,
        rope_traditional=False,
        value_bits=8,
        value_sub_dim=4,
    )
    assert "free θ per stage" in K.unsupported(free, 4)
    free.fused = True
    assert free.attention_path == "reference"
    k = mx.zeros((1, 2, 1, 16))
    free.update_and_fetch(k, k)
    free.fused_attention(mx.zeros((1, 4, 1, 16)), scale=1.0)
    assert free.last_attention == "reference"
    spec = LAYOUTS["d64-r11-q3"]
    # gains in 2 sets for 4 KV heads (a hand-made cache; calibration shares by layer or head):
    # neither kernel reads them the twin's way, so both leave them to it
    uneven = _cache(**{**spec, "h": 4, "atom_sets": 1, "gain_sets": 2})
    assert "2 gain sets for 4 KV heads" in K.unsupported(uneven, 12)
    uneven.fused = True
    assert uneven.attention_path == "reference"
    k = mx.zeros((1, 4, 1, 64))
    uneven.update_and_fetch(k, k)
    uneven.fused_attention(mx.zeros((1, 12, 1, 64)), scale=1.0)
    assert uneven.last_attention == "reference"
    assert "24 query heads over 2 KV heads" in K.unsupported(_cache(**spec), 24)
    assert "5 query heads" in K.unsupported(_cache(**spec), 5)
    # D 256: 3 stages fit CUDA's 48 KB (float16 atoms), not Metal's 32; 21 stages fit neither
    small = _cache(**LAYOUTS["d256-r3-q2"])
    assert K.unsupported(small, 2, "cuda") is None
    assert K.atom_bytes(K.layout(small, 2), "cuda") == 2
    assert "bytes of threadgroup memory (at most 32768" in K.unsupported(small, 2, "metal")
    big = _cache(**{**LAYOUTS["d256-r3-q2"], "r": 21})
    assert "bytes of threadgroup memory (at most 49152" in K.unsupported(big, 2, "cuda")
    monkeypatch.setattr(K, "backend", lambda: None)  # the CPU: the twin, whatever the layout
    assert not K.kernels_take(_cache(**spec), 6)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_generated_metal_sources_are_well_formed(layout):
    spec = LAYOUTS[layout]
    c = _cache(**spec)
    n_q = spec["h"] * spec["gq"]
    if K.unsupported(c, n_q, "metal"):
        assert layout == "d256-r3-q2"
        return
    lay = K.layout(c, n_q)
    size = K.atom_bytes(lay, "metal")
    src = K.partial_kernel_source(lay, size)
    ins = ["float16", "float16", "float32", "float32", "float32", "float16", "uint8", "float16"]
    ins += ["uint8"] + ["float16"] * 4 + ["float32"] * 2 + ["int32", "float32"]
    assert check_metal_source(src, ins, ["float32"] * 3) == []
    assert K.threadgroup_bytes(lay, size) <= K.THREADGROUP_LIMIT["metal"]
    src = K.combine_kernel_source(spec["d"], spec["gq"], mx.bfloat16)
    ins = ["float32", "float32", "float32", "int32", "int32"]
    assert check_metal_source(src, ins, ["bfloat16"]) == []


@needs_cxx
@pytest.mark.parametrize("atom_size", [4, 2])
def test_threadgroup_bytes_are_those_of_the_generated_source(atom_size):
    ins = ["float16", "float16", "float32", "float32", "float32", "float16", "uint8", "float16"]
    ins += ["uint8"] + ["float16"] * 4 + ["float32"] * 2 + ["int32", "float32"]
    for spec in LAYOUTS.values():
        lay = K.layout(_cache(**spec), spec["h"] * spec["gq"])
        lib = emu.build(K.partial_kernel_source(lay, atom_size), "cuda", ins, ["float32"] * 3)
        assert emu.threadgroup_bytes(lib) == K.threadgroup_bytes(lay, atom_size), lay


def test_an_unattended_fused_update_is_a_clear_error():
    c = _cache(**LAYOUTS["d64-r11-q3"])
    c.fused = True
    k = mx.zeros((1, 2, 1, 64))
    c.update_and_fetch(k, k)  # its attention never runs
    with pytest.raises(RuntimeError, match="never followed by its attention"):
        c.update_and_fetch(k, k)


# ------------------------------------------------------------------ 4. the CPU kernel

needs_cpu_kernel = pytest.mark.skipif(
    not K.cpu_kernel_here(), reason="the CPU extension is built on x86-64 Linux only"
)


@needs_cpu_kernel
@pytest.mark.parametrize("trad", [False, True])
@pytest.mark.parametrize(
    "layout,extra",
    [(name, {}) for name in sorted(LAYOUTS)]
    + [("d64-r11-q3", {"d": 48}), ("d64-r11-q3", {"d": 96, "vsub": 8})],
)
def test_the_cpu_kernel_matches_the_twin(layout, extra, trad):
    # 1100 coded tokens: three segments of 512, the last short, each of 64-token blocks; a
    # softened softmax (scale 0.02), where every token's key and value count
    spec = {**LAYOUTS[layout], **extra, "trad": trad}
    c, q = _decode_case(np.random.default_rng(7), spec, n_tok=1100)
    for scale in (0.3, 0.02):
        want = np.array(K.reference_attention(c, q, scale, None, c._pending))
        got = np.array(K.cpu_kernel_attention(c, q, scale, None, c._pending))
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)


def _prefill_case(batch: int, n_new: int, seed: int = 8):
    spec = LAYOUTS["d64-r11-q3"]
    rng = np.random.default_rng(seed)
    c = _cache(**spec)
    c.fused = True
    for _ in range(3):
        k = mx.array(rng.normal(size=(batch, 2, 233, 64)).astype(np.float32))
        c.update_and_fetch(k, k * 0.5)
        c._pending = None
    k = mx.array(rng.normal(size=(batch, 2, n_new, 64)).astype(np.float32))
    c.update_and_fetch(k, k)
    q = mx.array(rng.normal(size=(batch, 6, n_new, 64)).astype(np.float32))
    return c, q


@needs_cpu_kernel
@pytest.mark.parametrize("batch,n_new", [(1, 9), (2, 1), (2, 5)])
def test_the_cpu_kernel_takes_prefill_rows_and_batches(batch, n_new):
    c, q = _prefill_case(batch, n_new)
    mask = "causal" if n_new > 1 else None
    want = np.array(K.reference_attention(c, q, 0.2, mask, c._pending))
    got = np.array(K.cpu_kernel_attention(c, q, 0.2, mask, c._pending))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)


@needs_cpu_kernel
def test_the_cpu_kernels_bits_do_not_depend_on_the_threads():
    """The same call in two processes, one held to a single core (the kernel then runs one
    thread), one on every core: the same bytes; and a rerun in this process: the same bytes."""
    import hashlib
    import os
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "if sys.argv[1] == 'one':\n"
        "    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "import hashlib\n"
        "import numpy as np\n"
        "from tests.test_commvq_kernels import K, _prefill_case\n"
        "c, q = _prefill_case(2, 5)\n"
        "out = np.array(K.cpu_kernel_attention(c, q, 0.2, 'causal', c._pending))\n"
        "print(hashlib.sha256(out.tobytes()).hexdigest())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digests = [
        subprocess.run(
            [sys.executable, "-c", code, arm], capture_output=True, text=True, cwd=root, check=True
        ).stdout.split()[-1]
        for arm in ("one", "all")
    ]
    c, q = _prefill_case(2, 5)
    here = np.array(K.cpu_kernel_attention(c, q, 0.2, "causal", c._pending))
    assert digests[0] == digests[1] == hashlib.sha256(here.tobytes()).hexdigest()


@needs_cpu_kernel
def test_the_cache_takes_the_cpu_kernel_and_leaves_mask_arrays_to_the_twin(monkeypatch):
    from mlx_lm.models.base import create_causal_mask

    c, q = _prefill_case(1, 1)
    assert c.attention_path == "cpu-kernel"
    c.fused_attention(q, scale=0.2)
    assert c.last_attention == "cpu-kernel"
    k = mx.zeros((1, 2, 6, 64))
    c.update_and_fetch(k, k)
    window = create_causal_mask(6, c.offset - 6, window_size=50)  # a sliding window: the twin
    c.fused_attention(mx.zeros((1, 6, 6, 64)), scale=0.2, mask=window)
    assert c.last_attention == "reference"
    monkeypatch.setattr(K, "CPU_KERNEL", False)
    assert c.attention_path == "reference"
    c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    c.fused_attention(mx.zeros((1, 6, 1, 64)), scale=0.2)
    assert c.last_attention == "reference"


@needs_cpu_kernel
def test_the_cpu_kernel_refuses_bad_inputs_by_name():
    from veloxquant import cpu_kernels

    c, q = _prefill_case(1, 1)
    key_codes, key_scales, value_codes = c._pending["codes"]
    n = c._pending["n_coded"]
    rope = K.RopeSpec(64, False, 1e4, 1.0)
    f32 = mx.float32
    args = [
        q.reshape(1, 2, 3, 64),
        c.theta.astype(f32),
        c.theta_scale.astype(f32),
        c.key_gain.astype(f32),
        c.key_mean,
        key_codes,
        key_scales.astype(f32),
        value_codes,
        c.value_codebook.astype(f32),
        K.phase_table(rope, c.sinks, n),
        n,
        8,
        False,
    ]
    mx.eval(cpu_kernels.commvq_coded_attention(*args))  # as given: fine
    for i, bad, match in [
        (1, c.theta.astype(f32)[:, :, :, :32], "atoms must be"),
        (2, c.theta_scale.astype(f32)[:, :, :8], "atom scales must be"),
        (5, key_codes[..., :-1], "key code rows hold"),
        (9, K.phase_table(rope, c.sinks, n - 1), "phases are"),
        (10, n + 1, "n_coded must be within"),
        (11, 7, "2\\^bits codewords"),
        (6, key_scales, "float32"),
    ]:
        broken = list(args)
        broken[i] = bad
        with pytest.raises(ValueError, match=match):
            mx.eval(cpu_kernels.commvq_coded_attention(*broken))


@needs_cpu_kernel
def test_the_cpu_kernel_gives_the_transient_paths_tokens_on_the_real_model(
    smollm2, eval_text, monkeypatch
):
    # SmolLM2 with uncalibrated CommVQ caches: a 300-token prompt in two chunks (the second
    # chunk's rows under the causal mask through the kernel), then 24 greedy tokens. Every
    # kernel call is checked against the twin on the same update (within 1e-5 of its largest
    # output); the tokens are the transient path's, and the logits after the prompt within
    # 1e-3 of its. Later logits drift further (0.145 measured at one step, 0.0066 on the twin):
    # the kernel's float32 sums differ from the transient path's in the last bits, and a few
    # near-tie codes of the tokens leaving the window flip (0.01-0.06% of the key code bytes
    # in 5 of 30 layers), which then move single logits
    model, tok = smollm2
    config = KVCacheConfig(method="commvq", uncalibrated=True)
    ids = mx.array([tok.encode(eval_text)[:300]])
    kernel_attention, errors = K.cpu_kernel_attention, []

    def checked(cache, queries, scale, mask, pending):
        got = kernel_attention(cache, queries, scale, mask, pending)
        want = K.reference_attention(cache, queries, scale, mask, pending)
        errors.append((mx.abs(got - want).max() / mx.abs(want).max()).item())
        return got

    monkeypatch.setattr(K, "cpu_kernel_attention", checked)
    runs = {}
    for fused in (False, True):
        monkeypatch.setenv("VELOXQUANT_FUSED", "1" if fused else "0")
        caches = make_cache(model, config)
        model(ids[:, :200], cache=caches)
        logits = [model(ids[:, 200:], cache=caches)[:, -1]]
        for _ in range(24):
            logits.append(model(mx.argmax(logits[-1], axis=-1)[:, None], cache=caches)[:, -1])
        runs[fused] = (mx.concatenate(logits), caches)
    (a, _), (b, fused_caches) = runs[False], runs[True]
    assert {c.last_attention for c in fused_caches} == {"cpu-kernel"}
    assert len(errors) == 26 * len(fused_caches) and max(errors) < 1e-5, max(errors)
    assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item()
    assert mx.abs(a[0] - b[0]).max().item() < 1e-3
