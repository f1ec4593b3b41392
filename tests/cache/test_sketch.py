"""The keys' residual sketch (cache.k_sketch): the signs of a Gaussian projection of
what a key's codes leave out and its norm, so a query's score over the key is
unbiased (TurboQuant's 1-bit residual, QJL's estimator)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.cache.quant import Storage, dequantize_tokens, quantize_tokens
from kvlab.cache.quant.storage import sketch_scores
from kvlab.eval import calibrate
from tests.helpers import LAYOUTS, VARIANTS, last_logits, random_tokens, same_logits
from tests.test_export import assert_exports, assert_round_trips, inference

SKETCHED = dict(k_bits=2, v_bits=4, k_axis="token", v_axis="token", group_size=8, k_sketch=16)


def test_scores_with_the_sketch_are_unbiased_and_without_it_are_not():
    """Over 400 draws of the projection (sketch_seed), the mean score of a query over
    2-bit keys with the sketch is the exact one within 4 standard errors; the
    codes' score alone misses some key by more than 10."""
    spec = Storage(
        bits=2, format="int", axis="token", group_size=16, symmetric=False,
        scale_dtype="float32", dtype="float32", sketch=64,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.normal(size=(1, 1, 8, 64)).astype(np.float32))
    query = jnp.asarray(rng.normal(size=(1, 1, 1, 64)).astype(np.float32))
    exact = np.asarray(query[0, 0, 0] @ keys[0, 0].T)
    estimates = []
    for seed in range(400):
        s = dataclasses.replace(spec, sketch_seed=seed)
        payload, scale, zero = quantize_tokens(keys, s)
        assert payload.shape[-1] == s.row_bytes(64) == 16 + 8 + 4
        coded = np.asarray(query[0, 0, 0] @ dequantize_tokens(payload, scale, zero, s)[0, 0].T)
        estimates.append(coded + np.asarray(sketch_scores(payload, s, query))[0, 0, 0])
    estimates = np.array(estimates)
    error = estimates.std(0) / np.sqrt(len(estimates))
    assert (np.abs(estimates.mean(0) - exact) < 4 * error).all()
    assert (np.abs(coded - exact) > 10 * error).any()


LAYOUTS_AND_POOL = {
    **LAYOUTS,
    "pooled": {"evict": {"method": "adakv", "budget": 24, "recent": 2}},
}


@pytest.mark.parametrize("layout", LAYOUTS_AND_POOL)
def test_it_is_the_dense_cache_in_pages_under_eviction_the_kernels_and_chunks(layout):
    """A prefill and three decode steps over 2-bit keys with a 16-bit sketch: in pages,
    the dense cache's logits; evicting with a budget holding every token (per head,
    or AdaKV's pool of every head), too; under the native kernels (which decline
    it), the reference's; a token at a time, the one prefill's; other logits than
    the codes alone, and 2 + 2 bytes more a key."""
    cfg = VARIANTS["gqa"]()
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(SKETCHED)
    tokens = random_tokens(cfg, (2, 15), seed=4)
    want = same_logits(cfg, cache_cfg, tokens, LAYOUTS_AND_POOL[layout])
    if layout == "chunked":
        plain = cache_cfg.copy_and_resolve_references()
        plain.k_sketch = 0
        assert np.abs(last_logits(cfg, plain, tokens, 12) - want).max() > 1e-4
        keys = cfg.model.num_layers * 2 * cfg.model.num_kv_heads * 32
        sketch = kvlab.cache_bytes(cfg.model, cache_cfg, 2, 32)
        assert sketch == kvlab.cache_bytes(cfg.model, plain, 2, 32) + keys * (2 + 2)
        assert "and a 16-bit residual sketch" in kvlab.cache.accounting.cache_label(
            cfg.model, cache_cfg
        )


def test_a_sketch_is_refused_where_it_cannot_be_kept():
    cfg = VARIANTS["gqa"]()

    def invalid(match, model=cfg.model, **fields):
        with pytest.raises(ValueError, match=match):
            kvlab.config.validate_cache_config({**cfg.cache.to_dict(), **fields}, model)

    invalid(r"cache.k_sketch=12 is not a whole number of bytes", k_sketch=12)
    invalid(r"cache.k_sketch=16 .*cache.k_bits=16 has none", k_sketch=16)
    invalid(r"cache.k_sketch", k_sketch=-8)
    invalid(r"cannot combine with cache.k_before_rope", k_sketch=16, k_bits=4, k_before_rope=True)
    mla = VARIANTS["mla_absorbed"]()
    invalid(r"model.attention='mla'", model=mla.model, k_sketch=16)


def test_a_sketched_cache_exports_for_tpu_and_cuda():
    cfg = VARIANTS["gqa"]()
    cfg.cache.update(SKETCHED)
    cfg.model.attention_impl = "pallas"
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)


def test_an_exported_step_over_sketched_outlying_calibrated_keys_round_trips(tmp_path):
    """Static ranges, outliers and the sketch's bits (Storage fields) survive
    jax.export's serialization: the step read back computes the same cache."""
    cfg = VARIANTS["gqa"]()
    ranges = np.random.default_rng(0).uniform(1, 3, (cfg.model.num_layers, 2, 16))
    path = str(tmp_path / "scales.npz")
    calibrate.save_scales(path, {"k": ranges})
    cfg.cache.update(SKETCHED, k_axis="calibrated", symmetric=True, scales=path, k_outliers=1)
    assert_round_trips(cfg)
