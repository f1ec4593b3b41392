import jax.numpy as jnp
import numpy as np

import kvlab
from kvlab.cache.placement import causal_mask, place_without_cache
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
    np.testing.assert_array_equal(
        placement.cached_mask[:, 0], [[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        placement.fresh_mask[0],
        [[1, 0, 0], [1, 1, 0], [1, 1, 0]],  # token 2 is padding
    )
    np.testing.assert_array_equal(placement.fresh_mask[1], np.tril(np.ones((3, 3))))


def test_plain_forward_is_causal_from_zero():
    placement = place_without_cache(2, 4)
    np.testing.assert_array_equal(placement.positions, [[0, 1, 2, 3]] * 2)
    np.testing.assert_array_equal(placement.fresh_mask[1], np.tril(np.ones((4, 4))))
    assert placement.slots is None and placement.cached_mask is None
