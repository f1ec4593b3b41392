"""Expected Attention (kvlab/cache/evict/expected_attention.py) against its
definition (kvpress's ExpectedAttentionPress): the mean and covariance of the
queries before RoPE, turned by RoPE averaged over the next positions, give each
key an expected score; soft-maxed past the sinks, averaged over the KV head's
query heads and times the value's norm, it ranks the keys."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.evict import expected_attention as expected
from tests.cache.test_evict import evicting, kivi, layer0_keys, layer0_values, run
from tests.helpers import VARIANTS, build, intermediates, random_tokens


def layer0_raw_queries(cfg, params, tokens):
    """Layer 0's queries before RoPE: float64 [B, T, N, H]."""
    captured = intermediates(cfg, params, tokens)["block_0"]["attention"]
    return np.asarray(captured["query"]["__call__"][0], np.float64)


def expected_attention(q, keys, values, end, theta, future=512, sinks=4, covariance=True):
    """The definition for one row, in float64: q [T, N, H] before RoPE, keys (after
    RoPE) and values [T, K, H]; float64 [K, T] with the sinks scored above all."""
    heads, width = q.shape[1], q.shape[2]
    groups = heads // keys.shape[1]
    half = width // 2
    frequency = theta ** (-np.arange(half) * 2 / width)
    angle = (end + np.arange(future))[:, None] * frequency  # [F, H/2]
    cos, sin = np.cos(angle).mean(0), np.sin(angle).mean(0)
    # RoPE in halves, averaged: column form R (x -> R x) for each pair (i, i + H/2)
    turn = np.zeros((width, width))
    turn[np.arange(half), np.arange(half)] = turn[
        np.arange(half) + half, np.arange(half) + half
    ] = cos
    turn[np.arange(half), np.arange(half) + half] = -sin
    turn[np.arange(half) + half, np.arange(half)] = sin
    seen = q[sinks:]  # [T', N, H]
    scores = np.zeros((keys.shape[1], len(keys) - sinks))
    for n in range(heads):
        mean = seen[:, n].mean(0)
        k = keys[sinks:, n // groups]  # [T - sinks, H]
        logit = k @ (turn @ mean) / np.sqrt(width)
        if covariance:
            centred = seen[:, n] - mean
            spread = turn @ (centred.T @ centred / len(seen)) @ turn.T
            logit += np.einsum("ti,ij,tj->t", k, spread, k) / (2 * width)
        e = np.exp(logit - logit.max())
        scores[n // groups] += e / e.sum() / groups
    scores *= np.linalg.norm(values[sinks:], axis=-1).T
    return np.concatenate([np.full((keys.shape[1], sinks), scores.max() + 1), scores], axis=1)


@pytest.mark.parametrize("covariance", [True, False])
def test_one_prefill_keeps_the_keys_of_highest_expected_attention(covariance):
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 20), seed=8)
    _, params, _ = build(cfg)
    q = layer0_raw_queries(cfg, params, tokens)
    keys, values = layer0_keys(cfg, params, tokens), layer0_values(cfg, params, tokens)
    options = {"covariance": covariance, "future_positions": 64}
    cache_cfg = evicting(cfg, "expected_attention", budget=9, recent=0, options=options)
    _, cache = run(cfg, cache_cfg, tokens, [20], 32)
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    for b in range(2):
        score = expected_attention(
            q[b], keys[b], values[b], 20, cfg.model.rope_theta, 64, covariance=covariance
        )
        for h in range(cfg.model.num_kv_heads):
            best = np.sort(np.argsort(-score[h], kind="stable")[:9])
            np.testing.assert_array_equal(kept[b, h], best)


