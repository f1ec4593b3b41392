"""Dense-and-sparse storage (cache.<prefix>_outliers): per token and KV head, the numbers
largest against their range kept in cache.dtype with their channel beside the codes
of the rest (KVQuant's outliers)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.quant import Storage, dequantize_tokens, quantize_tokens
from kvlab.cache.quant.storage import split_outliers
from kvlab.eval import calibrate
from tests.helpers import LAYOUTS, VARIANTS, build, random_tokens, same_logits
from tests.test_export import assert_exports, inference


def spec_of(outliers: int, axis="token", fmt="int", bits=4, ranges=()) -> Storage:
    return Storage(
        bits=bits, format=fmt, axis=axis, group_size=8, symmetric=True,
        scale_dtype="float32", dtype="float32", ranges=ranges, outliers=outliers,
    )  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(
    outliers=st.integers(1, 3),
    fmt_bits=st.sampled_from([("int", 4), ("int", 2), ("nf", 4), ("fp8", 8)]),
    seed=st.integers(0, 2**16),
)
def test_the_largest_numbers_come_back_exactly_and_the_rest_within_their_groups_bound(
    outliers, fmt_bits, seed
):
    """Per token and head the k numbers of largest magnitude are restored as stored
    (float32: exactly); each group of the others is coded over its own largest
    magnitude, so its error is within the format's bound of that group's scale."""
    fmt, bits = fmt_bits
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 3, 4, 16)).astype(np.float32)
    x[..., rng.integers(0, 16)] *= 50  # an outlier channel
    spec = spec_of(outliers, fmt=fmt, bits=bits)
    payload, scale, _ = quantize_tokens(jnp.asarray(x), spec)
    assert payload.shape[-1] == spec.row_bytes(16) == 16 * bits // 8 + outliers * 5
    restored = np.asarray(dequantize_tokens(payload, scale, None, spec))
    top = np.argsort(-np.abs(x), axis=-1)[..., :outliers]
    np.testing.assert_array_equal(
        np.take_along_axis(restored, top, -1), np.take_along_axis(x, top, -1)
    )
    rest = x.copy()
    np.put_along_axis(rest, top, 0.0, -1)
    groups = np.abs(rest).reshape(2, 3, 4, 2, 8).max(-1, keepdims=True)
    bound = {
        "int": groups / (2 ** (bits - 1) - 1) / 2,
        "fp8": groups * 2.0**-4,
        "nf": groups * 0.2,
    }[fmt]
    error = np.abs(restored - x).reshape(2, 3, 4, 2, 8)
    others = np.ones_like(x, bool)
    np.put_along_axis(others, top, False, -1)
    assert (
        error[others.reshape(error.shape)]
        <= np.broadcast_to(bound, error.shape)[others.reshape(error.shape)] * (1 + 1e-5) + 1e-7
    ).all()


def test_over_calibrated_ranges_the_numbers_most_beyond_them_are_kept():
    """With static ranges, the outliers are the numbers largest against their
    channel's range: one 10x past it comes back exactly instead of clipped."""
    ranges = ((1.0,) * 8 + (100.0,) * 8,)
    spec = spec_of(1, axis="calibrated", fmt="fp8", bits=8, ranges=ranges)
    x = np.zeros((1, 1, 1, 16), np.float32)
    x[..., 3], x[..., 12] = 10.0, 90.0  # 10x its range; within its range
    _, channels, numbers = split_outliers(jnp.asarray(x), spec)
    assert int(channels[0, 0, 0, 0]) == 3 and float(numbers[0, 0, 0, 0]) == 10.0
    restored = dequantize_tokens(quantize_tokens(jnp.asarray(x), spec)[0], None, None, spec)
    assert float(restored[0, 0, 0, 3]) == 10.0
    assert abs(float(restored[0, 0, 0, 12]) - 90.0) <= 90 * 2.0**-4


