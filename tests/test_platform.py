"""Platform setup and the runtime's dependency boundary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from veloxquant import _platform


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only")
def test_openblas_is_preloaded_before_mlx():
    assert _platform.blas_library == "libblas.so.3"
    maps = Path("/proc/self/maps").read_text()
    assert "openblas" in maps, (
        "libblas.so.3 must resolve to OpenBLAS (apt-get install libopenblas0-pthread)"
    )


def test_runtime_imports_without_pipeline_dependencies():
    """Caches and bundle loading need only mlx, mlx-lm, numpy and safetensors."""
    code = (
        "import sys\n"
        # tqdm stays: mlx-lm itself imports it
        "for name in ('dvc', 'hydra', 'omegaconf', 'datasets', 'gguf', 'matplotlib'):\n"
        "    sys.modules[name] = None  # makes `import name` raise ImportError\n"
        "import veloxquant\n"
        "from veloxquant import KVCacheConfig, make_cache, load_bundle\n"
        "import veloxquant.config, veloxquant.bundle, veloxquant.methods.baselines\n"
        "import pkgutil, importlib, veloxquant.methods as m\n"
        "for info in pkgutil.iter_modules(m.__path__):\n"
        "    importlib.import_module('veloxquant.methods.' + info.name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("preset, expected", [(None, "0"), ("1", "1")])
def test_float32_matmuls_stay_full_precision_unless_the_user_says_otherwise(preset, expected):
    # On CUDA (and Apple M5) MLX runs float32 matmuls as TF32 unless MLX_ENABLE_TF32=0, which
    # mis-assigns near points in k-means (seen on an H200); importing veloxquant turns it off.
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    if preset is not None:
        env["MLX_ENABLE_TF32"] = preset
    code = "import os, veloxquant, mlx.core; print(os.environ.get('MLX_ENABLE_TF32'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == expected, out.stderr


def _blas_core(env: dict) -> str:
    code = "import veloxquant, mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))"
    env = {**env, "OPENBLAS_VERBOSE": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return next(line for line in (out.stdout + out.stderr).splitlines() if line.startswith("Core:"))


@pytest.mark.skipif(
    not {"avx2", "fma"} <= _platform._cpu_flags(), reason="pins AVX2 kernels on x86 only"
)
def test_openblas_runs_the_same_kernels_on_every_x86_cpu_unless_the_user_picks_others():
    # AVX-512 and AVX2 GEMM kernels round differently: unpinned, an AVX-512 machine wrote other
    # artifacts than the AVX2 machines the committed dvc.lock came from.
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    assert _blas_core(env) == f"Core: {_platform.BLAS_CORETYPE}"
    assert _blas_core({**env, "OPENBLAS_CORETYPE": ""}) == f"Core: {_platform.BLAS_CORETYPE}"
    assert _blas_core({**env, "OPENBLAS_CORETYPE": "Sandybridge"}) == "Core: Sandybridge"
