"""cache.evict.when='decoding': kvpress's DecodingPress. A row's prefill is stored
whole; every `interval` decode steps (a step of a row that already holds tokens) or
in a step of at least the budget's tokens, it compresses back to the budget, its
target_size; a row whose tokens would not fit its slots (budget + headroom +
interval - 1) compresses in that step instead."""

from __future__ import annotations

import numpy as np
import pytest

import kvlab
from tests.cache.test_after_prefill import kept
from tests.cache.test_evict import evicting, layer0_keys
from tests.helpers import VARIANTS, build, random_tokens
from tests.test_export import assert_exports, assert_round_trips, inference

BUDGET, INTERVAL, HEADROOM, MAX_LEN = 6, 3, 2, 40
SLOTS = BUDGET + HEADROOM + INTERVAL - 1


def decoding(cfg, method, bits=16, **fields):
    fields = {"budget": BUDGET, "interval": INTERVAL, "headroom": HEADROOM, **fields}
    return evicting(cfg, method, bits, when="decoding", **fields)


def schedule(prompts, steps):
    """The protocol by definition, per row: (tokens held, steps since it compressed)
    after the prefill and after each step of `steps` [n][B] tokens."""
    held = [min(p, BUDGET) if p > SLOTS else p for p in prompts]
    since = [0] * len(prompts)
    out = [(list(held), list(since))]
    for fed in steps:
        for row, n in enumerate(fed):
            if n == 0:
                continue
            held[row] += n
            since[row] += 1
            if since[row] >= INTERVAL or n >= BUDGET or held[row] > SLOTS:
                held[row], since[row] = min(held[row], BUDGET), 0
        out.append((list(held), list(since)))
    return out


# Two rows: one prompt stored whole, one longer than the slots (compressed in its
# prefill); one row idles a step (its count waits), one is given two tokens at once.
PROMPTS = [5, SLOTS + 3]
STEPS = [[1, 1], [1, 0], [1, 1], [2, 1], [1, 1], [1, 1], [1, 1], [1, 1]]


def run(cfg, cache_cfg, tokens, observe):
    """Prefill PROMPTS, then STEPS; observe(cache) after each."""
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, MAX_LEN)
    lengths = np.asarray(PROMPTS, np.int32)
    _, cache = apply({"params": params}, tokens[:, : max(PROMPTS)], cache=cache, num_tokens=lengths)
    observe(cache)
    for fed in STEPS:
        at = np.asarray(cache.lengths)
        step = np.stack([tokens[r, at[r] : at[r] + 2] for r in range(2)])
        _, cache = apply(
            {"params": params}, step, cache=cache, num_tokens=np.asarray(fed, np.int32)
        )
        observe(cache)
    cache.check()
    return cache


@pytest.mark.parametrize(
    "method, bits", [("knorm", 16), ("snapkv", 16), ("h2o", 16), ("adakv", 16), ("knorm", 8)]
)
def test_rows_compress_every_interval_decode_steps_and_hold_what_the_protocol_says(method, bits):
    """Each head holds, after every step, what the protocol holds by definition (a
    pool: its K heads together), and the layer's count is the protocol's; also
    over 8-bit codes per token."""
    cfg = VARIANTS["gqa"]()
    tokens = np.asarray(random_tokens(cfg, (2, MAX_LEN), seed=21))
    cache_cfg = decoding(cfg, method, bits)
    seen = []
    run(cfg, cache_cfg, tokens, seen.append)
    heads = cfg.model.num_kv_heads
    for cache, (held, since) in zip(seen, schedule(PROMPTS, STEPS), strict=True):
        for layer in cache.layers:
            assert layer.policy.slots == SLOTS * (heads if layer.policy.pooled else 1)
            stored = np.asarray(layer.stored(cache.lengths))
            np.testing.assert_array_equal(stored.sum(-1), np.asarray(held) * heads)
            if not layer.policy.pooled:
                assert (stored == np.asarray(held)[:, None]).all()
            np.testing.assert_array_equal(np.asarray(layer.since), since)


