"""Shared fixtures. `veloxquant` is imported first so OpenBLAS is preloaded before mlx."""

from __future__ import annotations

import os
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import pytest

# Files that take a large share of the suite, collected first: with `make test`'s workers
# (pytest-xdist, one file per worker at a time) they start at once and the other worker runs
# the rest alongside, instead of one of them starting last and running alone.
SLOW_FIRST = ("test_pipeline.py", "test_ratequant.py", "test_kernels.py")


def pytest_collection_modifyitems(items: list) -> None:
    def rank(item) -> int:
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order within each file is kept


@pytest.fixture(autouse=True, scope="module")
def _attention_dispatch_as_found_by_the_module():
    """The same for a test file: a module fixture's make_cache (VecInfer caches fuse by default
    on the CPU with the extension built, and install the dispatch and tap the model's rope) must
    not leave the dispatch installed for the next file in the worker."""
    from veloxquant import attention

    was = attention.installed()
    yield
    if not was and attention.installed():
        attention.uninstall()


@pytest.fixture(autouse=True)
def _attention_dispatch_as_found():
    """A test that routes mlx-lm's attention (make_cache with VELOXQUANT_FUSED=1 installs the
    dispatch for good, as a program wants) leaves it as it found it, so tests that check the
    routing see the same state whichever file ran before them in their worker."""
    from veloxquant import attention

    was = attention.installed()
    yield
    if not was and attention.installed():
        attention.uninstall()


@pytest.fixture(autouse=True)
def _cuda_multiprocessors_of_the_timed_card(monkeypatch):
    """Tests that stand in a CUDA backend on this CPU machine (`backend()` patched) split one
    query's work as on the H100 / H200 the kernels were timed on, 132 multiprocessors of 228 KB
    of shared memory (1 KB of it kept per threadgroup): there is no CUDA driver here to ask
    (tests/test_kernels.py asks the real one)."""
    import veloxquant.kernels as vk

    monkeypatch.setattr(vk, "cuda_multiprocessors", lambda: vk.TIMED_CARD_MULTIPROCESSORS)
    monkeypatch.setattr(vk, "cuda_shared_memory", lambda: vk.TIMED_CARD_SHARED_MEMORY)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The embedded SmolLM2-135M GGUF imported once per test session (float32).

    Set VELOXQUANT_TEST_MODEL_DIR to reuse an already imported dir and save ~20 s.
    """
    from veloxquant.model_import import import_model

    reuse = os.environ.get("VELOXQUANT_TEST_MODEL_DIR")
    if reuse:
        return Path(reuse)
    return import_model("default", tmp_path_factory.mktemp("model") / "smollm2-135m")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model, tokenizer) of the embedded default model."""
    from veloxquant.model_import import load_model

    return load_model(smollm2_dir)


@pytest.fixture(scope="session")
def eval_text() -> str:
    """Held-out-style prose from CPython's pydoc topics (last topics in sorted order)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    return "\n\n".join(topics[k] for k in keys[-12:])


@pytest.fixture(scope="session")
def calib_dir(smollm2, tmp_path_factory) -> Path:
    """A calibration layout like the pipeline's, from the real model on 4 x 256 tokens of pydoc
    prose whose topics are disjoint from `eval_text`'s (which takes the last 12):
    data/{calib.safetensors, data.json} and activations/ (a full capture of those tokens)."""
    import numpy as np
    from pydoc_data.topics import topics

    from veloxquant.capture import capture_activations
    from veloxquant.data import tokens_sha256
    from veloxquant.io import save_safetensors_atomic, write_json_atomic

    model, tok = smollm2
    text = "\n\n".join(topics[k] for k in sorted(topics)[:-12])
    ids = np.array(tok.encode(text)[: 4 * 256], np.int32).reshape(4, 256)
    root = tmp_path_factory.mktemp("calib")
    save_safetensors_atomic(root / "data" / "calib.safetensors", {"tokens": ids})
    write_json_atomic(
        root / "data" / "data.json",
        {
            "source": {"kind": "pydoc_topics", "topics": "all but the last 12"},
            "seq_len": 256,
            "calib": {
                "file": "calib.safetensors",
                "n_windows": 4,
                "n_tokens": int(ids.size),
                "sha256": tokens_sha256(ids),
            },
        },
    )
    capture_activations(
        model, ids, root / "activations", token_budget=ids.size, seed=0, progress=False
    )
    return root


# The methods the README examples, the serving tests and test_qfilters use, calibrated for real
# on the real capture; Q-Filters with its defaults (as its stage does), VecInfer's k-means on a
# tiny budget.
SMALL_CALIBRATION = {"qfilters": {}, "vecinfer": {"iters": 1, "max_vectors": 4096}}


@pytest.fixture(scope="session")
def artifacts_root(smollm2_dir, calib_dir, tmp_path_factory) -> Path:
    """A dir laid out like the repo root after `dvc repro`, for the README examples and the
    serving tests: artifacts/smollm2-135m/{model, data, activations, bundle}. The model dir
    links the real model's files (so a bundle can be exported into it without touching the
    original); the bundle holds SMALL_CALIBRATION's methods, calibrated on `calib_dir`."""
    from veloxquant.calibrate import calibrate

    root = tmp_path_factory.mktemp("repo")
    art = root / "artifacts" / "smollm2-135m"
    (art / "model").mkdir(parents=True)
    for f in Path(smollm2_dir).iterdir():
        if f.is_file():
            (art / "model" / f.name).symlink_to(f.resolve())
    (art / "data").symlink_to(calib_dir / "data")
    (art / "activations").symlink_to(calib_dir / "activations")
    for method, hp in SMALL_CALIBRATION.items():
        calibrate(method, art / "activations", art / "model", art / "bundle", progress=False, **hp)
    return root
