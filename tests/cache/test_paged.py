"""The paged cache: the dense cache's logits through any block tables, for every
model and bit-width; exact bytes; writes outside a row's pages are dropped."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.cache.paged import PagedCache, PagedLayer, PagedQuantizedLayer
from tests.helpers import (
    build,
    count_compiles,
    mla_config,
    random_tokens,
    run_in_chunks,
    tiny_config,
)

BATCH, MAX_LEN, PAGE = 3, 40, 8  # 5 pages per row


def with_bits(cfg, k_bits, v_bits, **cache):
    first, second = kvlab.config.cached_prefixes(cfg.model)
    cfg.cache.update({f"{first}_bits": k_bits, f"{second}_bits": v_bits, **cache})
    cfg.cache.group_size = 8
    return kvlab.validate_config(cfg)


CASES = {
    "gqa": lambda: tiny_config(num_kv_heads=2),
    "mqa_k4v8_residual": lambda: with_bits(tiny_config(num_kv_heads=1), 4, 8, residual=8),
    "mla": lambda: mla_config(absorb=True),
    "mla_latent4": lambda: with_bits(mla_config(absorb=False), 4, 16),
}


def paged(cfg, num_pages=0):
    cfg = kvlab.validate_config(cfg.copy_and_resolve_references())
    cfg.cache.update(kind="paged", page_size=PAGE, num_pages=num_pages)
    return kvlab.validate_config(cfg)


def shuffled_tables(cache: PagedCache, seed: int) -> PagedCache:
    """The same cache with every row's pages scattered over the pool."""
    order = np.random.default_rng(seed).permutation(cache.block_tables.size)
    return cache.replace(
        block_tables=jnp.asarray(order.reshape(cache.block_tables.shape), jnp.int32)
    )


def run_steps(cfg, cache, tokens, chunks):
    _, params, apply = build(cfg)
    return run_in_chunks(apply, params, cache, tokens, chunks)


@pytest.mark.parametrize("name", sorted(CASES))
def test_paged_gives_the_dense_logits_through_scattered_pages(name):
    cfg = CASES[name]()
    tokens = random_tokens(cfg, (BATCH, 24), seed=1)
    chunks = [11, 11, 1, 1]  # prefill chunks crossing pages, then decode steps
    dense, _ = run_steps(
        cfg, kvlab.init_cache(cfg.model, cfg.cache, BATCH, MAX_LEN), tokens, chunks
    )
    pcfg = paged(cfg)
    cache = shuffled_tables(kvlab.init_cache(pcfg.model, pcfg.cache, BATCH, MAX_LEN), seed=2)
    out, cache = run_steps(pcfg, cache, tokens, chunks)
    np.testing.assert_allclose(out, dense, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(cache.lengths, [24] * BATCH)
    layer = cache.layers[0]
    expected = (
        PagedLayer if cfg.cache.k_bits == cfg.cache.latent_bits == 16 else PagedQuantizedLayer
    )
    if name == "mla":
        expected = PagedLayer
    assert isinstance(layer, expected)


def test_pools_have_the_pallas_layout_and_rows_own_their_pages():
    cfg = paged(tiny_config(num_kv_heads=2))
    cache = kvlab.init_cache(cfg.model, cfg.cache, BATCH, MAX_LEN)
    for pool in cache.layers[0].pools:  # k_pages, v_pages: [K, P, L, H]
        assert pool.shape == (2, BATCH * 5, PAGE, cfg.model.head_dim)
    np.testing.assert_array_equal(cache.block_tables, np.arange(15).reshape(3, 5))
    assert cache.capacity == MAX_LEN


def test_writes_outside_a_rows_pages_are_dropped():
    cfg = paged(tiny_config(num_kv_heads=1), num_pages=8)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 1, 16)  # 2 pages of 8
    # The row holds page 3 only; its second page is missing (-1).
    cache = cache.replace(block_tables=jnp.array([[3, -1]], jnp.int32))
    _, params, apply = build(cfg)
    _, cache = apply({"params": params}, random_tokens(cfg, (1, 12)), cache=cache)
    for pool in cache.layers[0].pools:
        written = np.abs(np.asarray(pool)).sum(axis=(0, 2, 3)) > 0  # per page
        assert written.tolist() == [False, False, False, True, False, False, False, False]


