"""veloxquant: calibrated KV-cache compression for MLX."""

from veloxquant._platform import full_float32_matmuls, preload_blas

preload_blas()  # both must precede the first `import mlx.core`
full_float32_matmuls()

__version__ = "0.1.0"

from veloxquant.config import KVCacheConfig, make_cache  # noqa: E402

# Importing the cache modules registers their classes in mlx_lm.models.cache, so
# mlx_lm's load_prompt_cache finds them by name in a fresh process.
import veloxquant.methods.eviction  # noqa: E402,F401
import veloxquant.methods.qfilters  # noqa: E402,F401
import veloxquant.methods.vecinfer  # noqa: E402,F401

__all__ = ["KVCacheConfig", "make_cache", "load_bundle", "__version__"]


def __getattr__(name: str):
    if name == "load_bundle":  # resolved lazily so the bundle module can import `veloxquant`
        from veloxquant.bundle import load_bundle

        return load_bundle
    raise AttributeError(name)
