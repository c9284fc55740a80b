"""Compile the one-launch decode-attention kernel as MLX 0.32's CUDA backend does, without a
GPU: the source text of its `build_kernel` (our header and body as `compiled` hands them over,
#include lines included), NVRTC with MLX's options and its name expression of the kernel
(which the launch-bounds macro must not break), SASS for sm_90a; then the registers, stack and
threadgroup memory of the binary. For the 8B layer shape and default layout, with the coded
tokens on the CUDA cores and on the tensor cores (`kernels.MMA`); then KIVI's partial kernel
(8B shape, G 64, 2/2, 4/2 and 3/5 key/value bits) and its combine (bfloat16 output).

    pip install "nvidia-cuda-nvrtc==13.*"          # libnvrtc, as the MLX CUDA wheel uses
    git clone --depth 1 https://github.com/ml-explore/mlx /tmp/mlx   # MLX's device headers
    python benchmarks/check_nvrtc_compile.py --mlx-source /tmp/mlx

Needs a CUDA toolkit's headers (cuda_fp16.h, cccl; `--cuda-include`, default
$CUDA_HOME/include) and cuobjdump (as kernel_code_size.py). The device headers MLX compiles
into its library are those of its source tree (`mlx/backend/cuda/device`).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

import veloxquant.kernels as vk
from bench_kernels import decode_inputs
from kernel_code_size import D, G, H, _tool
from veloxquant.methods.kivi import kernels as KIVI
from veloxquant.methods.vecinfer import kernels as K

# MLX 0.32's custom_kernel.cpp (build_kernel) and jit_module.cpp (compile)
MLX_PREAMBLE = (
    '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
)
MLX_NAMESPACE = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"


def nvrtc_library(path: str | None) -> ctypes.CDLL:
    if path:
        return ctypes.CDLL(path)
    import nvidia  # the nvidia-cuda-nvrtc wheel's namespace package

    for root in nvidia.__path__:
        for lib in sorted(Path(root).glob("cu*/lib/libnvrtc.so*")):
            if "builtins" not in lib.name:
                return ctypes.CDLL(str(lib))
    raise SystemExit("libnvrtc not found: pip install 'nvidia-cuda-nvrtc==13.*'")


def mlx_source_text(src: vk.KernelSource, name: str, in_dtypes: list, out_dtypes: list) -> str:
    body, header = vk.cuda_kernel_text(src, name)
    args = [
        f"    const {vk.CUDA_TYPES[d]}* {n}" for n, d in zip(src.inputs, in_dtypes, strict=True)
    ]
    args += [f"    {vk.CUDA_TYPES[d]}* {n}" for n, d in zip(src.outputs, out_dtypes, strict=True)]
    signature = f"__global__ void custom_kernel_{name}(\n" + ",\n".join(args) + ") {\n"
    return MLX_PREAMBLE + header + MLX_NAMESPACE + signature + body + "}\n\n} // namespace\n"


def compile_like_mlx(nvrtc, text: str, name: str, includes: list[str], work: Path) -> str:
    """NVRTC as MLX runs it; returns cuobjdump's resource usage of the kernel."""

    def check(status: int, prog=None) -> None:
        if status == 0:
            return
        log = b""
        if prog is not None:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, buf)
            log = buf.value
        raise SystemExit(f"NVRTC error {status}:\n{log.decode()[-4000:]}")

    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"k.cu", 0, None, None))
    expression = f"mlx::core::cu::custom_kernel_{name}".encode()
    check(nvrtc.nvrtcAddNameExpression(prog, expression))
    options = [b"--device-as-default-execution-space", b"--gpu-architecture=sm_90a"]
    options += [f"--include-path={p}".encode() for p in includes]
    check(
        nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options)),
        prog,
    )
    lowered = ctypes.c_char_p()
    check(nvrtc.nvrtcGetLoweredName(prog, expression, ctypes.byref(lowered)), prog)
    size = ctypes.c_size_t()
    check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
    cubin = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetCUBIN(prog, cubin))
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    (work / "k.cubin").write_bytes(cubin.raw)
    usage = subprocess.run(
        [_tool("cuobjdump"), "-res-usage", str(work / "k.cubin")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return " ".join(line.strip() for line in usage.splitlines() if "REG:" in line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mlx-source", required=True, help="an MLX source tree (its device headers)")
    default = str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include")
    p.add_argument("--cuda-include", default=default)
    p.add_argument("--nvrtc", help="libnvrtc.so (default: the nvidia-cuda-nvrtc wheel's)")
    args = p.parse_args()
    includes = [args.mlx_source, args.cuda_include, str(Path(args.cuda_include) / "cccl")]
    nvrtc = nvrtc_library(args.nvrtc)
    for mma in (False, True):
        K.MMA = mma
        K.clear_memos()
        caches, qs, pend = decode_inputs(4096, 1, 1, H, G, D)
        a = K.attention_inputs(caches[0], qs[0], 1 / D**0.5, pend[0], one_launch=True)
        src = a["sources"][0]
        ins = [vk.dtype_name(x.dtype) for x in a["partial"]]
        name = vk.compiled_name(src, tuple(ins))
        for files in (True, False):  # the #include lines MLX holds, and the text itself
            vk.CUDA_SOURCE_FILES = files
            text = mlx_source_text(src, name, ins, ["float32", vk.dtype_name(qs[0].dtype)])
            with tempfile.TemporaryDirectory() as tmp:
                usage = compile_like_mlx(nvrtc, text, name, includes, Path(tmp))
            print(f"MMA {mma}, source files {files}: {usage}")
    for kb, vb in ((2, 2), (4, 2), (3, 5)):
        lay = KIVI.Layout(D, 64, kb, vb, G)
        ins = ["bfloat16", "int32", "uint32", "float16", "float16", "uint32", "float16"]
        ins += ["float16"] * 5 + ["bfloat16", "bfloat16", "int32", "float32"]
        usage = compile_kivi(nvrtc, KIVI.partial_kernel_source(lay), ins, ["float32"] * 3, includes)
        print(f"KIVI partial {lay}: {usage}")
    src = KIVI.combine_kernel_source(D, G, mx.bfloat16)
    ins = ["float32", "float32", "float32", "int32", "int32"]
    print(f"KIVI combine: {compile_kivi(nvrtc, src, ins, ['bfloat16'], includes)}")


def compile_kivi(nvrtc, src: vk.KernelSource, ins: list, outs: list, includes: list) -> str:
    name = vk.compiled_name(src, tuple(ins))
    text = mlx_source_text(src, name, ins, outs)
    with tempfile.TemporaryDirectory() as tmp:
        return compile_like_mlx(nvrtc, text, name, includes, Path(tmp))


if __name__ == "__main__":
    main()
