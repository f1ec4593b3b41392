import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvlab.attention.rope import apply_rope


@given(
    head_dim=st.sampled_from([2, 8, 32]),
    theta=st.sampled_from([100.0, 10_000.0]),
    shift=st.integers(0, 500),
    seed=st.integers(0, 2**16),
)
def test_scores_depend_only_on_relative_position(head_dim, theta, shift, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, 1, head_dim), np.float32)
    k = rng.standard_normal((1, 1, 1, head_dim), np.float32)

    def score(q_pos, k_pos):
        rq = apply_rope(q, jnp.array([[q_pos]]), theta)
        rk = apply_rope(k, jnp.array([[k_pos]]), theta)
        return float(jnp.sum(rq * rk))

    np.testing.assert_allclose(score(7, 3), score(7 + shift, 3 + shift), rtol=1e-4, atol=1e-4)


def test_rotation_keeps_norm_and_position_zero_is_identity():
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 16))
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    rotated = apply_rope(x, positions, 10_000.0)
    np.testing.assert_allclose(
        jnp.linalg.norm(rotated, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5
    )
    np.testing.assert_array_equal(rotated[:, 0], x[:, 0])
    assert not np.allclose(rotated[:, 1], x[:, 1])
