"""`veloxquant serve`: mlx-lm's own OpenAI-compatible server (`mlx_lm.server`) with our caches.

    veloxquant serve MODEL_DIR --method vecinfer [--bundle DIR] [--budget B] --host H --port P

Every flag veloxquant does not define goes to mlx_lm.server's own parser, so --host, --port,
--max-tokens, --temp, --prompt-cache-size, --decode-concurrency ... mean what they mean there.

How it hooks in (mlx-lm 0.32):
- `mlx_lm.server.main()` parses the flags and ends with `run(host, port, ModelProvider(args))`;
  `serve` points the module's `run` at ours for that call, so the parsing, logging setup and
  every flag stay mlx-lm's.
- Our `ModelProvider` loads the model with mlx-lm's loader, then gives the model a
  `make_cache` (what `mlx_lm.models.cache.make_prompt_cache` calls, for every request and in
  batched generation) that builds our caches from the bundle loaded and checked once. The model
  is loaded before the server listens, so a missing bundle, a fingerprint mismatch or a
  refused flag stops the server at startup instead of failing requests.
- Our caches batch (`merge` gives a `veloxquant.batch.BatchedCache`), so the server keeps its
  batched path; mlx-lm's plain KVCache is never substituted.
- Refused up front: --kv-bits with anything but the fp16 method (it would replace our caches
  mid-stream) and --draft-model (speculative decoding rewinds caches, ours cannot).
- Resident KV bytes: each prompt-cache entry the server stores is logged with its tokens and
  bytes against an uncompressed KVCache; GET /veloxquant/stats returns the same as JSON, for
  the last entry and for the whole prompt cache.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from veloxquant.config import KVCacheConfig, cache_factory, check_kv_bits
from veloxquant.generate import kv_summary

log = logging.getLogger("veloxquant.serve")
STATS_PATH = "/veloxquant/stats"


def _server():
    import mlx_lm.server

    return mlx_lm.server


def make_model_provider(cli_args: Any, config: KVCacheConfig) -> Any:
    """An mlx_lm.server.ModelProvider whose models build veloxquant caches."""
    server = _server()

    class ModelProvider(server.ModelProvider):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            if draft_model_path is not None:
                raise ValueError(
                    "--draft-model: speculative decoding rewinds the cache after rejected "
                    "drafts, and veloxquant caches cannot be trimmed. Serve without it."
                )
            super()._load(model_path, adapter_path, draft_model_path)
            build = cache_factory(self.model, config)
            caches = build()
            check_kv_bits(caches, self.cli_args.kv_bits)
            self.model.make_cache = build  # what make_prompt_cache calls
            self.is_batchable = all(hasattr(c, "merge") for c in caches)
            log.info(
                "veloxquant: %s with %s caches (%s x%d), batching %s",
                model_path,
                config.label(),
                type(caches[0]).__name__,
                len(caches),
                "on" if self.is_batchable else "off (one request at a time)",
            )

    return ModelProvider(cli_args)


def make_prompt_cache_store(provider: Any) -> Any:
    """mlx-lm's LRUPromptCache that logs what each stored entry holds."""
    server = _server()

    class PromptCache(server.LRUPromptCache):
        last: dict[str, Any] | None = None

        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
            summary = kv_summary(provider.model, prompt_cache)
            self.last = {"cache_type": cache_type, **summary.as_dict()}
            log.info("veloxquant: prompt cache %s entry: %s", cache_type, summary.line())

    return PromptCache(provider.cli_args.prompt_cache_size)


def make_handler() -> type:
    """mlx-lm's APIHandler plus GET /veloxquant/stats."""
    server = _server()

    class APIHandler(server.APIHandler):
        def do_GET(self):
            if self.path != STATS_PATH:
                return super().do_GET()
            store = self.response_generator.prompt_cache
            body = {
                "prompt_cache": {"sequences": len(store), "kv_bytes": store.nbytes},
                "last_entry": store.last,
            }
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())
            self.wfile.flush()

    return APIHandler


def run(host: str, port: int, model_provider: Any, *, config: KVCacheConfig) -> None:
    """What mlx_lm.server.run does, with our provider, prompt-cache store and handler."""
    import mlx.core as mx

    server = _server()
    if mx.distributed.init().size() > 1:
        raise ValueError("veloxquant serve runs on one machine (no distributed serving).")
    provider = make_model_provider(model_provider.cli_args, config)
    provider.load_default()  # fail at startup, not in the generation thread
    generator = server.ResponseGenerator(provider, make_prompt_cache_store(provider))
    server._run_http_server(host, port, generator, handler_class=make_handler())


def serve(model_dir: str, config: KVCacheConfig, server_args: list[str]) -> None:
    """Run mlx_lm.server's main() on `server_args` with `--model model_dir` and our caches."""
    server = _server()
    if any(a == "--model" or a.startswith("--model=") for a in server_args):
        raise ValueError("give the model as MODEL_DIR, not --model")
    argv, original_run = sys.argv, server.run
    sys.argv = ["mlx_lm.server", "--model", str(model_dir), *server_args]
    server.run = lambda host, port, provider: run(host, port, provider, config=config)
    try:
        server.main()
    finally:
        sys.argv, server.run = argv, original_run
