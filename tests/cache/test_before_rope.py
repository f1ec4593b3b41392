"""Keys coded before RoPE (cache.k_before_rope): a key is turned back from its position
before it is quantized and turned again when read, so a channel's scale follows
one channel of the key projection (KVQuant's pre-RoPE keys)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.cache.quant import dequantize_tokens, quantize_tokens, storages
from kvlab.eval import calibrate
from kvlab.rope import apply_rope
from tests.helpers import (
    LAYOUTS,
    VARIANTS,
    build,
    intermediates,
    last_logits,
    random_tokens,
    same_logits,
)
from tests.test_export import assert_exports, assert_round_trips, inference

KEYS = dict(k_bits=4, v_bits=4, k_axis="channel", v_axis="token", group_size=8, residual=8)


def key_spec(cfg, **cache):
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(KEYS, k_before_rope=True)
    cache_cfg.update(cache)
    return storages(cfg.model, cache_cfg)[0]


def as_tokens(x):
    """[B, T, K, H] (the model's layout) as [B, K, T, H] (the cache's)."""
    return jnp.swapaxes(x, 1, 2)


@pytest.mark.parametrize("scaling", [None, {"type": "llama3"}])
def test_the_codes_are_those_of_the_key_before_rope_turned_at_its_position(scaling):
    """Coding a key after RoPE at position p, then reading it at p, is coding the key
    before RoPE the plain way and applying RoPE (kvlab.rope.apply_rope, the
    attention's own) to what comes back, under plain and Llama 3.1's RoPE."""
    cfg = VARIANTS["gqa"]()
    if scaling is not None:
        cfg.model.rope_scaling.update(
            type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_len=8,
        )  # fmt: skip
    spec = key_spec(cfg)
    plain = dataclasses.replace(spec, rope=())
    rng = np.random.default_rng(0)
    before = jnp.asarray(rng.normal(size=(2, 16, 2, 16)).astype(np.float32))  # [B, T, K, H]
    positions = jnp.asarray(rng.integers(0, 500, (2, 16)), jnp.int32)
    theta, rope = cfg.model.rope_theta, cfg.model.rope_scaling
    after = apply_rope(before, positions, theta, rope)
    payload, scale, zero = quantize_tokens(as_tokens(after), spec, positions)
    read = dequantize_tokens(payload, scale, zero, spec, positions)
    want = apply_rope(
        jnp.swapaxes(dequantize_tokens(*quantize_tokens(as_tokens(before), plain), plain), 1, 2),
        positions, theta, rope,
    )  # fmt: skip
    np.testing.assert_allclose(read, as_tokens(want), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="at their positions"):
        quantize_tokens(as_tokens(after), spec)


def test_a_channel_outlier_loses_less_coded_before_rope():
    """Keys whose channel 0 is 30x the others before RoPE (the structure KVQuant
    finds in keys): after RoPE that magnitude turns between channels 0 and 8 by a
    radian a position, so per-channel scales over groups of tokens span it both
    ways; before RoPE it stays in one channel, nearly constant. 4 bits, groups of 8."""
    cfg = VARIANTS["gqa"]()
    spec = key_spec(cfg)
    rng = np.random.default_rng(1)
    before = rng.normal(size=(2, 64, 2, 16)).astype(np.float32)
    before[..., 0] = 30 + rng.normal(size=(2, 64, 2))
    positions = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (2, 64))
    after = as_tokens(apply_rope(jnp.asarray(before), positions, cfg.model.rope_theta))
    errors = {}
    for name, s in (("before", spec), ("after", dataclasses.replace(spec, rope=()))):
        read = dequantize_tokens(*quantize_tokens(after, s, positions), s, positions)
        errors[name] = float(jnp.mean((read - after) ** 2))
    assert errors["before"] < errors["after"] / 4, errors


@pytest.mark.parametrize("layout", ["paged", "native", "chunked"])
def test_it_is_the_dense_cache_in_pages_under_the_kernels_and_in_chunks(layout):
    """A prefill and three decode steps with keys coded before RoPE, per channel in
    groups of 8 with 8 in full precision: in pages, the dense cache's logits;
    under the native kernels (which decline such keys), the reference's; a token
    at a time, the one prefill's. Other logits than keys coded after RoPE, the
    same bytes. (An evicting cache is refused.)"""
    cfg = VARIANTS["gqa"]()
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(KEYS, k_before_rope=True)
    # Tokens whose keys lie off the 4-bit codes' boundaries by more than float32
    # rounding: a prompt's key projection and one token's run in different matrix
    # routines, and a key within a rounding of a boundary (seed 4 has one on an
    # AVX2 CPU, not on an AVX-512 one) takes the next code in one of them.
    tokens = random_tokens(cfg, (2, 27), seed=5)
    want = same_logits(cfg, cache_cfg, tokens, LAYOUTS[layout], prompt=24)
    after = cache_cfg.copy_and_resolve_references()
    after.k_before_rope = False
    assert np.abs(last_logits(cfg, after, tokens, 24) - want).max() > 1e-4
    assert kvlab.cache_bytes(cfg.model, after, 2, 32) == kvlab.cache_bytes(
        cfg.model, cache_cfg, 2, 32
    )


def test_calibrated_ranges_are_those_of_the_key_projection(tmp_path):
    """Scales calibrated per channel for keys coded before RoPE are the largest
    magnitudes of the key projection's outputs (the model's keys before RoPE, read
    from its intermediates), and the cache they make runs."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (4, 96), 0)
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(KEYS, k_before_rope=True, k_axis="calibrated", k_bits=8, k_format="fp8")
    ranges = calibrate.scales(cfg.model, cache_cfg, params, tokens)
    captured = intermediates(cfg, params, tokens)
    for layer in range(cfg.model.num_layers):
        keys = captured[f"block_{layer}"]["attention"]["key"]["__call__"][0]
        want = np.abs(np.asarray(keys)).max(axis=(0, 1))  # [K, H]
        np.testing.assert_allclose(ranges["k"][layer], want, rtol=1e-5)
    path = str(tmp_path / "scales.npz")
    calibrate.save_scales(path, ranges)
    cache_cfg.scales = path
    logits, _ = apply(
        {"params": params}, tokens[:1, :20], cache=kvlab.init_cache(cfg.model, cache_cfg, 1, 32)
    )
    full, _ = apply({"params": params}, tokens[:1, :20])
    assert np.abs(np.asarray(logits) - np.asarray(full)).max() < 0.5


