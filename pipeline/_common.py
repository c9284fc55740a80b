"""Helpers shared by the stage scripts: params and artifact paths."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

import veloxquant  # noqa: F401  (preloads OpenBLAS before mlx)

ROOT = Path(__file__).resolve().parent.parent
PARAMS = ROOT / "params.yaml"


def load_params() -> dict[str, Any]:
    if not PARAMS.is_file():
        raise SystemExit("params.yaml is missing: run `python -m pipeline.compose` first.")
    return yaml.safe_load(PARAMS.read_text())


def model_key_arg(description: str) -> tuple[str, dict[str, Any]]:
    """Parse the stage's single argument (the model key) and return (key, params)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model", help="model key under `models:` in params.yaml")
    key = parser.parse_args().model
    params = load_params()
    if key not in params.get("models", {}):
        raise SystemExit(
            f"Unknown model {key!r}; params.yaml has {sorted(params.get('models', {}))}"
        )
    return key, params


def artifacts(key: str) -> Path:
    return ROOT / "artifacts" / key