def test_knorm_keeps_the_budget_of_smallest_keys_among_those_held_at_each_compression():
    """Layer 0's keys do not depend on what is evicted: with recent 0 the kept set
    of each head is, after every step, the protocol's iterated choice by key norm."""
    cfg = VARIANTS["gqa"]()
    tokens = np.asarray(random_tokens(cfg, (2, MAX_LEN), seed=22))
    _, params, _ = build(cfg)
    norms = np.linalg.norm(layer0_keys(cfg, params, tokens), axis=-1)  # [B, T, K]
    seen = []
    run(cfg, decoding(cfg, "knorm", recent=0), tokens, lambda c: seen.append(kept(c.layers[0])))
    heads = cfg.model.num_kv_heads
    held = [[set(range(p)) for _ in range(heads)] for p in PROMPTS]
    since, ends = [0, 0], list(PROMPTS)

    def compress(row):
        for h in range(heads):
            best = sorted(held[row][h], key=lambda t: norms[row, t, h])[:BUDGET]
            held[row][h] = set(best)

    for row, p in enumerate(PROMPTS):
        if p > SLOTS:
            compress(row)
    expected = [[[sorted(h) for h in row] for row in held]]
    for fed in STEPS:
        for row, n in enumerate(fed):
            if n == 0:
                continue
            for h in range(heads):
                held[row][h] |= set(range(ends[row], ends[row] + n))
            ends[row] += n
            since[row] += 1
            if since[row] >= INTERVAL or n >= BUDGET or len(held[row][0]) > SLOTS:
                compress(row)
                since[row] = 0
        expected.append([[sorted(h) for h in row] for row in held])
    assert [[[list(map(int, h)) for h in row] for row in c] for c in seen] == expected


def test_a_budget_of_the_whole_cache_gives_the_full_cache_logits():
    """A budget of max_len never drops a token: a prefill and decode steps read
    exactly what the full cache holds."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 16), seed=23)
    full = kvlab.init_cache(cfg.model, cfg.cache, 2, 16)
    expected, _ = apply({"params": params}, tokens, cache=full)
    cache_cfg = decoding(cfg, "snapkv", budget=16, interval=2, headroom=0)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 16)
    outs = []
    first, cache = apply({"params": params}, tokens[:, :10], cache=cache)
    outs.append(first)
    for t in range(10, 16):
        out, cache = apply({"params": params}, tokens[:, t : t + 1], cache=cache)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, 1), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "method, kind, window",
    [("snapkv", "dense", 3), ("adakv", "paged", 4), ("expected_attention", "dense", 4)],
)
def test_buffered_queries_score_as_if_the_decode_steps_were_one_step(method, kind, window):
    """A compression after 4 decode steps of one token scores by the buffered
    queries of the steps before (QueryBuffer) as the same 4 tokens given in one
    step score by their own (nothing is evicted before it, so every query saw the
    same keys): the same tokens are kept in every layer, and the buffer is empty
    after it. `window`: the queries scored (obs_window; Expected Attention: all 4)."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 9), seed=26)
    finals = []
    for interval, steps in ((4, [(5, 6), (6, 7), (7, 8), (8, 9)]), (1, [(5, 9)])):
        cache_cfg = decoding(
            cfg, method, budget=4, interval=interval, headroom=6, recent=1, obs_window=window
        )
        if method == "expected_attention":  # its first 4 positions would fill the budget
            cache_cfg.evict.options = {"sink_tokens": 0}
        cache_cfg.update(kind=kind, page_size=2)
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 16)
        _, cache = apply({"params": params}, tokens[:, :5], cache=cache)
        for start, end in steps:
            assert all(int(layer.since[0]) == start - 5 for layer in cache.layers)
            _, cache = apply({"params": params}, tokens[:, start:end], cache=cache)
        assert all(int(layer.since[0]) == 0 for layer in cache.layers)  # compressed
        assert all((np.asarray(layer.buffer.positions) == -1).all() for layer in cache.layers)
        finals.append([kept(layer) for layer in cache.layers])
    assert finals[0] == finals[1]
    # a pool's heads share 4 x K
    assert all(sum(map(len, row)) == 4 * len(row) for layer in finals[0] for row in layer)


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_the_slots_and_the_count_are_the_bytes_counted(kind):
    cfg = VARIANTS["gqa"]()
    cache_cfg = decoding(cfg, "knorm")
    cache_cfg.update(kind=kind, page_size=4)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 3, MAX_LEN)
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 3, MAX_LEN) == kvlab.tree_bytes(cache)
    assert cache.layers[0].since.shape == (3,)
    label = kvlab.cache.cache_label(cfg.model, cache_cfg)
    assert f"knorm keeping {BUDGET} tokens per KV head every {INTERVAL} decode steps" in label
    assert f"headroom {HEADROOM}" in label and "interval" not in label


