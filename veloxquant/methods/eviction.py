"""Token-eviction KV caches: one budgeted cache class, and the two baselines built on it.

- StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
  arXiv 2309.17453): keep the first `sinks` tokens and the most recent ones.
- K-norm (Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
  Compression", arXiv 2406.11430): keep the tokens whose key has the lowest L2 norm.
- Q-Filters (veloxquant/methods/qfilters.py) scores keys by +<k_post, f> with the same cache.

Knobs (KVCacheConfig fields, and one option):
- budget: tokens kept per layer and KV head. An int >= 1 is a fixed count: nothing is evicted
  before the cache holds more than that many tokens. A float in (0, 1) is a fraction of the
  tokens seen so far, so the kept count grows with `offset`: max(ceil(budget * offset),
  min_budget, sinks + window).
- options={"min_budget": 64}: the floor of a fractional budget, in tokens. Without it a short
  prompt would be cut to a quarter of its 20 tokens before the first answer token, and the
  answer turns to gibberish. With it, a prompt plus answer that fits in min_budget tokens is
  never evicted (attention sees what an fp16 cache holds), and long contexts see the
  fraction. The default 64 is at most the fraction of a 512-token prefill at any budget
  >= 0.125, so it changes nothing once a context is long enough for the fraction to matter.
- sinks:  protected first tokens (default min(4, B // 4)).
- window: protected most recent tokens (default 3/4 of B), as the Q-Filters paper's cache keeps
  a recent window. B is the current budget in tokens. An int budget smaller than
  sinks + window is an error. Why 3/4: recency carries most of the attention mass on the default
  model, and a short window (1/8 or 1/2 of B) made Q-Filters lose to StreamingLLM at small
  budgets; 3/4 was chosen over 1/2 and 7/8 by KL on a calibration-split window, never on the
  held-out text. The same default applies to every eviction method, so comparisons at equal
  budget stay fair.

How it runs (DESIGN.md section 7):
- `update_and_fetch` appends the new keys/values and returns everything it holds, so attention for
  the current chunk sees the kept past plus the whole current chunk; then the cache evicts down to
  the budget. This works for chunked prefill and one-token decode alike, so the kept set is
  re-decided after every chunk, with everything in between scored in float32.
- Each KV head keeps its own tokens, but every head keeps the same number, so one [N, S] mask
  serves all heads; kept tokens stay in temporal order, so the causal part of the mask is the
  usual bottom-right one (`make_mask` uses size(), not offset).
- Evicted tokens are really gone: the arrays are gathered down to the kept tokens, so `nbytes`
  is what is resident. `offset` stays the absolute position used for RoPE; kept keys keep
  their RoPE phase.
- No `bits` attribute; `to_quantized` raises (so mlx-lm's `kv_bits=` cannot swap in an
  uncompressed-then-quantized cache); trimming is refused (evicted tokens cannot be restored).
- Batching: `merge` builds a `veloxquant.batch.BatchedCache`, which keeps one of these caches per
  sequence (each sequence evicts its own tokens), so batched generation gives each sequence
  exactly the tokens it would get alone.
- The classes are registered in `mlx_lm.models.cache` (veloxquant/methods/__init__.py) so
  `save_prompt_cache` / `load_prompt_cache` round-trip.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from veloxquant.methods.base import Artifact, CompressedCache, Method, pack_state, unpack_state

DEFAULT_SINKS = 4
DEFAULT_WINDOW_FRACTION = 0.75
DEFAULT_MIN_BUDGET = 64
OPTIONS = {"min_budget": DEFAULT_MIN_BUDGET}


def check_budget(budget: Any) -> int | float:
    """An int token count >= 1, or a float fraction in (0, 1); anything else is an error."""
    if budget is None:
        raise ValueError(
            "Eviction caches need a budget: KVCacheConfig(budget=256) keeps 256 tokens per layer "
            "and head; budget=0.25 keeps a quarter of the tokens seen."
        )
    if (
        isinstance(budget, bool)
        or not isinstance(budget, numbers.Real)
        or not math.isfinite(budget)
    ):
        raise ValueError(f"budget must be a number, got {budget!r}.")
    if 0 < budget < 1:
        return float(budget)
    if budget >= 1 and float(budget).is_integer():
        return int(budget)
    raise ValueError(
        f"budget={budget!r} is neither a token count (an integer >= 1) nor a fraction in (0, 1)."
    )


def check_min_budget(min_budget: Any) -> int:
    if (
        isinstance(min_budget, bool)
        or not isinstance(min_budget, numbers.Integral)
        or min_budget < 0
    ):
        raise ValueError(f"min_budget must be an integer >= 0 (tokens), got {min_budget!r}.")
    return int(min_budget)


def default_sinks(budget_tokens: int) -> int:
    return min(DEFAULT_SINKS, budget_tokens // 4)


def default_window(budget_tokens: int) -> int:
    return max(1, int(DEFAULT_WINDOW_FRACTION * budget_tokens))


class EvictionCache(CompressedCache):
    """Budgeted KV cache that keeps sinks + recent window + the best-scored tokens in between.

    Subclasses define `score(keys) -> float32 [B, H, S]` (higher = keep).
    """

    def __init__(
        self,
        budget: int | float,
        sinks: int | None = None,
        window: int | None = None,
        min_budget: int = DEFAULT_MIN_BUDGET,
    ):
        self.keys = None
        self.values = None
        self.offset = 0
        self.budget = check_budget(budget)
        self.min_budget = check_min_budget(min_budget)
        for name, v in (("sinks", sinks), ("window", window)):
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0
            ):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {v!r}.")
        self.sinks = None if sinks is None else int(sinks)
        self.window = None if window is None else int(window)
        if isinstance(self.budget, int):
            s, w = self._protected(self.budget)
            if self.budget < s + w:
                raise ValueError(
                    f"budget={self.budget} tokens is smaller than sinks + window = {s} + {w}; "
                    f"raise the budget to at least {s + w} or lower sinks/window."
                )

    # -- what to keep -------------------------------------------------------------------------

    def score(self, keys: mx.array) -> mx.array:
        raise NotImplementedError

    def _protected(self, budget_tokens: int) -> tuple[int, int]:
        s = default_sinks(budget_tokens) if self.sinks is None else self.sinks
        w = default_window(budget_tokens) if self.window is None else self.window
        return s, w

    def budget_tokens(self) -> int:
        """Tokens kept after the current eviction (before sinks/window flooring)."""
        if isinstance(self.budget, int):
            return self.budget
        return max(1, self.min_budget, math.ceil(self.budget * self.offset))

    def _evict(self) -> None:
        n = self.keys.shape[2]
        budget = self.budget_tokens()
        s, w = self._protected(budget)
        budget = max(budget, s + w)
        if n <= budget:
            return
        keep_mid = budget - s - w
        B, H = self.keys.shape[:2]
        parts = [mx.broadcast_to(mx.arange(s, dtype=mx.uint32), (B, H, s))]
        if keep_mid > 0:
            scores = self.score(self.keys[..., s : n - w, :])
            top = mx.argpartition(-scores, kth=keep_mid - 1, axis=-1)[..., :keep_mid]
            # temporal order keeps the causal mask of the next chunk bottom-right aligned
            parts.append(mx.sort(top.astype(mx.uint32), axis=-1) + s)
        parts.append(mx.broadcast_to(mx.arange(n - w, n, dtype=mx.uint32), (B, H, w)))
        idx = mx.concatenate(parts, axis=-1)[..., None]
        self.keys = mx.take_along_axis(self.keys, idx, axis=2)
        self.values = mx.take_along_axis(self.values, idx, axis=2)

    # -- mlx-lm cache protocol ----------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._before_update(keys)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        full_keys, full_values = self.keys, self.values
        self._evict()
        return full_keys, full_values

    def _before_update(self, keys: mx.array) -> None:
        pass

    def size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            raise NotImplementedError(
                f"{type(self).__name__} does not support sliding-window attention layers "
                "(window_size is set by this model); use it with full-attention models."
            )
        # The stored past is size() tokens, not offset: all of it is visible to the new chunk.
        return create_attention_mask(
            N, offset=self.size(), return_array=return_array, window_size=None
        )

    def empty(self) -> bool:
        return self.keys is None

    @property
    def compressed_tokens(self) -> int:
        return self.offset - self.size()  # evicted

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def state_arrays(self) -> dict:
        return {"keys": self.keys, "values": self.values}

    @property
    def meta_state(self) -> dict:
        return {
            "offset": self.offset,
            "budget": str(self.budget),
            "sinks": self.sinks,
            "window": self.window,
            "min_budget": self.min_budget,
        }

    def restore(self, arrays: dict, meta: dict) -> None:
        # from_state skips __init__, so everything the cache needs is restored here
        self.keys, self.values = arrays["keys"], arrays["values"]
        self.offset = int(meta["offset"])
        budget = str(meta["budget"])
        self.budget = check_budget(int(budget) if budget.isdigit() else float(budget))
        self.sinks = None if meta["sinks"] is None else int(meta["sinks"])
        self.window = None if meta["window"] is None else int(meta["window"])
        # prompt caches saved before min_budget existed evicted without a floor
        self.min_budget = int(meta.get("min_budget", 0))

    @property
    def state(self) -> dict:
        return pack_state(self.state_arrays(), self.meta_state)

    @state.setter
    def state(self, v: dict) -> None:
        self.restore(*unpack_state(type(self).__name__, v))


class StreamingLLMCache(EvictionCache):
    """Sinks + most recent tokens (the window setting is moot: all non-sink slots are recent)."""

    def score(self, keys: mx.array) -> mx.array:
        B, H, S, _ = keys.shape
        return mx.broadcast_to(mx.arange(S, dtype=mx.float32), (B, H, S))


class KNormCache(EvictionCache):
    """Keep the tokens with the lowest key L2 norm (scores are -||k||, float32)."""

    def score(self, keys: mx.array) -> mx.array:
        k = keys.astype(mx.float32)
        return -mx.sqrt(mx.sum(k * k, axis=-1))


def min_budget_option(config: Any) -> int:
    """options["min_budget"], which only a fractional budget reads (never silently ignored)."""
    if "min_budget" in config.options and isinstance(check_budget(config.budget), int):
        raise ValueError(
            f"options={{'min_budget': ...}} is the floor of a fractional budget; "
            f"budget={config.budget} is already a token count. Drop min_budget."
        )
    return check_min_budget(config.options.get("min_budget", DEFAULT_MIN_BUDGET))


def make_streamingllm_caches(model: Any, config: Any, artifact: Artifact | None) -> list:
    min_budget = min_budget_option(config)
    return [
        StreamingLLMCache(config.budget, config.sinks, config.window, min_budget)
        for _ in model.layers
    ]


def make_knorm_caches(model: Any, config: Any, artifact: Artifact | None) -> list:
    min_budget = min_budget_option(config)
    return [
        KNormCache(config.budget, config.sinks, config.window, min_budget) for _ in model.layers
    ]


STREAMINGLLM = Method(
    name="streamingllm",
    summary="eviction baseline: keep sinks + the most recent tokens (budget=N or fraction)",
    make_caches=make_streamingllm_caches,
    fields=("budget", "sinks", "window"),
    options=OPTIONS,
    cache_classes=(StreamingLLMCache,),
)

KNORM = Method(
    name="knorm",
    summary="eviction baseline: keep sinks + window + the keys of lowest L2 norm",
    make_caches=make_knorm_caches,
    fields=("budget", "sinks", "window"),
    options=OPTIONS,
    cache_classes=(KNormCache,),
)
