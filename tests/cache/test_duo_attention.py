"""DuoAttention (kvlab/cache/evict/duo_attention.py) against its definition
(arXiv:2410.10819, as kvpress's DuoAttentionPress masks): the lowest-scoring
head_ratio of the model's KV heads stream (their first sink_size and last
recent_size positions), the others keep every token; each layer's pool holds
what its heads need, and its patterns come from kvlab.eval.calibrate."""

import numpy as np
import pytest

import kvlab
from kvlab.eval.calibrate import duo_patterns, save_patterns
from tests.cache.test_after_prefill import kept
from tests.cache.test_evict import assert_composes, evicting
from tests.helpers import VARIANTS, build, random_tokens, run_in_chunks

LENGTH = 24


def duo(cfg, patterns, tmp_path, **fields):
    path = str(tmp_path / "patterns.npz")
    save_patterns(path, np.asarray(patterns))
    options = {"patterns": path, "head_ratio": 0.5, "sink_size": 2, "recent_size": 4}
    return evicting(cfg, "duo_attention", recent=0, options=options, **fields)


@pytest.mark.parametrize(
    "patterns, retrieval",
    [
        ([[0.9, 0.1], [0.8, 0.2]], [[True, False], [True, False]]),  # one of each per layer
        ([[0.9, 0.8], [0.1, 0.2]], [[True, True], [False, False]]),  # a layer of each
    ],
)
def test_streaming_heads_keep_their_sinks_and_latest_tokens_retrieval_heads_all(
    patterns, retrieval, tmp_path
):
    """At the budget DuoAttention needs (30 slots per layer of 2 heads, or 48 and 12
    shared by what the layers need), fed in chunks of 7, 7, 7 and 3 tokens: a
    streaming head holds positions 0, 1 and 20-23, a retrieval head all 24."""
    cfg = VARIANTS["gqa"]()
    cache_cfg = duo(cfg, patterns, tmp_path, budget=15)
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, LENGTH)
    _, cache = run_in_chunks(apply, params, cache, random_tokens(cfg, (2, LENGTH)), [7, 7, 7, 3])
    window = [0, 1, 20, 21, 22, 23]
    for layer, heads in zip(cache.layers, retrieval, strict=True):
        assert layer.policy.slots == sum(LENGTH if r else len(window) for r in heads)
        for row in kept(layer):
            assert row == [list(range(LENGTH)) if r else window for r in heads]
    counted = kvlab.cache_bytes(cfg.model, cache_cfg, 2, LENGTH)
    assert counted == kvlab.tree_bytes(cache)


@pytest.mark.parametrize(
    "budget, retrieval, streaming",
    [
        (13, [0, 1, *range(6, LENGTH)], [0, 1, 20, 21, 22, 23]),  # 4 slots short
        (17, list(range(LENGTH)), [0, 1, *range(16, LENGTH)]),  # 4 to spare
        (3, [0, 1], [0, 1, 22, 23]),  # the sinks last of all
    ],
)
def test_a_budget_off_its_need_costs_the_retrieval_heads_or_widens_the_windows(
    budget, retrieval, streaming, tmp_path
):
    """With fewer slots than it needs the retrieval heads drop their oldest tokens
    after the sinks, then the streaming heads their oldest latest ones, the sinks
    going last; with more, the streaming heads keep more of their latest."""
    cfg = VARIANTS["gqa"]()
    cache_cfg = duo(cfg, [[0.9, 0.1], [0.8, 0.2]], tmp_path, budget=budget)
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, LENGTH)
    _, cache = run_in_chunks(apply, params, cache, random_tokens(cfg, (1, LENGTH)), [7, 7, 7, 3])
    for layer in cache.layers:
        assert kept(layer) == [[retrieval, streaming]]


def test_a_compressed_context_keeps_each_layers_heads_what_they_need(tmp_path):
    """after_prefill at the ratio DuoAttention needs (a retrieval layer and a
    streaming one: 32 + 8 of 2 x 16 tokens x 2 layers, 0.625): the retrieval
    layer keeps the 16-token context, the streaming layer 0, 1, 14, 15 per head
    (sink 2, recent 2); the question then appends."""
    cfg = VARIANTS["gqa"]()
    cache_cfg = duo(cfg, [[0.9, 0.8], [0.1, 0.2]], tmp_path, ratio=0.625)
    cache_cfg.evict.options.recent_size = 2
    cache_cfg.evict.update(when="after_prefill", headroom=4)
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (1, 20), seed=1)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, 20)
    _, cache = apply({"params": params}, tokens[:, :16], cache=cache, compress=True)
    assert kept(cache.layers[0]) == [[list(range(16))] * 2]
    assert kept(cache.layers[1]) == [[[0, 1, 14, 15]] * 2]
    _, cache = apply({"params": params}, tokens[:, 16:], cache=cache)
    assert kept(cache.layers[1]) == [[[0, 1, 14, 15, 16, 17, 18, 19]] * 2]