def test_a_rotated_cache_keeps_the_same_keys():
    """Scores are invariant under the cache's orthogonal transform of keys and
    queries: a Hadamard-rotated cache keeps exactly the unrotated cache's tokens."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 20), seed=2)
    plain = evicting(cfg, "expected_attention", budget=8, recent=0)
    rotated = plain.copy_and_resolve_references()
    rotated.update(k_transform="hadamard", v_transform="hadamard")
    _, a = run(cfg, plain, tokens, [20], 32)
    _, b = run(cfg, rotated, tokens, [20], 32)
    for x, y in zip(a.layers, b.layers, strict=True):
        np.testing.assert_array_equal(
            np.sort(np.asarray(x.positions), -1), np.sort(np.asarray(y.positions), -1)
        )


def test_it_decodes_over_groups_and_pages_within_its_budget():
    """Token by token after a prefill, dense and KIVI groups in pages: finite
    logits, no head over its budget; a budget that holds the sequence gives the
    full cache's logits."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 28))
    full, _ = run(cfg, cfg.cache, tokens, [14, 14], 32)
    held, _ = run(cfg, evicting(cfg, "expected_attention", budget=32), tokens, [14, 14], 32)
    np.testing.assert_allclose(held, full, atol=2e-6)
    for cache_cfg, budget in (
        (evicting(cfg, "expected_attention", budget=10), 10),
        (kivi(cfg, "expected_attention", 0, budget=24), 24),
    ):
        cache_cfg.update(kind="paged", page_size=8)
        out, cache = run(cfg, cache_cfg, tokens, [14] + [1] * 14, 32)
        assert np.isfinite(out).all()
        assert (np.asarray(cache.layers[0].stored(cache.lengths)) <= budget).all()


def test_a_latent_model_and_bad_options_are_refused():
    cfg = VARIANTS["mla_absorbed"]()
    with pytest.raises(ValueError, match="cannot score a model.attention='mla' cache"):
        kvlab.init_cache(cfg.model, evicting(cfg, "expected_attention", budget=8), 1, 32)
    gqa = VARIANTS["gqa"]()
    with pytest.raises(ValueError, match="options.future_positions=0 is below 1"):
        options = {"future_positions": 0}
        kvlab.init_cache(
            gqa.model, evicting(gqa, "expected_attention", budget=8, options=options), 1, 32
        )


YARN = dict(type="yarn", factor=4.0, original_max_len=64, beta_fast=32.0, beta_slow=1.0)


@settings(max_examples=10, deadline=None)
@given(
    future=st.integers(1, 600),
    end=st.integers(0, 9000),
    scaling=st.sampled_from([None, YARN | dict(mscale=0.0, mscale_all_dim=0.0)]),
)
def test_the_rotation_averaged_over_the_future_is_the_mean_of_each_positions(future, end, scaling):
    """RoPE averaged over the next `future` positions (rotate's span, one position
    for every basis row) is the mean of cos and sin of every position's angle
    times the scaling's attention factor (the definition's matrix, row form; each
    angle the float32 product the model computes, its cos and sin in float64)."""
    width, theta = 16, 10000.0
    turn = lambda x, p, span: kvlab.rope.apply_rope(  # noqa: E731
        x.transpose(0, 2, 1, 3), p, theta, scaling, span
    ).transpose(0, 2, 1, 3)
    got = expected._average_rotation(turn, jnp.asarray([end, end + 5]), 2, width, future)
    inverse, factor = kvlab.rope.rope_frequencies(width, theta, scaling)
    half = width // 2
    for row, start in enumerate((end, end + 5)):
        positions = (start + np.arange(future, dtype=np.float32))[:, None]
        angle = (positions * np.asarray(inverse, np.float32)).astype(np.float64)
        cos, sin = factor * np.cos(angle).mean(0), factor * np.sin(angle).mean(0)
        column = np.zeros((width, width))
        i = np.arange(half)
        column[i, i] = column[i + half, i + half] = cos
        column[i, i + half], column[i + half, i] = -sin, sin
        for head in range(2):
            np.testing.assert_allclose(got[row, head], column.T, atol=2e-5)


@settings(max_examples=10, deadline=None)
@given(queries=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_the_spread_term_is_each_keys_quadratic_form(queries, seed):
    """k^T R^T S R k, S the sum of the centred queries' outer products, whether
    summed over the queries (fewer than the 16 channels) or through S: the
    definition in float64."""
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(2, 2, 7, 1, 16))
    centred = rng.normal(size=(2, 2, queries, 3, 16))
    turn = rng.normal(size=(2, 2, 16, 16))
    got = expected._spread(*(jnp.asarray(x, jnp.float32) for x in (keys, centred, turn)))
    spread = np.einsum("bkqgw,bkqgv->bkgwv", centred, centred)
    turned = np.einsum("bkwu,bkgwv,bkvz->bkguz", turn, spread, turn)
    want = np.einsum("bkcjw,bkgwv,bkcjv->bkgcj", keys, turned, keys)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
