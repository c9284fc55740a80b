"""The partial decode-attention kernel's machine code, without a GPU: registers, bytes of SASS,
and bytes per phase (8B layer shape, default layout, the synthetic caches of bench_kernels.py).

    python benchmarks/kernel_code_size.py
    python benchmarks/kernel_code_size.py --baseline /tmp/base_kernels.py

It writes the CUDA translation unit MLX would hand NVRTC, with the timeline stamps of
`profile_partial_kernel.py` at the phase boundaries, compiles it with nvcc (`-cubin
-arch=sm_90a`), disassembles it with cuobjdump, and reports the bytes from each stamp to the next
in code order (the compiler's layout: the exact tokens' branch comes first, and the span that
ends at "Hadamard" is the coded branch's start). Fetching a fully unrolled loop's instructions
once per tile took longer than its arithmetic on the H200
(benchmarks/results/instruction-fetch-h200.txt), so code size is worth watching. MLX's NVRTC
allocated 0-14 more registers than nvcc here in that file.

Needs nvcc (CUDA 12 or 13) and cuobjdump on PATH or in $CUDA_HOME/bin; the `nvidia-cuda-cuobjdump`
wheel has one (`pip install nvidia-cuda-cuobjdump`, then its nvidia/cu13/bin). The MLX header the
source includes is replaced by a stub that includes CUDA's fp16 / bf16 headers.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)

from ab_kernel_revisions import load_baseline
from bench_kernels import decode_inputs
from profile_partial_kernel import STAMP_NAMES, stamped_source
from veloxquant.kernels import dtype_name
from veloxquant.methods.vecinfer import kernels as current

H, G, D = 8, 4, 128
_STUB = "#pragma once\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cstdint>\n"


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None and os.environ.get("CUDA_HOME"):
        candidate = Path(os.environ["CUDA_HOME"]) / "bin" / name
        found = str(candidate) if candidate.exists() else None
    if found is None:
        raise SystemExit(f"{name} not found: put it on PATH or set CUDA_HOME (see the docstring)")
    return found


def translation_unit(kernels, stamped: bool) -> str:
    """The partial kernel's CUDA source for the default layout at 4K tokens, as MLX builds it."""
    caches, qs, pend = decode_inputs(4096, 1, 1, H, G, D)
    a = kernels.attention_inputs(caches[0], qs[0], 1 / math.sqrt(D), pend[0])
    src = stamped_source(a["sources"][0]) if stamped else a["sources"][0]
    outputs = ["float32"] * 3 + (["uint32"] if stamped else [])
    return src.cuda_translation_unit([dtype_name(x.dtype) for x in a["partial"]], outputs)


def compile_and_read(source: str, work: Path, tag: str) -> tuple[str, str]:
    """(ptxas's resource line, the SASS listing) of `source`."""
    (work / "mlx/backend/cuda/device").mkdir(parents=True, exist_ok=True)
    (work / "mlx/backend/cuda/device/utils.cuh").write_text(_STUB)
    cu, cubin = work / f"{tag}.cu", work / f"{tag}.cubin"
    cu.write_text(source)
    cmd = [_tool("nvcc"), "-cubin", "-arch=sm_90a", "-std=c++17", f"-I{work}", "-Xptxas", "-v"]
    done = subprocess.run([*cmd, str(cu), "-o", str(cubin)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"nvcc failed on {cu}:\n{done.stderr[-3000:]}")
    used = [line.strip() for line in done.stderr.splitlines() if "Used" in line]
    sass = subprocess.run(
        [_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    return (used[0] if used else "?"), sass


def phase_bytes(sass: str) -> list[tuple[int, str]]:
    """(code address, stamp name) of every timeline stamp, in code order: each stamp reads
    %globaltimer (CS2R ... SR_GLOBALTIMERLO) and stores it at slot k's offset, 8·k bytes into
    the group's row (per-tile slots use a computed address: named by the tile's first slot)."""
    lines = sass.splitlines()
    marks, per_tile = [], iter(["tile phase table", "tile scores", "tile softmax", "tile values"])
    for i, line in enumerate(lines):
        if "SR_GLOBALTIMERLO" not in line:
            continue
        at = int(re.search(r"/\*([0-9a-f]+)\*/", line).group(1), 16)
        name = "?"
        for later in lines[i : i + 60]:
            store = re.search(r"STG\.E .*?\[R\d+\.64(?:\+0x([0-9a-f]+))?\], R\d+ ;", later)
            if store:
                offset = int(store.group(1), 16) if store.group(1) else 0
                if offset or not marks:  # slot 0, "start", is the kernel's first stamp
                    name = STAMP_NAMES[offset // 8]
                else:
                    name = next(per_tile, "?")
                break
        marks.append((at, name))
    return marks


def report(tag: str, kernels, work: Path) -> None:
    used, sass = compile_and_read(translation_unit(kernels, False), work, f"{tag}_plain")
    addresses = [int(x, 16) for x in re.findall(r"/\*([0-9a-f]{4,})\*/", sass)]
    print(f"{tag}: {kernels.__file__}")
    print(f"  {used}")
    print(f"  {max(addresses) + 16} bytes of SASS")
    _, sass = compile_and_read(translation_unit(kernels, True), work, f"{tag}_stamped")
    marks = phase_bytes(sass)
    end = max(int(x, 16) for x in re.findall(r"/\*([0-9a-f]{4,})\*/", sass)) + 16
    print("  bytes from each timeline stamp to the next, in code order:")
    for (at, name), (nxt, after) in zip(marks, [*marks[1:], (end, "code end")], strict=True):
        print(f"    {name:>18} -> {after:<18} at {at:#08x}: {nxt - at:6d} bytes")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--baseline", help="a kernels.py of another revision, reported first")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            report("baseline", load_baseline(args.baseline), Path(tmp))
        report("this tree", current, Path(tmp))


if __name__ == "__main__":
    main()
