"""cache.evict.when='after_prefill': kvpress's protocol. The step given compress=True
(the context's prefill) keeps each head's best `target` tokens; the tokens after it
(a question, an answer) append unscored in the `headroom` slots beyond the budget."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from tests.cache.test_evict import evicting
from tests.helpers import VARIANTS, build, random_tokens

# One scorer per path of the layer: a state kept per slot (h2o), the attention of an
# observation window (snapkv), the pool (adakv), the keys alone (knorm).
SCORED = ["h2o", "snapkv", "adakv", "knorm"]
CONTEXT, AFTER = 12, 5


def after_prefill(cfg, method, bits=16, **fields):
    return evicting(cfg, method, bits, when="after_prefill", headroom=AFTER, **fields)


def kept(layer):
    """Per row, per KV head: the sorted positions a layer holds."""
    p, positions = layer.policy, np.asarray(layer.positions)
    heads = p.kv_heads if p.pooled else positions.shape[1]
    out = []
    for row in positions:
        if p.pooled:
            tags = row[0][row[0] >= 0]
            out.append([sorted(tags[tags % heads == h] // heads) for h in range(heads)])
        else:
            out.append([sorted(r[r >= 0]) for r in row])
    return out


@pytest.mark.parametrize("method", SCORED)
def test_the_compressed_context_is_what_every_step_keeps_and_the_rest_appends(method):
    """Compressing a one-step prefill keeps the tokens every_step keeps at a budget of
    the target; the next tokens are all kept, whether fed at once or one by one."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, CONTEXT + AFTER), seed=4)
    context, rest = tokens[:, :CONTEXT], tokens[:, CONTEXT:]
    max_len = CONTEXT + AFTER
    every = kvlab.init_cache(cfg.model, evicting(cfg, method, budget=6), 2, max_len)
    _, every = apply({"params": params}, context, cache=every)
    cache = kvlab.init_cache(cfg.model, after_prefill(cfg, method, budget=6), 2, max_len)
    first, cache = apply({"params": params}, context, cache=cache, compress=True)
    layers = cache.layers
    for ours, theirs in zip(layers, every.layers, strict=True):
        assert kept(ours) == kept(theirs)
    at_once, whole = apply({"params": params}, rest, cache=cache)
    one_by_one, step = [], cache
    for t in range(AFTER):
        out, step = apply({"params": params}, rest[:, t : t + 1], cache=step)
        one_by_one.append(out)
    np.testing.assert_allclose(np.concatenate(one_by_one, 1), at_once, atol=2e-5, rtol=0)
    new = set(range(CONTEXT, CONTEXT + AFTER))
    for before, after, again in zip(layers, whole.layers, step.layers, strict=True):
        for row_before, row_after, row_again in zip(
            kept(before), kept(after), kept(again), strict=True
        ):
            for head_before, head_after, head_again in zip(
                row_before, row_after, row_again, strict=True
            ):
                assert set(head_after) == set(head_before) | new == set(head_again)


def test_a_target_at_least_the_context_gives_the_full_cache_logits():
    """ratio=1 keeps every context token: the question and the answer then read
    exactly what the full cache holds."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, CONTEXT + AFTER), seed=5)
    full = kvlab.init_cache(cfg.model, cfg.cache, 2, CONTEXT + AFTER)
    expected, _ = apply({"params": params}, tokens, cache=full)
    cache = kvlab.init_cache(cfg.model, after_prefill(cfg, "snapkv", ratio=1.0), 2, CONTEXT + AFTER)
    first, cache = apply({"params": params}, tokens[:, :CONTEXT], cache=cache, compress=True)
    rest, _ = apply({"params": params}, tokens[:, CONTEXT:], cache=cache)
    np.testing.assert_allclose(np.concatenate([first, rest], 1), expected, atol=2e-5, rtol=0)


def test_each_row_keeps_its_share_of_its_own_context_and_the_slots_are_the_promise():
    """A ratio's target is floor(ratio x the row's context) (kvpress's n_kept), at
    least the recent tokens; past the headroom the cache evicts back within its slots."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 16), seed=6)
    max_len = 32
    cache_cfg = after_prefill(cfg, "knorm", ratio=0.5)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, max_len)
    slots = cache.layers[0].policy.slots  # half of the context's room, and the headroom
    assert slots == math.ceil(0.5 * (max_len - AFTER)) + AFTER
    assert "knorm keeping 50% of the context per KV head after its prefill" in (
        kvlab.cache.cache_label(cfg.model, cache_cfg)
    )
    lengths = jnp.asarray([16, 11], jnp.int32)
    _, cache = apply({"params": params}, tokens, cache=cache, num_tokens=lengths, compress=True)
    stored = np.asarray(cache.layers[0].stored(cache.lengths))
    np.testing.assert_array_equal(stored, [[8, 8], [5, 5]])  # floor(0.5 x 16), floor(0.5 x 11)
    small = kvlab.init_cache(cfg.model, after_prefill(cfg, "knorm", ratio=0.125), 1, max_len)
    _, small = apply({"params": params}, tokens[:1], cache=small, compress=True)
    # floor(0.125 x 16) = 2 = evict.recent: the recent tokens stay whatever the share
    assert kept(small.layers[0])[0] == [[14, 15], [14, 15]]
    for _ in range(3 * AFTER):  # decode past the headroom
        _, cache = apply({"params": params}, tokens[:, :1], cache=cache)
        for layer in cache.layers:
            assert np.asarray(layer.stored(cache.lengths)).max() <= slots
    assert np.asarray(cache.layers[0].stored(cache.lengths)).max() == slots


