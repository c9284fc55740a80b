"""Nothing is silently ignored or swapped (issue 11, item 5): knobs that do not apply, unknown
options, and mlx-lm's kv_bits= on a cache that is not a plain KVCache all fail loudly."""

from __future__ import annotations

import veloxquant  # noqa: F401  (must precede mlx imports)
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from tests import test_contract as contract
from tests.test_contract import build, knobs
from veloxquant import KVCacheConfig
from veloxquant.config import check_kv_bits
from veloxquant.methods import METHODS

tiny = contract.tiny
OURS = [name for name, m in METHODS.items() if m.cache_classes]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "fp16", "bits": 4}, r"bits=4.*does not apply to method 'fp16'"),
        ({"method": "fp16", "options": {"x": 1}}, r"unknown options \['x'\]"),
        ({"method": "nope"}, "Unknown KV-cache method"),
        ({"method": "fp16", "uncalibrated": True}, "no uncalibrated variant"),
    ],
)
def test_config_refuses_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCacheConfig(**kwargs)


def test_every_method_refuses_a_knob_it_does_not_read():
    for name, method in METHODS.items():
        for knob in ("bits", "budget", "sinks", "window"):
            if knob not in method.fields:
                with pytest.raises(ValueError, match="does not apply"):
                    KVCacheConfig(method=name, **{knob: 3})


@pytest.mark.parametrize("method", OURS)
def test_kv_bits_is_refused_up_front_and_to_quantized_fails_clearly(method, tiny):
    caches = build(tiny, {"method": method, **knobs(method)})
    with pytest.raises(ValueError, match="kv_bits=4 .*--kv-bits"):
        check_kv_bits(caches, 4)
    check_kv_bits(caches, None)
    with pytest.raises(NotImplementedError, match="QuantizedKVCache"):
        caches[0].to_quantized(bits=4)
    # Library use: mlx-lm asks for the conversion at quantized_kv_start (here at once) and
    # our caches refuse, instead of being skipped (VecInfer) or replaced.
    with pytest.raises(NotImplementedError, match="QuantizedKVCache"):
        steps = generate_step(
            mx.array([1, 2, 3, 4]),
            tiny["model"],
            prompt_cache=caches,
            max_tokens=2,
            kv_bits=4,
            quantized_kv_start=0,
        )
        for _ in steps:
            pass


def test_kv_bits_only_for_a_plain_kvcache():
    check_kv_bits([KVCache()], 4)  # mlx-lm's own behaviour: quantize after quantized_kv_start
    with pytest.raises(ValueError, match="QuantizedKVCache"):
        check_kv_bits([QuantizedKVCache()], 4)  # mlx-lm would skip it without a word
