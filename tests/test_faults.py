"""Crash safety: kill every mutating bundle command at each of its durability points.

Each command (`veloxquant calibrate`, `merge_bundles` as the bundle stage calls it, `veloxquant
bundle export`) runs in its own process on a copy of a bundle that already holds two
generations.
veloxquant.io's fault hook (VELOXQUANT_FAULT_AT=N) makes it os._exit just before its Nth fsync,
rename or unlink, as a SIGKILL there would. After each kill the bundle on disk must be exactly
the old one or exactly the new one (manifest bytes), verify against the model, and a rerun must
succeed, give the same bytes as an uninterrupted run and leave no debris.

Everything runs on a tiny random llama with synthetic (spec-shaped) artifacts, except the
calibration under test, and each run is a fork of one driver process that imported veloxquant
once (DRIVER below), so the whole matrix takes seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from veloxquant.bundle import MANIFEST, export_bundle, merge_bundles, verify_bundle, write_method
from veloxquant.capture import capture_activations
from veloxquant.data import tokens_sha256
from veloxquant.fingerprint import fingerprint_model_dir
from veloxquant.io import FAULT_AT_ENV, FAULT_EXIT_CODE, FAULT_LOG_ENV, write_json_atomic
from veloxquant.methods import METHODS
from veloxquant.methods.base import ModelDims

ROOT = Path(veloxquant.__file__).resolve().parents[1]
CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "vocab_size": 96,
    "rope_theta": 1e4,
    "rope_traditional": True,
    "tie_word_embeddings": True,
}
COVERED: dict[str, int] = {}  # command -> kill points covered, printed at the end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny llama model dir, its calibration data and a capture, in the pipeline's layout."""
    root = tmp_path_factory.mktemp("faults")
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    model_dir = root / "model"
    model_dir.mkdir()
    mx.save_safetensors(
        str(model_dir / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 64)).astype(np.int32)
    write_json_atomic(
        root / "data" / "data.json",
        {
            "source": {"kind": "random", "seed": 0},
            "seq_len": 64,
            "calib": {"n_windows": 2, "n_tokens": int(ids.size), "sha256": tokens_sha256(ids)},
        },
    )
    capture_activations(model, ids, root / "activations", token_budget=ids.size, progress=False)
    return {"root": root, "model_dir": model_dir, "acts": root / "activations"}


def synthetic(bundle: Path, model_dir: Path, method: str, seed: int = 0) -> None:
    """A spec-shaped artifact (positive, unit-norm rows pass the methods' value checks)."""
    spec = METHODS[method]
    hp = spec.hyperparameters()
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, t in spec.tensor_specs(ModelDims.of(model_dir), hp).items():
        x = rng.uniform(0.1, 1.0, t.shape).astype(t.dtype)
        tensors[name] = x / np.linalg.norm(x, axis=-1, keepdims=True)
    write_method(
        bundle,
        method,
        tensors,
        model_dir=fingerprint_model_dir(model_dir),
        data_fingerprint={
            "source": {"kind": "random"},
            "split": "calib",
            "seq_len": 64,
            "n_tokens": 128,
            "sha256": "ab" * 32,
        },
        capture_point=spec.capture_point,
        hyperparameters=hp,
        diagnostics={},
    )


def listed(manifest_bytes: bytes) -> set[str]:
    return {e["file"] for e in json.loads(manifest_bytes)["methods"].values()}


# Runs in a subprocess: imports veloxquant once, then runs the command in one fork per run, so
# each killed run is its own process (os._exit ends it where the hook fires) without paying
# for the interpreter and mlx-lm imports every time. The clean run logs the durability points;
# each kill-NN copy is then killed before point NN, and rerun-NN is a copy of it, rerun.
DRIVER = r"""
import json, os, shutil, sys
import veloxquant.bundle, veloxquant.cli
from veloxquant.io import FAULT_AT_ENV, FAULT_LOG_ENV

job = json.loads(sys.argv[1])
template, work = job["template"], job["work"]


def forked(source, copy, env):
    shutil.copytree(source, copy, symlinks=True)
    argv = [a.replace("{copy}", copy) for a in job["argv"]]
    pid = os.fork()
    if pid == 0:
        os.environ.update(env)
        try:
            if argv[0] == "merge":
                veloxquant.bundle.merge_bundles(argv[1], argv[2:])
                rc = 0
            else:
                rc = veloxquant.cli.main(argv)
        except BaseException:
            rc = 1
        os._exit(rc)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


log = os.path.join(work, "points.log")
clean = forked(template, os.path.join(work, "clean"), {FAULT_LOG_ENV: log})
points = open(log).read().splitlines() if os.path.exists(log) else []
rcs = []
for i in range(1, len(points) + 1):
    killed, rerun = os.path.join(work, f"kill-{i:02d}"), os.path.join(work, f"rerun-{i:02d}")
    rcs.append(forked(template, killed, {FAULT_AT_ENV: str(i)}))
    rcs.append(forked(killed, rerun, {}))  # the rerun starts from the killed run's debris
print(json.dumps({"clean": clean, "points": points, "rcs": rcs}))
"""


