"""Platform setup and the runtime's dependency boundary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import veloxquant
from veloxquant import _platform


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only")
def test_openblas_is_preloaded_before_mlx():
    assert _platform.blas_library == "libblas.so.3"
    maps = Path("/proc/self/maps").read_text()
    assert "openblas" in maps, "libblas.so.3 must resolve to OpenBLAS (apt-get install libopenblas0-pthread)"


def test_runtime_imports_without_pipeline_dependencies():
    """Caches and bundle loading need only mlx, mlx-lm, numpy and safetensors."""
    code = (
        "import sys\n"
        "for name in ('dvc', 'hydra', 'omegaconf', 'datasets', 'gguf', 'matplotlib'):\n"  # tqdm stays: mlx-lm itself imports it

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
