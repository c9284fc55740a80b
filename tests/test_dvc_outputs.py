"""The evaluate stage's DVC outputs (issue 11): a metrics file per row so `dvc metrics show`
reads as a table, plot CSVs for `dvc plots show`, and no churn: the same inputs give the same
bytes, and the committed outputs are exactly what the writers make of the committed results."""

from __future__ import annotations

import hashlib
from pathlib import Path

import veloxquant  # noqa: F401  (must precede mlx imports)
import numpy as np
import pytest

from tests import test_contract as contract
from veloxquant.evaluate import ROW_METRIC_KEYS, evaluate_rows, read_csv, write_outputs

ROOT = Path(__file__).parent.parent
tiny = contract.tiny


def digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_inputs_same_bytes(tiny, tmp_path):
    rows = [
        {"name": "fp16", "method": "fp16"},
        {"name": "knorm-25%", "method": "knorm", "budget": 0.25, "options": {"min_budget": 0}},
        {"name": "knorm-50%", "method": "knorm", "budget": 0.5, "options": {"min_budget": 0}},
        {"name": "vecinfer-uncal", "method": "vecinfer", "uncalibrated": True},
    ]
    windows = np.random.default_rng(0).integers(0, contract.VOCAB, (2, 96)).astype(np.int32)
    outs = []
    for run in ("a", "b"):
        results = evaluate_rows(tiny["model"], windows, rows, prefill=32, chunk=16, progress=False)
        write_outputs(results, tmp_path / run)
        outs.append(digests(tmp_path / run))
    assert outs[0] == outs[1]
    assert set(outs[0]) == {
        "metrics.json",
        "eval.csv",
        "eval_budget.csv",
        "eval.png",
        *(f"metrics/{r['name']}.json" for r in rows),
    }
    budget = (tmp_path / "a" / "eval_budget.csv").read_text().splitlines()
    assert budget[0].startswith("name,series,budget,kl") and len(budget) == 3


@pytest.mark.parametrize("model", ["smollm2-135m"])
def test_committed_outputs_are_what_the_writers_make(model, tmp_path):
    committed = ROOT / "artifacts" / model
    write_outputs(read_csv(committed / "eval.csv"), tmp_path)
    ours = digests(tmp_path)
    theirs = {k: v for k, v in digests(committed).items() if k in ours}
    assert ours == theirs
    for path in (committed / "metrics").iterdir():
        assert path.read_text().count(":") == len(ROW_METRIC_KEYS)


def import_closure(entry: str) -> set[Path]:
    """Every veloxquant/pipeline source file that `entry` (a module name) imports, directly or
    through other project modules, including imports inside functions (read with ast, so a
    lazily imported module counts: it runs when the stage does)."""
    import ast

    def path_of(name: str) -> Path | None:
        base = ROOT.joinpath(*name.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    seen: set[Path] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        # importing a.b.c runs a/__init__.py and a/b/__init__.py too
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            p = path_of(".".join(parts[:i]))
            if p is None or p in seen:
                continue
            seen.add(p)
            pkg = ".".join(parts[:i]) if p.name == "__init__.py" else ".".join(parts[: i - 1])
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Import):
                    todo += [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:  # relative: from the package this file is in
                        up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                        mod = ".".join(up + ([node.module] if node.module else []))
                    else:
                        mod = node.module or ""
                    todo.append(mod)
                    todo += [f"{mod}.{a.name}" for a in node.names]  # submodules
    return {p for p in seen if p.parts[len(ROOT.parts)] in ("veloxquant", "pipeline")}


def test_evaluate_stage_depends_on_every_module_it_runs():
    """evaluate runs every method's cache, so a change to any code it imports must rerun it:
    its DVC deps (files or folders) cover the whole import closure of pipeline/evaluate.py."""
    import yaml

    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["evaluate"]["do"]
    deps = [ROOT / d for d in stage["deps"] if "${" not in d]
    closure = import_closure("pipeline.evaluate")
    assert ROOT / "veloxquant" / "batch.py" in closure  # the closure sees what evaluate uses
    assert ROOT / "veloxquant" / "kernels.py" in closure  # ... lazily imported ones too
    missing = sorted(
        str(p.relative_to(ROOT)) for p in closure if not any(p == d or d in p.parents for d in deps)
    )
    assert not missing, f"dvc.yaml evaluate deps miss {missing}"
