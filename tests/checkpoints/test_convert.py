"""Attention conversion: MHA -> GQA/MQA by mean-pooling each group's K/V heads,
MHA/GQA -> MLA by partial RoPE and a joint SVD of keys and values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.checkpoints.convert import FACTORS, to_gqa, to_mla
from tests.helpers import TOLERANCE, build, random_tokens, run_in_chunks, tiny_config


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
    # A fused tree (kvlab.fuse_projections) converts to the same parameters.
    fused = kvlab.fuse_projections(params)
    for convert in (lambda p: to_gqa(cfg, p, 2), lambda p: to_mla(cfg, p, 8, select="uniform")):
        want, got = convert(params)[1], convert(fused)[1]
        assert jax.tree.structure(got) == jax.tree.structure(want)
        assert all(
            np.array_equal(a, b)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        )


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


def latent_logits(cfg, params, tokens):
    """The converted model's logits: plain forward, and through a cache token by
    token absorbed and expanded."""
    results = [kvlab.Transformer(cfg.model).apply({"params": params}, tokens)[0]]
    for absorb in (True, False):
        model_cfg = cfg.model.copy_and_resolve_references()
        model_cfg.mla.absorb = absorb
        apply = jax.jit(kvlab.Transformer(model_cfg).apply)
        cache = kvlab.init_cache(model_cfg, cfg.cache, tokens.shape[0], tokens.shape[1])
        logits, _ = run_in_chunks(apply, params, cache, tokens, [1] * tokens.shape[1])
        results.append(logits)
    return results


def test_latent_conversion_at_full_rank_with_every_pair_kept_is_exact():
    kv_heads = 4  # MHA (the dropped-pairs test below converts GQA)
    cfg = tiny_config(num_kv_heads=kv_heads)
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 6))
    source, _ = apply({"params": params}, tokens)
    model = cfg.model
    full_rank = min(model.embed_dim, kv_heads * model.head_dim)
    converted_cfg, converted = to_mla(
        cfg, params, full_rank, rope_pairs=model.head_dim // 2, select="norm", tokens=tokens
    )
    mla = converted_cfg.model.mla
    assert converted_cfg.model.attention == "mla" and mla.rope_heads == kv_heads
    assert (mla.nope_dim, mla.rope_dim, mla.latent_norm) == (0, model.head_dim, False)
    for logits in latent_logits(converted_cfg, converted, tokens):
        np.testing.assert_allclose(logits, source, atol=TOLERANCE)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_latent_conversion_at_full_rank_unrotates_only_the_dropped_pairs():
    # A RoPE base that overflows float32 turns pair 0 alone (theta ** 0 = 1, inf ** -x = 0),
    # so this source's dropped pairs never rotate: keeping pair 0 must reproduce it
    # exactly, through the no-position keys' SVD path and the reordered queries.
    cfg = tiny_config(num_kv_heads=2, rope_theta=1e300)
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 6))
    source, _ = apply({"params": params}, tokens)
    full_rank = min(cfg.model.embed_dim, 2 * (2 * cfg.model.head_dim - 2))
    converted_cfg, converted = to_mla(cfg, params, full_rank, rope_pairs=1, select="high")
    assert converted_cfg.model.mla.rope_pairs == (((0,), (0,)),) * cfg.model.num_layers
    for logits in latent_logits(converted_cfg, converted, tokens):
        np.testing.assert_allclose(logits, source, atol=TOLERANCE)
    # The same conversion of a model whose every pair turns is not the source.
    plain = tiny_config(num_kv_heads=2)
    _, params, apply = build(plain)
    converted_cfg, converted = to_mla(plain, params, full_rank, rope_pairs=1, select="high")
    logits = kvlab.Transformer(converted_cfg.model).apply({"params": converted}, tokens)[0]
    assert np.abs(logits - apply({"params": params}, tokens)[0]).max() > 100 * TOLERANCE


def test_latent_conversion_is_the_best_factorization_of_its_rank():
    cfg = tiny_config(num_kv_heads=2)
    _, params, _ = build(cfg)
    attention = params["block_0"]["attention"]
    width = cfg.model.head_dim
    nope = np.setdiff1d(np.arange(width), [0, width // 2])  # select='high', one pair
    stacked = np.concatenate(
        [np.asarray(attention["key"]["kernel"])[:, k, nope] for k in range(2)]
        + [np.asarray(attention["value"]["kernel"]).reshape(cfg.model.embed_dim, -1)],
        axis=1,
    )
    tokens = random_tokens(cfg, (4, 16))
    # The block's attention input on the calibration tokens: [B T, D]
    _, variables = kvlab.Transformer(cfg.model).apply(
        {"params": params},
        tokens,
        capture_intermediates=lambda module, _: module.name == "attention_norm",
        mutable=["intermediates"],
    )
    inputs = np.asarray(variables["intermediates"]["block_0"]["attention_norm"]["__call__"][0])
    inputs = inputs.reshape(-1, cfg.model.embed_dim).astype(np.float64)

    def residual(rank, factor):
        """W - down @ up of block 0 (keys' no-position columns, then values)."""
        calibration = tokens if factor == "activations" else None
        _, converted = to_mla(
            cfg, params, rank, rope_pairs=1, select="high", tokens=calibration, factor=factor
        )
        layer = converted["block_0"]["attention"]
        down = np.asarray(layer["kv_down"]["kernel"], np.float64)  # [D, R]
        # Query heads 0 and 1 read KV head 0, heads 2 and 3 KV head 1.
        up = [np.asarray(layer[name])[:, ::2].reshape(rank, -1) for name in ("key_up", "value_up")]
        return np.concatenate([down @ up[0], down @ up[1]], axis=1) - stacked

    singular = np.linalg.svd(stacked, compute_uv=False)
    for rank in (4, 16, 32):
        # Eckart-Young: the residual is exactly the dropped singular values.
        np.testing.assert_allclose(
            np.linalg.norm(residual(rank, "weights")),
            np.sqrt(np.sum(singular[rank:] ** 2)),
            rtol=1e-4,
            atol=1e-5,
        )
    # Weighted by the calibration inputs, the error on them is the least of its rank
    # (below the weights' SVD), and nothing is lost at full rank.
    for rank in (4, 16):
        on_inputs = {f: np.linalg.norm(inputs @ residual(rank, f)) for f in FACTORS}
        assert on_inputs["activations"] < on_inputs["weights"]
    full_rank = min(cfg.model.embed_dim, stacked.shape[1])
    assert np.abs(residual(full_rank, "activations")).max() < 1e-5


def test_norm_selection_keeps_the_pairs_queries_and_keys_use():
    cfg = tiny_config(num_kv_heads=2)
    _, params, _ = build(cfg)
    width, half = cfg.model.head_dim, cfg.model.head_dim // 2
    rng = np.random.default_rng(0)
    live = rng.permuted(np.tile(np.arange(half), (cfg.model.num_layers, 2, 1)), axis=-1)[..., :2]

    def keep_live_pairs(path, leaf):
        names = [getattr(key, "key", None) for key in path]
        if "attention" not in names or not {"query", "key"} & set(names):
            return leaf
        layer = int(names[0].split("_")[1])
        heads = leaf.shape[1]
        mask = np.zeros((heads, width), bool)
        for n in range(heads):
            pairs = live[layer, n * 2 // heads]  # query head n reads KV head n // 2
            mask[n, pairs] = mask[n, pairs + half] = True
        return jnp.where(mask, leaf, 0)

    params = jax.tree_util.tree_map_with_path(keep_live_pairs, params)
    tokens = random_tokens(cfg, (2, 16))
    converted_cfg, _ = to_mla(cfg, params, 8, rope_pairs=2, select="norm", tokens=tokens)
    assert np.array_equal(converted_cfg.model.mla.rope_pairs, np.sort(live, axis=-1))


@pytest.mark.parametrize(
    "select,rope_pairs,expected",
    [("high", 2, (0, 1)), ("low", 2, (6, 7)), ("uniform", 4, (0, 2, 4, 6))],
)
def test_fixed_pair_selections(select, rope_pairs, expected):
    cfg = tiny_config(num_kv_heads=4)  # head_dim 16: pairs 0..7
    _, params, _ = build(cfg)
    converted_cfg, _ = to_mla(cfg, params, 8, rope_pairs=rope_pairs, select=select)
    assert converted_cfg.model.mla.rope_pairs == ((expected,) * 4,) * cfg.model.num_layers
    # The cache holds the latent and one RoPE key per source KV head.
    numbers = 8 + 4 * 2 * rope_pairs
    row = kvlab.cache.accounting.ROW_BYTES
    assert kvlab.cache_bytes(converted_cfg.model, cfg.cache, 1, 64) - row == (
        numbers * 4 * 64 * cfg.model.num_layers
    )


@pytest.mark.parametrize(
    "make,arguments,words",
    [
        (lambda: kvlab.load_config("configs/mla.py:tiny"), {}, "model.attention='mla'"),
        (lambda: tiny_config(qkv_bias=True), {}, "model.qkv_bias=True"),
        (lambda: tiny_config(qk_norm=True), {}, "model.qk_norm=True"),
        (lambda: tiny_config(topology="cla:2"), {}, "model.topology='cla:2'"),
        (tiny_config, dict(kv_rank=65), "kv_rank=65 exceeds the full rank 64"),
        (tiny_config, dict(kv_rank=0), "kv_rank=0 is below 1"),
        (tiny_config, dict(rope_pairs=9), "rope_pairs=9: a head of model.head_dim=16 has 8"),
        (tiny_config, dict(select="random"), "select='random' is not a choice"),
        (tiny_config, dict(select="norm"), "select='norm' with factor='weights' needs calibration"),
        (tiny_config, dict(factor="activations"), "factor='activations' needs calibration"),
        (tiny_config, dict(factor="svd"), "factor='svd' is not a choice"),
        (tiny_config, dict(select="high", tokens=np.zeros((1, 2), np.int32)), "tokens are for"),
    ],
)
def test_bad_latent_conversions_are_refused(make, arguments, words):
    arguments = {"kv_rank": 8, "select": "high", **arguments}
    with pytest.raises(ValueError, match=words):
        to_mla(make(), {}, **arguments)