def test_keys_before_rope_are_refused_where_rows_are_not_positions():
    cfg = VARIANTS["gqa"]()
    quantized = {**cfg.cache.to_dict(), **KEYS, "k_before_rope": True}

    def invalid(match, model=cfg.model, **fields):
        with pytest.raises(ValueError, match=match):
            kvlab.config.validate_cache_config({**quantized, **fields}, model)

    invalid(r"cache.k_before_rope=True cannot combine with cache.k_bits=16", k_bits=16)
    invalid(r"cache.evict.method='snapkv'", evict={**cfg.cache.evict.to_dict(), "method": "snapkv"})
    invalid(r"cache.k_transform='hadamard'", k_transform="hadamard")
    invalid(r"cache.k_before_rope", k_before_rope=1)
    windowed = cfg.model.copy_and_resolve_references()
    windowed.sliding_window = 8
    invalid(r"model.sliding_window=8", model=windowed)
    mla = VARIANTS["mla_absorbed"]()
    with pytest.raises(ValueError, match=r"model.attention='mla'"):
        kvlab.config.validate_cache_config(
            {**mla.cache.to_dict(), "k_before_rope": True}, mla.model
        )


def test_a_cache_of_keys_before_rope_exports_for_tpu_and_cuda():
    """The prefill and the decode step, lowered for TPU and CUDA from this host; the
    frequencies are the program's numbers (no compile while tracing)."""
    cfg = VARIANTS["gqa"]()
    cfg.cache.update(KEYS, k_before_rope=True)
    cfg.model.attention_impl = "pallas"
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)


def test_an_exported_step_over_keys_before_rope_round_trips():
    """RoPE's numbers in the keys' Storage survive jax.export's serialization."""
    cfg = VARIANTS["gqa"]()
    cfg.cache.update(KEYS, k_before_rope=True)
    assert_round_trips(cfg)
