"""Where a kernel's warps wait, by region and by instruction, from ncu's per-instruction counters:
the CSV of `ncu --import REPORT --page source --csv --print-source sass` (a report taken with
`--set full`; `h200_mma.sh costs` writes one for the decode-attention kernel at 64K).

The regions are the code before the tensor-core tile loop (the setup), the loop (the backward
branch whose body holds the most HMMAs, as `kernel_code_size.py` finds it) and the code after
it (the merge, the exact tokens, the encode). For each: its share of the warp-state samples and
their reasons, shared-memory wavefronts against the ideal (bank conflicts) and global tag
requests; then the instructions with the most samples.

    python benchmarks/ncu_source_stalls.py full64k_sass.csv [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(row: dict, key: str) -> float:
    try:
        return float(row.get(key, "").replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> list[tuple[int, str, dict]]:
    """(offset from the kernel's first instruction, SASS text, counters) per instruction."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    rows = list(csv.reader(lines))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[header]
    data = [
        dict(zip(names, r, strict=False)) for r in rows[header + 1 :] if r and r[0].startswith("0x")
    ]
    base = int(data[0]["Address"], 16)
    return [(int(r["Address"], 16) - base, r["Source"].strip(), r) for r in data]


def tile_loop(code: list[tuple[int, str]], base: int = 0) -> tuple[int, int]:
    """(first, last) offset of the tensor-core tile loop in `code`, (offset, SASS text) pairs:
    the innermost backward branch's body holding the most HMMAs (nvcc also places cold blocks
    after a loop and branches back, so a "loop" spanning it and more code has as many); with no
    HMMA (the CUDA cores), the longest. `base`: what to subtract from branch targets to make them
    offsets (ncu prints absolute addresses, cuobjdump offsets)."""
    loops = []
    for at, text in code:
        m = re.search(r"\bBRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) - base < at:
            start = int(m.group(1), 16) - base
            hmma = sum("HMMA" in t for a, t in code if start <= a <= at)
            loops.append((hmma, at - start, start, at))
    if not loops:
        raise SystemExit("no backward branch in the SASS: the tile loop was not found")
    most = max(h for h, *_ in loops)
    _, _, start, end = max(loops, key=lambda x: (x[0], -x[1] if most else x[1]))
    return start, end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    code = read(args.csv)
    base = int(code[0][2]["Address"], 16)
    start, end = tile_loop([(a, t) for a, t, _ in code], base)
    stalls = [k for k in code[0][2] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_number(r, SAMPLES) for _, _, r in code)
    print(f"tile loop at {start:#x}-{end:#x}; {total:.0f} warp-state samples in all")
    regions = {
        "before the loop": lambda a: a < start,
        "tile loop": lambda a: start <= a <= end,
        "after the loop": lambda a: a > end,
    }
    for name, inside in regions.items():
        rows = [r for a, _, r in code if inside(a)]
        n = sum(_number(r, SAMPLES) for r in rows)
        why = collections.Counter({k[6:]: sum(_number(r, k) for r in rows) for k in stalls})
        print(
            f"{name}: {n:.0f} samples ({100 * n / total:.1f}%): "
            + ", ".join(f"{k} {100 * v / max(n, 1):.0f}%" for k, v in why.most_common(7))
        )
        shared = sum(_number(r, "L1 Wavefronts Shared") for r in rows)
        ideal = sum(_number(r, "L1 Wavefronts Shared Ideal") for r in rows)
        tags = sum(_number(r, "L1 Tag Requests Global") for r in rows)
        executed = sum(_number(r, "Instructions Executed") for r in rows)
        print(
            f"    {executed:.0f} warp instructions, shared wavefronts {shared:.0f} (ideal "
            f"{ideal:.0f}), global tag requests {tags:.0f}"
        )
        top = sorted(
            ((a, t, r) for a, t, r in code if inside(a)), key=lambda x: -_number(x[2], SAMPLES)
        )
        for a, t, r in top[: args.top]:
            why = collections.Counter({k[6:]: _number(r, k) for k in stalls})
            print(
                f"    {a:#07x} {_number(r, SAMPLES):6.0f}  {t[:56]:56s} "
                + ", ".join(f"{k} {v:.0f}" for k, v in why.most_common(2))
            )


if __name__ == "__main__":
    main()
