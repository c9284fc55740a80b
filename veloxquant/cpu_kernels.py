"""MLX's float32 CPU softmax, log-sum-exp and affine quantized matmul and mlx-lm's swiglu, bit
for bit, vectorized (x86-64 with AVX2 and FMA); and VecInfer's decode attention from the codes.

MLX's x86 wheels are built for baseline x86-64. There its CPU `exp` runs one element at a time
and calls libm for every fma and floor, about 30 ns per element: the causal softmax of the
attention is most of a forward pass of a small model, and the log-softmax over the vocabulary
and the MLP's sigmoid most of the rest (benchmarks/results/bench_cpu_forward-cpu.txt).
`cpu_kernels.cpp` performs the same IEEE operations, element for element, eight lanes at a
time, as MLX primitives: each returns the bits MLX's own returns (tests compare them, and
benchmarks/check_cpu_kernels.py every float32 input of the exp), NaN payloads aside, so
artifacts do not depend on whether it is built. Gradients are MLX's, op for op.

- `exp(x)` = `mx.exp(x)` (no gradient);
- `softmax(x)` = `mx.softmax(x, axis=-1, precise=True)`;
- `causal_softmax(scores, offset)` = that softmax of `where(causal, scores, lowest)`, computing
  only each row's visible part;
- `logsumexp(x)` = `mx.logsumexp(x, axis=-1, keepdims=True)`;
- `swiglu(gate, up)` = mlx-lm's `swiglu`;
- `quantized_matmul(x, w, scales, biases, ...)` = `mx.quantized_matmul` of affine codes (mlx-lm's
  quantized KV cache), whose CPU loop is scalar too;
- `nearest_centroid(x, c)` and `cluster_sums(x, codes, k)`: k-means' assignment and its
  scatter-adds (`veloxquant.kmeans`), without the [vectors, centroids] score block;
- `nearest_pair_codeword(u, v, cross)`: CommVQ's nearest of its 4096 codewords, without the
  [vectors, 4096] score block;
- `vecinfer_coded_attention(...)`: VecInfer's decode attention over the coded past straight
  from the codes, nothing of [tokens, head_dim] built; the one kernel here that does not
  reproduce MLX's bits (it is not a rewrite of an MLX op; its oracle is the pure-MLX twin);
- `vectorized()`: for the duration of a block, mlx-lm's attention on the CPU in float32
  (through `veloxquant.attention.cpu_attention`) and its swiglu use them.

It is a small C++ extension, compiled against the installed MLX by `build()` (`veloxquant
build-cpu-kernels`, which `make setup` runs on x86-64 Linux) with the system's g++ and
nanobind's sources. The functions take it when it is built for this MLX and this source and the
CPU has AVX2 and FMA, and MLX's own ops otherwise, having said once in the log why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

log = logging.getLogger("veloxquant")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
MODULE = "_cpu_kernels"  # NB_MODULE's name in SOURCE
LIBRARY = Path(__file__).with_name(MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
STAMP = Path(__file__).with_name(MODULE + ".build.json")
_unavailable_reason: str | None = None
_module: Any = None


def wanted_here() -> bool:
    """Whether this platform has the problem the extension solves: x86-64 Linux (elsewhere MLX's
    CPU exp is vectorized, or MLX runs on a GPU)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


CXXFLAGS = (
    "-std=c++20",
    "-O2",
    # every multiply and add rounded on its own, as in MLX's one-lane CPU loops
    "-ffp-contract=off",
    "-DNDEBUG",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-fno-strict-aliasing",
    # nanobind shares MLX's array type only with extensions of MLX's domain.
    "-DNB_DOMAIN=mlx",
    "-DNB_COMPACT_ASSERTIONS",
)


def _stamp() -> dict:
    # What the library was compiled from, how, and against: a change of any needs a rebuild
    # (MLX's C++ ABI is not stable across releases).
    return {
        "source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "flags": list(CXXFLAGS),
        "mlx": importlib.metadata.version("mlx"),
    }


