import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab.cache.placement import causal_mask, place_without_cache, write_tokens
from tests.helpers import tiny_config


def test_causal_mask_hides_later_and_unwritten_keys():
    mask = causal_mask(jnp.array([[2, 3], [0, 1]]), jnp.array([4, 1]), kv_size=5)
    expected = np.array(
        [
            [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]],
            [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0]],  # row 1 holds one token: its padding sees only it
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)


def test_cache_places_new_tokens_after_each_row():
    cfg = tiny_config()
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=6)
    cache = cache.replace(lengths=jnp.array([3, 0]))
    placement = cache.place(3, jnp.array([2, 3]))
    np.testing.assert_array_equal(placement.positions, [[3, 4, 5], [0, 1, 2]])
    np.testing.assert_array_equal(placement.slots, [[3, 4, 6], [0, 1, 2]])  # 6 = dropped padding
    np.testing.assert_array_equal(placement.lengths, [3, 0])
    np.testing.assert_array_equal(placement.num_tokens, [2, 3])
    np.testing.assert_array_equal(
        placement.fresh_mask[0],
        [[1, 0, 0], [1, 1, 0], [1, 1, 0]],  # token 2 is padding
    )
    np.testing.assert_array_equal(placement.fresh_mask[1], np.tril(np.ones((3, 3))))


def test_plain_forward_is_causal_from_zero():
    placement = place_without_cache(2, 4)
    np.testing.assert_array_equal(placement.positions, [[0, 1, 2, 3]] * 2)
    np.testing.assert_array_equal(placement.fresh_mask[1], np.tril(np.ones((4, 4))))
    assert placement.slots is None and placement.lengths is None


@given(
    batch=st.integers(1, 3),
    capacity=st.integers(1, 8),
    new=st.integers(1, 4),
    heads_first=st.booleans(),
    data=st.data(),
)
def test_write_tokens_writes_exactly_the_slots_in_range(batch, capacity, new, heads_first, data):
    slots = np.array(
        data.draw(
            st.lists(
                st.lists(st.integers(-3, capacity + 2), min_size=new, max_size=new, unique=True),
                min_size=batch,
                max_size=batch,
            )
        ),
        np.int32,
    )
    # Tokens [B, T, 3 heads, 2 channels] into a [B, S, 3, 2] buffer, or head-major
    # ([B, 3, T, 2] into [B, 3, S, 2]).
    values = np.arange(batch * new * 6, dtype=np.float32).reshape(batch, new, 3, 2)
    expected = -np.ones((batch, capacity, 3, 2))
    for b in range(batch):
        for t in range(new):
            if 0 <= slots[b, t] < capacity:  # negative slots are dropped, never wrapped
                expected[b, slots[b, t]] = values[b, t]
    if heads_first:
        buffer = -jnp.ones((batch, 3, capacity, 2))
        new_tokens = jnp.asarray(values.transpose(0, 2, 1, 3))
        out = write_tokens(buffer, new_tokens, jnp.asarray(slots), axis=2)
        out = np.asarray(out).transpose(0, 2, 1, 3)
    else:
        buffer = -jnp.ones((batch, capacity, 3, 2))
        out = np.asarray(write_tokens(buffer, jnp.asarray(values), jnp.asarray(slots)))
    np.testing.assert_array_equal(out, expected)


def test_dynamic_update_slice_would_have_clamped():
    """Why write_tokens is a scatter: the slice version silently moves the write."""
    buffer = jnp.zeros((1, 4))
    clamped = jax.lax.dynamic_update_slice(buffer, jnp.ones((1, 2)), (0, 3))
    np.testing.assert_array_equal(clamped, [[0, 0, 1, 1]])  # slot 2 overwritten
    dropped = write_tokens(buffer[..., None], jnp.ones((1, 2, 1)), jnp.array([[3, 4]]))
    np.testing.assert_array_equal(dropped[..., 0], [[0, 0, 0, 1]])
