"""Short prompts through every eviction method: a fractional budget must not evict a 20-token
prompt down to 5 tokens (issue 11: the README's example printed gibberish). Below the
`min_budget` floor nothing is evicted, so greedy generation is token for token fp16's."""

from __future__ import annotations

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from veloxquant import KVCacheConfig, make_cache
from veloxquant.methods import METHODS

EVICTION = [name for name, m in METHODS.items() if "budget" in m.fields]
NEW_TOKENS = 8  # a <= 32-token prompt plus these stays under the default 64-token floor


def greedy(model, prompt: list[int], caches: list) -> list[int]:
    steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=NEW_TOKENS)
    return [tok for tok, _ in steps]


def config(method: str, budget: float, artifacts_root, **kw) -> KVCacheConfig:
    bundle = artifacts_root / "artifacts" / "smollm2-135m" / "bundle"
    calibrated = METHODS[method].calibrated
    return KVCacheConfig(
        method=method, budget=budget, artifact_dir=str(bundle) if calibrated else None, **kw
    )


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    _, tok = smollm2
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Explain Python decorators."},
    ]
    out = [tok.apply_chat_template(chat, add_generation_prompt=True)]  # 22 tokens
    assert all(len(p) <= 32 for p in out), [len(p) for p in out]
    return out  # the README test runs another short prompt (qfilters at 25%) against fp16


@pytest.fixture(scope="module")
def fp16_tokens(smollm2, prompts) -> list[list[int]]:
    model, _ = smollm2
    return [greedy(model, p, make_cache(model, KVCacheConfig())) for p in prompts]


@pytest.mark.parametrize("method", EVICTION)
def test_short_prompts_match_fp16(method, smollm2, artifacts_root, prompts, fp16_tokens):
    model, _ = smollm2
    for prompt, want in zip(prompts, fp16_tokens, strict=True):
        caches = make_cache(model, config(method, 0.125, artifacts_root))
        assert greedy(model, prompt, caches) == want
        assert caches[0].size() == caches[0].offset  # nothing evicted


@pytest.mark.parametrize("method", EVICTION)
def test_the_floor_then_the_fraction(method, smollm2, artifacts_root):
    """Kept tokens per layer: max(min_budget, ceil(budget * offset)); min_budget=0 gives the
    bare fraction (sinks + window still protected)."""
    model, _ = smollm2
    rng = np.random.default_rng(0)

    def sizes(cfg):
        cache = make_cache(model, cfg)[0]
        out = []
        for _ in range(5):
            k = mx.array(rng.standard_normal((1, 3, 64, 64)), mx.float32)
            cache.update_and_fetch(k, k)
            out.append(cache.size())
        return out

    assert sizes(config(method, 0.25, artifacts_root)) == [64, 64, 64, 64, 80]
    assert sizes(config(method, 0.25, artifacts_root, options={"min_budget": 0})) == [
        16,
        32,
        48,
        64,
        80,
    ]


def test_min_budget_is_checked():
    with pytest.raises(ValueError, match="min_budget must be an integer"):
        make_cache(None, KVCacheConfig(method=EVICTION[0], budget=0.25, options={"min_budget": -1}))
    with pytest.raises(ValueError, match="floor of a fractional budget"):
        make_cache(None, KVCacheConfig(method=EVICTION[0], budget=64, options={"min_budget": 8}))
