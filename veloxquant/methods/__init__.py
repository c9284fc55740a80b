"""One KV-cache method per module. Each exposes `make_caches(model, config) -> list`."""
