"""Evicting caches (kvlab/cache/evict/): exactness, what they keep, their bytes, refusals."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.evict.layers import _free_slots
from kvlab.cache.evict.scorers import Candidates, best, running_count
from kvlab.config import evict_methods
from kvlab.eval.calibrate import init_gates, save_filters, save_gates, save_patterns
from kvlab.registry import SCORERS
from kvlab.rope import apply_rope
from tests.helpers import VARIANTS, build, intermediates, random_tokens, run_in_chunks

METHODS = evict_methods()[1:]
CHUNKS = [4, 1, 4]  # 9 tokens
MAX_LEN = 16


@functools.cache
def _artefacts() -> str:
    """This test process's folder of calibrated artefacts, removed when it exits."""
    folder = tempfile.mkdtemp(prefix="kvlab-test-artefacts-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@functools.cache
def _artefact(method: str, shape: tuple) -> dict:
    """The options of a method calibrated offline, naming a file of random numbers of
    `shape` (qfilter's filters; duo_attention's head scores, its windows made small)."""
    name = f"{method}-{'x'.join(map(str, shape))}.npz"
    path = os.path.join(_artefacts(), name)
    array = np.random.default_rng(0).normal(size=shape)
    if "patterns" in SCORERS.get(method).defaults:  # duo_attention, kvzip_head
        save_patterns(path, array)
        return {"patterns": path, "sink_size": 2, "recent_size": 4}
    if "gates" in SCORERS.get(method).defaults:  # fast_kvzip: shape (layers, D, K, G)
        save_gates(path, init_gates(*shape, d=4, sinks=2, seed=1))
        return {"gates": path}
    save_filters(path, array)
    return {"filters": path}


def evicting(cfg, method, bits=16, **fields):
    """A copy of cfg's cache section evicting by `method` (and stored in `bits`); a
    method calibrated offline (qfilter, duo_attention) reads random artefacts of the
    model's shape."""
    cache = cfg.cache.copy_and_resolve_references()
    base = method.split(":")[-1]
    calibrated = base in SCORERS.names() and SCORERS.get(base).calibrated
    if calibrated and "options" not in fields:
        model = cfg.model
        width = model.mla.kv_rank if model.attention == "mla" else model.head_dim
        shape = (kvlab.cache.topology.num_cache_layers(model), model.num_kv_heads)
        defaults = SCORERS.get(base).defaults
        if "gates" in defaults:
            groups = model.num_heads // model.num_kv_heads
            shape = (shape[0], model.embed_dim, model.num_kv_heads, groups)
        elif "patterns" not in defaults:
            shape = (*shape, width)
        fields["options"] = dict(_artefact(base, shape))
    cache.evict.update({"method": method, "recent": 2, **fields})
    if bits != 16:
        for prefix in kvlab.config.cached_prefixes(cfg.model):
            cache.update({f"{prefix}_bits": bits, f"{prefix}_axis": "token"})
        cache.group_size = 8
    return cache


def run(cfg, cache_cfg, tokens, chunks=CHUNKS, max_len=MAX_LEN):
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, tokens.shape[0], max_len)
    return run_in_chunks(apply, params, cache, tokens, chunks)


def kivi(cfg, method, residual, **fields):
    """cfg's cache stored as KIVI stores it (the first cached tensor, keys or latents,
    with per-channel scales shared by groups of 8 tokens; the second per token; 4
    bits), `residual` tokens in full precision, evicting by `method`."""
    cache = evicting(cfg, method, **fields)
    first, second = kvlab.config.cached_prefixes(cfg.model)
    cache.update({f"{first}_bits": 4, f"{first}_axis": "channel", f"{second}_bits": 4})
    cache.update({f"{second}_axis": "token", "group_size": 8, "residual": residual})
    return cache


KIVI_LEN, KIVI_CHUNKS = 32, [7] * 4  # 28 tokens, one compiled step shape


def assert_composes(cfg, method, budget=24, **fields):
    """`method` (with cache.evict `fields`) keeping a budget that holds 28 tokens
    gives the full cache's logits; over KIVI's settling groups in pages of 8 it
    gives finite logits and no head holds more than `budget` (a pool: its heads
    together no more than theirs)."""
    tokens = random_tokens(cfg, (2, 28))
    full, _ = run(cfg, cfg.cache, tokens, [14, 14], KIVI_LEN)
    held, _ = run(cfg, evicting(cfg, method, budget=32, **fields), tokens, [14, 14], KIVI_LEN)
    np.testing.assert_allclose(held, full, atol=3e-6)
    cache_cfg = kivi(cfg, method, 0, budget=budget, **fields)
    cache_cfg.update(kind="paged", page_size=8)
    out, cache = run(cfg, cache_cfg, tokens, KIVI_CHUNKS, KIVI_LEN)
    assert np.isfinite(out).all()
    for layer in cache.layers:
        stored = np.asarray(layer.stored(cache.lengths))
        assert (stored.sum(-1) <= budget * stored.shape[-1]).all()
        assert layer.policy.pooled or (stored <= budget).all()


@pytest.mark.parametrize(
    "name, bits, methods",
    [
        # nothing is evicted, so the score functions never decide: one method per
        # path (ring, attention mass, stored scores, pool, per-layer budgets)
        # (quantized and latent caches: the KIVI test below)
        ("gqa", 16, ("window", "snapkv", "h2o", "adakv", "pyramidkv")),
    ],
)
def test_a_budget_that_holds_the_sequence_gives_the_full_cache_logits(name, bits, methods):
    """Budget >= length: nothing is evicted, the logits are the full cache's (the
    same cache without eviction, quantized alike)."""
    cfg = VARIANTS[name]()
    tokens = random_tokens(cfg, (2, 9))
    full, _ = run(cfg, evicting(cfg, "none", bits), tokens)
    for method in methods:
        # pyramidkv's last layer keeps recent + mean / beta: give it a mean that holds 9
        budget, max_len = (9 * 20, 9 * 20) if method == "pyramidkv" else (MAX_LEN, MAX_LEN)
        cache_cfg = evicting(cfg, method, bits, budget=budget)
        out, cache = run(cfg, cache_cfg, tokens, max_len=max_len)
        # More slots (pyramidkv) or one pool (adakv): the same sums in another order.
        tolerance = 3e-6 if method in ("adakv", "pyramidkv") else 0.0
        np.testing.assert_allclose(out, full, atol=tolerance, rtol=0, err_msg=method)
        for layer in cache.layers:
            heads = layer.stored(cache.lengths)
            np.testing.assert_array_equal(heads, np.full(heads.shape, 9), err_msg=method)