def build_command(output: Path) -> list[str]:
    """The g++ command that compiles SOURCE and nanobind into the extension at `output`."""
    try:
        import nanobind
    except ImportError as e:
        raise RuntimeError(
            "building veloxquant's CPU kernels needs nanobind's sources: "
            "pip install -c constraints.txt 'nanobind>=3.0.1,<3.1' (the `cpu` extra has it)"
        ) from e

    nb_dir = Path(nanobind.__file__).parent
    mlx_dir = Path(importlib.util.find_spec("mlx").submodule_search_locations[0])
    return [
        os.environ.get("CXX", "g++"),
        *CXXFLAGS,
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{nb_dir / 'include'}",
        f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}",
        f"-I{mlx_dir / 'include'}",
        str(SOURCE),
        str(nb_dir / "src" / "nb_combined.cpp"),
        f"-L{mlx_dir / 'lib'}",
        "-lmlx",
        f"-Wl,-rpath,{mlx_dir / 'lib'}",
        "-o",
        str(output),
    ]


def is_built() -> bool:
    """Whether LIBRARY exists and was built from this SOURCE against this MLX."""
    try:
        return LIBRARY.exists() and json.loads(STAMP.read_text()) == _stamp()
    except (OSError, ValueError):
        return False


def build(force: bool = False) -> Path:
    """Compile the extension next to this module (a no-op when `is_built()`, unless `force`).
    The library and its stamp are written to temporary files and renamed into place, so an
    interrupted build leaves the previous one intact."""
    if is_built() and not force:
        return LIBRARY
    if not wanted_here():
        raise RuntimeError(
            f"veloxquant.cpu_kernels is for x86-64 Linux; this is {sys.platform} "
            f"{platform.machine()}, where MLX's own CPU exp is vectorized"
        )
    with tempfile.TemporaryDirectory(dir=LIBRARY.parent, prefix=".build-") as tmp:
        out = Path(tmp) / LIBRARY.name
        cmd = build_command(out)
        print("building", LIBRARY.name, ":", " ".join(cmd), file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"compiling {SOURCE.name} failed (is g++ installed? `apt-get install g++`):\n"
                + result.stderr[-4000:]
            )
        stamp = Path(tmp) / STAMP.name
        stamp.write_text(json.dumps(_stamp(), indent=1) + "\n")
        os.replace(out, LIBRARY)
        os.replace(stamp, STAMP)
    global _module, _unavailable_reason
    _module, _unavailable_reason = None, None
    return LIBRARY