def test_overflow_past_max_len_is_dropped_even_with_room_in_the_last_page():
    cfg = paged(tiny_config(num_kv_heads=1), num_pages=4)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 1, 12)  # 2 pages of 8 hold 16 slots
    _, params, _ = build(cfg)
    model = kvlab.Transformer(cfg.model)
    _, cache = kvlab.prefill(model, params, cache, random_tokens(cfg, (1, 15)))
    assert bool(cache.overflowed()[0])
    for pool in cache.layers[0].pools:
        last_page = np.asarray(pool)[:, 1]  # slots 8..15; only 8..11 are the row's
        assert np.abs(last_page[:, :4]).sum() > 0 and not last_page[:, 4:].any()


@pytest.mark.parametrize("name", ["mqa_k4v8_residual", "mla_latent4"])
def test_quantized_writes_touch_only_the_rows_pages(name):
    """A quantized paged write puts the flushed groups into the row's pages and
    leaves every other page of each pool (payloads, scales, zeros) as it was."""
    cfg = paged(CASES[name](), num_pages=10)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 1, 16)  # 2 pages of 8
    cache = cache.replace(block_tables=jnp.array([[7, 2]], jnp.int32))
    _, params, apply = build(cfg)
    _, cache = run_in_chunks(apply, params, cache, random_tokens(cfg, (1, 16)), [5, 1, 1, 9])
    touched = np.zeros(10, bool)
    for tensor in cache.layers[0].tensors:
        for pool in (tensor.payload, tensor.scale, tensor.zero):
            if pool is not None:
                touched |= np.abs(np.asarray(pool, np.float32)).sum(axis=(0, 2, 3)) > 0
    settled = cache.layers[0].layout.settled(16)  # tokens held quantized, in pages
    assert settled > 0
    assert np.flatnonzero(touched).tolist() == sorted([7, 2][: -(-settled // PAGE)])


def test_overflow_is_refused_and_decode_compiles_once():
    cfg = paged(tiny_config())
    model, params, _ = build(cfg)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 2, 16)
    with pytest.raises(ValueError, match="would hold 17 tokens but the cache holds 16"):
        model.apply({"params": params}, random_tokens(cfg, (2, 17)), cache=cache)
    _, cache = kvlab.prefill(model, params, cache, random_tokens(cfg, (2, 4)))
    token = jnp.array([1, 2], jnp.int32)
    _, cache = kvlab.decode_step(model, params, cache, token)
    with count_compiles() as compiles:
        for _ in range(8):
            _, cache = kvlab.decode_step(model, params, cache, token)
    assert compiles[0] == 0 and int(cache.lengths[0]) == 13


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"page_size": 0}, "cache.page_size=0"),
        ({"num_pages": -1}, "cache.num_pages=-1"),
        ({"k_bits": 4, "k_axis": "channel", "group_size": 16, "page_size": 8}, "cache.page_size=8"),
    ],
)
def test_bad_paged_configs_name_the_field(fields, match):
    cfg = tiny_config()
    cfg.cache.update(kind="paged", **fields)
    with pytest.raises(ValueError, match=match):
        kvlab.validate_config(cfg)


def test_too_few_pages_for_the_rows_is_refused():
    cfg = paged(tiny_config(), num_pages=4)
    with pytest.raises(ValueError, match="cache.num_pages=4 is too few"):
        kvlab.init_cache(cfg.model, cfg.cache, 1, MAX_LEN)


@pytest.mark.parametrize("name", sorted(CASES))
def test_paged_bytes_are_exact(name):
    cfg = paged(CASES[name]())
    for (batch, max_len), pages in itertools.product([(1, 8), (3, 40), (2, 41)], [0, 64]):
        cfg.cache.num_pages = pages
        analytic = kvlab.cache_bytes(cfg.model, cfg.cache, batch, max_len)
        shapes = jax.eval_shape(lambda: kvlab.init_cache(cfg.model, cfg.cache, batch, max_len))  # noqa: B023
        assert analytic == kvlab.tree_bytes(shapes)
