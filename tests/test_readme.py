"""Every Python block in README.md runs as written, against the real default model and real
artifacts laid out as `dvc repro` lays them out (conftest's `artifacts_root`, small budgets),
in a copy of that layout so the examples may write into it (e.g. export a bundle)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import pytest

README = Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.fixture(scope="module")
def repo(artifacts_root, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("readme") / "repo"
    shutil.copytree(artifacts_root / "artifacts", dst / "artifacts", symlinks=True)
    return dst


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    code = compile(BLOCKS[index], f"README.md python block {index + 1}", "exec")
    exec(code, {"__name__": "__main__"})
    out = capsys.readouterr().out
    if index == 0:  # the headline example: a sensible answer, not 'wrawrawra...'
        assert "decorator" in out.lower(), out
        assert not re.search(r"(\w{2,5})\1{2,}", out), out
        words = re.findall(r"[A-Za-z]+", out)
        assert len(words) > 30 and sum(len(w) > 12 for w in words) < 3, out
