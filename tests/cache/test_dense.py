import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab.cache.dense import write_tokens
from tests.helpers import mla_config, tiny_config


@given(
    batch=st.integers(1, 3),
    capacity=st.integers(1, 8),
    new=st.integers(1, 4),
    heads_first=st.booleans(),
    data=st.data(),
)
def test_write_tokens_writes_exactly_the_slots_in_range(batch, capacity, new, heads_first, data):
    slots = np.array(
        data.draw(
            st.lists(
                st.lists(st.integers(0, capacity + 2), min_size=new, max_size=new, unique=True),
                min_size=batch,
                max_size=batch,
            )
        ),
        np.int32,
    )
    # Tokens [B, T, 3 heads, 2 channels] into a [B, S, 3, 2] or a [B, 3, S, 2] buffer.
    values = np.arange(batch * new * 6, dtype=np.float32).reshape(batch, new, 3, 2)
    expected = -np.ones((batch, capacity, 3, 2))
    for b in range(batch):
        for t in range(new):
            if slots[b, t] < capacity:
                expected[b, slots[b, t]] = values[b, t]
    if heads_first:
        buffer = -jnp.ones((batch, 3, capacity, 2))
        out = write_tokens(buffer, jnp.asarray(values), jnp.asarray(slots), axis=2)
        out = np.asarray(out).transpose(0, 2, 1, 3)
    else:
        buffer = -jnp.ones((batch, capacity, 3, 2))
        out = np.asarray(write_tokens(buffer, jnp.asarray(values), jnp.asarray(slots)))
    np.testing.assert_array_equal(out, expected)


def test_dynamic_update_slice_would_have_clamped():
    """Why write_tokens is a scatter: the slice version silently moves the write."""
    buffer = jnp.zeros((1, 4))
    clamped = jax.lax.dynamic_update_slice(buffer, jnp.ones((1, 2)), (0, 3))
    np.testing.assert_array_equal(clamped, [[0, 0, 1, 1]])  # slot 2 overwritten
    dropped = write_tokens(buffer[..., None], jnp.ones((1, 2, 1)), jnp.array([[3, 4]]))
    np.testing.assert_array_equal(dropped[..., 0], [[0, 0, 0, 1]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cache_shapes_and_dtypes(dtype, kv_heads):
    cfg = tiny_config(num_kv_heads=kv_heads)
    cfg.cache.dtype = dtype
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=3, max_len=10)
    assert len(cache.layers) == cfg.model.num_layers
    for layer in cache.layers:
        for buffer in (layer.k, layer.v):
            assert buffer.shape == (3, kv_heads, 10, cfg.model.head_dim)
            assert buffer.dtype == jnp.dtype(dtype)
    assert cache.lengths.dtype == jnp.int32 and cache.lengths.shape == (3,)
    assert cache.capacity == 10 and cache.batch_size == 3
    assert not cache.overflowed().any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_latent_cache_holds_only_the_latent_and_the_rope_key(dtype):
    cfg = mla_config(kv_rank=40, rope_dim=6)
    cfg.cache.dtype = dtype
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=9)
    assert len(cache.layers) == cfg.model.num_layers
    for layer in cache.layers:
        assert set(vars(layer)) == {"c_kv", "k_rope"}
        assert layer.c_kv.shape == (2, 9, 40) and layer.k_rope.shape == (2, 9, 6)
        assert layer.c_kv.dtype == layer.k_rope.dtype == jnp.dtype(dtype)
    assert cache.capacity == 9


@pytest.mark.parametrize("name,value", [("batch_size", 0), ("max_len", -1), ("max_len", 2.0)])
def test_bad_cache_sizes(name, value):
    cfg = tiny_config()
    sizes = {"batch_size": 1, "max_len": 8, name: value}
    with pytest.raises(ValueError, match=f"{name}={value!r} is not a positive integer"):
        kvlab.init_cache(cfg.model, cfg.cache, **sizes)