def test_its_patterns_are_calibrated_per_head_and_it_composes(tmp_path):
    """duo_patterns: one finite area in [0, 1] per cache layer and KV head; over KIVI's
    groups in pages the pools keep their budget, and a budget that holds the
    sequence gives the full cache's logits."""
    cfg = VARIANTS["gqa"]()
    _, params, _ = build(cfg)
    patterns = duo_patterns(cfg.model, params, random_tokens(cfg, (2, 32)), length=64)
    assert patterns.shape == (cfg.model.num_layers, cfg.model.num_kv_heads)
    assert np.isfinite(patterns).all() and (patterns >= 0).all() and (patterns <= 1).all()
    path = str(tmp_path / "calibrated.npz")
    save_patterns(path, patterns)
    assert_composes(cfg, "duo_attention", options={"patterns": path, "recent_size": 8})


def _rope(x, positions, theta):
    """RoPE in float64 (kvlab's half-split convention): x [..., H] at positions [P]."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * theta ** (-np.arange(half) / half)  # [P, H/2]
    sin, cos = np.sin(angles)[:, None, :], np.cos(angles)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def test_the_first_layers_patterns_are_kvpress_on_the_fly_estimate():
    """duo_patterns' first layer against kvpress's duo_attention_on_the_fly written out
    in float64 from the parameters: per row the mean query and key of the normed
    embeddings, repeated at positions 0 .. P - 1 under RoPE; the last query's
    softmax over those keys; the mean of its cumulative sum; per KV head the
    mean over its query heads, then over the rows."""
    cfg = VARIANTS["gqa"]()
    m = cfg.model
    _, params, _ = build(cfg)
    tokens, length = random_tokens(cfg, (3, 40), seed=4), 50
    found = duo_patterns(m, params, tokens, length=length)
    block = params["block_0"]
    x = np.asarray(params["embed"]["embedding"], np.float64)[tokens]  # [B, T, D]
    h = x / np.sqrt((x**2).mean(-1, keepdims=True) + m.norm_eps)
    h = h * np.asarray(block["attention_norm"]["scale"], np.float64)
    q = np.einsum("btd,dnh->btnh", h, np.asarray(block["attention"]["query"]["kernel"], np.float64))
    k = np.einsum("btd,dkh->btkh", h, np.asarray(block["attention"]["key"]["kernel"], np.float64))
    positions = np.arange(length, dtype=np.float64)
    groups = m.num_heads // m.num_kv_heads
    areas = []
    for row in range(tokens.shape[0]):
        last = _rope(q[row].mean(0), positions[-1:], m.rope_theta)[0]  # [N, H]
        keys = np.repeat(_rope(k[row].mean(0), positions, m.rope_theta), groups, axis=1)
        logits = np.einsum("nh,pnh->np", last, keys) / np.sqrt(m.head_dim)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        areas.append(np.cumsum(weights, -1).mean(-1).reshape(-1, groups).mean(-1))
    np.testing.assert_allclose(found[0], np.mean(areas, 0), rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"patterns": ""}, "options.patterns='' names no file"),
        ({"head_ratio": 1.5}, "head_ratio=1.5 is not a share of the heads"),
        ({"sink_size": -1}, "sink_size=-1 is negative"),
        ({"shape": (3, 2)}, "holds patterns for 3 layers, not 2"),
        ({"shape": (2, 3)}, "not for cache layer 0 of 2 KV heads"),
    ],
)
def test_missing_or_mismatched_patterns_are_refused(options, message, tmp_path):
    cfg = VARIANTS["gqa"]()
    shape = options.pop("shape", (2, 2))
    path = str(tmp_path / "patterns.npz")
    save_patterns(path, np.ones(shape))
    cache_cfg = evicting(cfg, "duo_attention", budget=12, options={"patterns": path, **options})
    with pytest.raises(ValueError, match=message):
        cache = kvlab.init_cache(cfg.model, cache_cfg, 1, 32)
        _, params, apply = build(cfg)
        apply({"params": params}, random_tokens(cfg, (1, 8)), cache=cache)
