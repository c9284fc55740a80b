"""The one-launch decode-attention kernel's loops in machine code, without a GPU: for the 8B
layer shape and default layout, its coded tokens on the CUDA cores and on the tensor cores
(`kernels.MMA`): registers, threadgroup memory, threadgroups per multiprocessor that those
allow on an H200, and the instructions in the span of every loop (a backward branch to it), with
the kinds that tell the loops apart.

    python benchmarks/kernel_loops.py
    python benchmarks/kernel_loops.py --kivi   # KIVI's partial kernel (8B shape, G 64, 2/2 bits)
    python benchmarks/kernel_loops.py --commvq # CommVQ's partial kernel (8B shape, 2-bit keys)

A loop's instructions run once per trip, so the tile loop's cost per tile is its own
instructions plus each inner loop's times its trips (the trips are the layout's: see
benchmarks/results/mma-tiles-cpu.md). Compiles with NVRTC (or nvcc) and needs cuobjdump, as
kernel_code_size.py.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)

from bench_kernels import decode_inputs
from kernel_code_size import D, G, H, compile_and_read
from veloxquant.kernels import dtype_name
from veloxquant.methods.commvq import kernels as COMMVQ
from veloxquant.methods.kivi import kernels as KIVI
from veloxquant.methods.vecinfer import kernels as K

REGISTERS_PER_SM, SMEM_PER_SM, THREADS_PER_SM = 65536, 233472, 2048  # H200 (sm_90)
MIN_SPAN = 90
SHOWN = ("FFMA", "HMMA", "LDS", "LDG", "MUFU", "SHFL", "BAR")


def loops(sass: str) -> list[tuple[int, int, dict]]:
    """(start, end, {opcode: count}) of the span of every backward branch (the loops, and some
    jumps back into shared code), in address order."""
    code = [
        (int(at, 16), op.split(".")[0])
        for at, op in re.findall(
            r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9.]+)", sass, re.M
        )
    ]
    found = set()
    for at, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+[^;]*?BRA[^;]*?(0x[0-9a-f]+)", sass):
        if int(target, 16) < int(at, 16):
            found.add((int(target, 16), int(at, 16)))
    out = []
    for start, end in sorted(found):
        ops: dict[str, int] = {}
        for a, op in code:
            if start <= a <= end:
                ops[op] = ops.get(op, 0) + 1
        out.append((start, end, ops))
    return out


def report(mma: bool, work: Path) -> None:
    K.MMA = mma
    K.clear_memos()
    caches, qs, pend = decode_inputs(4096, 1, 1, H, G, D)
    a = K.attention_inputs(caches[0], qs[0], 1 / D**0.5, pend[0], one_launch=True)
    src = a["sources"][0]
    ins = [dtype_name(x.dtype) for x in a["partial"]]
    tu = src.cuda_translation_unit(ins, ["float32", dtype_name(qs[0].dtype)])
    used, sass = compile_and_read(tu, work, f"mma{int(mma)}")
    regs = int(re.search(r"Used (\d+) registers", used).group(1))
    smem = int(re.search(r"(\d+) bytes smem", used).group(1))
    per_sm = min(
        REGISTERS_PER_SM // (-(-regs // 8) * 8 * K.TILE),
        SMEM_PER_SM // (smem + 1024),  # 1 KB per threadgroup is reserved
        THREADS_PER_SM // K.TILE,
    )
    print(f"coded tokens on the {'tensor' if mma else 'CUDA'} cores (MMA = {mma})")
    print(f"  {used}; {per_sm} threadgroups per multiprocessor")
    print(f"  mma instructions: {sass.count('HMMA')}")
    print(f"  spans of {MIN_SPAN}+ instructions: all, then FFMA HMMA LDS LDG MUFU SHFL BAR")
    for start, end, ops in loops(sass):
        n = sum(ops.values())
        if n >= MIN_SPAN:
            kinds = " ".join(f"{ops.get(k, 0):4d}" for k in SHOWN)
            print(f"    {start:#07x}-{end:#07x}: {n:5d}  {kinds}")


def report_kivi(work: Path, key_bits: int, value_bits: int, mma: bool) -> None:
    """KIVI's partial kernel: every loop (on the CUDA cores the score loop walks 4 channels a
    trip, the value loop 16 tokens, with remainder loops after them; on the tensor cores the
    tile loop is one span)."""
    lay = KIVI.Layout(D, 64, key_bits, value_bits, G)
    ins = ["bfloat16", "int32", "uint32", "float16", "float16", "uint32", "float16"]
    ins += ["float16"] * 5 + ["bfloat16", "bfloat16", "int32", "float32"]
    source = KIVI.partial_kernel_source(lay, mma)
    tu = source.cuda_translation_unit(ins, ["float32"] * 3)
    used, sass = compile_and_read(tu, work, f"kivi{key_bits}{value_bits}{int(mma)}")
    print(f"KIVI partial, {lay}, {'tensor' if mma else 'CUDA'} cores")
    print(f"  {used}")
    print("  loops: all, then FFMA HMMA LDS LDG MUFU SHFL BAR")
    for start, end, ops in loops(sass):
        kinds = " ".join(f"{ops.get(k, 0):4d}" for k in SHOWN)
        print(f"    {start:#07x}-{end:#07x}: {sum(ops.values()):5d}  {kinds}")


def report_commvq(work: Path, atom_size: int, code_words: bool) -> None:
    """CommVQ's partial kernel at the 8B shape with 2-bit keys (R = 21 stages, d4b8 values, int8
    atoms per head, the key mean): its coded-token loop is the longest span, run once per
    token and KV head by a SIMD group (it includes the accurate sincos's slow path for angles
    past 105615 rad, which the trips at shorter positions skip)."""
    lay = COMMVQ.Layout(D, 21, G, 8, 4, False, True, H, H, 1, H)
    ins = ["bfloat16", "float16", "float32", "float32", "float32", "float16", "uint8", "float16"]
    ins += ["uint8"] + ["float16"] * 4 + ["float32"] * 2 + ["int32", "float32"]
    source = COMMVQ._partial_kernel_source(lay, atom_size, code_words)
    tu = source.cuda_translation_unit(ins, ["float32"] * 3)
    used, sass = compile_and_read(tu, work, f"commvq{atom_size}{int(code_words)}")
    smem = COMMVQ.threadgroup_bytes(lay, atom_size)
    print(f"CommVQ partial, {lay}, atoms float{8 * atom_size}, code rows as words {code_words}")
    print(f"  {used}; {smem} bytes of threadgroup memory")
    print("  loops: all, then FFMA HMMA LDS LDG MUFU SHFL BAR")
    for start, end, ops in loops(sass):
        kinds = " ".join(f"{ops.get(k, 0):4d}" for k in SHOWN)
        print(f"    {start:#07x}-{end:#07x}: {sum(ops.values()):5d}  {kinds}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kivi", action="store_true", help="KIVI's partial kernel instead")
    p.add_argument("--commvq", action="store_true", help="CommVQ's partial kernel instead")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.commvq:
            for atom_size, words in ((4, True), (4, False), (2, True)):
                report_commvq(Path(tmp), atom_size, words)
            return
        if args.kivi:
            for kb, vb in ((2, 2), (4, 2), (3, 5)):
                takes = KIVI.mma_takes(KIVI.Layout(D, 64, kb, vb, G)) is None
                for mma in (False, True) if takes else (False,):
                    report_kivi(Path(tmp), kb, vb, mma)
            return
        for mma in (False, True):
            report(mma, Path(tmp))


if __name__ == "__main__":
    main()
