"""What each part of the tensor-core tile loop costs: copies of this tree's kernels.py with one
part taken out, for `h200_mma.sh costs` to time inside real decode steps.

All but one of these arms compute wrong attention (their times are bounds, never results): each
drops one kind of memory traffic of the coded tokens' loop and keeps the rest, the MMAs and the
addressing as they are, so that the time it saves is what that traffic costs in the loop.

    nophase    the phase A fragments not loaded (register values instead of the host table)
    nokrow     key code rows loaded for the first block of a tile only (later blocks reuse them)
    novrow     value code rows not loaded (codes made from the block's probabilities)
    nokgather  key codebook gathers skipped (the address stands in for the entry)
    novgather  value codebook gathers skipped
    stream     correct: code rows loaded as streaming (__ldcs: evict first), so that they do not
               evict the phase table from L1

    python benchmarks/cost_arms.py /tmp           # writes /tmp/<arm>_kernels.py, prints arm=path
    python benchmarks/cost_arms.py /tmp --sass    # and each arm's tile loop by kind (NVRTC)

(The value gathers' bank-conflict arm, `vconf`, went when the value book got a copy per lane
of a half-warp: value-book-h100.txt.)

`--sass` checks on the CPU that each arm took out what it says (the loop's loads by kind), with
cuobjdump on PATH as `kernel_code_size.py` needs it.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "veloxquant/methods/vecinfer/kernels.py"

_VALUE_GATHER = "ve[u][s] = vq_lds(vbook_lane + vq_bits_at(vw, s * VB, VB, VLG), VEWT());"
_HELPER_ANCHOR = "#define VQ_MMA_HELPERS\n"
_FAKE_ENTRY = """__device__ inline uint32_t vq_fake_entry(uint32_t x, uint32_t) { return x; }
__device__ inline uint2 vq_fake_entry(uint32_t x, uint2) { return make_uint2(x, x ^ 1u); }
"""
_PHASE_LOAD = "const uint4 f = frags[(db * PC + pc) * 32 + lane];"
_KEY_ROWS = "vq_slice<KSW, KW, KALIGN>(kw[r], krow + 8 * r * KW, kfirst, ksh);"
_VALUE_ROWS = "vq_slice<VSW, VW, VALIGN>(vw, vrow + 4 * u * VW, vfirst, vsh);"
_KEY_GATHER = "a[2 * hf + r] = vq_lds(kbook_lane + at, 0u);"
_SLICE_LOAD = "for (int i = 0; i < SW; ++i) out[i] = at[i];"

# arm: [(text of kernels.py, what replaces it)], each text found exactly once
ARMS: dict[str, list[tuple[str, str]]] = {
    "nophase": [
        (
            _PHASE_LOAD,
            "const uint4 f = make_uint4((uint32_t)lane, (uint32_t)pc, (uint32_t)db, "
            "(uint32_t)tile);",
        )
    ],
    "nokrow": [
        (
            _KEY_ROWS,
            "for (int i = 0; i < KSW; ++i) "
            "kw[r][i] = kahead[r][i] * (2u * k + 1u) + (uint32_t)tile;",
        )
    ],
    "novrow": [
        (
            _VALUE_ROWS,
            "for (int i = 0; i < VSW; ++i) vw[i] = pb[u & 1] * 0x9E3779B9u + (uint32_t)(u + i);",
        )
    ],
    "nokgather": [(_KEY_GATHER, "a[2 * hf + r] = kbook_lane + at;")],
    "novgather": [
        (_HELPER_ANCHOR, _HELPER_ANCHOR + _FAKE_ENTRY),
        (
            _VALUE_GATHER,
            "ve[u][s] = vq_fake_entry(vbook_lane + vq_bits_at(vw, s * VB, VB, VLG), VEWT());",
        ),
    ],
    "stream": [(_SLICE_LOAD, "for (int i = 0; i < SW; ++i) out[i] = __ldcs(at + i);")],
}


def arm_source(name: str, text: str) -> str:
    """This tree's kernels.py with arm `name`'s replacements; each must match exactly once."""
    for old, new in ARMS[name]:
        if text.count(old) != 1:
            found = text.count(old)
            raise SystemExit(f"arm {name}: {old!r} is in kernels.py {found} times, not once")
        text = text.replace(old, new)
    return text


def write_arms(out: Path) -> dict[str, Path]:
    text = KERNELS.read_text()
    paths = {}
    for name in ARMS:
        paths[name] = out / f"{name}_kernels.py"
        paths[name].write_text(arm_source(name, text))
    return paths


def loop_loads(path: Path) -> str:
    """The arm's one-launch tile loop (NVRTC, sm_90a): instructions, HMMAs, loads by kind."""
    import kernel_code_size as kcs
    from ab_kernel_revisions import load_baseline

    kernels = load_baseline(str(path))
    with tempfile.TemporaryDirectory() as tmp:
        buf = io.StringIO()
        with redirect_stdout(buf):
            kcs.one_launch_report(path.stem, kernels, Path(tmp))
    line = [x for x in buf.getvalue().splitlines() if "tile loop" in x][0]
    return line.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="directory for <arm>_kernels.py")
    p.add_argument("--sass", action="store_true", help="each arm's tile loop by kind (NVRTC)")
    args = p.parse_args()
    paths = write_arms(Path(args.out))
    for name, path in paths.items():
        print(f"{name}={path}")  # as profile_decode_step.py's --baseline takes them
    if args.sass:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        for name, path in [("this tree", KERNELS), *paths.items()]:
            print(f"{name:>10}: {loop_loads(path)}")


if __name__ == "__main__":
    main()