def _load() -> Any:
    """The extension module, or None (with `_unavailable_reason` set, logged once)."""
    global _module, _unavailable_reason
    if _module is not None or _unavailable_reason is not None:
        return _module
    if not wanted_here():
        _unavailable_reason = "not x86-64 Linux"
    elif not LIBRARY.exists():
        _unavailable_reason = f"{LIBRARY.name} is not built (`veloxquant build-cpu-kernels`)"
    elif not is_built():
        _unavailable_reason = (
            f"{LIBRARY.name} was built from another source or MLX "
            "(rebuild: `veloxquant build-cpu-kernels`)"
        )
    else:
        spec = importlib.util.spec_from_file_location(
            f"veloxquant.{MODULE}",
            LIBRARY,
            loader=importlib.machinery.ExtensionFileLoader(f"veloxquant.{MODULE}", str(LIBRARY)),
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if module.cpu_supported():
            _module = module
        else:
            _unavailable_reason = "this CPU lacks AVX2 or FMA"
    if _module is None:
        # Elsewhere MLX's own CPU exp is vectorized: nothing is lost, so nothing to warn of.
        log.log(
            logging.WARNING if wanted_here() else logging.DEBUG,
            "veloxquant: MLX's own CPU exp, softmax and swiglu run (the same results, several "
            "times slower on x86): %s",
            _unavailable_reason,
        )
    return _module


def available() -> bool:
    """Whether `softmax` runs the extension (False, with one log line why, otherwise)."""
    return _load() is not None


def usable(*arrays: mx.array) -> bool:
    """Whether the extension takes these arrays: float32, on the CPU, and built here."""
    return (
        all(a.dtype == mx.float32 for a in arrays) and mx.default_device() == mx.cpu and available()
    )


def exp(x: mx.array) -> mx.array:
    """`mx.exp(x)`, the same bits, for forward passes (no gradient is defined through it)."""
    if usable(x):
        return _module.exp(x)
    return mx.exp(x)


def _softmax_vjp(output: mx.array, cotangent: mx.array) -> mx.array:
    # MLX's Softmax::vjp, op for op, so gradients have its bits too.
    sv = output * cotangent
    return sv - output * mx.sum(sv, axis=-1, keepdims=True)


@mx.custom_function
def _native_softmax(x: mx.array) -> mx.array:
    return _module.softmax(x)


@_native_softmax.vjp
def _native_softmax_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> mx.array:
    return _softmax_vjp(output, cotangent)


def softmax(x: mx.array) -> mx.array:
    """`mx.softmax(x, axis=-1, precise=True)`, the same bits; the extension's on the CPU for
    float32."""
    if x.ndim >= 1 and usable(x):
        return _native_softmax(x)
    return mx.softmax(x, axis=-1, precise=True)


def _visible(scores: mx.array, offset: int) -> mx.array:
    n_queries, n_keys = scores.shape[-2:]
    return mx.arange(offset, offset + n_queries)[:, None] >= mx.arange(n_keys)[None]


def _lowest(dtype: mx.Dtype) -> mx.array:
    return mx.array(mx.finfo(dtype).min, dtype)


def causal_softmax(scores: mx.array, offset: int) -> mx.array:
    """`softmax(where(causal, scores, lowest))` over the last axis of scores [..., Lq, Lk],
    where query i sees keys j <= offset + i (MLX's causal attention mask), with its bits and
    its gradients' bits; the extension computes only the visible part of each row."""
    if scores.ndim >= 2 and usable(scores):
        return _native_causal_softmax(offset)(scores)
    return mx.softmax(
        mx.where(_visible(scores, offset), scores, _lowest(scores.dtype)), axis=-1, precise=True
    )


@functools.lru_cache(maxsize=64)
def _native_causal_softmax(offset: int) -> Any:
    """The extension's causal softmax for one offset, with its vjp (a custom function takes
    arrays only, so the offset is bound here)."""

    @mx.custom_function
    def fn(scores: mx.array) -> mx.array:
        return _module.causal_softmax(scores, offset)

    @fn.vjp
    def fn_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> mx.array:
        # MLX's Select::vjp for the scores: the mask as floats times the softmax's vjp (a custom
        # function of one array gets that array as its primals).
        seen = _visible(primals, offset).astype(cotangent.dtype)
        return seen * _softmax_vjp(output, cotangent)

    return fn


@mx.custom_function
def _native_logsumexp(x: mx.array) -> mx.array:
    return _module.logsumexp(x)


@_native_logsumexp.vjp
def _native_logsumexp_vjp(primals: Any, cotangent: mx.array, output: mx.array) -> mx.array:
    # MLX's LogSumExp::vjp: the cotangent times the input's softmax.
    return cotangent * _native_softmax(primals)


def logsumexp(x: mx.array) -> mx.array:
    """`mx.logsumexp(x, axis=-1, keepdims=True)`, the same bits (and gradients' bits)."""
    if x.ndim >= 1 and usable(x):
        return _native_logsumexp(x)
    return mx.logsumexp(x, axis=-1, keepdims=True)


def log_softmax(x: mx.array) -> mx.array:
    """`x - mx.logsumexp(x, axis=-1, keepdims=True)`, the same bits (and gradients' bits)."""
    return x - logsumexp(x)


def _mlx_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return mlx_lm_swiglu(gate, up)


@mx.custom_function
def _native_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return _module.swiglu(gate, up)


@_native_swiglu.vjp
def _native_swiglu_vjp(primals: Any, cotangent: mx.array, output: mx.array):
    # mlx-lm's own swiglu's vjp (it recomputes the sigmoid with MLX's exp): the same bits.
    _, grads = mx.vjp(_mlx_swiglu, list(primals), [cotangent])
    return tuple(grads)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """mlx-lm's `swiglu(gate, up)` (`nn.silu(gate) * up`), the same bits (and gradients')."""
    if gate.shape == up.shape and usable(gate, up):
        return _native_swiglu(gate, up)
    return _mlx_swiglu(gate, up)


def _mlx_quantized_matmul(transpose: bool, group_size: int, bits: int) -> Any:
    def fn(x, w, scales, biases):
        return mx.quantized_matmul(
            x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits
        )

    return fn


@functools.lru_cache(maxsize=64)
def _native_quantized_matmul(transpose: bool, group_size: int, bits: int) -> Any:
    """The extension's quantized matmul for one layout, with MLX's own vjp for x, the scales and
    the biases (through `mx.vjp` of `mx.quantized_matmul`: the same bits)."""
    reference = _mlx_quantized_matmul(transpose, group_size, bits)

    @mx.custom_function
    def fn(x, w, scales, biases):
        return _module.quantized_matmul(x, w, scales, biases, transpose, group_size, bits)

    @fn.vjp
    def fn_vjp(primals: Any, cotangent: mx.array, output: mx.array):
        x, w, scales, biases = primals
        # MLX defines none for the codes: they get zeros
        _, grads = mx.vjp(lambda x, s, b: reference(x, w, s, b), [x, scales, biases], [cotangent])
        return grads[0], mx.zeros_like(w), grads[1], grads[2]

    return fn


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    transpose: bool,
    group_size: int,
    bits: int,
) -> mx.array:
    """`mx.quantized_matmul` of an affine-quantized w (mlx-lm's quantized KV cache), the same
    bits; the extension's on the CPU for float32 x, scales and biases, where MLX's is a scalar
    loop."""
    if (
        biases is not None
        and w.dtype == mx.uint32
        and x.ndim >= 2
        and w.ndim >= 2
        and scales.shape[:-2] == w.shape[:-2]
        and usable(x, scales, biases)
    ):
        return _native_quantized_matmul(transpose, group_size, bits)(x, w, scales, biases)
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits
    )


