"""Compile veloxquant's generated CUDA sources with NVRTC, the compiler MLX's CUDA backend runs
on `mx.fast.cuda_kernel` sources, here on a machine without a GPU.

The kernel emulator (`kernel_emulator.py`) runs the kernels' logic on the CPU, but it stands in
its own C++ for the CUDA-only helpers (the tensor cores' PTX, shared-memory loads by address,
`ex2.approx`): only a CUDA compiler sees those. This one is NVRTC from the `nvidia-cuda-nvrtc`
wheel, with CUDA's headers from `nvidia-cuda-runtime` and `nvidia-cuda-cccl` (the test extra
installs all three on x86-64 Linux), given the translation unit MLX 0.32 builds
(`KernelSource.cuda_translation_unit`) and the options of its `jit_module.cpp`. MLX's own
header is replaced by the CUDA headers it includes. Compiling to SASS also runs ptxas, whose
register and spill counts `compile_cuda` returns.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

# what MLX's mlx/backend/cuda/device/utils.cuh includes from CUDA (its own headers aside)
_MLX_UTILS = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
"""


def _cuda_root() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    for base in spec.submodule_search_locations if spec else []:
        root = Path(base) / "cu13"
        if (root / "lib" / "libnvrtc.so.13").exists():
            return root
    return None


@functools.cache
def _nvrtc() -> ctypes.CDLL | None:
    root = _cuda_root()
    if root is None:
        return None
    # NVRTC opens its builtins library by name: loaded first, by path, it is found
    ctypes.CDLL(str(root / "lib" / "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(root / "lib" / "libnvrtc.so.13"))


def available() -> bool:
    """Whether NVRTC and CUDA's headers are installed (the test extra, on x86-64 Linux)."""
    root = _cuda_root()
    return root is not None and (root / "include" / "cuda_fp16.h").exists()


@dataclass
class Compiled:
    ok: bool
    log: str
    registers: int | None  # per thread, from ptxas (None when it did not run)
    spill_bytes: int | None  # spill stores plus spill loads
    cubin: bytes = b""  # the binary, for cuobjdump (benchmarks/kernel_code_size.py)


def compile_cuda(translation_unit: str, arch: str = "sm_90a") -> Compiled:
    """NVRTC's verdict on a translation unit, compiled to SASS for `arch` as MLX compiles for a
    device of that compute capability (the `a` suffix from 9.0 on)."""
    lib = _nvrtc()
    if lib is None:
        raise RuntimeError("NVRTC is not installed: pip install the test extra (x86-64 Linux)")
    root = _cuda_root()
    prog = ctypes.c_void_p()
    headers = (ctypes.c_char_p * 1)(_MLX_UTILS.encode())
    names = (ctypes.c_char_p * 1)(b"mlx/backend/cuda/device/utils.cuh")
    rc = lib.nvrtcCreateProgram(
        ctypes.byref(prog), translation_unit.encode(), b"kernel.cu", 1, headers, names
    )
    if rc:
        raise RuntimeError(f"nvrtcCreateProgram failed ({rc})")
    try:
        options = [
            "--device-as-default-execution-space",
            f"--gpu-architecture={arch}",
            f"-I{root / 'include'}",
            f"-I{root / 'include' / 'cccl'}",
            "--ptxas-options=-v",
        ]
        args = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), args)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        cubin = b""
        if rc == 0:
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            binary = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, binary)
            cubin = binary.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return Compiled(
        ok=rc == 0,
        log=log,
        registers=int(used.group(1)) if used else None,
        spill_bytes=int(spills.group(1)) + int(spills.group(2)) if spills else None,
        cubin=cubin,
    )