@pytest.mark.parametrize("name", ["gqa"])
def test_a_window_equals_a_plain_forward_with_a_banded_mask(name):
    """model.sliding_window in the plain forward, its ring cache and the 'window'
    policy on the same weights agree, whatever the chunks; the band matters."""
    cfg = VARIANTS[name]()
    tokens = random_tokens(cfg, (2, 9))
    _, params, apply = build(cfg)
    causal, _ = apply({"params": params}, tokens)
    windowed = cfg.copy_and_resolve_references()
    windowed.model.sliding_window = 3
    _, same_params, band_apply = build(windowed)
    banded, _ = band_apply({"params": same_params}, tokens)
    assert np.abs(np.asarray(banded) - np.asarray(causal))[:, 3:].min() > 0  # it sees less
    np.testing.assert_allclose(banded[:, :3], causal[:, :3], atol=5e-6, rtol=0)
    for chunks in ([9], CHUNKS, [2, 5, 2]) if name == "gqa" else (CHUNKS,):
        ring, cache = run(windowed, windowed.cache, tokens, chunks)
        np.testing.assert_allclose(ring, banded, atol=5e-6, rtol=0)
        policy, _ = run(cfg, evicting(cfg, "window", budget=3), tokens, chunks)
        np.testing.assert_allclose(policy, banded, atol=5e-6, rtol=0)
    assert (
        kvlab.tree_bytes(cache.layers) * MAX_LEN
        == kvlab.tree_bytes(kvlab.init_cache(cfg.model, cfg.cache, 2, MAX_LEN).layers) * 3
    )


def test_sinks_keep_the_first_tokens_and_a_recent_window():
    """StreamingLLM with 2 sinks in 5 slots: after 9 tokens the ring holds 0, 1 and
    6..8, and the logits do not depend on the chunks (each query sees the sinks
    and its last 3 positions, as the window test checks for the band)."""
    cfg = VARIANTS["mha"]()
    tokens = random_tokens(cfg, (1, 9))
    cache_cfg = evicting(cfg, "sinks", budget=5, sinks=2)
    out, cache = run(cfg, cache_cfg, tokens)
    held = kvlab.cache.evict.ring_positions(cache.lengths, cache.layers[0].policy)
    assert sorted(np.asarray(held)[0].tolist()) == [0, 1, 6, 7, 8]
    chunked, _ = run(cfg, cache_cfg, tokens, [1] * 9)
    np.testing.assert_allclose(chunked, out, atol=5e-6, rtol=0)
    window, _ = run(cfg, evicting(cfg, "window", budget=5), tokens)
    assert np.abs(window - out)[:, 6:].min() > 0  # the sinks are seen


@pytest.mark.parametrize("bits, methods", [(16, ("sinks", "adakv")), (4, ("h2o",))])
def test_a_paged_evicting_cache_equals_the_dense_one(bits, methods):
    """Slots in pages (block tables in another order, pages of 2 slots) keep and
    give exactly what the dense evicting cache does; its bytes are counted.
    (Groups of KIVI's storage in pages: the next test.)"""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 9))
    _, params, apply = build(cfg)
    for method in methods:
        cache_cfg = evicting(cfg, method, bits, budget=5, sinks=1)
        dense, dense_cache = run(cfg, cache_cfg, tokens)
        cache_cfg.update(kind="paged", page_size=2)
        paged = kvlab.init_cache(cfg.model, cache_cfg, 2, MAX_LEN)
        assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, MAX_LEN) == kvlab.tree_bytes(paged)
        # pages for the kept slots (adakv: one pool of K x 5), not MAX_LEN / 2 = 8
        assert paged.block_tables.shape == (2, 5 if method == "adakv" else 3)
        paged = paged.replace(block_tables=paged.block_tables[::-1, ::-1])
        out, paged = run_in_chunks(apply, params, paged, tokens, CHUNKS)
        np.testing.assert_array_equal(out, dense, err_msg=method)
        for a, b in zip(dense_cache.layers, paged.layers, strict=True):
            if a.positions is not None:
                np.testing.assert_array_equal(a.positions, b.positions)


def test_paged_groups_of_kivi_storage_equal_the_dense_ones():
    """h2o's settling groups in pages of 8 rows (block tables reversed), rings and
    ring scores per row: the logits, kept positions and scores of the dense
    layer, and the bytes counted. (A window's paged groups: the test above.)"""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 28))
    _, params, apply = build(cfg)
    cache_cfg = kivi(cfg, "h2o", 8, budget=24)
    chunks = KIVI_CHUNKS
    dense, dense_cache = run(cfg, cache_cfg, tokens, chunks, KIVI_LEN)
    cache_cfg.update(kind="paged", page_size=8)
    paged = kvlab.init_cache(cfg.model, cache_cfg, 2, KIVI_LEN)
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, KIVI_LEN) == kvlab.tree_bytes(paged)
    assert paged.block_tables.shape == (2, dense_cache.layers[0].policy.slots)  # a group a page
    paged = paged.replace(block_tables=paged.block_tables[::-1, ::-1])
    out, paged = run_in_chunks(apply, params, paged, tokens, chunks)
    np.testing.assert_array_equal(out, dense)
    for a, b in zip(dense_cache.layers, paged.layers, strict=True):
        for field in ("positions", "scores", "ring_scores"):
            if getattr(a, field) is not None:
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


@pytest.mark.parametrize(
    "name, residual, methods",
    [("gqa", 8, ("h2o", "knorm", "window")), ("mla_absorbed", 0, ("h2o", "snapkv", "sinks"))],
)
def test_kivi_eviction_with_a_budget_that_holds_the_sequence_gives_the_quantized_logits(
    name, residual, methods
):
    """Per-channel key scales and a residual ring: tokens settle in groups exactly when
    the quantized cache flushes them, so with nothing evicted the logits are the
    quantized cache's; h2o's scores (kept groups and ring slots) hold every query's
    attention once, the mass of a settling token being summed over the blocks it
    was read through."""
    cfg = VARIANTS[name]()
    tokens = random_tokens(cfg, (2, 28))
    full, _ = run(cfg, kivi(cfg, "none", residual), tokens, KIVI_CHUNKS, KIVI_LEN)
    for method in methods:
        cache_cfg = kivi(cfg, method, residual, budget=KIVI_LEN)
        out, cache = run(cfg, cache_cfg, tokens, KIVI_CHUNKS, KIVI_LEN)
        np.testing.assert_array_equal(out, full, err_msg=method)
        for layer in cache.layers:
            heads = layer.stored(cache.lengths)
            np.testing.assert_array_equal(heads, np.full(heads.shape, 28), err_msg=method)
            if method == "h2o":  # each of the 28 queries gives each KV head a mass of 1
                total = layer.scores.sum(-1) + layer.ring_scores.sum(-1)
                np.testing.assert_allclose(total, np.full(total.shape, 28.0), rtol=1e-5)