def test_keys_with_outlier_channels_lose_less_with_them_split_off():
    """A model's keys with a few channels 20x the rest (what KVQuant measures in
    real keys): two outliers a token cut the 4-bit error, and cost their bytes."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 2, 64)
    _, cache = apply({"params": params}, random_tokens(cfg, (2, 64), seed=1), cache=cache)
    keys = np.asarray(cache.layers[0].tensors[0]).copy()
    keys[..., [2, 9]] *= 20
    errors = {}
    for outliers in (0, 2):
        spec = spec_of(outliers)
        restored = dequantize_tokens(*quantize_tokens(jnp.asarray(keys), spec), spec)
        errors[outliers] = float(jnp.mean((restored - keys) ** 2))
    assert errors[2] < errors[0] / 4, errors


@pytest.mark.parametrize("keys", ["token", "channel"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_it_is_the_dense_cache_in_pages_under_eviction_the_kernels_and_chunks(layout, keys):
    """A prefill and three decode steps, keys per token or per channel (KIVI's,
    16 in full precision), values per token, two outliers a token each: in pages,
    the dense cache's logits; evicting with a budget holding every token, too;
    under the native kernels (which decline the layout), the reference's; a
    token at a time, the one prefill's. The bytes counted are the tree's."""
    cfg = VARIANTS["gqa"]()
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(k_bits=4, v_bits=4, k_axis=keys, v_axis="token", group_size=8)
    cache_cfg.update(k_outliers=2, v_outliers=2, residual=8 if keys == "channel" else 0)
    same_logits(cfg, cache_cfg, random_tokens(cfg, (2, 15), seed=4), LAYOUTS[layout])


def test_the_bytes_are_the_codes_and_each_outlier_with_its_channel():
    cfg = VARIANTS["gqa"]()
    m = cfg.model
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(k_bits=4, v_bits=4, k_axis="token", group_size=8, dtype="bfloat16")
    plain = kvlab.cache_bytes(m, cache_cfg, 3, 64)
    cache_cfg.update(k_outliers=3)
    tokens = m.num_layers * 3 * m.num_kv_heads * 64
    assert kvlab.cache_bytes(m, cache_cfg, 3, 64) == plain + tokens * 3 * (1 + 2)
    assert "k int per token and 3 outliers a token" in kvlab.cache.accounting.cache_label(
        m, cache_cfg
    )


def test_outliers_beside_calibrated_fp8_scales_export_for_tpu_and_cuda(tmp_path):
    """fp8 codes over calibrated ranges with one outlier a token, the prefill and the
    decode step lowered for TPU and CUDA from this host (no kernel: they decline)."""
    cfg = VARIANTS["gqa"]()
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(k_bits=8, v_bits=8, k_format="fp8", v_format="fp8", k_axis="calibrated")
    cache_cfg.update(v_axis="calibrated", k_outliers=1, v_outliers=1)
    _, params, _ = build(cfg)
    path = str(tmp_path / "scales.npz")
    ranges = calibrate.scales(cfg.model, cache_cfg, params, random_tokens(cfg, (2, 64)))
    calibrate.save_scales(path, ranges)
    cfg.cache = cache_cfg
    cfg.cache.scales = path
    cfg.model.attention_impl = "pallas"
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)


def test_outliers_are_refused_where_they_cannot_be_kept():
    cfg = VARIANTS["gqa"]()

    def invalid(match, **fields):
        cache = {**cfg.cache.to_dict(), **fields}
        with pytest.raises(ValueError, match=match):
            kvlab.config.validate_cache_config(cache, cfg.model)

    invalid(r"cache.k_outliers=2 keeps numbers .* cache.k_bits=16", k_outliers=2)
    invalid(r"cache.k_outliers=16 leaves no number of model.head_dim=16", k_outliers=16, k_bits=4)
    invalid(r"cache.v_outliers", v_outliers=-1)
    invalid(r"cache.latent_outliers=1 applies to a tensor", latent_outliers=1)


def test_codebooks_are_fitted_to_the_numbers_left_after_the_outliers(tmp_path):
    """Levels fitted with outliers split off come from the coded numbers alone (other
    levels than without), and the cache they make runs."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(k_bits=2, v_bits=2, k_format="codebook", v_format="codebook")
    cache_cfg.update(k_axis="token", group_size=8)
    tokens = random_tokens(cfg, (2, 64))
    without = calibrate.codebooks(cfg.model, cache_cfg, params, tokens)
    cache_cfg.update(k_outliers=2, v_outliers=2)
    books = calibrate.codebooks(cfg.model, cache_cfg, params, tokens)
    assert not np.array_equal(books["k"], without["k"])
    path = str(tmp_path / "books.npz")
    calibrate.save_codebooks(path, books)
    cache_cfg.codebooks = path
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, 32)
    logits, _ = apply({"params": params}, random_tokens(cfg, (1, 10), seed=2), cache=cache)
    assert np.isfinite(np.asarray(logits)).all()
