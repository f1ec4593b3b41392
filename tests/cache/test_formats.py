"""Storage formats (kvlab/cache/formats): the normal-float grid as QLoRA defines
it, what it loses against int codes at equal bytes, a format through every cache
kind, and kernels that decline codes they do not dequantize."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab import registry
from kvlab.cache.formats import normal_float
from kvlab.cache.quant import Storage, dequantize_tokens, quantize_tokens
from kvlab.kernels import native
from tests.helpers import ROOT, random_tokens

# QLoRA's NF4 levels (arXiv:2305.14314, appendix E; bitsandbytes' table).
NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip


def test_the_4_bit_grid_is_qloras_nf4():
    np.testing.assert_allclose(normal_float.grid(4), NF4, atol=2e-7)


@given(bits=st.sampled_from([2, 4, 8]))
def test_a_grid_spans_minus_one_to_one_with_an_exact_zero(bits):
    levels = normal_float.grid(bits)
    assert len(levels) == 2**bits and (np.diff(levels) > 0).all()
    assert levels[0] == -1 and levels[-1] == 1 and 0 in levels
    assert (levels < 0).sum() == 2 ** (bits - 1) - 1  # one level more on the positive side


def test_normal_numbers_lose_less_on_the_normal_float_grid_at_equal_bytes():
    """4-bit codes of normally distributed numbers, one scale per 64 (QLoRA's
    block): the grid's error is below the symmetric int levels', at equal bytes."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 4, 64, 64)), jnp.float32)
    errors = {}
    for fmt in ("nf", "int"):
        spec = Storage(4, fmt, "token", 64, True, "float32", "float32")
        restored = dequantize_tokens(*quantize_tokens(x, spec), spec)
        errors[fmt] = float(jnp.mean((restored - x) ** 2))
    assert errors["nf"] < 0.8 * errors["int"], errors
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:tiny")
    sizes = {}
    for fmt in ("nf", "int"):
        cfg.cache.update(k_bits=4, v_bits=4, k_format=fmt, v_format=fmt, symmetric=True)
        sizes[fmt] = kvlab.cache_bytes(cfg.model, cfg.cache, 2, 64)
    assert sizes["nf"] == sizes["int"]


def test_registered_formats_are_what_the_config_may_name():
    assert {"int", "fp8", "nf"} <= set(registry.FORMATS.names())
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:tiny")
    cfg.cache.update(k_bits=4, k_format="e2m1")
    with pytest.raises(ValueError, match=r"cache.k_format='e2m1' is not supported"):
        kvlab.validate_config(cfg)
    cfg.cache.update(k_format="fp8")
    with pytest.raises(ValueError, match=r"cache.k_format='fp8' needs 8 bits but cache.k_bits=4"):
        kvlab.validate_config(cfg)


def decode(cfg, params, tokens):
    """Logits of a 12-token prefill and three decode steps."""
    model = kvlab.Transformer(cfg.model)
    step = jax.jit(lambda c, t: kvlab.prefill(model, params, c, t))
    cache = kvlab.init_cache(cfg.model, cfg.cache, 2, 16)
    logits, cache = step(cache, tokens[:, :12])
    out = [logits[:, -1]]
    for t in range(12, 15):
        logits, cache = step(cache, tokens[:, t : t + 1])
        out.append(logits[:, -1])
    cache.check()
    return np.stack(out)


def step_calls(cfg, params) -> str:
    """The jaxpr of a decode step (traced, not run)."""
    model = kvlab.Transformer(cfg.model)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 2, 16)
    step = lambda c, t: kvlab.prefill(model, params, c, t)  # noqa: E731
    return str(jax.make_jaxpr(step)(cache, jnp.zeros((2, 1), jnp.int32)))


CACHES = {
    "dense": ({}, {}),
    "paged": (dict(kind="paged", page_size=8), {}),
    "evicting": (dict(kind="paged", page_size=8), dict(method="h2o", budget=12, recent=2)),
}
CALLS = {"pallas": "pallas_call", "native": "kvlab_quant_scores"}


@pytest.mark.parametrize("impl", CALLS)
@pytest.mark.parametrize("kind", CACHES)
def test_kernels_decline_codes_they_do_not_dequantize(kind, impl):
    """K4V4 on the normal-float grid (residual 4) under the Pallas kernels (the
    interpreter here) and the native ones: no kernel reads the codes, the
    reference does, and the logits are the XLA path's; int codes in the same
    dense or paged cache are the kernels'."""
    if impl == "native" and not native.available():
        pytest.skip(f"kvlab.kernels.native unavailable: {native.unavailable_reason()}")
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:tiny")
    cfg.model.num_layers = 1
    cfg.cache.update(k_bits=4, v_bits=4, k_format="nf", v_format="nf", group_size=4, residual=4)
    cfg.cache.update(CACHES[kind][0])
    cfg.cache.evict.update(CACHES[kind][1])
    cfg = kvlab.validate_config(cfg)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    tokens = jnp.asarray(random_tokens(cfg, (2, 15)))
    reference = decode(cfg, params, tokens)
    cfg.model.attention_impl = impl
    np.testing.assert_allclose(decode(cfg, params, tokens), reference, atol=1e-5)
    assert CALLS[impl] not in step_calls(cfg, params)
    if kind != "evicting":  # an evicting layer's slots are the reference's under any backend
        cfg.cache.update(k_format="int", v_format="int")
        assert CALLS[impl] in step_calls(cfg, params)