def _without_eviction(cfg, cache_cfg, batch, max_len):
    """cache_cfg's evicting cache with group slots for every token: the same
    policy (and band), nothing evicted."""
    cache = kvlab.init_cache(cfg.model, cache_cfg, batch, max_len)
    specs = kvlab.cache.quant.storages(cfg.model, cache_cfg)
    shapes = [(t.heads, t.width) for t in kvlab.config.cached_tensors(cfg.model)]
    dtype = kvlab.config.dtype_of(cache_cfg.dtype)
    layers = []
    for layer in cache.layers:
        policy = dataclasses.replace(layer.policy, slots=max_len // layer.policy.granularity)
        layers.append(kvlab.cache.factory._evicting_layer(policy, specs, shapes, dtype, batch))
    return cache.replace(layers=tuple(layers))


@pytest.mark.parametrize(
    "name, residual, fields, kind, kept",
    [
        ("gqa", 8, dict(method="window", budget=12), "dense", [8]),
        ("mla_absorbed", 0, dict(method="sinks", budget=6, sinks=2), "paged", [0, 16]),
    ],
)
def test_a_window_over_settling_groups_keeps_what_its_band_reads(
    name, residual, fields, kind, kept
):
    """window / sinks over KIVI storage: each query sees the sinks and its last
    `span` positions, quantized as the quantized cache stores them; the layer keeps
    the sinks' groups and just enough of the newest settled ones (the rest of the
    band is unsettled), so evicting the older groups changes nothing: the logits
    equal the same band over every group, also from pages (block tables
    reversed). A model's sliding_window is the same cache."""
    cfg = VARIANTS[name]()
    tokens = random_tokens(cfg, (2, 28))
    _, params, apply = build(cfg)
    cache_cfg = kivi(cfg, **fields, residual=residual)
    chunks = [6, 6, 6, 6, 4]  # steps that start at offsets 0, 6, 4, 2 of a group
    everything = _without_eviction(cfg, cache_cfg, 2, KIVI_LEN)
    reference, _ = run_in_chunks(apply, params, everything, tokens, chunks)
    cache_cfg.update(kind=kind, page_size=8)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, KIVI_LEN)
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, KIVI_LEN) == kvlab.tree_bytes(cache)
    if kind == "paged":
        assert cache.block_tables.shape == (2, cache.layers[0].policy.slots)  # a group a page
        cache = cache.replace(block_tables=cache.block_tables[::-1, ::-1])
    out, cache = run_in_chunks(apply, params, cache, tokens, chunks)
    # The reference reads the groups evicted here only if the band lets it.
    np.testing.assert_allclose(out, reference, atol=3e-6, rtol=0)  # slots: another order
    for layer in cache.layers:
        assert np.asarray(layer.positions).tolist() == [[kept] * layer.positions.shape[1]] * 2
    if fields["method"] == "window":
        windowed = cfg.copy_and_resolve_references()
        windowed.model.sliding_window = fields["budget"]
        model_cache = kivi(windowed, "none", residual)
        policies = kvlab.cache.evict.policies  # the same layers, so the same program
        assert policies(windowed.model, model_cache, 32) == policies(cfg.model, cache_cfg, 32)


@pytest.mark.parametrize(
    "method, residual, recent", [("h2o", 8, 2), ("snapkv", 0, 10), ("adakv", 0, 10)]
)
def test_kivi_eviction_keeps_whole_groups_the_ring_and_the_recent_groups(method, residual, recent):
    """A budget of 24: each head keeps the settled groups of 8 tokens that fit
    beside the fullest unsettled ring (residual + 7 tokens): (24 - residual - 7) // 8
    (AdaKV: the layer's K x that, unequally); a group holding one of the `recent`
    latest positions stays; no head holds more than 24; the bytes are counted."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 28))
    cache_cfg = kivi(cfg, method, residual, budget=24, recent=recent)
    out, cache = run(cfg, cache_cfg, tokens, KIVI_CHUNKS, KIVI_LEN)
    assert np.isfinite(out).all()
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, KIVI_LEN) == kvlab.tree_bytes(cache)
    kv_heads, groups = cfg.model.num_kv_heads, (24 - residual - 7) // 8
    settled = (28 - residual) // 8 * 8
    must_stay = {first for first in range(0, settled, 8) if first + 7 >= 28 - recent}
    for layer in cache.layers:
        positions = np.asarray(layer.positions)
        if layer.policy.pooled:  # tags: first position x K + head
            kept = [
                [positions[b, 0][positions[b, 0] % kv_heads == h] for h in range(kv_heads)]
                for b in range(2)
            ]
            assert (positions >= 0).sum() == 2 * kv_heads * groups
            kept = [[p[p >= 0] // kv_heads for p in row] for row in kept]
        else:
            assert (positions >= 0).all() and positions.shape == (2, kv_heads, groups)
            kept = [[positions[b, h] for h in range(kv_heads)] for b in range(2)]
        stored = np.asarray(layer.stored(cache.lengths))
        for b, row in enumerate(kept):
            for h, firsts in enumerate(row):
                assert len(set(firsts)) == len(firsts)
                assert all(f % 8 == 0 and 0 <= f < settled for f in firsts)
                assert must_stay <= set(firsts.tolist())
                assert stored[b, h] == 8 * len(firsts) + 28 - settled
        # AdaKV's heads share K x 24 unequally; the others hold 24 each at most
        assert (
            (stored.sum(-1) <= 24 * kv_heads).all() if layer.policy.pooled else stored.max() <= 24
        )


def layer0_attention(cfg, params, tokens):
    """Layer 0's attention probabilities from the plain forward: float64 [B, N, T, T]."""
    found = intermediates(cfg, params, tokens)["block_0"]["attention"]
    q, k = found["query"]["__call__"][0], found["key"]["__call__"][0]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    q = apply_rope(q, positions, cfg.model.rope_theta, cfg.model.rope_scaling)
    k = apply_rope(k, positions, cfg.model.rope_theta, cfg.model.rope_scaling)
    groups = cfg.model.num_heads // cfg.model.num_kv_heads
    k = np.repeat(np.asarray(k, np.float64), groups, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64), k) / np.sqrt(q.shape[-1])
    length = tokens.shape[1]
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True)


