"""ChunkKV (kvlab/cache/evict/chunkkv.py), a wrapper over any scorer, against its
definition (arXiv:2502.00299, as kvpress's ChunkKVPress selects): the scorer's
scores are averaged over chunks of consecutive positions and over the KV heads,
and the best chunks stay whole in every head."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.evict.chunkkv import ChunkKV
from tests.cache.test_evict import assert_composes, bare_candidates, evicting, layer0_keys, run
from tests.helpers import VARIANTS, build, random_tokens


def test_one_prefill_keeps_the_chunks_of_highest_mean_score_in_every_head():
    """chunkkv over knorm: 24 tokens in chunks of 4, a budget of 12 keeps the 3
    chunks whose mean of -|key| over their tokens and the KV heads is highest."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 24), seed=2)
    _, params, _ = build(cfg)
    score = -np.linalg.norm(layer0_keys(cfg, params, tokens), axis=-1)  # [B, T, K]
    cache_cfg = evicting(cfg, "chunkkv:knorm", budget=12, recent=0, options={"chunk_length": 4})
    _, cache = run(cfg, cache_cfg, tokens, [24], 32)
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    for b in range(2):
        chunks = score[b].sum(-1).reshape(6, 4).mean(-1)
        best = np.sort(np.argsort(-chunks, kind="stable")[:3])
        expected = (best[:, None] * 4 + np.arange(4)).reshape(-1)
        for h in range(cfg.model.num_kv_heads):
            np.testing.assert_array_equal(kept[b, h], expected)


def test_a_budget_inside_a_chunk_keeps_the_best_whole_and_part_of_the_next():
    """26 tokens, the last 2 recent (kept, outside the means), a budget of 12 in
    chunks of 4: the 2 best chunks whole and 2 tokens of the third, which every
    head shares."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 26), seed=5)
    cache_cfg = evicting(cfg, "chunkkv:keydiff", budget=12, recent=2, options={"chunk_length": 4})
    _, cache = run(cfg, cache_cfg, tokens, [26], 32)
    for layer in cache.layers:
        kept = np.sort(np.asarray(layer.positions), axis=-1)
        for row in kept:
            assert (row == row[0]).all()  # every KV head the same tokens
            assert {24, 25} <= set(row[0])
            chunks = np.bincount(row[0][row[0] < 24] // 4, minlength=6)
            assert sorted(chunks.tolist()) == [0, 0, 0, 2, 4, 4]


@pytest.mark.parametrize("scorer", ["h2o", "adakv", "lagkv"])
def test_it_wraps_any_scorer_over_pools_groups_and_pages(scorer):
    """Over stateful, pooled and key/value scorers, KIVI's groups and pages."""
    cfg = VARIANTS["gqa"]()
    assert_composes(cfg, f"chunkkv:{scorer}", options={"chunk_length": 8})
    options = {"chunk_length": 8}
    label = kvlab.cache.cache_label(
        cfg.model, evicting(cfg, f"chunkkv:{scorer}", budget=24, options=options)
    )
    assert f"chunkkv:{scorer} keeping 24 tokens" in label and "chunk_length=8" in label


@pytest.mark.parametrize(
    "method, options, message",
    [
        ("chunkkv:knorm", {"chunk_length": 0}, "cache.evict.options.chunk_length=0 is below 1"),
        ("chunkkv:window", {}, "cache.evict.method='chunkkv:window' puts wrappers over 'window'"),
        ("knorm:knorm", {}, "names 'knorm', which is no eviction wrapper"),
        ("chunkkv:knorm", {"pooling": "mean"}, "options.pooling='mean' is no option"),
    ],
)
def test_bad_compositions_are_refused_naming_the_field(method, options, message):
    cfg = VARIANTS["gqa"]()
    with pytest.raises(ValueError, match=message):
        kvlab.init_cache(cfg.model, evicting(cfg, method, budget=8, options=options), 1, 32)


@settings(max_examples=12, deadline=None)
@given(
    shape=st.sampled_from([(1, 2, 9), (2, 1, 30), (2, 3, 17)]),
    chunk_length=st.sampled_from([1, 3, 20]),
    seed=st.integers(0, 2**16),
)
def test_chunk_means_are_the_definitions_with_or_without_max_len(shape, chunk_length, seed):
    """ChunkKV.priority: each counted candidate's priority is the mean over its
    row's counted candidates of the same chunk (position // chunk_length), an
    uncounted one's its own; summed by chunk number below max_len, or by the
    chunks' sorted order without it, alike."""
    rng = np.random.default_rng(seed)
    max_len = 64
    positions = rng.integers(0, max_len, shape)
    valid = rng.random(shape) < 0.8
    priority = rng.standard_normal(shape).astype(np.float32)
    heads = np.broadcast_to(np.arange(shape[1])[:, None], shape)
    c = bare_candidates(
        positions, valid, heads, shape[1], max_len=max_len, options={"chunk_length": chunk_length}
    )
    chunks = positions // chunk_length
    want = priority.copy()
    for b in range(shape[0]):
        for e, i in zip(*np.nonzero(valid[b]), strict=True):
            same = valid[b] & (chunks[b] == chunks[b, e, i])
            want[b, e, i] = priority[b][same].mean()
    for max_len_given in (max_len, 0):
        got = ChunkKV().priority(dataclasses.replace(c, max_len=max_len_given), priority)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
