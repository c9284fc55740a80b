"""Generate params.yaml from conf/ (Hydra), exactly as `dvc exp run` does.

python -m pipeline.compose [hydra overrides...]      e.g.  model=my-model eval.windows=8
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"


def compose_yaml(overrides: list[str] | None = None) -> str:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=overrides or [])
    OmegaConf.resolve(cfg)
    return OmegaConf.to_yaml(cfg)


def compose_params(overrides: list[str] | None = None) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(compose_yaml(overrides))


def main(argv: list[str] | None = None) -> None:
    from veloxquant.io import write_bytes_atomic

    text = compose_yaml(sys.argv[1:] if argv is None else argv)
    write_bytes_atomic(ROOT / "params.yaml", text.encode())
    print(f"wrote {ROOT / 'params.yaml'}")


if __name__ == "__main__":
    main()