# veloxquant.kmeans scores a vector against a centroid with an OpenBLAS GEMM of inner
# dimension d + 1; its pinned Haswell kernel sums each score in order (what `nearest_centroid`
# does) up to d = 6, and in another order from d = 7 on.
NEAREST_MAX_DIM = 6


def nearest_centroid(x: mx.array, c: mx.array) -> tuple[mx.array, mx.array]:
    """veloxquant.kmeans' nearest centroid, the same codes and errors, without a score block:
    x [G, n, d] and c [G or 1, k, d] float32 on the CPU, d <= NEAREST_MAX_DIM (see `usable`) ->
    (codes [G, n] uint32, squared errors [G, n] float32). Raises on a NaN distance."""
    if not (usable(x, c) and x.ndim == 3 and x.shape[-1] <= NEAREST_MAX_DIM):
        raise ValueError(
            "cpu_kernels.nearest_centroid takes float32 x [G, n, d <= 6] on the CPU with the "
            "extension built; use veloxquant.kmeans.assign"
        )
    codes, err = _module.nearest_centroid(x, c)
    return codes, err


def nearest_pair_codeword(u: mx.array, v: mx.array, cross: mx.array) -> tuple[mx.array, mx.array]:
    """CommVQ's nearest of K*K codewords from its separable terms, the same codes and scores:
    u, v [G, n, K] and cross [G, K, K] float32 on the CPU -> (codes [G, n] uint32, the first
    smallest a*K + b of (u_a + v_b) + cross_ab; that score [G, n]), without the [n, K*K] block.
    Raises on a NaN score."""
    if not usable(u, v, cross):
        raise ValueError(
            "cpu_kernels.nearest_pair_codeword takes float32 arrays on the CPU with the "
            "extension built"
        )
    codes, best = _module.nearest_pair_codeword(u, v, cross)
    return codes, best


