"""The real DVC pipeline, end to end, on tiny budgets in a throwaway copy of the repo.

Checks that `dvc repro` builds every artifact, that a second run is a no-op, that changing an
eval param reruns only `evaluate`, and that the bundle it ships loads into working caches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.compose import ROOT, compose_params

MODEL = "smollm2-135m"
TINY = [
    "data.seq_len=128", "data.calib_windows=4", "data.eval_windows=1",
    "capture.token_budget=512", "eval.windows=1", "eval.prefill=64", "eval.chunk=32",
]


def _tiny_params() -> dict:
    params = compose_params(TINY)
    # Keep the eval small: one row per kind, and drop trainings that need more tokens than
    # the tiny capture holds (d8b12 wants 4096 vectors per head).
    keep = {"fp16", "mlx-q4", "qfilters-25%", "qfilters-25%-uncalibrated", "vecinfer-2bit",
            "vecinfer-2bit-uncalibrated"}
    params["eval"]["rows"] = [r for r in params["eval"]["rows"] if r["name"] in keep]
    for name, variant in list(params.get("method", {}).get("vecinfer", {}).get("variants", {}).items()):
        if variant.get("key_bits", 8) > 8 or variant.get("value_bits", 8) > 8:
            del params["method"]["vecinfer"]["variants"][name]
    return params


def _run(cmd: list[str], cwd: Path) -> str:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", PYTHONPATH=str(cwd))
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    dst = tmp_path_factory.mktemp("repo")
    for rel in files:
        if rel.startswith(("artifacts/", "tests/")) and rel != "artifacts/.gitkeep":
            continue
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    (dst / "params.yaml").write_text(yaml.safe_dump(_tiny_params(), sort_keys=False))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tiny"]):
        subprocess.run(cmd, cwd=dst, check=True, capture_output=True)
    return dst


def _dvc() -> str:
    return str(Path(sys.executable).parent / "dvc")


@pytest.mark.slow
def test_dvc_repro_end_to_end(repo):
    log = _run([_dvc(), "repro"], repo)
    a = repo / "artifacts" / MODEL
    for rel in ("model/config.json", "data/data.json", "activations/capture.json",
                "bundle/manifest.json", "metrics.json", "eval.csv", "eval.png"):
        assert (a / rel).is_file(), f"missing {rel}\n{log[-3000:]}"

    metrics = json.loads((a / "metrics.json").read_text())
    assert metrics["fp16"]["kl"] == 0.0 and metrics["fp16"]["top1"] == 1.0
    assert 0 < metrics["mlx-q4"]["kl"] < 1.0
    manifest = json.loads((a / "bundle" / "manifest.json").read_text())
    assert set(manifest["methods"]) >= {"qfilters"}

    # A second repro is a no-op.
    again = _run([_dvc(), "repro"], repo)
    assert "Running stage" not in again, again

    # Changing an eval param reruns only evaluate.
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["eval"]["chunk"] = 16
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rerun = _run([_dvc(), "repro"], repo)
    ran = sorted({line.split("'")[1] for line in rerun.splitlines() if line.startswith("Running stage")})
    assert ran == [f"evaluate@{MODEL}"], rerun

    # The pipeline's bundle verifies against its model through the CLI.
    out = _run([str(Path(sys.executable).parent / "veloxquant"), "bundle", "verify",
                str(a / "bundle"), "--model", str(a / "model"), "--strict"], repo)
    assert "OK" in out