def layer0_keys(cfg, params, tokens):
    """Layer 0's keys after RoPE, as its cache stores them: float64 [B, T, K, H]."""
    captured = intermediates(cfg, params, tokens)["block_0"]["attention"]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    key = kvlab.rope.apply_rope(
        captured["key"]["__call__"][0], positions, cfg.model.rope_theta, cfg.model.rope_scaling
    )
    return np.asarray(key, np.float64)


def layer0_values(cfg, params, tokens):
    """Layer 0's values as its cache stores them: float64 [B, T, K, H]."""
    captured = intermediates(cfg, params, tokens)["block_0"]["attention"]
    return np.asarray(captured["value"]["__call__"][0], np.float64)


def test_h2o_scores_are_the_column_sums_of_the_attention_matrix():
    """With nothing evicted, h2o's accumulated score of each token is the attention it
    got from every query, averaged over its KV head's query heads, whatever the chunks."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 9))
    _, params, _ = build(cfg)
    probs = layer0_attention(cfg, params, tokens)  # [B, N, T, T]
    groups = cfg.model.num_heads // cfg.model.num_kv_heads
    per_kv_head = probs.reshape(2, cfg.model.num_kv_heads, groups, 9, 9).mean(2)
    expected = per_kv_head.sum(axis=2)  # [B, K, T]: each key's column sum
    for chunks in ([9], CHUNKS):
        _, cache = run(cfg, evicting(cfg, "h2o", budget=MAX_LEN), tokens, chunks)
        layer = cache.layers[0]
        np.testing.assert_array_equal(
            layer.positions[:, :, :9], np.broadcast_to(np.arange(9), (2, 2, 9))
        )
        np.testing.assert_allclose(layer.scores[:, :, :9], expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "pyramidkv", "adakv", "knorm", "random"])
def test_scored_eviction_keeps_the_budget_the_recent_tokens_and_the_best(method):
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 9))
    out, cache = run(cfg, evicting(cfg, method, budget=4), tokens)
    assert np.isfinite(out).all()
    kv_heads = cfg.model.num_kv_heads
    for layer in cache.layers:
        budget = layer.policy.slots // (kv_heads if layer.policy.pooled else 1)
        stored = np.asarray(layer.stored(cache.lengths))
        positions = np.asarray(layer.positions)
        if layer.policy.pooled:  # unequal heads, one pool: the layer's total is K x budget
            np.testing.assert_array_equal(stored.sum(1), kv_heads * budget)
            heads = [positions[b, 0] % kv_heads for b in range(2)]
            kept = [
                [
                    sorted(positions[b, 0][(heads[b] == h) & (positions[b, 0] >= 0)] // kv_heads)
                    for h in range(kv_heads)
                ]
                for b in range(2)
            ]
            assert all(len(k) >= layer.policy.floor for row in kept for k in row)
        else:
            np.testing.assert_array_equal(stored, budget)
            kept = [[sorted(positions[b, h]) for h in range(kv_heads)] for b in range(2)]
        for row in kept:
            for head in row:
                assert len(set(head)) == len(head) and all(0 <= p < 9 for p in head)
                assert {7, 8} <= set(head)  # evict.recent=2


def test_snapkv_after_one_prefill_keeps_the_top_pooled_tokens():
    """One prefill step: SnapKV keeps the recent tokens and, of the others, those
    whose attention from the last obs_window queries, max-pooled over kernel
    neighbours, is largest (per KV head, mean over its query heads)."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 12), seed=3)
    _, params, _ = build(cfg)
    probs = layer0_attention(cfg, params, tokens)  # [B, N, T, T]
    groups = cfg.model.num_heads // cfg.model.num_kv_heads
    mass = probs[:, :, -4:].sum(2).reshape(2, cfg.model.num_kv_heads, groups, 12).mean(2)
    padded = np.pad(mass, ((0, 0), (0, 0), (1, 1)), constant_values=-np.inf)
    pooled = np.maximum(np.maximum(padded[..., :-2], padded[..., 1:-1]), padded[..., 2:])
    _, cache = run(cfg, evicting(cfg, "snapkv", budget=6, obs_window=4, kernel=3), tokens, [12])
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    for b in range(2):
        for h in range(cfg.model.num_kv_heads):
            best = np.argsort(-pooled[b, h, :10], kind="stable")[:4]
            np.testing.assert_array_equal(kept[b, h], np.sort([*best, 10, 11]))


