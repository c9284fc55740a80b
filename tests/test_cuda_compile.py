"""The generated CUDA sources compile under NVRTC, the compiler MLX's CUDA backend uses, with
its options (`tests/nvrtc.py`). The emulator tests run the same sources' logic on the CPU but
stand in for their CUDA-only helpers; this is where those (inline PTX included) meet a real
CUDA compiler before a GPU does."""

from __future__ import annotations

import dataclasses

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import pytest

from tests import nvrtc
from tests.test_kernels import LAYOUT_CHANGES, _layout
from veloxquant.methods.commvq import kernels as COMMVQ
from veloxquant.methods.kivi import kernels as KIVI
from veloxquant.methods.vecinfer import kernels as K

pytestmark = pytest.mark.skipif(
    not nvrtc.available(), reason="NVRTC is installed with the test extra on x86-64 Linux only"
)

F32, I32, U8, U32, F16, BF16 = "float32", "int32", "uint8", "uint32", "float16", "bfloat16"
# the one-launch kernel's inputs (ONE_LAUNCH_INPUTS) and outputs for bf16 queries and windows
ONE_IN = [BF16, I32, U8, U8, U32] + [BF16] * 6 + [BF16]
ONE_OUT = [F32, BF16]


def _compiles(source, ins: list[str], outs: list[str], arch: str = "sm_90a") -> nvrtc.Compiled:
    done = nvrtc.compile_cuda(source.cuda_translation_unit(ins, outs), arch)
    assert done.ok, f"{source.name} does not compile for {arch} under NVRTC:\n{done.log[-3000:]}"
    return done


@pytest.mark.parametrize("changes", LAYOUT_CHANGES)
def test_vecinfer_cuda_sources_compile_under_nvrtc(changes, monkeypatch):
    lay = _layout(**changes)
    for mma in (True, False):  # the one launch on the tensor cores, then on the CUDA cores
        monkeypatch.setattr(K, "MMA", mma)
        assert K.mma_takes(lay) is mma
        # with the model's rotation of the step's query and key, then rotating them itself
        for rope_in in (False, True) if lay.center else (False,):
            src = K.one_launch_kernel_source(lay, mx.bfloat16, mx.bfloat16, rope_in=rope_in)
            _compiles(src, ONE_IN, ONE_OUT)
    # the two launches (Metal's path, and CUDA's where the one launch does not fit)
    partial, combine = K.attention_kernel_sources(lay, mx.float16)
    _compiles(partial, [F32, I32, F32, U8, U8, F16, F16, F16, F16, F32, F32] + [F16] * 7, [F32] * 3)
    _compiles(combine, [F32, F32, F32, I32, F16, F16], [F16])
    both_in = [F32, F32, F32, I32, F16, F16] + [F16, F16, F32, F16, F16, F32, F16, F16]
    _compiles(K.combine_encode_kernel_source(lay, mx.float16), both_in, [F16, U8, U8])
    in_place = K.combine_encode_kernel_source(lay, mx.float16, mx.float16)
    _compiles(in_place, both_in + [U8, U8, F16, F16], [F16])
    encode_in = [F16, F16, I32, F32, F16, F16, F32, F16, F16, F16, F16]
    _compiles(K.encode_kernel_source(lay), encode_in, [U8, U8])


def test_the_timeline_stamps_and_cuts_still_apply_and_compile(monkeypatch):
    """benchmarks/profile_partial_kernel.py's timeline-one finds its stamps' places (the tile
    loop's start among them) and its --cut edits in the one-launch source by exact text, and a
    GPU run stops at the first that no longer matches: each applies to this tree's default
    layout, and the stamped kernel compiles under NVRTC with every cut."""
    import pathlib
    import sys

    bench = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
    monkeypatch.setattr(sys, "path", [bench, *sys.path])
    import profile_partial_kernel as ppk

    lay = _layout()
    assert K.mma_takes(lay)
    src = K.one_launch_kernel_source(lay, mx.bfloat16, mx.bfloat16)
    outs = [*ONE_OUT, U32, U32]  # tstamp, smid
    for cut in [None, *ppk.ONE_CUTS]:
        cut_src = ppk.one_launch_cut(src, cut)  # SystemExit where a cut no longer matches
        assert cut is None or cut_src.body != src.body
        stamped = ppk.one_launch_stamped(cut_src, loop=True)
        assert stamped.body.count("VQ_STAMP1(") == ppk.NSTAMP1 + 1  # and the macro's own line
        _compiles(stamped, ONE_IN, outs)
    # --setup: the setup's stamps too, each slot once, in the order the setup runs them, with
    # the model's rotation and rotating the step's query and key itself (--rope-in)
    rotating = K.one_launch_kernel_source(lay, mx.bfloat16, mx.bfloat16, rope_in=True)
    for one in (src, rotating):
        stamped = ppk.one_launch_stamped(one, loop=True, setup=True)
        assert stamped.body.count("VQ_STAMP1(") == ppk.NSTAMP1_SETUP + 1
        at = {k: stamped.body.index(f"VQ_STAMP1({k});") for k in range(ppk.NSTAMP1_SETUP)}
        order = [k for _, k, _ in ppk.SETUP_PHASES] + [ppk.SETUP_PHASES[-1][2]]
        assert sorted(order, key=at.get) == order
        _compiles(stamped, ONE_IN, outs)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a"])
