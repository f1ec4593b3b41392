import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import kvlab
import kvlab.attention.core
from kvlab.attention.core import attend, ordered_after
from kvlab.cache.placement import causal_mask
from tests.helpers import build, tiny_config


def reference_attention(q, k, v, mask):
    """Textbook attention with K/V repeated to every query head (what attend avoids)."""
    groups = q.shape[2] // k.shape[1]
    k = np.repeat(np.asarray(k, np.float64), groups, axis=1)
    v = np.repeat(np.asarray(v, np.float64), groups, axis=1)
    scores = np.einsum("btnh,bnsh->bnts", np.asarray(q, np.float64), k) / np.sqrt(q.shape[-1])
    scores = np.where(np.asarray(mask)[:, None], scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bnsh->btnh", probs, v)


@given(
    batch=st.integers(1, 3),
    queries=st.integers(1, 5),
    extra_keys=st.integers(0, 6),
    kv_heads=st.sampled_from([1, 2, 3]),
    groups=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([1, 4, 8]),
    value_dim=st.sampled_from([2, 8]),
    split=st.integers(0, 11),
    seed=st.integers(0, 2**16),
)
def test_grouped_attention_equals_repeated_kv_reference(
    batch, queries, extra_keys, kv_heads, groups, head_dim, value_dim, split, seed
):
    keys = queries + extra_keys
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, queries, kv_heads * groups, head_dim), np.float32)
    k = rng.standard_normal((batch, kv_heads, keys, head_dim), np.float32)
    v = rng.standard_normal((batch, kv_heads, keys, value_dim), np.float32)
    # Queries are the last tokens of rows of different lengths.
    lengths = rng.integers(queries, keys + 1, size=batch)
    positions = lengths[:, None] - queries + np.arange(queries)
    mask = np.asarray(jax.jit(causal_mask, static_argnums=2)(positions, lengths, keys))
    expected = reference_attention(q, k, v, mask)
    whole = jax.jit(attend)(q, [(k, v, mask)])
    assert whole.shape == (batch, queries, kv_heads * groups, value_dim)
    np.testing.assert_allclose(whole, expected, atol=1e-5)
    # The same keys split into two blocks (cache and new tokens) along S.
    cut = min(split, keys)
    blocks = [
        (k[:, :, :cut], v[:, :, :cut], mask[..., :cut]),
        (k[:, :, cut:], v[:, :, cut:], mask[..., cut:]),
    ]
    np.testing.assert_allclose(jax.jit(attend)(q, blocks), expected, atol=1e-5)


def dots(jaxpr) -> int:
    return sum(e.primitive.name == "dot_general" for e in jaxpr.eqns)


@given(
    batch=st.integers(2, 3),
    queries=st.integers(2, 5),
    cached=st.integers(1, 6),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_a_prompt_over_an_empty_cache_skips_its_products_alone(
    batch, queries, cached, kv_heads, groups, seed
):
    """Several queries over a cache block and the new tokens: when no row sees a
    cached slot, the cache's products are skipped (a cond's other branch). A row
    that sees none comes out as over the new tokens alone, and bit for bit the
    same whether or not another row sees the cache."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, queries, kv_heads * groups, 8), np.float32)
    k, v = (rng.standard_normal((batch, kv_heads, cached + queries, 8), np.float32) for _ in "kv")
    fresh = np.tril(np.ones((queries, queries), bool))[None].repeat(batch, 0)

    def blocks(seen, rows=fresh):
        return [
            (k[:, :, :cached], v[:, :, :cached], seen),
            (k[:, :, cached:], v[:, :, cached:], rows),
        ]

    nobody = np.zeros((batch, 1, cached), bool)
    first = nobody.copy()
    first[0, 0, : rng.integers(1, cached + 1)] = True  # row 0 sees some of the cache

    jaxpr = jax.make_jaxpr(lambda seen: attend(q, blocks(seen)))(nobody).jaxpr
    (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    skip, held = (dots(branch.jaxpr) for branch in cond.params["branches"])
    assert (skip, held, dots(jaxpr)) == (0, 2, 2)  # the cache's products; the new tokens'
    step = jax.make_jaxpr(lambda seen: attend(q[:, -1:], blocks(seen, fresh[:, -1:])))(nobody)
    assert "cond" not in str(step)  # a decode step never holds a cache in a cond

    run = jax.jit(lambda seen: attend(q, blocks(seen)))
    alone, some = np.asarray(run(nobody)), np.asarray(run(first))
    np.testing.assert_array_equal(some[1:], alone[1:])  # rows seeing none
    new_only = jax.jit(attend)(q, blocks(nobody)[1:])  # another program: its last bits
    np.testing.assert_allclose(alone, new_only, rtol=1e-6, atol=1e-6)
    expected = reference_attention(
        q, k, v, np.concatenate([first[:, 0, None].repeat(queries, 1), fresh], -1)
    )
    np.testing.assert_allclose(some, expected, atol=1e-5)
    np.testing.assert_allclose(alone[1:], expected[1:], atol=1e-5)


def test_fully_masked_row_gives_finite_output():
    q = jnp.ones((1, 1, 2, 4))
    kv = jnp.ones((1, 1, 3, 4))
    out = attend(q, [(kv, kv, jnp.zeros((1, 1, 3), bool))])
    assert np.isfinite(np.asarray(out)).all()


def test_ordered_after_leaves_values_unchanged():
    values = (jnp.array([1.5, -2.0, 0.0]), jnp.array([3], jnp.bfloat16))
    after = ordered_after(values, jnp.array([[1e30, -4.0]]))
    for before, now in zip(values, after, strict=True):
        np.testing.assert_array_equal(before, now)
        assert before.dtype == now.dtype


def cache_copies(step, model, params, cache, token) -> int:
    """Copies of a whole cache buffer in the compiled, cache-donating decode step."""
    text = step.lower(model, params, cache, token).compile().as_text()
    shape = ",".join(map(str, cache.layers[0].tensors[0].shape))
    return len(re.findall(rf"= f32\[{shape}\]\{{[^}}]*\}} copy\(", text))


def test_ordered_after_makes_the_cache_write_in_place():
    """Its purpose: the decode step writes the donated cache in place. Without the
    ordering (patched out here to show what it prevents) XLA copies every layer's
    keys and values each step."""
    cfg = tiny_config(num_kv_heads=2)
    model, params, _ = build(cfg)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 2, 64)
    token = jnp.zeros((2,), jnp.int32)
    assert cache_copies(kvlab.decode_step, model, params, cache, token) == 0
    with mock.patch.object(kvlab.attention.core, "ordered_after", lambda tree, _: tree):
        jax.clear_caches()  # trace the step again, without the ordering
        assert cache_copies(kvlab.decode_step, model, params, cache, token) > 0
    jax.clear_caches()