@settings(max_examples=20, deadline=None)
@given(
    values=st.lists(
        st.one_of(st.integers(-3, 3), st.sampled_from([-0.0, np.inf, -np.inf, np.nan])),
        min_size=1,
        max_size=24,
    ),
    rows=st.integers(1, 3),
    longer=st.booleans(),
)
def test_ranks_are_the_stable_argsort_of_the_argsort(values, rows, longer):
    """scorers.ranks, rows up to PAIRWISE_RANKS by pairs, longer ones by a sort:
    each entry's place in ascending order, among equals the earlier first (NaN
    last, -0 equal to 0), over rows of few distinct values (ties)."""
    from kvlab.cache.evict.scorers import PAIRWISE_RANKS, ranks

    if longer:  # past the pairwise rows' length: the sort
        values = (values * (PAIRWISE_RANKS // len(values) + 1))[: PAIRWISE_RANKS + 5]
    x = np.stack([np.roll(values, r) for r in range(rows)]).astype(np.float32)
    want = np.argsort(np.argsort(x, axis=-1, kind="stable"), axis=-1, kind="stable")
    np.testing.assert_array_equal(np.asarray(jax.jit(ranks)(jnp.asarray(x))), want)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    held=st.floats(0.0, 1.0),
    shape=st.sampled_from(
        [(1, 1, 1, 1), (2, 3, 1600, 3), (1, 2, 8200, 16), (2, 2, 300, 5), (1, 2, 40, 20)]
    ),
    backend=st.sampled_from(["xla", "native"]),
)
def test_new_tokens_take_the_lowest_free_slots_in_order(seed, held, shape, backend):
    """layers._free_slots, by whichever search a shape takes (minima, blocks of a
    large pool, a top-k, the native backend's kernel, a running count): the
    r-th kept new token of a head gets the r-th lowest slot not kept, over slots
    held sparsely, densely, in runs or all but a few."""
    batch, heads, slots, new = shape
    rng = np.random.default_rng(seed)
    kept = rng.random((batch, heads, slots)) < held
    if rng.random() < 0.3:  # a few free slots, far apart
        kept = np.ones_like(kept)
        kept[..., rng.integers(slots, size=rng.integers(1, 2 * new + 1))] = False
    elif rng.random() < 0.5:  # runs of held slots, as a pool fills after a compression
        kept = np.sort(kept, axis=-1)[..., ::-1] if rng.random() < 0.5 else kept
        kept = np.roll(kept, rng.integers(slots), axis=-1)
    kept_new = rng.random((batch, heads, new)) < 0.8
    free = [[np.flatnonzero(~kept[b, e]) for e in range(heads)] for b in range(batch)]
    for b in range(batch):  # no more kept new tokens than free slots
        for e in range(heads):
            extra = np.flatnonzero(kept_new[b, e])[len(free[b][e]) :]
            kept_new[b, e, extra] = False
    rank = np.cumsum(kept_new, axis=-1)
    with kvlab.backends.running(kvlab.backends.get(backend)):  # traced under it
        find = jax.jit(lambda kept, rank: _free_slots(kept, rank))
        got = np.asarray(find(jnp.asarray(kept), jnp.asarray(rank)))
    for b in range(batch):
        for e in range(heads):
            for t in np.flatnonzero(kept_new[b, e]):
                assert got[b, e, t] == free[b][e][rank[b, e, t] - 1], (b, e, t)


EDGES = [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-40, -1e-40, 3e38, -3e38]  # zeros, subnormals
EDGES += [np.inf, -np.inf, np.nan]


@settings(max_examples=40, deadline=None)
@given(
    x=st.lists(
        st.one_of(st.sampled_from(EDGES), st.floats(width=32, allow_nan=False)),
        min_size=4 * 24,
        max_size=4 * 24,
    ),
    counts=st.lists(st.integers(-2, 27), min_size=4, max_size=4),
)
def test_best_is_the_stable_sorts_first_count(x, counts):
    """scorers.best (no sort): each row's `count` largest, among equals the earlier
    first, NaN below -inf, -0 equal to 0 and subnormals apart, as a stable argsort
    has them (and `ranks(-x) < count`, but that XLA:CPU's sort takes subnormals
    for zeros); counts of none, some, every entry and past them."""
    x = np.asarray(x, np.float32).reshape(4, 24)
    count = np.asarray(counts, np.int32)[:, None]
    order = np.argsort(-x, axis=-1, kind="stable")  # NaN last, -0 equal to 0
    place = np.argsort(order, axis=-1, kind="stable")
    got = np.asarray(jax.jit(best)(jnp.asarray(x), jnp.asarray(count)))
    np.testing.assert_array_equal(got, place < count)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.sampled_from([0, 1, 2, 7, 64, 65, 1000])),
    seed=st.integers(0, 2**16),
    as_bool=st.booleans(),
)
def test_running_count_is_the_cumulative_sum(shape, seed, as_bool):
    """scorers.running_count (a parallel prefix) equals the cumulative sum along the
    last axis, exactly, for bools and integers of either sign, over rows of no,
    one, an odd and a power-of-two number of entries."""
    x = np.random.default_rng(seed).integers(-50, 50, shape).astype(np.int32)
    x = x > 0 if as_bool else x
    got = np.asarray(running_count(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.cumsum(x, axis=-1, dtype=np.int64))


def bare_candidates(positions, valid, heads, kv_heads: int, **fields) -> Candidates:
    """One step's candidates [B, E, C] as a scorer's own test builds them: the valid
    positions (the others -1) as their tags, each candidate's KV head, and `fields`;
    what the scorer under test does not read left empty."""
    positions = jnp.asarray(np.where(valid, positions, -1))
    empty = dict(held=0, group=1, mass=None, state=None, keys=lambda: None, kernel=1, seed=0)
    return Candidates(
        tags=positions,
        valid=jnp.asarray(valid),
        positions=positions,
        heads=jnp.asarray(heads),
        layer=0,
        kv_heads=kv_heads,
        **(empty | fields),
    )


@settings(max_examples=12, deadline=None)
@given(
    heads=st.sampled_from([(2, 1), (1, 3), (1, 1)]),  # (storage heads, KV heads): a pool
    count=st.sampled_from([1, 7, 20]),  # few shapes: each compiles
    max_len=st.sampled_from([20, 33]),
    seed=st.integers(0, 2**16),
)
def test_candidates_rank_by_position_per_kv_head_valid_ones_first(heads, count, max_len, seed):
    """scorers.position_rank (a count over marked positions) against the definition:
    per storage head, the valid candidates by (KV head, position) 0 .. n - 1, then
    the others in candidate order."""
    from kvlab.cache.evict.scorers import position_rank

    storage, kv_heads = heads
    rng = np.random.default_rng(seed)
    shape = (2, storage, count)
    owner = rng.integers(0, kv_heads, shape)
    positions = np.stack(
        [np.stack([rng.permutation(max_len)[:count] for _ in range(storage)]) for _ in range(2)]
    )
    valid = rng.random(shape) < 0.7
    per_storage = np.broadcast_to(np.arange(storage)[:, None], shape)
    c = bare_candidates(
        positions, valid, owner if storage == 1 else per_storage, kv_heads, max_len=max_len
    )
    rank = np.asarray(position_rank(c))
    key = np.where(valid, np.asarray(c.heads) * max_len + positions, 10**6 + np.arange(count))
    want = np.argsort(np.argsort(key, axis=-1, kind="stable"), axis=-1)
    np.testing.assert_array_equal(rank, want)
    # and position_rank without max_len (a comparison sort) agrees
    sorted_rank = position_rank(dataclasses.replace(c, max_len=0))
    np.testing.assert_array_equal(np.asarray(sorted_rank), want)


def test_snapkv_mean_pooling_averages_the_prefix_before_the_window():
    """pooling='mean' (SnapKV's reference code and kvpress): the attention of the
    last obs_window queries to the tokens before the window, average-pooled over
    kernel neighbours with zeros past the ends and in place of the window (kept,
    cache.evict.recent = obs_window), is what ranks the tokens."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 12), seed=3)
    _, params, _ = build(cfg)
    probs = layer0_attention(cfg, params, tokens)  # [B, N, T, T]
    groups = cfg.model.num_heads // cfg.model.num_kv_heads
    mass = probs[:, :, -4:, :8].sum(2).reshape(2, cfg.model.num_kv_heads, groups, 8).mean(2)
    padded = np.pad(mass, ((0, 0), (0, 0), (1, 1)))
    pooled = (padded[..., :-2] + padded[..., 1:-1] + padded[..., 2:]) / 3
    fields = dict(budget=7, obs_window=4, recent=4, kernel=3, options={"pooling": "mean"})
    _, cache = run(cfg, evicting(cfg, "snapkv", **fields), tokens, [12])
    _, by_max = run(cfg, evicting(cfg, "snapkv", **{**fields, "options": {}}), tokens, [12])
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    for b in range(2):
        for h in range(cfg.model.num_kv_heads):
            best = np.argsort(-pooled[b, h], kind="stable")[:3]
            np.testing.assert_array_equal(kept[b, h], np.sort([*best, 8, 9, 10, 11]))
    assert (np.sort(np.asarray(by_max.layers[0].positions), axis=-1) != kept).any()


def test_h2o_average_ranks_by_the_attention_of_the_queries_that_saw_a_token():
    """options.average (kvpress's ObservedAttentionPress): each token's accumulated
    attention over the queries that saw it (12 - i for token i of a 12-token prefill)
    ranks it; the state each slot keeps is still the sum."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 12), seed=6)
    _, params, _ = build(cfg)
    probs = layer0_attention(cfg, params, tokens)  # [B, N, T, T]
    groups = cfg.model.num_heads // cfg.model.num_kv_heads
    column = probs.sum(2).reshape(2, cfg.model.num_kv_heads, groups, 12).mean(2)  # [B, K, T]
    mean = column / (12 - np.arange(12))
    cache_cfg = evicting(cfg, "h2o", budget=6, recent=1, options={"average": True})
    _, cache = run(cfg, cache_cfg, tokens, [12])
    layer = cache.layers[0]
    order = np.argsort(np.asarray(layer.positions), axis=-1)
    kept = np.take_along_axis(np.asarray(layer.positions), order, -1)
    differs = False
    for b in range(2):
        for h in range(cfg.model.num_kv_heads):
            best = np.sort([*np.argsort(-mean[b, h, :11], kind="stable")[:5], 11])
            np.testing.assert_array_equal(kept[b, h], best)
            by_sum = np.sort([*np.argsort(-column[b, h, :11], kind="stable")[:5], 11])
            differs |= (best != by_sum).any()
            scores = np.take_along_axis(np.asarray(layer.scores), order, -1)[b, h]
            np.testing.assert_allclose(scores, column[b, h, best], atol=2e-6, rtol=0)
    assert differs  # the average keeps other tokens than the sum here


def test_bytes_are_the_kept_slots():
    """AdaKV's pool stores what uniform SnapKV stores at the same total budget; a
    GQA model with 4 query heads per KV head keeping 50% stores 1/4 of the MHA
    model's layers at 50%; a ring stores no positions."""
    gqa, mha = VARIANTS["mha"](), VARIANTS["mha"]()
    for cfg, heads in ((gqa, 2), (mha, 8)):
        cfg.model.update(num_heads=8, num_kv_heads=heads)

    def layers(cfg, method, **fields):
        cache = kvlab.init_cache(cfg.model, evicting(cfg, method, **fields), 3, 64)
        return kvlab.tree_bytes(cache.layers)

    assert layers(mha, "adakv", ratio=0.5) == layers(mha, "snapkv", ratio=0.5)
    assert 4 * layers(gqa, "snapkv", ratio=0.5) == layers(mha, "snapkv", ratio=0.5)
    full = layers(mha, "none")
    assert 2 * layers(mha, "window", ratio=0.5) == full
    # scored: + an int32 position per slot and KV head (h2o: + its float32 score)
    per_slot = 3 * mha.model.num_layers * 8 * 32
    assert layers(mha, "snapkv", ratio=0.5) == full // 2 + 4 * per_slot
    assert layers(mha, "h2o", ratio=0.5) == full // 2 + 8 * per_slot


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(list(VARIANTS)),
    method=st.sampled_from(METHODS),
    bits=st.sampled_from([16, 8, 4, 2]),
    axis=st.sampled_from(["token", "channel"]),
    residual=st.sampled_from([0, 8]),
    ratio=st.sampled_from([0.125, 0.25, 0.5, 0.75, 1.0]),
    batch=st.integers(1, 3),
    max_len=st.integers(24, 80),
    paged=st.booleans(),
)
def test_cache_bytes_equal_tree_bytes_for_every_policy(
    name, method, bits, axis, residual, ratio, batch, max_len, paged
):
    cfg = VARIANTS[name]()
    cache_cfg = evicting(cfg, method, bits, ratio=ratio, sinks=1)
    first = kvlab.config.cached_prefixes(cfg.model)[0]
    cache_cfg.update({f"{first}_axis": axis, "residual": residual})  # KIVI's layout
    if paged:
        cache_cfg.update(kind="paged", page_size=16)
    build_cache = lambda: kvlab.init_cache(cfg.model, cache_cfg, batch, max_len)  # noqa: E731
    try:
        counted = kvlab.cache_bytes(cfg.model, cache_cfg, batch, max_len)
    except ValueError as refused:  # a budget that cannot keep its promise: refused alike
        assert "cache.evict" in str(refused) or "cache.residual" in str(refused)
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            build_cache()
        return
    assert counted == kvlab.tree_bytes(jax.eval_shape(build_cache))


@settings(max_examples=6, deadline=None)
@given(
    method=st.sampled_from(METHODS),
    storage=st.sampled_from(["16", "int4", "kivi"]),
    budget=st.integers(2, 24),
    recent=st.integers(0, 6),
    floor=st.sampled_from([0.0, 0.5, 1.0]),
    interval=st.sampled_from([1, 4]),
    chunks=st.lists(st.sampled_from([1, 7]), min_size=2, max_size=4),
)
@example(method="adakv", storage="16", budget=16, recent=6, floor=1.0, interval=1, chunks=[7, 7, 7])
@example(
    method="snapkv", storage="kivi", budget=23, recent=2, floor=0.0, interval=1, chunks=[7, 7, 7, 7]
)
def test_a_budget_is_a_promise_every_head_keeps_or_the_config_is_refused(
    method, storage, budget, recent, floor, interval, chunks
):
    """After every step no KV head holds more than its layer's budget (settled groups
    and the unsettled ring together; AdaKV's heads share K x budget), and AdaKV's
    heads each keep at least their floor; a budget that cannot keep that promise
    is refused naming the fields. A window over settling groups keeps what its
    band reads (the test above), so its promise is the band, not the bytes."""
    cfg = VARIANTS["gqa"]()
    bits = 4 if storage == "int4" else 16
    fields = dict(budget=budget, recent=recent, adakv_floor=floor, sinks=1, interval=interval)
    cache_cfg = (
        kivi(cfg, method, 8, **fields)
        if storage == "kivi"
        else evicting(cfg, method, bits, **fields)
    )
    if storage == "kivi" and method in ("window", "sinks"):
        return
    try:
        budgets = kvlab.cache.evict.layer_budgets(cfg.model, cache_cfg, KIVI_LEN)
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, KIVI_LEN)
    except ValueError as refused:
        assert "cache.evict" in str(refused) or "cache.residual" in str(refused)
        return
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, sum(chunks)))
    start = 0
    for size in chunks:
        _, cache = apply({"params": params}, tokens[:, start : start + size], cache=cache)
        start += size
        for layer, kept in zip(cache.layers, budgets, strict=True):
            held = np.asarray(layer.stored(cache.lengths))  # [B, K]
            policy = layer.policy
            if not policy.pooled:
                assert held.max() <= kept, (held, kept)
                continue
            assert (held.sum(-1) <= kept * policy.kv_heads).all(), (held, kept)
            units = (np.asarray(layer.positions) >= 0)[:, 0, :]  # [B, S] slots in use
            owner = np.asarray(layer.positions)[:, 0, :] % policy.kv_heads
            seen = (
                start if not policy.settles else policy.layout.settled(start) // policy.granularity
            )
            for h in range(policy.kv_heads):
                assert ((units & (owner == h)).sum(-1) >= min(policy.floor, seen)).all()