def test_paged_slots_keep_what_dense_ones_keep():
    """Pages of 2 slots, block tables reversed: the same kept tokens and counts."""
    cfg = VARIANTS["gqa"]()
    tokens = np.asarray(random_tokens(cfg, (2, MAX_LEN), seed=24))
    finals = []
    for kind in ("dense", "paged"):
        cache_cfg = decoding(cfg, "snapkv")
        cache_cfg.update(kind=kind, page_size=2)
        finals.append(run(cfg, cache_cfg, tokens, lambda c: None))
    for dense, paged in zip(finals[0].layers, finals[1].layers, strict=True):
        assert kept(dense) == kept(paged)
        np.testing.assert_array_equal(dense.since, paged.since)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"method": "window", "when": "decoding"}, "cache.evict.when='decoding' applies"),
        ({"method": "snapkv", "when": "decoding", "ratio": 0.5}, "cache.evict.budget=0 is 0"),
        ({"method": "snapkv", "when": "decoding", "budget": 8, "headroom": -1}, "headroom=-1"),
        (
            {"method": "snapkv", "when": "decoding", "budget": 8, "k_bits": 4, "residual": 16},
            "cannot compress a quantized layout whose tokens settle",
        ),
        (
            {"method": "kvzip", "when": "decoding", "budget": 8},
            "in the step that compresses it: set cache.evict.when='after_prefill'",
        ),
    ],
)
def test_what_decoding_cannot_compress_is_refused(fields, message):
    cfg = VARIANTS["gqa"]()
    quantized = {k: fields.pop(k) for k in ("k_bits", "residual") if k in fields}
    cfg.cache.update(quantized)
    cfg.cache.evict.update(fields)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        kvlab.init_cache(cfg.model, cfg.cache, 1, 32)


def test_a_decoding_cache_exports_for_tpu_and_cuda():
    """The prefill and the decode step (tests/test_sharding.py steps it on a mesh)."""
    cfg = VARIANTS["gqa"]()
    cfg.cache = decoding(cfg, "snapkv")
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)
    assert_round_trips(cfg)  # the count and the query buffer serialized with the step


def test_the_engine_refuses_it():
    cfg = VARIANTS["gqa"]()
    _, params, _ = build(cfg)
    paged = decoding(cfg, "snapkv")
    paged.kind = "paged"
    with pytest.raises(ValueError, match="the engine's steps of a request"):
        kvlab.Engine(cfg.model, paged, params)


def test_generate_decodes_through_it():
    """kvlab.generate's prefill is stored whole (its compress flag is after_prefill's)
    and its decode loop compresses: a budget of the whole cache generates what the
    full cache does, a small one what stepping the model by hand does."""
    cfg = VARIANTS["gqa"]()
    model, params, apply = build(cfg)
    prompts = random_tokens(cfg, (2, 10), seed=25)
    full = kvlab.generate(model, params, prompts, cache_cfg=cfg.cache, max_new_tokens=6)
    whole = decoding(cfg, "snapkv", budget=16, headroom=0, interval=2)
    same = kvlab.generate(model, params, prompts, cache_cfg=whole, max_new_tokens=6)
    np.testing.assert_array_equal(same, full)
    small = decoding(cfg, "knorm", budget=4, headroom=6)
    out = np.asarray(kvlab.generate(model, params, prompts, cache_cfg=small, max_new_tokens=6))
    cache = kvlab.init_cache(cfg.model, small, 2, out.shape[1])
    logits, cache = apply({"params": params}, prompts, cache=cache)
    for t in range(10, 16):
        token = np.argmax(np.asarray(logits[:, -1]), -1)
        np.testing.assert_array_equal(out[:, t], token)
        logits, cache = apply({"params": params}, token[:, None].astype(np.int32), cache=cache)
