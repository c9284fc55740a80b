"""veloxquant: calibrated KV-cache compression for MLX."""

from veloxquant._platform import full_float32_matmuls, preload_blas

preload_blas()  # both must precede the first `import mlx.core`
full_float32_matmuls()

from veloxquant._version import __version__  # noqa: E402
from veloxquant.bundle import load_bundle  # noqa: E402
from veloxquant.config import KVCacheConfig, make_cache  # noqa: E402

# veloxquant.methods (imported by both) registers every cache class in mlx_lm.models.cache, so
# mlx_lm's load_prompt_cache finds them by name in a fresh process that imported veloxquant.

__all__ = ["KVCacheConfig", "make_cache", "load_bundle", "__version__"]
