"""Shared fixtures. `veloxquant` is imported first so OpenBLAS is preloaded before mlx."""

from __future__ import annotations

import os
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import pytest


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