@pytest.mark.parametrize("rope_in", [False, True])
def test_the_tensor_core_kernel_keeps_its_launch_bounds(arch, rope_in):
    # MMA_MIN_THREADGROUPS threadgroups of TILE threads per multiprocessor leave each thread
    # 65536 / (TILE * 4) = 128 registers: MLX writes the signature, so the bounds reach NVRTC
    # through the translation unit (kernels.cuda_kernel_text), as here
    lay = _layout()
    assert K.MMA and K.mma_takes(lay)
    src = K.one_launch_kernel_source(lay, mx.bfloat16, mx.bfloat16, rope_in=rope_in)
    assert src.min_threadgroups == K.MMA_MIN_THREADGROUPS
    done = _compiles(src, ONE_IN, ONE_OUT, arch)
    assert done.registers <= 65536 // (K.TILE * K.MMA_MIN_THREADGROUPS)


@pytest.mark.parametrize(
    "d,group_size,bits,gq",
    [(64, 32, (2, 2), 3), (128, 16, (3, 6), 2), (128, 64, (4, 2), 4), (64, 64, (2, 4), 8)],
)
def test_kivi_cuda_sources_compile_under_nvrtc(d, group_size, bits, gq):
    lay = KIVI.Layout(d, group_size, *bits, gq)
    ins = [F16, I32, U32, F16, F16, U32, F16] + [F16] * 7 + [I32, F32]
    _compiles(KIVI.partial_kernel_source(lay), ins, [F32] * 3)
    if KIVI.mma_takes(lay) is None:  # the tensor cores' kernel too
        _compiles(KIVI.partial_kernel_source(lay, True), ins, [F32] * 3)
    _compiles(KIVI.combine_kernel_source(d, gq, mx.bfloat16), [F32, F32, F32, I32, I32], [BF16])


def test_kivi_partial_keeps_six_threadgroups_per_multiprocessor():
    # KEY_UNROLL channels' code loads go out at once (benchmarks/results/kivi-key-unroll-h100.txt:
    # 64 took 30% off the 64K partial at 80 registers); past 65536 / (TILE * 6) = 85 registers an
    # sm_90 multiprocessor holds 5 of its threadgroups, and the loads' latency shows again. The
    # split count aims for one wave of GROUPS_PER_MULTIPROCESSOR per multiprocessor, which the
    # registers must allow (kivi-splits-h100.txt: 1.3 waves were 18% slower)
    lay = KIVI.Layout(128, 64, 2, 2, 4)  # the 8B shape at 2 bits, as timed
    ins = [BF16, I32, U32, F16, F16, U32, F16] + [F16] * 7 + [I32, F32]
    done = _compiles(KIVI.partial_kernel_source(lay), ins, [F32] * 3)
    assert done.registers is not None and done.registers <= 65536 // (KIVI.TILE * 6)
    assert 65536 // (KIVI.TILE * done.registers) >= KIVI.GROUPS_PER_MULTIPROCESSOR == 6


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kivi_tensor_core_splits_are_sized_for_its_registers(arch):
    # the splits of a cache with a tensor-core launch aim for one wave of
    # MMA_GROUPS_PER_MULTIPROCESSOR threadgroups per multiprocessor: as many as its registers
    # allow, and no fewer. No launch bounds: asked for 4 threadgroups, ptxas spilled where it
    # needs no spill left alone (102 registers on sm_90a, 125 on sm_80)
    lay = KIVI.Layout(128, 64, 2, 2, 4)
    ins = [BF16, I32, U32, F16, F16, U32, F16] + [F16] * 7 + [I32, F32]
    done = _compiles(KIVI.partial_kernel_source(lay, True), ins, [F32] * 3, arch)
    assert done.spill_bytes == 0
    assert done.registers is not None
    fit = 65536 // (KIVI.TILE * (-(-done.registers // 8) * 8))  # registers go 8 at a time
    assert fit == KIVI.MMA_GROUPS_PER_MULTIPROCESSOR, (done.registers, fit)


