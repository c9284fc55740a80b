"""Readers during rewrites: one writer process rewrites a bundle in a loop while this process
loads it in a loop, with no lock on the read side. Every load must succeed and be one
generation, never a mix: its tensors are the ones its manifest entry says they are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import numpy as np
import pytest

from tests.test_bundle import DATA, qfilters_tensors, write_qf
from veloxquant.bundle import BundleError, load_bundle
from veloxquant.fingerprint import fingerprint_model_dir

ROOT = Path(veloxquant.__file__).resolve().parents[1]
WRITES = 40  # each one a new generation: new file, and the one two generations back deleted
LOADS = 100  # at least; the reader goes on until the writer is done

WRITER = """
import json, sys, time
from pathlib import Path
from tests.test_bundle import DATA, write_qf

bundle, fp, n = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), int(sys.argv[3])
for i in range(1, n + 1):
    write_qf(bundle, fp, seed=i, data={**DATA, "n_tokens": 1000 + i})
    if i == 1:  # from here on every write races the reader's loop
        (bundle.parent / "started").touch()
        while not (bundle.parent / "reading").exists():
            time.sleep(0.001)
"""


def test_reader_sees_whole_generations_during_rewrites(tmp_path, smollm2_dir):
    fp = fingerprint_model_dir(smollm2_dir)
    bundle = tmp_path / "bundle"
    write_qf(bundle, fp, seed=0, data={**DATA, "n_tokens": 1000})
    (tmp_path / "fp.json").write_text(json.dumps(fp))
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(bundle), str(tmp_path / "fp.json"), str(WRITES)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert writer.poll() is None, writer.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Load until the writer is done (at least LOADS times), so every load races a rewrite
        errors, seen, loads, during = [], set(), 0, 0
        (tmp_path / "reading").touch()
        while loads < LOADS or writer.poll() is None:
            assert time.monotonic() < deadline + 120, "the writer did not finish"
            running = writer.poll() is None
            loads += 1
            try:
                b = load_bundle(bundle)
                seed = b.manifest["methods"]["qfilters"]["hyperparameters"]["seed"]
                assert b.manifest["methods"]["qfilters"]["data"]["n_tokens"] == 1000 + seed
                got = np.array(b.tensors("qfilters")["filters"])
                np.testing.assert_array_equal(got, qfilters_tensors(seed)["filters"])
                seen.add(seed)
                during += running
            except Exception as e:  # every failure counts, whatever its kind
                errors.append(f"{type(e).__name__}: {e}")
    finally:
        _, stderr = writer.communicate(timeout=120)
    assert writer.returncode == 0, stderr[-3000:]
    assert errors == [], f"{len(errors)} of {loads} loads failed, e.g. {errors[:3]}"
    # the loop really overlapped the rewrites
    assert during >= 10 and len(seen) >= 3, (during, sorted(seen))
    final = load_bundle(bundle).manifest["methods"]["qfilters"]["hyperparameters"]["seed"]
    assert final == WRITES
    print(f"\nconcurrency: {loads} loads, {during} during {WRITES} rewrites, 0 errors")


def test_reader_retries_when_its_generation_is_collected(tmp_path, smollm2_dir, monkeypatch):
    """Deterministically, the race the loop above may or may not hit: two commits land between
    a reader's manifest read and its file read, so its file is collected. It starts over."""
    import veloxquant.bundle as bundle_module

    fp = fingerprint_model_dir(smollm2_dir)
    bundle = tmp_path / "bundle"
    write_qf(bundle, fp, seed=0)
    real, calls = bundle_module._load_method, []

    def racing(bundle_dir, manifest, method):
        calls.append(manifest["methods"][method]["hyperparameters"]["seed"])
        if len(calls) == 1:
            write_qf(bundle, fp, seed=1)
            write_qf(bundle, fp, seed=2)  # collects seed 0's file
        return real(bundle_dir, manifest, method)

    monkeypatch.setattr(bundle_module, "_load_method", racing)
    b = load_bundle(bundle)
    assert calls == [0, 2]
    np.testing.assert_array_equal(
        np.array(b.tensors("qfilters")["filters"]), qfilters_tensors(2)["filters"]
    )

    # A listed file missing under an unchanged manifest is damage, not a race: no retry.
    monkeypatch.setattr(bundle_module, "_load_method", real)
    path = bundle / b.manifest["methods"]["qfilters"]["file"]
    path.unlink()
    calls.clear()
    monkeypatch.setattr(bundle_module, "_load_method", lambda *a: calls.append(1) or real(*a))
    with pytest.raises(BundleError, match=rf"{path.name}: file listed in the manifest is missing"):
        load_bundle(bundle)
    assert calls == [1]