def test_an_interval_evicts_every_few_steps_leaving_room_for_the_next_ones():
    """knorm token by token through a budget of 6 with cache.evict.interval=3
    (recent 0): a step that overflows drops the largest keys down to 4, so the
    next two steps append unscored; the kept sets are a NumPy replay of that
    rule over layer 0's keys, and no head ever holds more than 6."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (1, 15), seed=4)
    _, params, apply = build(cfg)
    norms = np.linalg.norm(layer0_keys(cfg, params, tokens)[0], axis=-1)  # [T, K]
    cache = kvlab.init_cache(
        cfg.model, evicting(cfg, "knorm", budget=6, recent=0, interval=3), 1, 16
    )
    kept = [[] for _ in range(cfg.model.num_kv_heads)]
    for t in range(15):
        _, cache = apply({"params": params}, tokens[:, t : t + 1], cache=cache)
        for h, held in enumerate(kept):
            held.append(t)
            if len(held) > 6:  # down to 6 - (3 - 1)
                order = sorted(held, key=lambda p: norms[p, h])
                kept[h] = order[:4]
        positions = np.asarray(cache.layers[0].positions)[0]
        for h in range(cfg.model.num_kv_heads):
            assert sorted(positions[h][positions[h] >= 0].tolist()) == sorted(kept[h]), t
        assert np.asarray(cache.layers[0].stored(cache.lengths)).max() <= 6


@settings(max_examples=30, deadline=None)
@given(
    method=st.sampled_from(METHODS),
    storage=st.sampled_from(["16", "kivi"]),
    budget=st.integers(1, 2000),
    recent=st.integers(0, 40),
    floor=st.sampled_from([0.0, 0.2, 1.0]),
    when=st.sampled_from(["every_step", "after_prefill", "decoding"]),
)
@example(method="snapkv", storage="16", budget=1024, recent=8, floor=0.0, when="every_step")
@example(method="adakv", storage="16", budget=100, recent=8, floor=1.0, when="every_step")
@example(method="snapkv", storage="kivi", budget=300, recent=8, floor=0.0, when="every_step")
def test_the_default_interval_is_the_methods_own_as_far_as_the_layer_allows(
    method, storage, budget, recent, floor, when
):
    """cache.evict.interval=0 (the default) is 1 for a method whose definition
    evicts at every step (Scorer.stepwise: h2o, tova, duo_attention) and for a
    compression after prefill; else each layer's budget/16 tokens, at most 64
    (decoding: that many steps), or fewer where the spare slots would eat what the
    layer always keeps (recent, AdaKV's floor): then the most it allows, one group
    more being refused. It never refuses a config interval 1 builds; set
    explicitly, the interval a layer chose builds it alike."""
    cfg = VARIANTS["gqa"]()
    fields = dict(budget=budget, recent=recent, adakv_floor=floor, when=when, interval=0)
    make = (
        functools.partial(kivi, cfg, method, 8)
        if storage == "kivi"
        else functools.partial(evicting, cfg, method)
    )
    plan = functools.partial(kvlab.cache.evict.policies, cfg.model, max_len=4096)
    try:
        chosen = plan(make(**fields))
    except ValueError as refused:  # refused whatever the interval, never for its own
        assert "cache.evict" in str(refused) or "cache.residual" in str(refused)
        with pytest.raises(ValueError):
            plan(make(**{**fields, "interval": 1}))
        return
    scorer = kvlab.cache.evict.scorer_of(method)
    if scorer is None:  # a window
        assert {p.interval for p in chosen} == {1}
        return
    batched = not scorer.stepwise and when != "after_prefill"
    for policy in chosen:
        batch = max(1, min(64, policy.budget // 16))
        if not batched:
            assert policy.interval == 1
        elif when == "decoding":
            assert policy.interval == batch
        else:
            assert 1 <= policy.interval <= batch
    least = min(chosen, key=lambda p: p.interval)
    explicit = plan(make(**{**fields, "interval": least.interval}))
    for policy, alike in zip(chosen, explicit, strict=True):
        assert (policy == alike) == (policy.interval == least.interval)
    g = least.granularity
    below = least.interval < max(1, min(64, least.budget // 16)) - g + 1
    if batched and when == "every_step" and below:
        with pytest.raises(ValueError, match=r"cache\.evict\.interval="):
            plan(make(**{**fields, "interval": least.interval + g}))


@settings(max_examples=8, deadline=None)
@given(
    budget=st.integers(3, 7),
    recent=st.integers(0, 2),
    chunks=st.lists(st.integers(1, 3), min_size=2, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_knorm_every_step_scores_only_new_tokens_and_keeps_the_smallest_keys(
    budget, recent, chunks, seed
):
    """knorm is static (Scorer.static): competing every step, the layer carries its
    slots' scores (minus the key norms) and scores only the step's new tokens. Its
    kept sets are, after every step, a NumPy replay of the definition over layer
    0's keys (distinct tokens: no equal norms): the `recent` latest stay, then the
    smallest keys of those held and the new ones."""
    cfg = VARIANTS["gqa"]()
    length = sum(chunks)
    tokens = np.random.default_rng(seed).permutation(cfg.model.vocab_size)[None, :length]
    tokens = jnp.asarray(tokens, jnp.int32)
    _, params, apply = build(cfg)
    norms = np.linalg.norm(layer0_keys(cfg, params, tokens)[0], axis=-1)  # [T, K]
    cache_cfg = evicting(cfg, "knorm", budget=budget, recent=recent)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, 24)
    assert cache.layers[0].policy.remembers and cache.layers[0].scores is not None
    heads = cfg.model.num_kv_heads
    held, end = [[] for _ in range(heads)], 0
    for n in chunks:
        _, cache = apply({"params": params}, tokens[:, end : end + n], cache=cache)
        end += n
        for h in range(heads):
            candidates = held[h] + list(range(end - n, end))
            always = [t for t in candidates if t >= end - recent]
            rest = sorted((t for t in candidates if t < end - recent), key=lambda t: norms[t, h])
            held[h] = always + rest[: max(0, budget - len(always))]
        layer = cache.layers[0]
        positions, scores = np.asarray(layer.positions)[0], np.asarray(layer.scores)[0]
        for h in range(heads):
            stored = positions[h] >= 0
            assert sorted(positions[h][stored].tolist()) == sorted(held[h]), (end, h)
            expected = -norms[positions[h][stored], h]
            np.testing.assert_allclose(scores[h][stored], expected, rtol=1e-5)


def assert_unknown_state_is_rebuilt(method: str, field: str):
    """A row whose per-slot `field` (a remembered score, a carried weight) is
    unknown (NaN: reset_rows started it on prefix pages) has it rebuilt at its
    next write under `method`: the same kept tokens and `field` as a layer that
    knew it, in every layer."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 12), seed=5)
    _, cache = run(cfg, evicting(cfg, method, budget=4), tokens[:, :9])
    _, params, apply = build(cfg)
    known = apply({"params": params}, tokens[:, 9:], cache=cache)[1]
    unknown = cache.replace(
        layers=[
            layer.replace(**{field: getattr(layer, field).at[0].set(jnp.nan)})
            for layer in cache.layers
        ]
    )
    rebuilt = apply({"params": params}, tokens[:, 9:], cache=unknown)[1]
    for a, b in zip(known.layers, rebuilt.layers, strict=True):
        np.testing.assert_array_equal(a.positions, b.positions)
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-6)
        assert np.isfinite(np.asarray(getattr(b, field))).all()


