import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab.attention.mla import MultiHeadLatentAttention, absorbed_attention, expanded_attention
from kvlab.cache.placement import Placement, causal_mask, place_without_cache
from kvlab.config import frozen
from kvlab.layers import projection
from kvlab.rope import apply_rope
from tests.helpers import TOLERANCE, build, mla_config, plain_rope, random_tokens, run_in_chunks


def reference(q_nope, q_rope, c_kv, k_rope, mask, key_up, value_up, scale):
    """MLA written out in float64: per-head keys [k_nope | k_rope], values, softmax."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    k_nope = np.einsum("bsr,rnh->bnsh", f(c_kv), f(key_up))
    values = np.einsum("bsr,rnh->bnsh", f(c_kv), f(value_up))
    scores = np.einsum("btnh,bnsh->bnts", f(q_nope), k_nope)
    scores += np.einsum("btnh,bsh->bnts", f(q_rope), f(k_rope))
    scores = np.where(np.asarray(mask)[:, None], scores * scale, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bnsh->btnh", probs, values)


def random_inputs(seed, batch, queries, keys, heads, rank, nope, rope, value_dim):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    lengths = rng.integers(queries, keys + 1, size=batch)
    positions = lengths[:, None] - queries + np.arange(queries)
    mask = np.asarray(causal_mask(jnp.asarray(positions), jnp.asarray(lengths), keys))
    return dict(
        q_nope=normal(batch, queries, heads, nope),
        q_rope=normal(batch, queries, heads, rope),
        c_kv=normal(batch, keys, rank),
        k_rope=normal(batch, keys, rope),
        mask=mask,
        key_up=normal(rank, heads, nope) / np.sqrt(rank),
        value_up=normal(rank, heads, value_dim) / np.sqrt(rank),
        scale=(nope + rope) ** -0.5,
    )


def call(attention, inputs, split):
    """Runs an MLA attention path with the keys cut into two blocks at `split`."""
    c_kv, k_rope, mask = inputs["c_kv"], inputs["k_rope"], inputs["mask"]
    cut = min(split, c_kv.shape[1])
    # [B, 1, S, .]: the latent and the RoPE key as the cache holds them
    c_kv, k_rope = c_kv[:, None], k_rope[:, None]
    blocks = [
        (c_kv[:, :, :cut], k_rope[:, :, :cut], mask[..., :cut]),
        (c_kv[:, :, cut:], k_rope[:, :, cut:], mask[..., cut:]),
    ]
    run = jax.jit(attention, static_argnums=5)
    return run(
        inputs["q_nope"],
        inputs["q_rope"],
        blocks,
        inputs["key_up"],
        inputs["value_up"],
        inputs["scale"],
    )


@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 2),
    queries=st.integers(1, 4),
    extra_keys=st.integers(0, 5),
    heads=st.sampled_from([1, 3, 4]),
    rank=st.integers(1, 12),
    nope=st.integers(1, 6),
    rope=st.sampled_from([2, 4]),
    value_dim=st.integers(1, 6),
    split=st.integers(0, 9),
)
def test_both_paths_equal_the_written_out_attention(
    seed, batch, queries, extra_keys, heads, rank, nope, rope, value_dim, split
):
    inputs = random_inputs(
        seed, batch, queries, queries + extra_keys, heads, rank, nope, rope, value_dim
    )
    expected = reference(**inputs)
    for attention in (expanded_attention, absorbed_attention):
        out = call(attention, inputs, split)
        assert out.shape == (batch, queries, heads, value_dim)
        np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


def largest_intermediate(attention, inputs) -> int:
    """Elements in the largest array the path builds."""
    blocks = [(inputs["c_kv"][:, None], inputs["k_rope"][:, None], inputs["mask"])]
    jaxpr = jax.make_jaxpr(attention, static_argnums=5)(
        inputs["q_nope"],
        inputs["q_rope"],
        blocks,
        inputs["key_up"],
        inputs["value_up"],
        inputs["scale"],
    )
    sizes = [0]

    def visit(jaxpr):
        for equation in jaxpr.eqns:
            sizes.extend(int(np.prod(v.aval.shape)) for v in equation.outvars)
            for sub in jax.extend.core.jaxprs_in_params(equation.params):
                visit(sub)

    visit(jaxpr.jaxpr)
    return max(sizes)


def test_absorbed_path_never_builds_per_head_keys_or_values():
    # One query over 64 cached tokens, 8 heads of width 16 from a rank-32 latent.
    inputs = random_inputs(0, 1, 1, 64, heads=8, rank=32, nope=16, rope=4, value_dim=16)
    per_head_kv = 1 * 8 * 64 * 16  # [B, N, S, H], what the expanded path builds
    assert largest_intermediate(expanded_attention, inputs) >= per_head_kv
    # Nothing larger than the latent [B, S, R] itself or the scores [B, N, S] (T = 1).
    assert largest_intermediate(absorbed_attention, inputs) <= max(1 * 64 * 32, 1 * 8 * 64)


# DeepSeek-V2's yarn (factor 40, mscale = mscale_all_dim = 0.707), over a short context.
DEEPSEEK_YARN = dict(
    type="yarn", factor=40.0, original_max_len=256, mscale=0.707, mscale_all_dim=0.707
)
BATCH, LENGTH = 2, 12


def latent_config(rope_scaling=None, **mla_fields):
    cfg = mla_config(**mla_fields)
    cfg.model.rope_scaling.update(rope_scaling or {})
    return kvlab.validate_config(cfg)


def reference_layer(model, params, x, placement, rope, scale, eps):
    """The latent attention layer written out with the given RoPE, softmax scale and
    latent-norm epsilon (the plain forward: expanded K/V)."""
    mla = model.mla

    def project(name, features, y, axis=-1):
        return projection(model, features, name, axis).apply({"params": params[name]}, y)

    def norm(y, name):
        y32 = y.astype(jnp.float32)
        normed = y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + eps)
        return (normed * params[name]["scale"].astype(jnp.float32)).astype(y.dtype)

    query_shape = (model.num_heads, model.head_dim)
    if mla.q_rank:
        latent_query = norm(project("query_down", mla.q_rank, x), "query_norm")
        q = project("query_up", query_shape, latent_query)
    else:
        q = project("query", query_shape, x)
    q_nope, q_rope = q[..., : mla.nope_dim], rope(q[..., mla.nope_dim :], placement.positions)
    c_kv = norm(project("kv_down", mla.kv_rank, x), "kv_norm")
    k_rope = rope(project("key_rope", (1, mla.rope_dim), x), placement.positions)[:, :, 0]
    blocks = [(c_kv[:, None], k_rope[:, None], placement.fresh_mask)]
    out = expanded_attention(q_nope, q_rope, blocks, params["key_up"], params["value_up"], scale)
    return project("out", model.embed_dim, out, axis=(-2, -1))


def latent_layer(cfg, seed=0):
    """(layer, params, x, placement at positions 1000..) with random latent-norm scales."""
    model = frozen(cfg.model)
    attention = MultiHeadLatentAttention(model)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, LENGTH, model.embed_dim), np.float32)
    start = place_without_cache(BATCH, LENGTH)
    placement = Placement(start.positions + 1000, start.fresh_mask)
    params = jax.jit(attention.init)(jax.random.key(seed), x, placement)["params"]
    params = jax.tree_util.tree_map_with_path(
        lambda path, leaf: (
            1 + 0.5 * rng.standard_normal(leaf.shape, np.float32)
            if path[-1].key == "scale"
            else leaf
        ),
        params,
    )
    return attention, params, x, placement


def test_default_latent_layer_computes_as_before_to_the_bit():
    cfg = latent_config(q_rank=24)
    attention, params, x, placement = latent_layer(cfg)
    assert set(params) == {
        "query_down", "query_norm", "query_up", "kv_down", "kv_norm", "key_rope",
        "key_up", "value_up", "out",
    }  # fmt: skip
    out, _ = jax.jit(attention.apply)({"params": params}, x, placement)
    model = frozen(cfg.model)
    rope = lambda y, positions: plain_rope(y, positions, model.rope_theta)  # noqa: E731
    expected = jax.jit(
        lambda p, x: reference_layer(
            model, p, x, placement, rope, model.head_dim**-0.5, model.norm_eps
        )
    )(params, x)
    np.testing.assert_array_equal(out, expected)


def test_yarn_mscale_enters_the_softmax_scale_and_mla_norm_eps_the_latent_norms():
    cfg = latent_config(rope_scaling=DEEPSEEK_YARN, q_rank=24, norm_eps=0.5)
    attention, params, x, placement = latent_layer(cfg)
    out, _ = jax.jit(attention.apply)({"params": params}, x, placement)
    model = frozen(cfg.model)
    rope = lambda y, positions: apply_rope(  # noqa: E731
        y, positions, model.rope_theta, model.rope_scaling
    )
    reference = jax.jit(
        lambda p, x, scale, eps: reference_layer(model, p, x, placement, rope, scale, eps)
    )
    mscale = 0.1 * 0.707 * math.log(40.0) + 1  # DeepSeek-V2's yarn_get_mscale(40, 0.707)
    scale = model.head_dim**-0.5 * mscale * mscale
    np.testing.assert_allclose(out, reference(params, x, scale, 0.5), atol=1e-5, rtol=1e-5)
    # Neither is a no-op: the plain scale or the model's epsilon give other outputs.
    for other_scale, other_eps in ((model.head_dim**-0.5, 0.5), (scale, model.norm_eps)):
        other = reference(params, x, other_scale, other_eps)
        assert float(jnp.max(jnp.abs(out - other))) > 1e-3


def test_cached_decode_equals_the_forward_with_yarn_and_latent_norm_eps():
    cfg = latent_config(rope_scaling=DEEPSEEK_YARN, q_rank=24, norm_eps=1e-3)
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (BATCH, 24))
    full, _ = apply({"params": params}, tokens)
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=BATCH, max_len=32)
    # a prefill of 8 tokens, then 16 single-token decode steps (absorbed)
    cached, _ = run_in_chunks(apply, params, cache, tokens, [8] + [1] * 16)
    assert float(jnp.max(jnp.abs(cached - full))) <= TOLERANCE


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("model.qk_norm", True, "model.qk_norm=True applies to grouped-query attention"),
        ("model.qkv_bias", True, "set model.qkv_bias=False or model.attention='gqa'"),
        ("model.mla.norm_eps", 0.0, "model.mla.norm_eps=0.0 is not a finite number > 0"),
        ("model.mla.norm_eps", math.nan, "model.mla.norm_eps=nan is not a finite number > 0"),
    ],
)
def test_bad_latent_options_are_refused(field, value, words):
    model = mla_config().model.to_dict()  # a plain dict takes a value of any type
    section, _, name = field.removeprefix("model.").rpartition(".")
    (model[section] if section else model)[name] = value
    with pytest.raises(ValueError, match=words):
        kvlab.Transformer(model)
