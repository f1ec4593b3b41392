"""Attention conversion: MHA -> GQA/MQA by mean-pooling each group's K/V heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.convert import to_gqa
from tests.helpers import TOLERANCE, build, random_tokens, tiny_config


def with_equal_heads_in_groups(params, group: int):
    """The same params with every KV head replaced by the first head of its group."""

    def copy(path, leaf):
        names = [getattr(key, "key", None) for key in path]
        if "attention" in names and {"key", "value"} & set(names):
            first = np.asarray(leaf)[..., ::group, :]
            return jnp.asarray(np.repeat(first, group, axis=-2))
        return leaf

    return jax.tree_util.tree_map_with_path(copy, params)


@pytest.mark.parametrize("target", [2, 1])
def test_pooling_is_exact_when_each_groups_heads_are_equal(target):
    cfg = tiny_config(num_kv_heads=4)
    _, params, apply = build(cfg)
    params = with_equal_heads_in_groups(params, 4 // target)
    tokens = random_tokens(cfg, (2, 12))
    source, _ = apply({"params": params}, tokens)
    converted_cfg, converted = to_gqa(cfg, params, target)
    assert converted_cfg.model.num_kv_heads == target and cfg.model.num_kv_heads == 4
    key = converted["block_0"]["attention"]["key"]["kernel"]
    assert key.shape == (cfg.model.embed_dim, target, cfg.model.head_dim)
    model = kvlab.Transformer(converted_cfg.model)
    logits, _ = model.apply({"params": converted}, tokens)
    np.testing.assert_allclose(logits, source, atol=TOLERANCE)
    # The converted model caches 4 / target times less.
    before = kvlab.cache_bytes(cfg.model, cfg.cache, 1, 64)
    after = kvlab.cache_bytes(converted_cfg.model, converted_cfg.cache, 1, 64)
    row = kvlab.cache.accounting.ROW_BYTES
    assert (before - row) == (4 // target) * (after - row)


def test_pooling_takes_the_mean_of_each_group():
    cfg = tiny_config(num_kv_heads=4)
    _, params, _ = build(cfg)
    _, converted = to_gqa(cfg, params, 2)
    value = np.asarray(params["block_1"]["attention"]["value"]["kernel"])
    np.testing.assert_allclose(
        converted["block_1"]["attention"]["value"]["kernel"][:, 1],
        (value[:, 2] + value[:, 3]) / 2,
        rtol=1e-6,
    )
    query = params["block_1"]["attention"]["query"]["kernel"]
    assert converted["block_1"]["attention"]["query"]["kernel"] is query


@pytest.mark.parametrize(
    "make,target,words",
    [
        (lambda: tiny_config(num_kv_heads=4), 3, "does not divide"),
        (lambda: tiny_config(num_kv_heads=2), 0, "num_kv_heads=0 is below 1"),
        (lambda: kvlab.load_config("configs/mla.py:tiny"), 1, "model.attention='mla'"),
    ],
)
def test_bad_conversions_are_refused(make, target, words):
    cfg = make()
    with pytest.raises(ValueError, match=words):
        to_gqa(cfg, {}, target)
