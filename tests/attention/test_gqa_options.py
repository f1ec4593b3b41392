"""Grouped-query attention's Hugging Face options: qkv_bias (Qwen2), qk_norm (Qwen3),
rope_scaling (Llama 3.1, Qwen2.5 yarn); at their defaults nothing changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.attention.core import attend
from kvlab.attention.gqa import GroupedQueryAttention
from kvlab.cache.placement import Placement, place_without_cache
from kvlab.config import frozen
from kvlab.layers import projection
from kvlab.rope import apply_rope
from tests.helpers import TOLERANCE, build, plain_rope, random_tokens, run_in_chunks, tiny_config

BATCH, LENGTH = 2, 12
LLAMA3 = dict(type="llama3", factor=8.0, original_max_len=16)
YARN = dict(type="yarn", factor=4.0, original_max_len=16, mscale=0.0)  # Qwen2.5's: no mscale


def options(rope_scaling=None, **model_fields):
    cfg = tiny_config(num_kv_heads=2, **model_fields)
    cfg.model.rope_scaling.update(rope_scaling or {})
    kvlab.config.validate_model_config(cfg.model)
    return cfg


def reference(model, params, x, placement, rope):
    """The layer written out as the Hugging Face models compute it: projection (+ bias),
    per-head RMSNorm of q and k, RoPE, causal attention, bias-free output projection."""

    def project(name, heads):
        kernel = {"params": {"kernel": params[name]["kernel"]}}
        out = projection(model, (heads, model.head_dim), name).apply(kernel, x)
        return out + params[name]["bias"] if model.qkv_bias else out

    def norm(y, name):
        mean_square = jnp.mean(y * y, axis=-1, keepdims=True)
        return y * jax.lax.rsqrt(mean_square + model.norm_eps) * params[name]["scale"]

    q, k = project("query", model.num_heads), project("key", model.num_kv_heads)
    v = project("value", model.num_kv_heads)
    if model.qk_norm:
        q, k = norm(q, "query_norm"), norm(k, "key_norm")
    q, k = rope(q, placement.positions), rope(k, placement.positions)
    out = attend(q, [(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), placement.fresh_mask)])
    return projection(model, model.embed_dim, "out", axis=(-2, -1)).apply(
        {"params": params["out"]}, out
    )


def layer(cfg, seed=0):
    """(layer, random params with random biases and norm scales, x, placement at 1000..)."""
    model = frozen(cfg.model)
    attention = GroupedQueryAttention(model)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, LENGTH, model.embed_dim), np.float32)
    start = place_without_cache(BATCH, LENGTH)
    placement = Placement(start.positions + 1000, start.fresh_mask)
    params = jax.jit(attention.init)(jax.random.key(seed), x, placement)["params"]
    return attention, perturb(params, seed), x, placement


def perturb(params, seed):
    """Random values in place of the zero biases and unit norm scales they start with."""
    rng = np.random.default_rng(seed)

    def randomize(path, leaf):
        if path[-1].key == "bias":
            return rng.standard_normal(leaf.shape, np.float32)
        if path[-1].key == "scale":
            return 1 + 0.5 * rng.standard_normal(leaf.shape, np.float32)
        return leaf

    return jax.tree_util.tree_map_with_path(randomize, params)


def test_defaults_compute_the_layer_as_before_to_the_bit():
    cfg = options()
    attention, params, x, placement = layer(cfg)
    assert set(params) == {"query", "key", "value", "out"}
    assert all(set(params[name]) == {"kernel"} for name in params)
    out, _ = jax.jit(attention.apply)({"params": params}, x, placement)
    model = frozen(cfg.model)
    rope = lambda y, positions: plain_rope(y, positions, model.rope_theta)  # noqa: E731
    expected = jax.jit(lambda p, x: reference(model, p, x, placement, rope))(params, x)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "fields",
    [
        dict(qkv_bias=True),
        dict(qk_norm=True, rope_scaling=dict(type="linear", factor=4.0)),
        dict(rope_scaling=LLAMA3),
        dict(rope_scaling=YARN),
    ],
    ids=["qkv_bias", "qk_norm_linear", "llama3", "yarn"],
)
def test_options_compute_what_the_hugging_face_layer_computes(fields):
    cfg = options(**fields)
    attention, params, x, placement = layer(cfg)
    out, _ = jax.jit(attention.apply)({"params": params}, x, placement)
    model = frozen(cfg.model)
    rope = lambda y, positions: apply_rope(  # noqa: E731
        y, positions, model.rope_theta, model.rope_scaling
    )
    expected = jax.jit(lambda p, x: reference(model, p, x, placement, rope))(params, x)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    # and each option makes a difference
    plain = options()
    plain_params = {name: {"kernel": params[name]["kernel"]} for name in ("query", "key", "value")}
    plain_params["out"] = params["out"]
    plain_out, _ = jax.jit(GroupedQueryAttention(frozen(plain.model)).apply)(
        {"params": plain_params}, x, placement
    )
    assert float(jnp.max(jnp.abs(out - plain_out))) > 1e-3


def param_shapes(cfg):
    """{'block_0/attention/query/kernel': shape, ...} without initialising anything."""
    model = kvlab.Transformer(cfg.model)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    leaves = jax.tree_util.tree_flatten_with_path(shapes["params"])[0]
    return {"/".join(key.key for key in path): leaf.shape for path, leaf in leaves}


def test_defaults_add_no_params_and_options_add_theirs():
    default = param_shapes(options())
    attention = {k: v for k, v in default.items() if k.startswith("block_0/attention/")}
    assert attention == {
        "block_0/attention/query/kernel": (64, 4, 16),
        "block_0/attention/key/kernel": (64, 2, 16),
        "block_0/attention/value/kernel": (64, 2, 16),
        "block_0/attention/out/kernel": (4, 16, 64),
    }
    scaled = param_shapes(options(rope_scaling=YARN))
    assert scaled == default
    added = param_shapes(options(qkv_bias=True, qk_norm=True))
    new = {k: v for k, v in added.items() if k not in default}
    assert set(default) <= set(added)
    for block in ("block_0", "block_1"):
        assert {k: v for k, v in new.items() if k.startswith(block)} == {
            f"{block}/attention/query/bias": (4, 16),  # [N, H]
            f"{block}/attention/key/bias": (2, 16),  # [K, H]
            f"{block}/attention/value/bias": (2, 16),
            f"{block}/attention/query_norm/scale": (16,),  # [H]
            f"{block}/attention/key_norm/scale": (16,),
        }


def all_options():
    """Qwen2's biases, Qwen3's norms and Qwen2.5's yarn at once (one compiled model)."""
    return options(qkv_bias=True, qk_norm=True, rope_scaling=YARN)