@pytest.mark.parametrize("method", ["knorm", "snapkv"])
def test_a_context_prefilled_in_blocks_keeps_the_target_of_the_whole(method):
    """compress=lengths: rows of 16 and 11 tokens fed 4 at a time, each block
    compressed to floor(0.5 x the whole row): each head ends at 8 and 5 tokens,
    never held more than its target and a block, and knorm's first layer (keys
    alone: the iterated top-k is the whole's) keeps what one step keeps."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 16), seed=11)
    lengths = np.asarray([16, 11], np.int32)
    cache_cfg = after_prefill(cfg, method, ratio=0.5, recent=0)
    one = kvlab.init_cache(cfg.model, cache_cfg, 2, 32)
    _, one = apply({"params": params}, tokens, cache=one, num_tokens=lengths, compress=True)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 32)
    for start in range(0, 16, 4):
        fed = np.clip(lengths - start, 0, 4).astype(np.int32)
        block = tokens[:, start : start + 4]
        _, cache = apply({"params": params}, block, cache=cache, num_tokens=fed, compress=lengths)
        seen = np.minimum(lengths, start + 4)
        for layer in cache.layers:
            held = np.asarray(layer.stored(cache.lengths))
            assert (held == np.minimum(seen, lengths // 2)[:, None]).all()
    if method == "knorm":
        assert kept(cache.layers[0]) == kept(one.layers[0])


def test_paged_and_quantized_slots_compress_alike():
    """8-bit codes per token in pages of 2 slots (block tables reversed): the same
    kept tokens and logits as the dense 8-bit cache, bytes counted."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, CONTEXT + AFTER), seed=9)
    cache_cfg = after_prefill(cfg, "snapkv", 8, budget=6)
    outs, caches = [], []
    for kind in ("dense", "paged"):
        cache_cfg.update(kind=kind, page_size=2)
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, CONTEXT + AFTER)
        assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, CONTEXT + AFTER) == kvlab.tree_bytes(
            cache
        )
        if kind == "paged":
            cache = cache.replace(block_tables=cache.block_tables[::-1, ::-1])
        first, cache = apply({"params": params}, tokens[:, :CONTEXT], cache=cache, compress=True)
        rest, cache = apply({"params": params}, tokens[:, CONTEXT:], cache=cache)
        outs.append(np.concatenate([first, rest], 1))
        caches.append(cache)
    np.testing.assert_array_equal(outs[0], outs[1])
    for dense, paged in zip(caches[0].layers, caches[1].layers, strict=True):
        assert kept(dense) == kept(paged)
        assert all(len(head) == 6 + AFTER for row in kept(dense) for head in row)


def test_adakv_compresses_its_pool_to_the_targets_with_each_floor():
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 16), seed=7)
    cache_cfg = after_prefill(cfg, "adakv", ratio=0.5, adakv_floor=1.0, recent=1)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 32)
    lengths = jnp.asarray([16, 12], jnp.int32)
    _, cache = apply({"params": params}, tokens, cache=cache, num_tokens=lengths, compress=True)
    for layer in cache.layers:
        # a floor of 1.0 leaves nothing to share: each head keeps exactly its target
        np.testing.assert_array_equal(np.asarray(layer.stored(cache.lengths)), [[8, 8], [6, 6]])


def test_generate_compresses_the_prompt():
    """kvlab.generate marks its prompt as the context: a target of the whole prompt
    generates what the full cache generates, a small one keeps its slots."""
    cfg = VARIANTS["gqa"]()
    model, params, _ = build(cfg)
    prompts = random_tokens(cfg, (2, 10), seed=8)
    full = kvlab.generate(model, params, prompts, cache_cfg=cfg.cache, max_new_tokens=4)
    whole = after_prefill(cfg, "snapkv", ratio=1.0)
    same = kvlab.generate(model, params, prompts, cache_cfg=whole, max_new_tokens=4)
    np.testing.assert_array_equal(same, full)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"method": "window", "when": "after_prefill"}, "cache.evict.when='after_prefill' applies"),
        ({"method": "snapkv", "when": "sometimes"}, "cache.evict.when='sometimes'"),
        ({"method": "snapkv", "headroom": 4}, "cache.evict.headroom=4 is room after"),
        ({"method": "snapkv", "when": "after_prefill", "headroom": -1}, "headroom=-1"),
        ({"method": "snapkv", "when": "after_prefill", "headroom": 32}, "leaves no room"),
        (
            {"method": "pyramidkv", "when": "after_prefill", "ratio": 0.5},
            "pyramidkv' with cache.evict.when='after_prefill' needs cache.evict.budget",
        ),
    ],
)
def test_what_after_prefill_cannot_compress_is_refused(fields, message):
    cfg = VARIANTS["gqa"]()
    cfg.cache.evict.update(fields)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        kvlab.init_cache(cfg.model, cfg.cache, 1, 32)


def test_a_settling_layout_and_the_engine_are_refused():
    cfg = VARIANTS["gqa"]()
    cache_cfg = after_prefill(cfg, "snapkv", budget=16)
    cache_cfg.update(k_bits=4, k_axis="channel", group_size=8)
    with pytest.raises(ValueError, match="cannot compress a quantized layout whose tokens settle"):
        kvlab.init_cache(cfg.model, cache_cfg, 1, 32)
    _, params, _ = build(cfg)
    with pytest.raises(ValueError, match="the engine's chunked, preempted prefills"):
        paged = after_prefill(cfg, "snapkv", budget=8)
        paged.kind = "paged"
        kvlab.Engine(cfg.model, paged, params)
