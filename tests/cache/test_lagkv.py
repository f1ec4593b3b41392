"""LagKV (kvlab/cache/evict/lagkv.py) against its definition (arXiv:2504.04704, as
kvpress's LagKVPress computes it): each partition of lag_size tokens is scored by
the min-max statistics of the partition after it, its keys' and values' spread
soft-maxed over the partition and ranked within it; the sinks and the tail stay."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.cache.evict.lagkv import LagKV
from tests.cache.test_evict import bare_candidates, evicting, kivi, layer0_keys, layer0_values, run
from tests.helpers import VARIANTS, build, random_tokens


def lagkv_scores(keys, values, lag, sinks, cross_scoring=False):
    """kvpress's LagKVPress.score for one head, in float64: keys, values [n, W]."""
    n = len(keys)
    if n < sinks + 2 * lag:
        score = np.ones(n)
        score[sinks:] = np.arange(n - sinks) / max(n - sinks, 1)
        return score
    end = sinks + (n - sinks) // lag * lag

    def spread(x):
        parts = x[sinks:end].reshape(-1, lag, x.shape[-1])
        low, high = parts[1:].min(1, keepdims=True), parts[1:].max(1, keepdims=True)
        s = ((parts[:-1] - low) / (high - low)).std(-1, ddof=1)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    score = (spread(keys) + spread(values)) / 2
    if not cross_scoring:
        score = np.argsort(np.argsort(score, -1), -1) / lag
    return np.concatenate([np.ones(sinks), score.reshape(-1), np.ones(n - sinks - score.size)])


@pytest.mark.parametrize("length, budget", [(22, 14), (24, 16)])
def test_one_prefill_keeps_the_sinks_the_tail_and_each_partitions_best(length, budget):
    """Lag 4 after 2 sinks: 22 tokens make 5 partitions, 4 of them scored and a tail
    of 4 (24: a tail of 6); the budget keeps the sinks, the tail and the 2 best
    ranked of each scored partition, per KV head (no tie at the cut)."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, length), seed=7)
    _, params, _ = build(cfg)
    keys, values = layer0_keys(cfg, params, tokens), layer0_values(cfg, params, tokens)
    options = {"lag_size": 4, "sink_tokens": 2}
    cache_cfg = evicting(cfg, "lagkv", budget=budget, recent=0, options=options)
    _, cache = run(cfg, cache_cfg, tokens, [length], 32)
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    for b in range(2):
        for h in range(cfg.model.num_kv_heads):
            score = lagkv_scores(keys[b, :, h], values[b, :, h], 4, 2)
            best = np.sort(np.argsort(-score, kind="stable")[:budget])
            np.testing.assert_array_equal(kept[b, h], best)
            assert {0, 1} <= set(best) and set(range(length - (length - 2) % 4 - 4, length)) <= set(
                best
            )


def test_a_head_too_short_for_a_reference_keeps_its_sinks_and_newest():
    """9 tokens < 2 sinks + 2 partitions of 4: nothing to score against, so the
    sinks and the newest tokens stay, as kvpress ranks them."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 9), seed=1)
    options = {"lag_size": 4, "sink_tokens": 2}
    _, cache = run(cfg, evicting(cfg, "lagkv", budget=5, recent=0, options=options), tokens, [9])
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    np.testing.assert_array_equal(kept, np.broadcast_to([0, 1, 6, 7, 8], kept.shape))


def test_decoding_drops_each_step_the_token_lagkv_scores_least():
    """A prefill of 16 into a budget of 16, then token by token (cross_scoring: the
    soft-maxed spreads themselves, unranked): each step the 17 candidates in position
    order are scored afresh and the lowest goes, replayed here per KV head."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (1, 22), seed=4)
    _, params, _ = build(cfg)
    keys, values = layer0_keys(cfg, params, tokens), layer0_values(cfg, params, tokens)
    options = {"lag_size": 4, "sink_tokens": 1, "cross_scoring": True}
    cache_cfg = evicting(cfg, "lagkv", budget=16, recent=0, options=options)
    chunks = [16] + [1] * 6
    _, cache = run(cfg, cache_cfg, tokens, chunks, 32)
    for h in range(cfg.model.num_kv_heads):
        kept = list(range(16))
        for t in range(16, 22):
            candidates = [*kept, t]
            score = lagkv_scores(keys[0, candidates, h], values[0, candidates, h], 4, 1, True)
            candidates.pop(int(np.argmin(score)))
            kept = candidates
        np.testing.assert_array_equal(np.sort(np.asarray(cache.layers[0].positions[0, h])), kept)


def test_it_runs_over_kivi_groups_pages_and_a_latent_within_its_budget():
    """A budget that holds the sequence gives the full cache's logits (GQA and a
    latent, whose latent serves as keys and values); KIVI's settling groups in
    pages score the mean of their tokens' and keep within the budget."""
    for name in ("gqa", "mla_absorbed"):
        cfg = VARIANTS[name]()
        tokens = random_tokens(cfg, (2, 28))
        options = {"lag_size": 4}
        full, _ = run(cfg, cfg.cache, tokens, [14, 14], 32)
        held, _ = run(cfg, evicting(cfg, "lagkv", budget=32, options=options), tokens, [14, 14], 32)
        np.testing.assert_allclose(held, full, atol=1e-5)
        evicted, cache = run(
            cfg, evicting(cfg, "lagkv", budget=12, options=options), tokens, [14, 14], 32
        )
        assert np.isfinite(evicted).all()
        assert (np.asarray(cache.layers[0].stored(cache.lengths)) <= 12).all()
    cache_cfg = kivi(cfg, "lagkv", 0, budget=24, options={"lag_size": 2, "sink_tokens": 1})
    cache_cfg.update(kind="paged", page_size=8)
    out, cache = run(cfg, cache_cfg, tokens, [7] * 4, 32)
    assert np.isfinite(out).all()
    assert (np.asarray(cache.layers[0].stored(cache.lengths)) <= 24).all()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"lag_size": 1}, "cache.evict.options.lag_size=1 is below 2"),
        ({"sink_tokens": -1}, "cache.evict.options.sink_tokens=-1 is below 0"),
        ({"lag_size": 4.0}, "cache.evict.options.lag_size=4.0 is not of its default's kind"),
        ({"lag": 4}, "cache.evict.options.lag=4 is no option of cache.evict.method='lagkv'"),
    ],
)
def test_bad_options_are_refused_naming_the_option(options, message):
    cfg = VARIANTS["gqa"]()
    with pytest.raises(ValueError, match=message):
        kvlab.init_cache(cfg.model, evicting(cfg, "lagkv", budget=8, options=options), 1, 32)


def test_its_scores_are_finite_where_a_reference_channel_is_constant():
    """A channel equal over a reference partition normalises to 0 (kvpress divides
    by zero there): the scores stay finite and in [0, 1]."""
    keys = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1, 18, 1, 4)), jnp.float32)
    keys = keys.at[..., 0].set(1.0)  # a constant channel
    c = bare_candidates(
        np.arange(18)[None, None],
        np.ones((1, 1, 18), bool),
        np.zeros((1, 1, 18), np.int32),
        1,
        keys=lambda: keys,
        values=lambda: keys,
        end=jnp.full((1, 1, 1), 18),
        options={"lag_size": 4, "sink_tokens": 2, "cross_scoring": False},
    )
    score = np.asarray(LagKV().score(c))
    assert np.isfinite(score).all() and (0 <= score).all() and (score <= 1).all()