def test_cached_decode_equals_the_forward_with_options_on():
    cfg = all_options()
    _, params, apply = build(cfg)
    params = perturb(params, 0)
    tokens = random_tokens(cfg, (BATCH, 24))
    full, _ = apply({"params": params}, tokens)
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=BATCH, max_len=32)
    # a prefill of 8 tokens, then 16 single-token decode steps
    cached, _ = run_in_chunks(apply, params, cache, tokens, [8] + [1] * 16)
    assert float(jnp.max(jnp.abs(cached - full))) <= TOLERANCE


@settings(max_examples=4)
@given(head=st.integers(0, 3), factor=st.floats(0.5, 8.0), which=st.sampled_from(["query", "key"]))
def test_qk_norm_makes_each_head_blind_to_the_scale_of_its_projection(head, factor, which):
    cfg = all_options()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (BATCH, 24))
    full, _ = apply({"params": params}, tokens)
    kernel = params["block_0"]["attention"][which]["kernel"]  # [D, N or K, H]
    head = head % kernel.shape[1]
    scaled = jax.tree_util.tree_map(lambda x: x, params)
    scaled["block_0"]["attention"][which]["kernel"] = kernel.at[:, head].multiply(factor)
    logits, _ = apply({"params": scaled}, tokens)
    assert float(jnp.max(jnp.abs(logits - full))) <= TOLERANCE


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("qkv_bias", 1, "model.qkv_bias=1 is not a bool"),
        ("qk_norm", "yes", "model.qk_norm='yes' is not a bool"),
        ("rope_scaling.type", "ntk", "model.rope_scaling.type='ntk' is not supported"),
        ("rope_scaling.factor", 0.0, "model.rope_scaling.factor=0.0 is not a finite number > 0"),
        ("rope_scaling.factor", float("nan"), "factor=nan is not a finite number > 0"),
        ("rope_scaling.factor", 4.0, "does nothing with model.rope_scaling.type='none'"),
        ("rope_scaling.original_max_len", -1, "original_max_len=-1 is below 0"),
        ("rope_scaling.original_max_len", 8.0, "original_max_len=8.0 is not an integer"),
        ("rope_scaling.mscale", -1.0, "mscale=-1.0 is not a finite number >= 0"),
        ("rope_scaling.beta_slow", float("inf"), "beta_slow=inf is not a finite number > 0"),
        ("rope_scaling.extra", 1, "model.rope_scaling.extra is not a kvlab config field"),
    ],
)
def test_bad_values_are_refused_before_anything_compiles(field, value, words):
    model = options().model.to_dict()  # a plain dict takes a value of any type, as a file could
    section, _, name = field.rpartition(".")
    (model[section] if section else model)[name] = value
    with pytest.raises(ValueError, match=words):
        kvlab.Transformer(model)


@pytest.mark.parametrize(
    "scaling, words",
    [
        (dict(type="llama3", factor=8.0), "original_max_len=0 is unset but"),
        (dict(type="yarn", factor=4.0), "set it to the context the model was trained on"),
        (
            dict(type="llama3", factor=8.0, original_max_len=16, high_freq_factor=1.0),
            "high_freq_factor=1.0 is not above model.rope_scaling.low_freq_factor=1.0",
        ),
        (
            dict(type="yarn", factor=4.0, original_max_len=16, beta_fast=1.0),
            "beta_fast=1.0 is not above model.rope_scaling.beta_slow=1.0",
        ),
    ],
)
def test_inconsistent_scalings_are_refused(scaling, words):
    cfg = tiny_config()
    cfg.model.rope_scaling.update(scaling)
    with pytest.raises(ValueError, match=words):
        kvlab.config.validate_model_config(cfg.model)


def test_a_config_saved_without_the_options_loads_with_them_off():
    cfg = kvlab.base_config("tiny")
    with cfg.model.unlocked():
        for name in ("qkv_bias", "qk_norm", "rope_scaling"):
            del cfg.model[name]
    kvlab.validate_config(cfg)
    assert not cfg.model.qkv_bias and not cfg.model.qk_norm
    assert cfg.model.rope_scaling == kvlab.base_config().model.rope_scaling
