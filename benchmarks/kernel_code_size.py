"""The partial decode-attention kernel's machine code, without a GPU: registers, bytes of SASS,
and bytes per phase (8B layer shape, default layout, the synthetic caches of bench_kernels.py).

    python benchmarks/kernel_code_size.py
    python benchmarks/kernel_code_size.py --baseline /tmp/base_kernels.py
    python benchmarks/kernel_code_size.py --one-launch --constants COMBINE_FLOAT4=0 \
        --baseline /tmp/base_kernels.py
    python benchmarks/kernel_code_size.py --one-launch --rope-in --baseline /tmp/base_kernels.py

It writes the CUDA translation unit MLX would hand NVRTC, with the timeline stamps of
`profile_partial_kernel.py` at the phase boundaries, compiles it for sm_90a with NVRTC as MLX
does (`tests/nvrtc.py`, from the test extra; `--nvcc` for nvcc -cubin instead, whose register
allocation differs a little), disassembles it with cuobjdump, and reports the bytes from each
stamp to the next in code order (the compiler's layout: the exact tokens' branch comes first,
and the span that ends at "Hadamard" is the coded branch's start). Fetching a fully unrolled
loop's instructions once per tile took longer than its arithmetic on the H200
(benchmarks/results/instruction-fetch-h200.txt), so code size is worth watching.

`--one-launch` reports the one-launch kernel instead (the decode steps' kernel on CUDA), with
`profile_partial_kernel.py timeline-one`'s stamps: the bytes of its merge (and of each phase of
it that timeline-one times) and the runs of global loads between two branches there, which
bound the loads a thread has in flight; then, in the kernel as MLX runs it (the stamps move the
register allocation), the registers and the instructions each SIMD group issues per tile of the
coded tokens' loop, by kind (their count times the cycles per issue is the split's time,
benchmarks/results/mma-tile-loop-sass-cpu.md; counts before 2026-12-07 were of the stamped
copy) (`--constants COMBINE_FLOAT4=0` and the like set this tree's kernels module first).

Needs cuobjdump (and for `--nvcc`, nvcc) on PATH or in $CUDA_HOME/bin; the `nvidia-cuda-cuobjdump`
wheel has one, and cuobjdump -sass runs nvdisasm (`pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`, then their nvidia/cu13/bin on PATH). The MLX header the
source includes is replaced by a stub that includes CUDA's fp16 / bf16 headers.
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests package
from tests import nvrtc  # noqa: E402

from ab_kernel_revisions import load_baseline
from ncu_source_stalls import tile_loop
from bench_kernels import decode_inputs
from profile_partial_kernel import MERGE_PHASES, ONE_MERGE_STAMPS, STAMP_NAMES, stamped_source
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


USE_NVCC = False  # --nvcc


def compile_and_read(source: str, work: Path, tag: str) -> tuple[str, str]:
    """(ptxas's resource line, the SASS listing) of `source`."""
    cubin = work / f"{tag}.cubin"
    if not USE_NVCC:
        done = nvrtc.compile_cuda(source)
        if not done.ok:
            raise SystemExit(f"NVRTC failed on {tag}:\n{done.log[-3000:]}")
        cubin.write_bytes(done.cubin)
        log = done.log
    else:
        (work / "mlx/backend/cuda/device").mkdir(parents=True, exist_ok=True)
        (work / "mlx/backend/cuda/device/utils.cuh").write_text(_STUB)
        cu = work / f"{tag}.cu"
        cu.write_text(source)
        cmd = [_tool("nvcc"), "-cubin", "-arch=sm_90a", "-std=c++17", f"-I{work}", "-Xptxas", "-v"]
        done = subprocess.run([*cmd, str(cu), "-o", str(cubin)], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"nvcc failed on {cu}:\n{done.stderr[-3000:]}")
        log = done.stderr
    used = [line.strip() for line in log.splitlines() if "Used" in line]
    sass = subprocess.run(
        [_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    return (used[0] if used else "?"), sass


def stamp_slots(sass: str) -> list[tuple[int, int | None]]:
    """(code address, slot) of every timeline stamp, in code order: each stamp reads
    %globaltimer (CS2R ... SR_GLOBALTIMERLO) and stores it at slot k's offset, 8·k bytes into
    the group's row (None where no such store follows)."""
    lines = sass.splitlines()
    marks = []
    for i, line in enumerate(lines):
        if "SR_GLOBALTIMERLO" not in line:
            continue
        at = int(re.search(r"/\*([0-9a-f]+)\*/", line).group(1), 16)
        slot = None
        for later in lines[i : i + 60]:
            store = re.search(r"STG\.E .*?\[R\d+\.64(?:\+0x([0-9a-f]+))?\], R\d+ ;", later)
            if store:
                slot = (int(store.group(1), 16) if store.group(1) else 0) // 8
                break
        marks.append((at, slot))
    return marks


def phase_bytes(sass: str) -> list[tuple[int, str]]:
    """(code address, stamp name) of every timeline stamp of the partial kernel, in code order
    (per-tile slots use a computed address, offset 0: named by the tile's first slot)."""
    marks, per_tile = [], iter(["tile phase table", "tile scores", "tile softmax", "tile values"])
    for at, slot in stamp_slots(sass):
        if slot is None:
            name = "?"
        elif slot or not marks:  # slot 0, "start", is the kernel's first stamp
            name = STAMP_NAMES[slot]
        else:
            name = next(per_tile, "?")
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


def one_launch_report(tag: str, kernels, work: Path, rope_in: bool = False) -> None:
    """The one-launch kernel (CUDA; 8B layer shape, default layout, bf16) with the stamps of
    `profile_partial_kernel.py timeline-one`: registers, and of the code from the split's end
    to the merge's, its bytes and the most global loads between two branches (the loads a
    thread can have in flight in the merge's split loop). With `rope_in`, its variant that
    rotates the step's query and key itself."""
    import veloxquant.kernels as vk
    from profile_partial_kernel import one_launch_stamped

    backend, vk.backend = vk.backend, lambda: "cuda"  # the one launch is CUDA's
    count, vk.cuda_multiprocessors = vk.cuda_multiprocessors, lambda: vk.TIMED_CARD_MULTIPROCESSORS
    shared, vk.cuda_shared_memory = vk.cuda_shared_memory, lambda: vk.TIMED_CARD_SHARED_MEMORY
    try:
        caches, qs, pend = decode_inputs(16384, 1, 1, H, G, D)
        caches[0]._reserve_codes(1)  # room for the in-place encode, as fused_attention makes
        a = kernels.attention_inputs(caches[0], qs[0], 1 / math.sqrt(D), pend[0])
    finally:
        vk.backend, vk.cuda_multiprocessors, vk.cuda_shared_memory = backend, count, shared
    if len(a["sources"]) != 1:
        raise SystemExit(f"{kernels.__file__}: the step is not one launch (ONE_LAUNCH off?)")
    src = a["sources"][0]
    if rope_in:
        window = a["partial"][7].dtype  # ONE_LAUNCH_INPUTS' win_k
        src = kernels.one_launch_kernel_source(a["layout"], qs[0].dtype, window, a["r"], True)
    inputs = [dtype_name(x.dtype) for x in a["partial"]]
    outputs = ["float32", dtype_name(qs[0].dtype)]
    # the stamps move the register allocation (the tile loop by up to 2%), so the kernel as MLX
    # runs it gives the registers and the loop, and the stamped one the merge's bytes
    used, sass = compile_and_read(
        src.cuda_translation_unit(inputs, outputs), work, tag.replace(" ", "_") + "_unstamped"
    )
    loop_code = _sass_code(sass)
    print(f"{tag}: {kernels.__file__}, one launch" + (", rotating (rope_in)" if rope_in else ""))
    print(f"  {used}")
    stamped = one_launch_stamped(src)
    tu = stamped.cuda_translation_unit(inputs, [*outputs, "uint32", "uint32"])
    sass = compile_and_read(tu, work, tag.replace(" ", "_"))[1]
    code = _sass_code(sass)
    stamps = one_launch_stamp_addresses(sass)
    runs, run = [], [0, 0]  # global loads between two branches: [all, 128-bit]
    for at, ins in code:
        if not stamps[1] <= at < stamps[2]:
            continue
        if "BRA" in ins:
            runs.append(run)
            run = [0, 0]
        elif "LDG" in ins:
            run = [run[0] + 1, run[1] + (".128" in ins)]
    runs = sorted([r for r in runs + [run] if r[0]], reverse=True)[:6]
    print(f"  {loop_code[-1][0] + 16} bytes of SASS; the merge (split done -> merged, stamped) "
          f"{stamps[2] - stamps[1]} bytes; its longest runs of global loads between two branches: "
          + ", ".join(f"{n} ({w} of 128 bits)" for n, w in runs))  # fmt: skip
    print("  the merge's phases (timeline-one's names), bytes: " + ", ".join(
        f"{name} {stamps[b] - stamps[a]}" for name, a, b in MERGE_PHASES))  # fmt: skip
    tile_loop_report(loop_code, 32 * a["r"])


def _sass_code(sass: str) -> list[tuple[int, str]]:
    """[(address, instruction)] of a cuobjdump -sass listing."""
    return [
        (int(m.group(1), 16), m.group(2))
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)
    ]


def one_launch_stamp_addresses(sass: str) -> dict[int, int]:
    """{stamp slot: code address} of the one-launch kernel's timeline-one stamps."""
    found = {slot: at for at, slot in stamp_slots(sass)}
    want = {0, 1, 2, 3, *(k for _, k in ONE_MERGE_STAMPS)}
    if set(found) != want:
        raise SystemExit(
            f"expected timeline-one's stamps {sorted(want)} in the SASS, found {found}"
        )
    return found


def tile_loop_report(code: list[tuple[int, str]], tokens_per_warp: int) -> None:
    """The coded tokens' tile loop: the backward branch whose body holds the most HMMAs. Its
    instructions are what each SIMD group issues per tile (`tokens_per_warp` coded tokens), so
    their count bounds the split's time when the schedulers issue every cycle."""
    start, end = tile_loop(code)
    loop = [ins for at, ins in code if start <= at <= end]
    body = [re.sub(r"^@!?U?P\w+\s+", "", ins).split(" ")[0] for ins in loop]
    hmma = sum(op.startswith("HMMA") for op in body)
    kinds = collections.Counter(op.split(".")[0] for op in body)
    print(f"  tile loop: {len(body)} instructions per SIMD group and tile ({hmma} HMMA), "
          f"{len(body) / tokens_per_warp:.1f} per coded token; "
          + ", ".join(f"{k} {n}" for k, n in kinds.most_common(10))
          + f"; local memory LDL {kinds['LDL']}, STL {kinds['STL']}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--baseline", help="a kernels.py of another revision, reported first")
    p.add_argument("--one-launch", action="store_true", help="the one-launch kernel's merge")
    p.add_argument("--rope-in", action="store_true", help="... rotating the step's q and k")
    p.add_argument("--constants", nargs="*", default=[], help="NAME=INT: this tree's settings")
    p.add_argument("--nvcc", action="store_true", help="compile with nvcc, not NVRTC")
    args = p.parse_args()
    global USE_NVCC
    USE_NVCC = args.nvcc
    for kv in args.constants:  # e.g. COMBINE_FLOAT4=1
        name, value = kv.split("=")
        if not isinstance(getattr(current, name, None), int):
            raise SystemExit(f"--constants: the kernels module has no integer setting {name}")
        setattr(current, name, int(value))
    if args.rope_in and not args.one_launch:
        raise SystemExit("--rope-in is a variant of the one-launch kernel: add --one-launch")
    run = report
    if args.one_launch:
        run = functools.partial(one_launch_report, rope_in=args.rope_in)
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            run("baseline", load_baseline(args.baseline), Path(tmp))
        run("this tree", current, Path(tmp))


if __name__ == "__main__":
    main()
