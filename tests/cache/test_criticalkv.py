"""CriticalKV (kvlab/cache/evict/criticalkv.py), a wrapper over any scorer, against
its definition (arXiv:2502.03805, as kvpress's CriticalKVPress computes it): the
scorer's best half of the kept share first, the rest by (score + epsilon) times
the L1 norm of each value's output projection, averaged over a KV head's query heads."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.evict.layers import reset_rows
from tests.cache.test_evict import (
    KIVI_LEN,
    assert_composes,
    assert_unknown_state_is_rebuilt,
    evicting,
    kivi,
    layer0_keys,
    layer0_values,
    run,
)
from tests.helpers import VARIANTS, build, random_tokens


def test_one_prefill_keeps_the_first_stage_then_the_heaviest_outputs():
    """criticalkv over knorm, 16 tokens into 8: the 4 smallest keys, then the 4 best
    (-|k| + 1e-4) x mean over the query heads of |W_o^h v|_1, recomputed here."""
    cfg = VARIANTS["gqa"]()
    model = cfg.model
    tokens = random_tokens(cfg, (2, 16), seed=6)
    _, params, _ = build(cfg)
    keys, values = layer0_keys(cfg, params, tokens), layer0_values(cfg, params, tokens)
    kernel = np.asarray(params["block_0"]["attention"]["out"]["kernel"], np.float64)  # [N, H, D]
    groups = model.num_heads // model.num_kv_heads
    cache_cfg = evicting(cfg, "criticalkv:knorm", budget=8, recent=0)
    _, cache = run(cfg, cache_cfg, tokens, [16])
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    for b in range(2):
        for h in range(model.num_kv_heads):
            score = -np.linalg.norm(keys[b, :, h], axis=-1)
            first = set(np.argsort(-score, kind="stable")[:4].tolist())
            heads = range(h * groups, (h + 1) * groups)
            weight = np.mean([np.abs(values[b, :, h] @ kernel[n]).sum(-1) for n in heads], 0)
            weighed = np.where(np.isin(np.arange(16), list(first)), np.inf, (score + 1e-4) * weight)
            np.testing.assert_array_equal(kept[b, h], np.sort(np.argsort(-weighed)[:8]))
            assert first <= set(kept[b, h].tolist())


@pytest.mark.parametrize("scorer", ["h2o", "adakv"])
def test_it_wraps_stateful_and_pooled_scorers(scorer):
    assert_composes(VARIANTS["gqa"](), f"criticalkv:{scorer}")


def test_bad_options_and_a_latent_model_are_refused():
    cfg = VARIANTS["gqa"]()
    for options, message in (
        ({"first_stage_ratio": 1.5}, "options.first_stage_ratio=1.5 is not a share"),
        ({"epsilon": -1.0}, "options.epsilon=-1.0 is negative"),
        ({"epsilon": float("nan")}, "options.epsilon=nan is not of its default's kind"),
    ):
        with pytest.raises(ValueError, match=message):
            kvlab.init_cache(
                cfg.model, evicting(cfg, "criticalkv:knorm", budget=8, options=options), 1, 32
            )
    latent = VARIANTS["mla_absorbed"]()
    with pytest.raises(ValueError, match="cannot score a model.attention='mla' cache"):
        kvlab.init_cache(latent.model, evicting(latent, "criticalkv:knorm", budget=8), 1, 32)


def _weights(cfg, params, tokens):
    """float64 [B, T, K]: each token's value weighed by the definition, |W_o^n v|_1
    averaged over its KV head's query heads n, from layer 0's values."""
    values = layer0_values(cfg, params, tokens)  # [B, T, K, H]
    kernel = np.asarray(params["block_0"]["attention"]["out"]["kernel"], np.float64)  # [N, H, D]
    per_head = kernel.reshape(cfg.model.num_kv_heads, -1, *kernel.shape[1:])  # [K, G, H, D]
    return np.abs(np.einsum("btkh,kghd->btkgd", values, per_head)).sum(-1).mean(-1)


@settings(max_examples=4, deadline=None)
@given(
    scorer=st.sampled_from(["knorm", "snapkv", "h2o", "adakv"]),
    paged=st.booleans(),
    interval=st.sampled_from([1, 4]),
    chunks=st.lists(st.sampled_from([1, 5]), min_size=2, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_each_slot_carries_its_values_weight_weighed_as_it_arrived(
    scorer, paged, interval, chunks, seed
):
    """Tokens stored one by one are weighed once, as they arrive, and each slot
    carries its token's weight (Policy.weighs), so a competition projects no held
    value again: after every step each held slot's weight is the definition's for
    its token (a pool's: for its KV head), and the bytes count the weights."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, sum(chunks)), seed=seed)
    _, params, apply = build(cfg)
    expected = _weights(cfg, params, tokens)
    cache_cfg = evicting(cfg, f"criticalkv:{scorer}", budget=6, interval=interval)
    if paged:
        cache_cfg.update(kind="paged", page_size=4)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 32)
    assert cache.layers[0].policy.weighs and cache.layers[0].weights is not None
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, 32) == kvlab.tree_bytes(cache)
    heads, end = cfg.model.num_kv_heads, 0
    for n in chunks:
        _, cache = apply({"params": params}, tokens[:, end : end + n], cache=cache)
        end += n
        layer = cache.layers[0]
        tags, weights = np.asarray(layer.positions), np.asarray(layer.weights)
        for b, e, s in zip(*np.nonzero(tags >= 0), strict=True):
            position, head = (
                divmod(tags[b, e, s], heads) if layer.policy.pooled else (tags[b, e, s], e)
            )
            np.testing.assert_allclose(weights[b, e, s], expected[b, position, head], rtol=2e-5)


def test_unknown_weights_are_weighed_afresh_with_the_same_choices():
    """reset_rows marks a started row's weights unknown (NaN) and leaves the others';
    unknown weights are weighed when next scored, with the same choices."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 9), seed=5)
    _, cache = run(cfg, evicting(cfg, "criticalkv:snapkv", budget=4), tokens)
    reset = reset_rows(cache.layers[0], jnp.asarray([True, False]), cache.lengths)
    assert np.isnan(np.asarray(reset.weights[0])).all()
    np.testing.assert_array_equal(reset.weights[1], cache.layers[0].weights[1])
    assert_unknown_state_is_rebuilt("criticalkv:snapkv", "weights")


def test_a_settling_layout_carries_no_weights():
    """KIVI's settled groups carry no weight (Policy.weighs is off: they are weighed
    at each competition, test_it_wraps_stateful_and_pooled_scorers), nor count one."""
    cfg = VARIANTS["gqa"]()
    cache_cfg = kivi(cfg, "criticalkv:knorm", 8, budget=24)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 2, KIVI_LEN)
    assert not cache.layers[0].policy.weighs and cache.layers[0].weights is None
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, KIVI_LEN) == kvlab.tree_bytes(cache)


def test_over_a_scorer_that_reads_no_mass_attention_computes_none():
    """criticalkv observes the last query for its output projections alone: over
    knorm (which reads no mass) no step's attention computes the mass
    (`competes` is False, Scorer.reads_mass), over snapkv the steps that score do."""
    cfg = VARIANTS["gqa"]()
    for method, computes in (("criticalkv:knorm", False), ("criticalkv:snapkv", True)):
        cache = kvlab.init_cache(cfg.model, evicting(cfg, method, budget=8), 2, 32)
        placement = cache.place(1, jnp.ones((2,), jnp.int32))
        competes = cache.layers[0].competes(placement)
        assert (competes is not False) == computes, method
