"""Prompt caches of our caches load in a process that never imported veloxquant (issue 11):
with `veloxquant.prompt_cache.load_prompt_cache`, or through mlx-lm's own `load_prompt_cache`
once the opt-in startup hook is installed. The hook imports nothing at startup (no mlx)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx.core as mx
import pytest

from tests import test_contract as contract
from tests.test_contract import build, knobs
from veloxquant.methods import METHODS
from veloxquant.prompt_cache import (
    HOOK_MODULE,
    hook_installed,
    install_hook,
    save_prompt_cache,
    uninstall_hook,
)

ROOT = Path(__file__).parent.parent
tiny = contract.tiny
OURS = [name for name, m in METHODS.items() if m.cache_classes]


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prompt-caches")
    out = {}
    for method in OURS:
        caches = build(tiny, {"method": method, **knobs(method)})
        tiny["model"](mx.arange(40)[None], cache=caches)
        mx.eval([c.state for c in caches])
        save_prompt_cache(root / f"{method}.safetensors", caches)
        out[method] = str(root / f"{method}.safetensors")
    return out


def fresh(code: str, *args: str) -> subprocess.CompletedProcess:
    """A new interpreter that has not imported veloxquant; the worktree is importable."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


LOAD = (
    "import json, sys\n"
    "{setup}\n"
    "from mlx_lm.models.cache import load_prompt_cache\n"
    "out = {{}}\n"
    "for path in json.loads(sys.argv[1]):\n"
    "    caches = load_prompt_cache(path)\n"
    "    out[path] = [type(caches[0]).__name__, caches[0].offset]\n"
    "print(json.dumps(out))\n"
)


def test_veloxquant_load_prompt_cache_in_a_fresh_process(saved):
    code = (
        "import json, sys\n"
        "import mlx_lm.models.cache as mlx_cache\n"
        "try:\n"
        "    mlx_cache.load_prompt_cache(sys.argv[1])\n"  # what mlx-lm alone does: KeyError
        "except KeyError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('mlx-lm resolved a veloxquant class by itself')\n"
        "from veloxquant.prompt_cache import load_prompt_cache\n"
        "caches, meta = load_prompt_cache(sys.argv[1], return_metadata=True)\n"
        "print(json.dumps([type(caches[0]).__name__, caches[0].offset, meta]))\n"
    )
    proc = fresh(code, saved[OURS[0]])
    assert proc.returncode == 0, proc.stderr
    name, offset, meta = json.loads(proc.stdout.splitlines()[-1])
    assert name in {c.__name__ for c in METHODS[OURS[0]].cache_classes} and offset == 40
    assert meta["veloxquant_version"] == veloxquant.__version__


def test_startup_hook_lets_mlx_lm_load_them(saved, tmp_path):
    site = tmp_path / "site-packages"
    site.mkdir()
    install_hook(site)
    assert hook_installed(site)
    # addsitedir processes the .pth exactly as interpreter startup does for site-packages
    setup = (
        "import site, sys\n"
        f"site.addsitedir({str(site)!r})\n"
        f"assert {HOOK_MODULE!r} in sys.modules\n"
        "assert not any(m.split('.')[0] in ('mlx', 'mlx_lm', 'veloxquant') for m in sys.modules)"
    )
    proc = fresh(LOAD.format(setup=setup), json.dumps(list(saved.values())))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    for method, path in saved.items():
        assert got[path][0] in {c.__name__ for c in METHODS[method].cache_classes}
        assert got[path][1] == 40
    assert uninstall_hook(site) and not hook_installed(site)
