"""Correct variants of the one-launch decode-attention kernel that were built and checked on the
CPU but not yet timed on a GPU (the device time of 2026-12-07's twenty-fourth session ran out
before their run): copies of this tree's kernels.py with one change each, for
`profile_decode_step.py --baseline` inside real decode steps, as `cost_arms.py` writes its arms.

    slots     the setup's slot -> RoPE pair map (`phase_slot_pairs`) computed from the layout's
              constants instead of read from the layer pack: one dependent round to memory fewer
              before the setup's sincos (the formula matches the table for head_dim 32-256 and
              every count of slow pairs)
    givenmax  every threadgroup folds its heads' running maxima into a per-head atomic max (as
              ordered uint keys, in the pack's counter segment after the counts) before it
              counts itself done, so the merging threadgroup reads each head's largest max
              instead of reducing the splits' maxima (timeline-one's "largest maxima" phase,
              0.7 us of the merge at 64K); the same max, so the same output bits

Both passed the emulator's one-launch tests in place of kernels.py (`tests/test_kernels.py -k
"match_the_twin or in_place or one_launch or rotates"`, 43 tests), where a wrong key order did
not fail them: the merge is exact for any shift at least the largest max, so only an
under- or overflowing shift shows. Before keeping givenmax, test the key order and the reset.

    python benchmarks/next_arms.py /tmp        # writes /tmp/<arm>_kernels.py, prints arm=path
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cost_arms import write_arms

_ORDERED_KEYS = '''# a float as a uint32 key whose unsigned order is the float's (atomicMax on
# keys is the max of the floats), and back; key 0 is below every float's key
_ORDERED_KEYS = """
#ifndef VQ_ORDERED_KEYS
#define VQ_ORDERED_KEYS
VQ_FN uint32_t vq_ordered(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
VQ_FN float vq_unordered(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
#endif
"""

'''

_GIVEN_MAXIMA = '''def _given_maxima(combine: str) -> str:
    """The merge with each head's largest max read from its atomic key (`vq_unordered`)."""
    start = combine.index("  VQ_BARRIER();\\n  // each head's largest max")
    last = "    s_cs[vq_tid] = 0.0f;\\n  }\\n"
    end = combine.index(last, start) + len(last)
    given = """  if ((int)vq_tid < G) {
    s_cm[vq_tid] = vq_unordered(vq_load_cg(counter + MAXKEYS + hq0 + vq_tid));
    s_cs[vq_tid] = 0.0f;
  }
  VQ_BARRIER();
"""
    return combine[:start] + given + combine[end:]


'''

_COMBINE_CALL = (
    '        combine = _combine_statements("h * G", lay.group, TILE, lay.head_dim, "s_tail")'
)
_EP = '                "EP": ENCODE_PARAM,'

ARMS: dict[str, list[tuple[str, str]]] = {
    "slots": [
        (
            "          jv[k] = NJ % TILE == 0 || jj < NJ ? slot_pairs[jj] : -1;\n",
            """          // `phase_slot_pairs` from the constants: the full chunks' exact pairs
          // in order, the last exact ones in the polynomial chunk's odd slots, the slow pairs
          const int jp = jj - 8 * PF, jq = jj - 8 * PC;
          jv[k] = !(NJ % TILE == 0 || jj < NJ) ? -1
                  : jj < 8 * PF ? (jj < PE ? jj : -1)
                  : jj < 8 * PC ? ((jp & 1) && 8 * PF + (jp >> 1) < PE ? 8 * PF + (jp >> 1) : -1)
                  : (jq < P - PE ? PE + jq : -1);
""",
        )
    ],
    "givenmax": [
        (
            "        helpers = partial.helpers\n        if rope_in:",
            "        helpers = partial.helpers + _ORDERED_KEYS\n        if rope_in:",
        ),
        ('_ONE_LAUNCH_TAIL = """', _ORDERED_KEYS + '_ONE_LAUNCH_TAIL = """'),
        (
            """  VQ_SHARED int s_last;
  VQ_DEVICE_FENCE();  // this thread's part writes, device-wide before the count""",
            """  VQ_SHARED int s_last;
  if (vq_tid < G) {
    VQ_GLOBAL uint32_t* key = const_cast<VQ_GLOBAL uint32_t*>(counter) + MAXKEYS + h * G;
    atomicMax(key + vq_tid, vq_ordered(s_mrun[vq_tid]));
  }
  VQ_DEVICE_FENCE();  // this thread's part writes, device-wide before the count""",
        ),
        (
            "    if (vq_tid == 0) const_cast<VQ_GLOBAL uint32_t*>(counter)[h] = 0u;",
            """    if (vq_tid == 0) const_cast<VQ_GLOBAL uint32_t*>(counter)[h] = 0u;
    if (vq_tid < G) const_cast<VQ_GLOBAL uint32_t*>(counter)[MAXKEYS + h * G + vq_tid] = 0u;""",
        ),
        (_COMBINE_CALL, _COMBINE_CALL + "\n        combine = _given_maxima(combine)"),
        ("def one_launch_kernel_source(", _GIVEN_MAXIMA + "def one_launch_kernel_source("),
        (_EP, _EP + '\n                "MAXKEYS": max(8, lay.n_kv_heads),'),
        (
            '        "counter": (max(8, h), "uint32"),',
            '        "counter": (max(8, h) + h * lay.group, "uint32"),',
        ),
    ],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="directory for <arm>_kernels.py")
    for name, path in write_arms(Path(p.parse_args().out), ARMS).items():
        print(f"{name}={path}")  # as profile_decode_step.py's --baseline takes them


if __name__ == "__main__":
    main()
