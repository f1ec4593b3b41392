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
