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

from pipeline.compose import ROOT
from veloxquant.methods import CALIBRATED

MODEL = "smollm2-135m"


def _shrink_conf(conf: Path) -> None:
    """Tiny budgets, written into the copied conf/ so `dvc exp run` composes them too."""

    def edit(rel: str, **values) -> dict:
        path = conf / rel
        cfg = yaml.safe_load(path.read_text())
        cfg.update(values)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return cfg

    edit("data/pydoc.yaml", seq_len=128, calib_windows=4, eval_windows=1)
    edit("capture/default.yaml", token_budget=512)
    edit("method/qfilters/default.yaml", max_rows_per_head=256)
    edit(
        "method/vecinfer/default.yaml",
        iters=2,
        max_vectors=2048,
        variants={"nocenter": {"center": False}},
    )
    edit(
        "method/commvq/default.yaml",
        iters=0,
        hard_iters=1,
        max_tokens=256,
        value_iters=2,
        value_max_vectors=2048,
        variants={},
    )
    edit(
        "method/ratequant/default.yaml",
        fisher_windows=2,
        fisher_tokens=128,
        validate_units=2,
        validate_tokens=64,
        # a 128-token window must hold quantized tokens (sinks + window + G = 44) to measure
        # anything: the calibration refuses one that does not
        window=8,
        group_size=32,
        fisher_chunk=16,
    )
    rows = yaml.safe_load((conf / "eval/default.yaml").read_text())["rows"]
    keep = {
        "fp16",
        "mlx-q4",
        "qfilters-25%",
        "qfilters-25%-uncalibrated",
        "vecinfer",
        "vecinfer-uncalibrated",
        "vecinfer-nocenter",
        "commvq-2bit",
        "ratequant-3",
        "ratequant-3-uniform",
    }
    edit(
        "eval/default.yaml",
        windows=1,
        prefill=64,
        chunk=32,
        rows=[r for r in rows if r["name"] in keep],
    )


def _run(cmd: list[str], cwd: Path) -> str:
    # Stage commands run `python`: make it this interpreter, whatever the caller's PATH holds.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, DVC_NO_ANALYTICS="1", PYTHONPATH=str(cwd), PATH=path)
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    )
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    dst = tmp_path_factory.mktemp("repo")
    for rel in files:
        if rel.startswith(("artifacts/", "tests/")) or rel == "dvc.lock":
            continue
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    _shrink_conf(dst / "conf")
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tiny"],
    ):
        subprocess.run(cmd, cwd=dst, check=True, capture_output=True)
    return dst


def _dvc() -> str:
    return str(Path(sys.executable).parent / "dvc")


@pytest.mark.slow
def test_dvc_repro_end_to_end(repo):
    # `dvc exp run -S` composes conf/ (Hydra) into params.yaml, then reproduces everything.
    log = _run([_dvc(), "exp", "run", "-S", "eval.chunk=32"], repo)
    assert yaml.safe_load((repo / "params.yaml").read_text())["data"]["seq_len"] == 128
    a = repo / "artifacts" / MODEL
    for rel in (
        "model/config.json",
        "data/data.json",
        "activations/capture.json",
        "bundle/manifest.json",
        "metrics.json",
        "metrics/fp16.json",
        "eval.csv",
        "eval_budget.csv",
        "eval.png",
    ):
        assert (a / rel).is_file(), f"missing {rel}\n{log[-3000:]}"

    # `dvc metrics show`: one line per cache configuration; `dvc plots show`: both x/y plots.
    shown = json.loads(_run([_dvc(), "metrics", "show", "--json"], repo).strip().splitlines()[-1])
    per_row = next(iter(shown.values()))["data"]  # the workspace
    assert f"artifacts/{MODEL}/metrics/qfilters-25%.json" in per_row, sorted(per_row)
    assert set(per_row[f"artifacts/{MODEL}/metrics/fp16.json"]["data"]) >= {"ppl_ratio", "kl"}
    plots = json.loads(_run([_dvc(), "plots", "show", "--json"], repo).strip().splitlines()[-1])
    for name, (x, y) in {
        "eval.csv": ("kv_bits_per_element", "ppl_ratio"),
        "eval_budget.csv": ("budget", "kl"),
    }.items():
        (plot,) = plots["data"][f"artifacts/{MODEL}/{name}"]
        enc = plot["content"]["encoding"]
        assert (enc["x"]["field"], enc["y"]["field"], enc["color"]["field"]) == (x, y, "series")
        assert plot["content"]["data"]["values"], name

    metrics = json.loads((a / "metrics.json").read_text())
    assert metrics["fp16"]["kl"] == 0.0 and metrics["fp16"]["top1"] == 1.0
    assert 0 < metrics["mlx-q4"]["kl"] < 1.0
    manifest = json.loads((a / "bundle" / "manifest.json").read_text())
    assert set(manifest["methods"]) == set(CALIBRATED)
    for row in ("qfilters-25%", "vecinfer", "vecinfer-nocenter"):
        assert metrics[row]["kl"] < 1.0, (row, metrics[row])
    # the tiny calibration still beats the Gaussian codebooks upstream ships
    assert metrics["vecinfer"]["kl"] < metrics["vecinfer-uncalibrated"]["kl"]

    # A second repro is a no-op.
    again = _run([_dvc(), "repro"], repo)
    assert "Running stage" not in again, again

    # Changing an eval param reruns only evaluate.
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["eval"]["chunk"] = 16
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rerun = _run([_dvc(), "repro"], repo)
    ran = sorted(
        {line.split("'")[1] for line in rerun.splitlines() if line.startswith("Running stage")}
    )
    assert ran == [f"evaluate@{MODEL}"], rerun

    # Each stage depends on the code it runs: a k-means change reruns exactly the stages that
    # train with it (vecinfer, commvq values) and evaluate.
    kmeans = repo / "veloxquant" / "kmeans.py"
    original = kmeans.read_text()
    kmeans.write_text(original + "\n# changed\n")
    status = _run([_dvc(), "status", "--json"], repo).strip().splitlines()
    stale = sorted(json.loads(next(line for line in status if line.startswith("{"))))
    kmeans.write_text(original)
    assert stale == [f"commvq@{MODEL}", f"evaluate@{MODEL}", f"vecinfer@{MODEL}"], stale

    # The pipeline's bundle verifies against its model through the CLI.
    out = _run(
        [
            str(Path(sys.executable).parent / "veloxquant"),
            "bundle",
            "verify",
            str(a / "bundle"),
            "--model",
            str(a / "model"),
            "--strict",
        ],
        repo,
    )
    assert "OK" in out
