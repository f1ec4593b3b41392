import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from tests.helpers import mla_config, tiny_config


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cache_shapes_and_dtypes(dtype, kv_heads):
    cfg = tiny_config(num_kv_heads=kv_heads)
    cfg.cache.dtype = dtype
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=3, max_len=10)
    assert len(cache.layers) == cfg.model.num_layers
    for layer in cache.layers:
        assert isinstance(layer, kvlab.cache.DenseLayer)
        for buffer in layer.tensors:  # k, v
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
    assert [t.name for t in kvlab.config.cached_tensors(cfg.model)] == ["c_kv", "k_rope"]
    for layer in cache.layers:
        c_kv, k_rope = layer.tensors
        assert c_kv.shape == (2, 1, 9, 40) and k_rope.shape == (2, 1, 9, 6)
        assert c_kv.dtype == k_rope.dtype == jnp.dtype(dtype)
    assert cache.capacity == 9


@pytest.mark.parametrize(
    "name,value",
    [("batch_size", 0), ("max_len", -1), ("max_len", 2.0), ("max_len", "8"), ("batch_size", True)],
)
def test_bad_cache_sizes(name, value):
    cfg = tiny_config()
    sizes = {"batch_size": 1, "max_len": 8, name: value}
    with pytest.raises(ValueError, match=rf"{name}={value!r} is (not an integer|below 1)"):
        kvlab.init_cache(cfg.model, cfg.cache, **sizes)


def test_numpy_sizes_are_integers():
    cfg = tiny_config()
    cache = kvlab.init_cache(cfg.model, cfg.cache, np.int64(2), np.int32(8))
    assert (cache.batch_size, cache.capacity) == (2, 8)