def kill_at_every_point(
    name: str, template: Path, bundle_rel: str, argv: list[str], model_dir: Path | None
) -> int:
    """Run `argv` on copies of `template` killed at each durability point; check the killed
    copies and their reruns."""
    work = template.parent / f"{template.name}-runs"
    work.mkdir()
    job = {"template": str(template), "work": str(work), "argv": argv}
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_AT_ENV, FAULT_LOG_ENV)}
    res = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(job)],
        cwd=ROOT,
        # one BLAS thread: the runs are tiny, and spinning threads only slow a busy machine
        env={**env, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["clean"] == 0, res.stderr[-3000:]
    old = (template / bundle_rel / MANIFEST).read_bytes()
    new = (work / "clean" / bundle_rel / MANIFEST).read_bytes()
    assert new != old
    points = out["points"]
    assert {"fsync", "rename"} <= {line.split()[1] for line in points}, points

    rcs = out["rcs"]
    assert len(rcs) == 2 * len(points)
    for i, point in enumerate(points, 1):
        assert rcs[2 * i - 2] == FAULT_EXIT_CODE, (point, rcs, res.stderr[-2000:])
        killed, rerun = work / f"kill-{i:02d}", work / f"rerun-{i:02d}"
        before = (killed / bundle_rel / MANIFEST).read_bytes()
        assert before in (old, new), f"killed before {point}: the manifest is neither old nor new"
        # the bundle the killed run left verifies and loads
        verify_bundle(killed / bundle_rel, model_dir=model_dir or killed, strict=True)

        assert rcs[2 * i - 1] == 0, (point, res.stderr[-2000:])
        bundle = rerun / bundle_rel
        assert (bundle / MANIFEST).read_bytes() == new, f"rerun after a kill before {point}"
        verify_bundle(bundle, model_dir=model_dir or rerun, strict=True)
        names = {p.name for p in bundle.iterdir()}
        assert not [n for n in names if n.endswith(".tmp")], (point, sorted(names))
        files = {n for n in names if n.endswith(".safetensors")}
        assert files == listed(new) | listed(before), (point, sorted(files))
        hidden = [p.name for p in rerun.rglob(".*") if p.name != ".lock"]
        assert not hidden, (point, hidden)
    COVERED[name] = len(points)
    return len(points)


def test_kill_calibrate_at_every_point(tiny, tmp_path):
    template = tmp_path / "calibrate"
    bundle = template / "bundle"
    synthetic(bundle, tiny["model_dir"], "qfilters", seed=1)
    synthetic(bundle, tiny["model_dir"], "vecinfer")
    # two generations, so the kill-tested write also collects one
    synthetic(bundle, tiny["model_dir"], "qfilters", seed=0)

    argv = ["calibrate", "qfilters", str(tiny["acts"]), str(tiny["model_dir"]), "{copy}/bundle"]
    n = kill_at_every_point(
        "calibrate",
        template,
        "bundle",
        [*argv, "--params", '{"seed": 2}'],
        tiny["model_dir"],
    )
    assert n >= 6


def method_bundles(tiny: dict, root: Path, seed: int) -> dict[str, Path]:
    """One single-method bundle per method, as the calibration stages leave them."""
    out = {}
    for method in ("qfilters", "vecinfer"):
        out[method] = root / f"{method}-{seed}"
        synthetic(out[method], tiny["model_dir"], method, seed)
    return out


def test_kill_merge_at_every_point(tiny, tmp_path):
    """The bundle stage after both methods were recalibrated: two new files, one manifest."""
    gens = {seed: method_bundles(tiny, tmp_path / "inputs", seed) for seed in (0, 1, 2)}
    template = tmp_path / "merge"
    merge_bundles(template / "bundle", list(gens[1].values()))
    merge_bundles(template / "bundle", list(gens[0].values()))

    n = kill_at_every_point(
        "merge",
        template,
        "bundle",
        ["merge", "{copy}/bundle", *map(str, gens[2].values())],
        tiny["model_dir"],
    )
    assert n >= 9


def test_kill_export_at_every_point(tiny, tmp_path):
    sources = {
        seed: merge_bundles(
            tmp_path / f"src-{seed}", list(method_bundles(tiny, tmp_path, seed).values())
        )
        for seed in (0, 1, 2)
    }
    template = tmp_path / "export"
    shutil.copytree(tiny["model_dir"], template)  # another copy of the same model
    export_bundle(sources[1], template)
    export_bundle(sources[0], template)

    n = kill_at_every_point(
        "export",
        template,
        "veloxquant",
        ["bundle", "export", str(sources[2]), "{copy}"],
        None,  # each copy is the model dir it is verified against
    )
    assert n >= 9
    print(f"\nfault injection: kill points covered {COVERED} = {sum(COVERED.values())}")
