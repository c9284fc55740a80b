"""Platform setup that must run before `mlx.core` is first imported.

The Linux `mlx[cpu]` wheel links the reference netlib BLAS (~6 GFLOP/s float32 GEMM).
Loading OpenBLAS into the global symbol namespace first makes MLX resolve its BLAS
symbols there instead (20-30x faster). See DESIGN.md section 4.
"""

from __future__ import annotations

import ctypes
import os
import sys

# Debian's libopenblas0-pthread registers itself as the libblas.so.3 alternative; loading
# libopenblas.so.0 by its own name does not take over MLX's BLAS symbols (measured: no speedup).
_BLAS_CANDIDATES = ("libblas.so.3",)
blas_library: str | None = None
# OpenBLAS picks its GEMM kernels by CPU at load time, and the AVX2 and AVX-512 kernels round
# differently: the same pipeline on two x86 machines of one kind wrote different artifacts
# (every calibration after capture, and every metric). Pinning the AVX2 kernels, which every
# CPU with AVX2 and FMA runs, makes them the same bytes; on an AVX-512 CPU they run the
# model's matmuls slower (benchmarks/results/bench_cpu_forward-cpu.txt).
BLAS_CORETYPE = "Haswell"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pin_blas_kernels() -> None:
    """Set OPENBLAS_CORETYPE to BLAS_CORETYPE (unless it is set already, or the CPU lacks AVX2
    and FMA) so that OpenBLAS runs the same kernels, with the same float sums, on every x86
    machine. Set OPENBLAS_CORETYPE yourself (e.g. SkylakeX) to choose other kernels, at the
    price of other bytes; an empty value counts as unset (OpenBLAS would detect the CPU)."""
    if not os.environ.get("OPENBLAS_CORETYPE") and {"avx2", "fma"} <= _cpu_flags():
        os.environ["OPENBLAS_CORETYPE"] = BLAS_CORETYPE


def blas_pinned() -> bool:
    """Whether MLX's CPU GEMMs run OpenBLAS's pinned BLAS_CORETYPE kernels (preloaded here,
    OPENBLAS_CORETYPE as pin_blas_kernels sets it): the sums veloxquant.cpu_kernels'
    k-means assignment reproduces."""
    return blas_library is not None and os.environ.get("OPENBLAS_CORETYPE") == BLAS_CORETYPE


def preload_blas() -> str | None:
    """Load OpenBLAS globally on Linux; return the library loaded, or None."""
    global blas_library
    if blas_library is not None or not sys.platform.startswith("linux"):
        return blas_library
    if os.environ.get("VELOXQUANT_NO_BLAS_PRELOAD"):
        return None
    if "mlx.core" in sys.modules:
        # Too late to affect symbol resolution; say so rather than pretend.
        print(
            "veloxquant: mlx.core was imported before veloxquant; OpenBLAS preload skipped "
            "(matmul will be slow). Import veloxquant first.",
            file=sys.stderr,
        )
        return None
    pin_blas_kernels()
    for name in _BLAS_CANDIDATES:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        blas_library = name
        return name
    print(
        "veloxquant: OpenBLAS not found; MLX CPU matmul will be ~30x slower. "
        "Install it with: apt-get install libopenblas0-pthread",
        file=sys.stderr,
    )
    return None


def full_float32_matmuls() -> None:
    """Keep float32 matmuls in full float32 on GPUs whose MLX backend would use TF32 (CUDA,
    Apple M5): k-means, the codebook encoder and the capture statistics compare distances that
    TF32's 10-bit mantissa blurs (measured on an H200: 3e-4 relative GEMM error against 1e-6 on
    the CPU, enough to mis-assign near points and fail the k-means tests). Models run in
    float16/bfloat16 on a GPU, so this does not slow them. Set MLX_ENABLE_TF32=1 to override."""
    if "mlx.core" not in sys.modules:
        os.environ.setdefault("MLX_ENABLE_TF32", "0")


def default_dtype() -> str:
    """float32 on the CPU backend (fp16 matmul is slow there), float16 on a GPU."""
    import mlx.core as mx

    if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return "float16"
    return "float32"


_lane_streams: list = []


def cpu_lanes(n: int = 2) -> list:
    """Streams on which independent pieces of work (eval rows, sequences) run side by side.

    MLX runs each stream's operations on a thread of its own, and on the CPU its elementwise
    and reduction operations are single-threaded (the softmax's exp is most of a forward pass,
    benchmarks/results/pipeline-time-cpu.md), so one stream leaves the other cores idle outside
    OpenBLAS's GEMMs.
    OpenBLAS keeps its thread count (its float sums depend on it), so each piece of work gives
    the same bits on any lane. On a GPU, or with one core, there is one lane: the default
    stream. Callers evaluate the lanes' work together and combine the results in a fixed order.
    """
    import mlx.core as mx

    if n < 1:
        raise ValueError(f"cpu_lanes needs n >= 1, got {n}")
    n = min(n, os.cpu_count() or 1)
    if mx.default_device() != mx.cpu or n == 1:
        return [mx.default_stream(mx.default_device())]
    while len(_lane_streams) < n - 1:  # created once: a stream lives as long as the process
        _lane_streams.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *_lane_streams[: n - 1]]
