import jax
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from tests.helpers import ROOT, mla_config, small_model_configs, tiny_config


@given(
    cfg=small_model_configs(),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    batch=st.integers(1, 4),
    max_len=st.integers(1, 40),
)
def test_analytic_bytes_equal_measured_bytes(cfg, dtype, batch, max_len):
    cfg.cache.dtype = dtype
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=batch, max_len=max_len)
    assert kvlab.cache_bytes(cfg.model, cfg.cache, batch, max_len) == kvlab.tree_bytes(cache)


@given(
    config=st.sampled_from(["gqa", "mqa", "mla"]),
    variant=st.sampled_from(["small", "base"]),
    batch=st.sampled_from([1, 8, 64]),
    max_len=st.sampled_from([2048, 32_768, 131_072]),
)
def test_large_caches_agree_without_allocating(config, variant, batch, max_len):
    cfg = kvlab.load_config(f"{ROOT}/configs/{config}.py:{variant}")
    abstract = jax.eval_shape(lambda: kvlab.init_cache(cfg.model, cfg.cache, batch, max_len))
    assert kvlab.cache_bytes(cfg.model, cfg.cache, batch, max_len) == kvlab.tree_bytes(abstract)


def test_formula_by_hand():
    # 2 (K, V) x 2 layers x 2 KV heads x 16 head_dim x 100 tokens x 3 rows x 4 bytes,
    # plus each row's length and error flags (int32 each)
    cfg = tiny_config(num_kv_heads=2)
    assert kvlab.cache_bytes(cfg.model, cfg.cache, 3, 100) == 2 * 2 * 2 * 16 * 100 * 3 * 4 + 3 * (
        4 + 4
    )
    cfg.cache.dtype = "bfloat16"
    assert kvlab.cache_bytes(cfg.model, cfg.cache, 3, 100) == 2 * 2 * 2 * 16 * 100 * 3 * 2 + 3 * (
        4 + 4
    )


def test_latent_formula_by_hand():
    # layers x (kv_rank + rope_dim) x tokens x rows x bytes + lengths
    cfg = mla_config(kv_rank=64, rope_dim=8)
    assert kvlab.cache_bytes(cfg.model, cfg.cache, 3, 100) == 2 * (64 + 8) * 100 * 3 * 4 + 3 * (
        4 + 4
    )


def test_sharing_heads_divides_the_cache():
    mha, mqa = tiny_config(num_kv_heads=4), tiny_config(num_kv_heads=1)
    payload = lambda cfg: (
        kvlab.cache_bytes(cfg.model, cfg.cache, 1, 1000) - kvlab.cache.accounting.ROW_BYTES
    )  # noqa: E731
    assert payload(mha) == 4 * payload(mqa)


def test_tree_bytes_counts_params():
    cfg = tiny_config()
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    count = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert kvlab.tree_bytes(params) == 4 * count