# CommVQ's partial kernel inputs (PARTIAL_INPUTS) for bf16 queries, fp16 windows, a float32 token
COMMVQ_IN = [BF16, F16, F32, F32, F32, F16, U8, F16, U8, F16, F16, F16, F16, F32, F32, I32, F32]


@pytest.mark.parametrize(
    "d,stages,gq,value,trad",
    [(128, 21, 4, (8, 4), False), (64, 11, 3, (8, 4), False), (32, 5, 2, (4, 2), True)],
)
def test_commvq_cuda_sources_compile_under_nvrtc(d, stages, gq, value, trad):
    # the 8B shape at 2 bits, SmolLM2's, a small interleaved one; float32 and float16 atoms,
    # key code rows as words and byte by byte
    lay = COMMVQ.Layout(d, stages, gq, *value, trad, True, 8, 8, 1, 8)
    for size in (4, 2):
        for words in (True, False):
            src = COMMVQ._partial_kernel_source(lay, size, words)
            done = _compiles(src, COMMVQ_IN, [F32] * 3)
            assert done.spill_bytes == 0
    combine = COMMVQ.combine_kernel_source(d, gq, mx.bfloat16)
    _compiles(combine, [F32, F32, F32, I32, I32], [BF16])


def test_commvq_partial_fits_the_threadgroups_its_splits_aim_for():
    # the splits aim for one wave of GROUPS_PER_MULTIPROCESSOR threadgroups per multiprocessor
    # (fewer where the shared memory holds fewer): at the 8B shape the float32 atoms' 47.7 KB
    # hold 4 on an H100's 228 KB, and the registers must allow them
    lay = COMMVQ.Layout(128, 21, 4, 8, 4, False, True, 8, 8, 1, 8)
    done = _compiles(COMMVQ.partial_kernel_source(lay, 4), COMMVQ_IN, [F32] * 3)
    assert done.registers is not None
    fit = 65536 // (COMMVQ.TILE * (-(-done.registers // 8) * 8))  # registers go 8 at a time
    assert fit >= COMMVQ.GROUPS_PER_MULTIPROCESSOR == 4, (done.registers, fit)
    assert 233472 // (COMMVQ.threadgroup_bytes(lay, 4) + 1024) == 4


def test_nvrtc_refuses_what_only_a_cuda_compiler_sees():
    # the emulator replaces the tensor-core helpers with C++ of its own, so an error in their
    # PTX passes every emulator test; NVRTC (ptxas) refuses it
    src = K.one_launch_kernel_source(_layout(), mx.bfloat16, mx.bfloat16)
    assert "ld.shared.b32" in src.header("cuda")
    for broken in (
        dataclasses.replace(src, helpers=src.helpers.replace("ld.shared.b32", "ld.shrd.b32")),
        dataclasses.replace(src, body=src.body + "\n{"),
    ):
        done = nvrtc.compile_cuda(broken.cuda_translation_unit(ONE_IN, ONE_OUT))
        assert not done.ok and "error" in done.log.lower()


def test_the_cost_arms_still_apply_and_compile(tmp_path):
    """benchmarks/cost_arms.py edits this tree's kernels.py by exact text (a GPU run of
    `h200_mma.sh costs` would stop at the first that no longer matches): each arm applies, and
    its one-launch kernel compiles under NVRTC."""
    import importlib.util
    import pathlib
    import sys

    def load(name: str, path: pathlib.Path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
        return module

    root = pathlib.Path(__file__).resolve().parents[1]
    arms = load("cost_arms", root / "benchmarks/cost_arms.py")
    try:
        for name, path in arms.write_arms(tmp_path).items():
            assert path.read_text() != arms.KERNELS.read_text()
            module = load(f"cost_arm_{name}", path)
            lay = module.Layout(**dataclasses.asdict(_layout()))
            assert module.mma_takes(lay)
            _compiles(
                module.one_launch_kernel_source(lay, mx.bfloat16, mx.bfloat16), ONE_IN, ONE_OUT
            )
    finally:
        for name in [n for n in sys.modules if n == "cost_arms" or n.startswith("cost_arm_")]:
            del sys.modules[name]
