"""The engine: continuous batching over a shared page pool gives every request
what it gets alone, with prefix caching on or off and under preemption."""

import numpy as np
import pytest

import kvlab
from tests.helpers import build, mla_config, tiny_config

NEW = 6


def engine_config(prefix_caching: bool, num_pages: int, **model):
    cfg = tiny_config(**model)
    cfg.cache.update(kind="paged", page_size=8, num_pages=num_pages, prefix_caching=prefix_caching)
    return kvlab.validate_config(cfg)


def requests(seed: int = 0, count: int = 7):
    """Prompts sharing a 20-token system prompt, with their own tails."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 20).tolist()
    return [system + rng.integers(0, 256, int(rng.integers(1, 14))).tolist() for _ in range(count)]


def solo(cfg, prompt):
    model, params, _ = build(cfg)
    cache = kvlab.validate_config(cfg.copy_and_resolve_references()).cache
    cache.kind = "dense"
    out = kvlab.generate(
        model, params, np.array([prompt], np.int32), cache_cfg=cache, max_new_tokens=NEW
    )
    return np.asarray(out)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_twice_the_demand_of_the_pages_finishes_every_request_as_alone(prefix_caching):
    # 3 slots of up to 48 tokens want 3 x 5 pages at most; the pool has 7.
    cfg = engine_config(prefix_caching, num_pages=7, num_kv_heads=2)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=3, max_len=48, prefill_chunk=8)
    prompts = requests()
    outputs = engine.generate(prompts, max_new_tokens=NEW)
    assert outputs == [solo(cfg, p) for p in prompts]
    assert engine.stats.preemptions > 0
    assert engine.stats.generated_tokens == NEW * len(prompts)
    assert engine.pages.num_free == 7  # every page came back (cached ones are evictable)
    computed = engine.stats.prefill_tokens
    if prefix_caching:
        assert computed < engine.stats.prompt_tokens
        assert engine.pages.stats.hit_tokens > 0
    else:  # every prompt once, and again for each preempted request
        assert computed >= engine.stats.prompt_tokens


def quantized_gqa():
    cfg = tiny_config(num_kv_heads=2)
    cfg.cache.update(k_bits=4, v_bits=8, k_axis="channel", group_size=8)
    return cfg


@pytest.mark.parametrize("make", [mla_config, quantized_gqa], ids=["mla", "gqa_k4v8"])
def test_prefix_caching_on_equals_off(make):
    outputs, computed = {}, {}
    for on in (False, True):
        cfg = make()
        cfg.cache.update(kind="paged", page_size=8, num_pages=16, prefix_caching=on)
        kvlab.validate_config(cfg)
        _, params, _ = build(cfg)
        engine = kvlab.Engine(
            cfg.model, cfg.cache, params, max_slots=2, max_len=48, prefill_chunk=16
        )
        outputs[on] = engine.generate(requests(seed=1, count=4), max_new_tokens=NEW)
        computed[on] = engine.stats.prefill_tokens
    assert outputs[True] == outputs[False]
    assert computed[True] < computed[False]


def test_bad_engine_inputs_are_refused():
    cfg = engine_config(False, num_pages=4)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=2, max_len=32)
    with pytest.raises(ValueError, match="requests is empty"):
        engine.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"requests\[1\] needs 35 cached tokens"):
        engine.generate([[1, 2], list(range(30))], max_new_tokens=6)
    with pytest.raises(ValueError, match=r"requests\[0\] is empty"):
        engine.generate([[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="cache.num_pages=2 is too few for one sequence"):
        kvlab.Engine(cfg.model, {**cfg.cache, "num_pages": 2}, params, max_slots=2, max_len=32)
    dense = dict(cfg.cache, kind="dense")
    with pytest.raises(ValueError, match="cache.kind='dense'"):
        kvlab.Engine(cfg.model, dense, params)
    with pytest.raises(ValueError, match="cache.residual=16 with cache.prefix_caching"):
        quantized = dict(cfg.cache, prefix_caching=True, k_bits=4, residual=16, page_size=16)
        kvlab.Engine(cfg.model, quantized, params)


def test_the_pool_holds_exactly_the_configured_pages():
    cfg = engine_config(False, num_pages=5)
    _, params, _ = build(cfg)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=4, max_len=32)
    assert engine.pages.num_pages == 5
    for pool in engine._cache.layers[0].pools:
        assert pool.shape[1] == 5
    assert kvlab.tree_bytes(engine._cache) == kvlab.cache_bytes(
        cfg.model, dict(cfg.cache), batch_size=4, seq_len=32
    )