def cluster_sums(x: mx.array, codes: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The sum [G, k, d] and count [G, k] (float32) of the vectors x [G, n, d] assigned to each
    of k centroids by codes [G, n] uint32, added in the order of the vectors as MLX's CPU
    scatter-add adds them (the same bits); the extension's, on the CPU."""
    if not (usable(x) and codes.dtype == mx.uint32):
        raise ValueError(
            "cpu_kernels.cluster_sums takes float32 x and uint32 codes on the CPU with the "
            "extension built"
        )
    sums, counts = _module.cluster_sums(x, codes, k)
    return sums, counts


def kmeanspp_draws(x: mx.array, first: mx.array, u: mx.array) -> mx.array:
    """veloxquant.kmeans' k-means++ D² draws, the same indices: x [G, m, d] float32, the first
    point of each group (uint32 [G]) and one uniform per draw and group (u [K - 1, G] float32)
    -> the K drawn indices [G, K] uint32, in one pass over the groups instead of K - 1 rounds of
    MLX operations."""
    if not (usable(x, u) and first.dtype == mx.uint32):
        raise ValueError(
            "cpu_kernels.kmeanspp_draws takes float32 x and u and uint32 first on the CPU with "
            "the extension built"
        )
    (idx,) = _module.kmeanspp_draws(x, first, u)
    return idx


def vecinfer_coded_attention(
    qt: mx.array,
    ab: mx.array | None,
    key_codes: mx.array,
    key_book: mx.array,
    value_codes: mx.array,
    value_book: mx.array,
    phases: mx.array | None,
    n_coded: int,
    key_bits: int,
    value_bits: int,
) -> tuple[mx.array, mx.array, mx.array]:
    """VecInfer's attention over the first n_coded coded tokens, straight from the packed codes,
    in one pass (`veloxquant.methods.vecinfer.kernels.cpu_kernel_attention`): the transformed,
    scaled query rows qt [B, H, R, D]; with a key mean, the rows' `rope.phase_coefficients` ab
    [B, H, R, D] and the coded positions' `rope.phase_table` phases [n_coded, D], else None; code
    buffers [B, H, capacity, bytes] uint8; books [1 or H, 2^bits, d] float32 -> (running max
    [B, H, R], sum [B, H, R], Σ exp(s - max) · value codewords [B, H, R, D]). Not the bits of
    MLX's ops (its sums run in another order): tests bound it against the pure-MLX twin."""
    if (ab is None) != (phases is None):
        raise ValueError("vecinfer_coded_attention: ab and phases come together (a key mean)")
    if not usable(qt, key_book, value_book, *[x for x in (ab, phases) if x is not None]):
        raise ValueError(
            "cpu_kernels.vecinfer_coded_attention takes float32 queries and books on the CPU "
            "with the extension built"
        )
    if ab is None:
        ab = phases = mx.zeros((1,), mx.float32)
    running_max, total, output = _module.vecinfer_coded_attention(
        qt,
        ab,
        key_codes,
        key_book,
        value_codes,
        value_book,
        phases,
        n_coded,
        key_bits,
        value_bits,
    )
    return running_max, total, output


@contextlib.contextmanager
def vectorized() -> Iterator[None]:
    """For the duration of a block, CPU float32 attention with a causal or no mask goes through
    `veloxquant.attention.cpu_attention` (the dispatch is installed for it), and mlx-lm's
    swiglu, in every loaded model module that bound it, through `swiglu`; both are put back
    after. Without the extension MLX's own ops run inside (the same bits; one log line says so)."""
    from veloxquant import attention

    available()  # says once, now, if MLX's ops will run instead
    patched = []
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("mlx_lm.models.")
            and name != "mlx_lm.models.activations"  # where the vjp and the fallback find it
            and getattr(module, "swiglu", None) is mlx_lm_swiglu
        ):
            module.swiglu = swiglu
            patched.append(module)
    try:
        with attention.native_softmax():
            yield
    finally:
        for module in patched:
            module.swiglu = mlx_lm_swiglu


def commvq_coded_attention(
    q: mx.array,
    theta: mx.array,
    theta_scale: mx.array | None,
    gains: mx.array,
    mean: mx.array | None,
    key_codes: mx.array,
    key_scales: mx.array,
    value_codes: mx.array,
    value_book: mx.array,
    phases: mx.array,
    n_coded: int,
    value_bits: int,
    traditional: bool,
) -> tuple[mx.array, mx.array, mx.array]:
    """CommVQ's attention over the first n_coded coded tokens, straight from the packed codes,
    in one pass (`veloxquant.methods.commvq.kernels.cpu_kernel_attention`): each block of keys
    rebuilt from the shared atoms and per-stage gains and rotated at its positions in L1, never
    as an array. The scaled query rows q [B, H, R, D]; the cache's shared atoms θ
    [S, 1, D/2, 64, 2] with their per-pair scales [S, 1, D/2, 1, 1] (or None), gains
    [G, stages, D/2, 2] and key mean [H, D] (or None), float32, in the model's channel order
    (`traditional`: RoPE pairs (2j, 2j + 1), else (j, j + D/2)); code buffers
    [B, H, capacity, bytes] uint8 and key scales [B, H, capacity] float32; the value book
    [1 or H, 2^bits, d]; the coded positions' `rope.phase_table` phases [n_coded, D] -> (running
    max [B, H, R], sum [B, H, R], Σ exp(s - max) · value codewords [B, H, R, D]). Not the bits of
    MLX's ops (its sums run in another order): tests bound it against the pure-MLX twin."""
    given = [x for x in (theta_scale, mean) if x is not None]
    if not usable(q, theta, gains, key_scales, value_book, phases, *given):
        raise ValueError(
            "cpu_kernels.commvq_coded_attention takes float32 queries, codebooks, scales and "
            "phases on the CPU with the extension built"
        )
    none = mx.zeros((1,), mx.float32)
    return tuple(
        _module.commvq_coded_attention(
            q,
            theta,
            none if theta_scale is None else theta_scale,
            gains,
            none if mean is None else mean,
            key_codes,
            key_scales,
            value_codes,
            value_book,
            phases,
            n_coded,
            value_bits,
            traditional,
        )
    )
