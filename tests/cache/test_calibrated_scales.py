"""Scales calibrated offline (cache.<prefix>_axis='calibrated', cache.scales): no scale
stored per group, a static one per layer, KV head and channel (vLLM's per-head
fp8 scales, KVQuant's per-channel ones), fitted by kvlab.eval.calibrate.scales."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.formats import FP8_MAX, normal_float
from kvlab.cache.quant import Storage, dequantize_tokens, quantize_tokens
from kvlab.cache.quant.tensor import PayloadReader, QuantizedTensor
from kvlab.eval import calibrate
from tests.helpers import LAYOUTS, VARIANTS, build, random_tokens, same_logits
from tests.test_export import assert_exports, inference

FP8 = dict(k_bits=8, v_bits=8, k_format="fp8", v_format="fp8")
CALIBRATED = dict(k_axis="calibrated", v_axis="calibrated")


def calibrated(cfg, tmp_path, per="head", **storage):
    """cfg's cache section storing k and v with calibrated scales (fp8 unless
    `storage` says otherwise), fitted on random tokens and saved under tmp_path."""
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(FP8, **CALIBRATED)
    cache_cfg.update(storage)
    _, params, _ = build(cfg)
    ranges = calibrate.scales(cfg.model, cache_cfg, params, random_tokens(cfg, (4, 96), 0), per=per)
    path = str(tmp_path / f"scales_{per}.npz")
    calibrate.save_scales(path, ranges)
    cache_cfg.scales = path
    return cache_cfg, ranges


def spec_of(fmt: str, bits: int, ranges: np.ndarray) -> Storage:
    return Storage(
        bits=bits, format=fmt, axis="calibrated", group_size=16, symmetric=True,
        scale_dtype="bfloat16", dtype="float32",
        ranges=tuple(tuple(float(x) for x in head) for head in ranges),
    )  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(
    fmt_bits=st.sampled_from([("int", 8), ("int", 4), ("int", 2), ("fp8", 8), ("nf", 4)]),
    spread=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**16),
)
def test_codes_over_a_static_scale_restore_within_the_formats_bound(fmt_bits, spread, seed):
    """Numbers [B, KH, N, Wd] inside their head's and channel's range come back within
    the format's rounding of the static scale (int: half a step; fp8: e4m3's
    relative 2^-4 and its smallest step; nf: half the grid's widest gap); numbers
    beyond the range take the end level, exactly +-range. No scale is stored."""
    fmt, bits = fmt_bits
    rng = np.random.default_rng(seed)
    ranges = rng.uniform(0.1, 1.0, (3, 8)).astype(np.float32) * spread
    inside = rng.uniform(-1, 1, (2, 3, 5, 8)).astype(np.float32) * ranges[:, None, :]
    spec = spec_of(fmt, bits, ranges)
    payload, scale, zero = quantize_tokens(jnp.asarray(inside), spec)
    assert scale is None and zero is None and payload.shape == (2, 3, 5, 8 * bits // 8)
    restored = np.asarray(dequantize_tokens(payload, None, None, spec))
    step = ranges[:, None, :] / spec.codes.top(spec)  # one level, in the number's units
    error = np.abs(restored - inside)
    if fmt == "int":
        bound = step / 2
    elif fmt == "fp8":
        bound = np.abs(inside) * 2.0**-4 + step * 2.0**-9  # e4m3: 3 mantissa bits
    else:
        bound = np.diff(normal_float.grid(bits)).max() / 2 * ranges[:, None, :]
    assert (error <= bound * (1 + 1e-5) + 1e-7).all()
    beyond = np.sign(inside) * ranges[:, None, :] * rng.uniform(1.5, 10, inside.shape)
    restored = np.asarray(
        dequantize_tokens(quantize_tokens(jnp.asarray(beyond), spec)[0], None, None, spec)
    )
    np.testing.assert_allclose(
        np.abs(restored), np.broadcast_to(ranges[:, None, :], beyond.shape), rtol=1e-6
    )
    assert (np.sign(restored) == np.sign(beyond)).all()


def test_attention_reads_the_codes_as_their_dequantized_numbers():
    """PayloadReader folds the static scale into the query and the output: its
    scores and weighted sums are those of the dequantized tokens."""
    rng = np.random.default_rng(1)
    ranges = rng.uniform(0.5, 2.0, (2, 16)).astype(np.float32)
    spec = spec_of("fp8", 8, ranges)
    x = jnp.asarray(rng.normal(size=(2, 2, 12, 16)).astype(np.float32))
    payload, _, _ = quantize_tokens(x, spec)
    reader = PayloadReader(QuantizedTensor(payload, None, None, None, spec))
    dense = np.asarray(reader.dequantize())
    q = rng.normal(size=(2, 2, 3, 16)).astype(np.float32)
    w = rng.uniform(size=(2, 2, 3, 12)).astype(np.float32)
    np.testing.assert_allclose(
        reader.scores(jnp.asarray(q)), q @ dense.swapaxes(-1, -2), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(reader.weighted_sum(jnp.asarray(w)), w @ dense, rtol=1e-5, atol=1e-5)
    chunk = reader.chunk(4, 4)
    np.testing.assert_allclose(chunk.dequantize(), dense[:, :, 4:8], rtol=0, atol=0)


def test_the_ranges_are_the_largest_magnitudes_the_cache_stores(tmp_path):
    """Per channel: the largest |k| and |v| of each layer, KV head and channel in a
    float32 cache of the calibration text; per head the largest over its channels;
    per tensor over every head; a lower quantile gives smaller ranges."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (4, 96), 0)
    plain = cfg.cache.copy_and_resolve_references()
    plain.dtype = "float32"
    cache = kvlab.init_cache(cfg.model, plain, 4, 96)
    _, cache = apply({"params": params}, tokens, cache=cache)
    largest = {
        prefix: np.stack(
            [np.abs(np.asarray(layer.tensors[i])).max(axis=(0, 2)) for layer in cache.layers]
        )
        for i, prefix in enumerate(("k", "v"))
    }  # [layers, K, W]
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(FP8, **CALIBRATED)
    for per, reduce in (("channel", ()), ("head", (2,)), ("tensor", (1, 2))):
        ranges = calibrate.scales(cfg.model, cache_cfg, params, tokens, per=per)
        for prefix, want in largest.items():
            want = want.max(axis=reduce, keepdims=True) if reduce else want
            np.testing.assert_allclose(
                ranges[prefix], np.broadcast_to(want, ranges[prefix].shape), rtol=1e-6
            )
    lower = calibrate.scales(cfg.model, cache_cfg, params, tokens, quantile=0.9)
    assert (lower["k"] < largest["k"]).all()
    only_keys = cache_cfg.copy_and_resolve_references()
    only_keys.update(v_axis="token")
    assert set(calibrate.scales(cfg.model, only_keys, params, tokens)) == {"k"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_it_is_the_dense_cache_in_pages_under_eviction_the_kernels_and_chunks(tmp_path, layout):
    """A prefill and three decode steps through a calibrated fp8 cache: in pages, the
    dense cache's logits; evicting with a budget that holds every token, the
    dense cache's; under the native kernels (which decline static scales), the
    reference's; fed a token at a time, the one prefill's (each token's codes
    are its own). The bytes counted are the tree's: codes alone, no scale."""
    cfg = VARIANTS["gqa"]()
    cache_cfg, _ = calibrated(cfg, tmp_path)
    same_logits(cfg, cache_cfg, random_tokens(cfg, (2, 15), seed=4), LAYOUTS[layout])


def test_it_stores_the_codes_alone_and_the_scales_per_group_cost_bytes(tmp_path):
    """Per layer and tensor, B x KH x S x Wd codes of one byte, no scale; the same fp8
    codes with a bfloat16 scale per 16 numbers store 1/8 more."""
    cfg = VARIANTS["gqa"]()
    cache_cfg, _ = calibrated(cfg, tmp_path)
    m = cfg.model
    codes = m.num_layers * 2 * 3 * m.num_kv_heads * 64 * m.head_dim
    rows = 3 * 8  # a length and error flags per row
    assert kvlab.cache_bytes(m, cache_cfg, 3, 64) == codes + rows
    grouped = cache_cfg.copy_and_resolve_references()
    grouped.update(k_axis="token", v_axis="token", group_size=16, scales="")
    assert kvlab.cache_bytes(m, grouped, 3, 64) == codes + codes // 16 * 2 + rows
    cache = kvlab.init_cache(m, cache_cfg, 1, 32)
    assert all(t.scale is None and t.zero is None for layer in cache.layers for t in layer.tensors)


def test_codebook_levels_over_calibrated_scales_lose_less_than_the_grid(tmp_path):
    """KVQuant's pieces together: 4-bit keys and values over calibrated scales with
    levels fitted per layer to the numbers over those scales (Lloyd-Max weighed by
    the ranges, read from cache.codebooks) lose less on held-out text than the
    normal-float grid over the same scales (per head: per channel, the tiny
    model's 384 calibration tokens fit its held-out ranges less well)."""
    cfg = VARIANTS["gqa"]()
    cache_cfg, _ = calibrated(
        cfg,
        tmp_path,
        per="head",
        k_bits=4,
        v_bits=4,
        k_format="nf",
        v_format="nf",
    )
    _, params, apply = build(cfg)
    books_cfg = cache_cfg.copy_and_resolve_references()
    books_cfg.update(k_format="codebook", v_format="codebook")
    books = calibrate.codebooks(cfg.model, books_cfg, params, random_tokens(cfg, (4, 96), 0))
    path = str(tmp_path / "books.npz")
    calibrate.save_codebooks(path, books)
    books_cfg.codebooks = path
    held_out = kvlab.init_cache(cfg.model, cfg.cache, 2, 64)
    _, held_out = apply({"params": params}, random_tokens(cfg, (2, 64), seed=9), cache=held_out)
    for layer in range(cfg.model.num_layers):
        fitted = kvlab.cache.quant.storages(cfg.model, books_cfg, layer)
        grid = kvlab.cache.quant.storages(cfg.model, cache_cfg, layer)
        for index in range(2):
            x = jnp.asarray(held_out.layers[layer].tensors[index], jnp.float32)
            errors = [
                float(jnp.mean((dequantize_tokens(*quantize_tokens(x, s), s) - x) ** 2))
                for s in (fitted[index], grid[index])
            ]
            assert errors[0] < errors[1], (layer, index, errors)
    logits, _ = apply(
        {"params": params},
        random_tokens(cfg, (1, 10), seed=2),
        cache=kvlab.init_cache(cfg.model, books_cfg, 1, 32),
    )
    assert np.isfinite(np.asarray(logits)).all()


def test_a_latent_model_calibrates_and_runs(tmp_path):
    """MLA's latent (one head) and RoPE key with calibrated fp8 scales."""
    cfg = VARIANTS["mla_absorbed"]()
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(
        latent_bits=8, rope_bits=8, latent_format="fp8", rope_format="fp8",
        latent_axis="calibrated", rope_axis="calibrated",
    )  # fmt: skip
    _, params, apply = build(cfg)
    ranges = calibrate.scales(cfg.model, cache_cfg, params, random_tokens(cfg, (2, 64)))
    assert ranges["latent"].shape == (cfg.model.num_layers, 1, cfg.model.mla.kv_rank)
    path = str(tmp_path / "mla.npz")
    calibrate.save_scales(path, ranges)
    cache_cfg.scales = path
    tokens = random_tokens(cfg, (1, 10), seed=2)
    full, _ = apply({"params": params}, tokens)
    logits, _ = apply(
        {"params": params}, tokens, cache=kvlab.init_cache(cfg.model, cache_cfg, 1, 32)
    )
    assert np.abs(np.asarray(logits) - np.asarray(full)).max() < 0.5


def test_without_usable_scales_the_cache_is_refused_naming_the_field(tmp_path):
    cfg = VARIANTS["gqa"]()
    cache_cfg, ranges = calibrated(cfg, tmp_path)

    def refused(match, **fields):
        broken = cache_cfg.copy_and_resolve_references()
        broken.update(fields)
        with pytest.raises(ValueError, match=match):
            kvlab.init_cache(cfg.model, broken, 1, 32)

    refused(r"cache.scales, which is empty", scales="")
    refused(r"cannot be read", scales=str(tmp_path / "missing.npz"))
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not an npz")
    refused(r"cannot be read", scales=str(garbage))
    only_v = str(tmp_path / "only_v.npz")
    calibrate.save_scales(only_v, {"v": ranges["v"]})
    refused(r"holds no ranges for 'k'", scales=only_v)
    other = str(tmp_path / "other_model.npz")
    calibrate.save_scales(other, {"k": ranges["k"][:, :1], "v": ranges["v"]})
    refused(r"not positive finite \[2 cache layers, 2 heads, 16 channels\]", scales=other)
    with pytest.raises(ValueError, match="not positive finite"):
        calibrate.save_scales(other, {"k": np.zeros_like(ranges["k"])})

    def invalid(match, **fields):
        with pytest.raises(ValueError, match=match):
            kvlab.config.validate_cache_config({**cache_cfg.to_dict(), **fields}, cfg.model)

    invalid(r"cache.scales=.* is read by no tensor", k_axis="token", v_axis="token")
    invalid(r"cache.k_axis='calibrated' .*cache.symmetric=True", k_format="int", k_bits=4)
    invalid(r"cache.scales", scales=3)
    invalid(r"cache.k_axis", k_axis="tokens")
    pooled = {**cache_cfg.to_dict(), "evict": {**cache_cfg.evict.to_dict(), "method": "adakv"}}
    with pytest.raises(ValueError, match=r"cache.evict.method.*static scale per KV head"):
        kvlab.config.validate_cache_config(pooled, cfg.model)


def test_calibrating_badly_is_refused():
    cfg = VARIANTS["gqa"]()
    _, params, _ = build(cfg)
    tokens = random_tokens(cfg, (1, 16))
    with pytest.raises(ValueError, match="axis='calibrated'"):
        calibrate.scales(cfg.model, cfg.cache, params, tokens)
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(FP8, **CALIBRATED)
    with pytest.raises(ValueError, match="per='token'"):
        calibrate.scales(cfg.model, cache_cfg, params, tokens, per="token")
    with pytest.raises(ValueError, match="quantile=0"):
        calibrate.scales(cfg.model, cache_cfg, params, tokens, quantile=0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_calibrated_cache_exports_for_tpu_and_cuda(tmp_path, impl):
    """The prefill and the decode step over codes with static scales, lowered for TPU
    and CUDA from this host: no CPU-only call, no Pallas kernel (they decline)."""
    cfg = VARIANTS["gqa"]()
    cfg.cache, _ = calibrated(cfg, tmp_path)
    cfg.model.attention_impl = impl
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)


def test_the_fp8_encoding_saturates_instead_of_overflowing():
    """e4m3fn has no infinity: a number past 448 over its scale would be NaN cast
    directly; encode gives the largest code of its sign."""
    spec = dataclasses.replace(spec_of("fp8", 8, np.ones((1, 8), np.float32)))
    codes = spec.codes.encode(jnp.asarray([1e6, -1e6, FP8_MAX, 0.0]), spec)
    np.testing.assert_array_equal(spec.codes.levels(codes, spec), [FP8_MAX, -FP8_MAX, FP8_MAX, 0.0])
