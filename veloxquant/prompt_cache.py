"""Prompt caches of veloxquant caches in processes that never imported veloxquant.

mlx-lm's `load_prompt_cache` resolves each saved class name in `mlx_lm.models.cache`; our
classes are registered there when `veloxquant.methods` is imported. A process that never
imported veloxquant (`mlx_lm generate --prompt-cache-file`, a worker that only imports
mlx_lm) gets a bare `KeyError: 'QFiltersCache'`. Two fixes:

- `veloxquant.prompt_cache.load_prompt_cache(path)`: registers our classes, then calls
  mlx-lm's; an unknown class is a clear error naming it.
- `veloxquant prompt-cache-hook install` (opt-in, `install_hook()`): puts a 30-line module and
  a one-line .pth file into site-packages. At interpreter startup it only appends an import
  finder that answers for the single module name `mlx_lm.models.cache` (nothing is imported,
  mlx included); when mlx-lm's cache module is first imported, its `load_prompt_cache` is
  wrapped so that a class name it does not know makes it `import veloxquant` (which registers
  ours) and retry. `uninstall_hook()` removes both files.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Any

HOOK_MODULE = "veloxquant_prompt_cache_hook"
HOOK_PTH = "veloxquant-prompt-cache-hook.pth"

# Standalone on purpose: it runs at every interpreter startup, before (and without) veloxquant.
HOOK_SOURCE = '''"""Installed by `veloxquant prompt-cache-hook install` (remove: `... uninstall`).

Lets mlx_lm's load_prompt_cache load veloxquant caches in a process that never imported
veloxquant. At startup this only adds an import finder for `mlx_lm.models.cache`."""

import sys

TARGET = "mlx_lm.models.cache"


def _wrap(module):
    original = module.load_prompt_cache

    def load_prompt_cache(file_name, return_metadata=False):
        try:
            return original(file_name, return_metadata)
        except KeyError as e:
            if not (e.args and isinstance(e.args[0], str)) or hasattr(module, e.args[0]):
                raise
            import veloxquant  # noqa: F401  registers veloxquant's cache classes in `module`

            return original(file_name, return_metadata)

    load_prompt_cache.__doc__ = original.__doc__
    module.load_prompt_cache = load_prompt_cache


class Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is cls or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_wrap(module, exec_module=exec_module):
                    exec_module(module)
                    _wrap(module)

                spec.loader.exec_module = exec_and_wrap
                return spec
        return None


if TARGET in sys.modules:
    _wrap(sys.modules[TARGET])
elif Finder not in sys.meta_path:
    sys.meta_path.insert(0, Finder)
'''


def load_prompt_cache(file_name: str | os.PathLike, return_metadata: bool = False) -> Any:
    """mlx-lm's `load_prompt_cache`, with veloxquant's cache classes registered first."""
    import mlx_lm.models.cache as mlx_cache

    import veloxquant.methods  # noqa: F401  (registers our cache classes in mlx_cache)

    try:
        return mlx_cache.load_prompt_cache(str(file_name), return_metadata=return_metadata)
    except KeyError as e:
        raise ValueError(
            f"{file_name}: the prompt cache holds a cache class {e.args[0]!r} that neither "
            "mlx-lm nor this veloxquant defines (saved by another version or another library?)."
        ) from e


def save_prompt_cache(
    file_name: str | os.PathLike, cache: list, metadata: dict[str, str] | None = None
) -> None:
    """mlx-lm's `save_prompt_cache`; the metadata also records the veloxquant version."""
    from mlx_lm.models.cache import save_prompt_cache as _save

    from veloxquant._version import __version__

    _save(str(file_name), cache, {**(metadata or {}), "veloxquant_version": __version__})


def default_site_dir() -> Path:
    """This interpreter's site-packages (of the active venv)."""
    return Path(sysconfig.get_paths()["purelib"])


def install_hook(site_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write the hook module and its .pth into `site_dir` (default: this site-packages)."""
    site = Path(site_dir) if site_dir else default_site_dir()
    module, pth = site / f"{HOOK_MODULE}.py", site / HOOK_PTH
    module.write_text(HOOK_SOURCE)
    pth.write_text(f"import {HOOK_MODULE}\n")
    return [module, pth]


def uninstall_hook(site_dir: str | os.PathLike | None = None) -> list[Path]:
    """Remove the hook's files from `site_dir`; returns the ones that were there."""
    site = Path(site_dir) if site_dir else default_site_dir()
    removed = []
    for path in (site / HOOK_PTH, site / f"{HOOK_MODULE}.py"):
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed


def hook_installed(site_dir: str | os.PathLike | None = None) -> bool:
    site = Path(site_dir) if site_dir else default_site_dir()
    return (site / HOOK_PTH).is_file() and (site / f"{HOOK_MODULE}.py").is_file()


__all__ = [
    "load_prompt_cache",
    "save_prompt_cache",
    "install_hook",
    "uninstall_hook",
    "hook_installed",
    "default_site_dir",
]
