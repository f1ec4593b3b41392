import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvlab.attention.mla import absorbed_attention, expanded_attention
from kvlab.cache.placement import causal_mask


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