def test_unknown_remembered_scores_are_scored_afresh_with_the_same_choices():
    assert_unknown_state_is_rebuilt("knorm", "scores")


def test_a_row_given_an_invalid_token_under_jit_keeps_its_kept_tokens():
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 9))
    _, cache = run(cfg, evicting(cfg, "h2o", budget=4), tokens)
    _, params, apply = build(cfg)
    bad = np.array(random_tokens(cfg, (2, 3), seed=1))
    bad[1, 1] = cfg.model.vocab_size
    logits, after = apply({"params": params}, jnp.asarray(bad), cache=cache)
    assert np.isnan(logits[1]).all() and np.isfinite(logits[0]).all()
    for old, new in zip(cache.layers, after.layers, strict=True):
        np.testing.assert_array_equal(old.positions[1], new.positions[1])
        np.testing.assert_array_equal(old.scores[1], new.scores[1])
        np.testing.assert_array_equal(old.tensors[0][1], new.tensors[0][1])
    with pytest.raises(kvlab.cache.CacheError, match="row 1"):
        after.check()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"evict.method": "lru"}, "cache.evict.method='lru' is not supported"),
        ({"evict.ratio": 0.0}, "cache.evict.ratio=0.0"),
        ({"evict.ratio": 1.5}, "cache.evict.ratio=1.5 is above 1"),
        ({"evict.budget": -1}, "cache.evict.budget=-1"),
        ({"evict.kernel": 4}, "cache.evict.kernel=4 is even"),
        ({"evict.adakv_floor": 2.0}, "cache.evict.adakv_floor=2.0"),
        (
            {"evict.method": "h2o", "kind": "paged", "prefix_caching": True},
            "cache.prefix_caching=True cannot combine with cache.evict.method='h2o'",
        ),
    ],
)
def test_bad_eviction_fields_are_refused_naming_the_field(change, message):
    cfg = VARIANTS["gqa"]()
    for field, value in change.items():
        section, _, name = field.rpartition(".")
        (cfg.cache[section] if section else cfg.cache)[name] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kvlab.init_cache(cfg.model, cfg.cache, 1, 32)


def test_budgets_that_cannot_hold_what_is_always_kept_are_refused():
    cfg = VARIANTS["gqa"]()
    with pytest.raises(ValueError, match=r"max_len=16777216 is too long for cache.evict"):
        kvlab.cache_bytes(cfg.model, evicting(cfg, "snapkv", budget=64), 1, 2**24)
    with pytest.raises(
        ValueError, match=r"cache.evict.recent=8 keeps every token of a budget of 4"
    ):
        kvlab.init_cache(cfg.model, evicting(cfg, "h2o", budget=4, recent=8), 1, 32)
    with pytest.raises(ValueError, match=r"cache.evict.sinks=4 leaves no recent window"):
        kvlab.init_cache(cfg.model, evicting(cfg, "sinks", ratio=0.125, sinks=4), 1, 32)
    windowed = VARIANTS["gqa"]()
    windowed.model.sliding_window = 8
    with pytest.raises(ValueError, match="cannot combine with model.sliding_window=8"):
        kvlab.init_cache(windowed.model, evicting(windowed, "h2o"), 1, 32)
