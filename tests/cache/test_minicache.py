"""MiniCache (model.topology='minicache:D', kvlab/cache/topology/minicache.py): from
layer D on, adjacent layers' keys and values are stored as one direction (SLERP of
the two) and each layer's magnitude, with the least mergeable tokens kept whole."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.dense import place_after
from kvlab.cache.topology import cache_layers, joint_layers
from kvlab.cache.topology.minicache import MiniCache
from tests.helpers import VARIANTS, build, last_logits, random_tokens
from tests.test_export import assert_exports, assert_round_trips, inference


def merged(topology: str, num_layers: int = 4):
    cfg = VARIANTS["gqa"]()
    cfg.model.num_layers, cfg.model.topology = num_layers, topology
    return cfg


def slerp_reference(x0, x1, t):
    """SLERP's definition in float64: the unit vectors' great-circle point at t."""
    u0 = x0 / np.linalg.norm(x0, axis=-1, keepdims=True)
    u1 = x1 / np.linalg.norm(x1, axis=-1, keepdims=True)
    angle = np.arccos(np.clip(np.sum(u0 * u1, -1, keepdims=True), -1, 1))
    return (np.sin((1 - t) * angle) * u0 + np.sin(t * angle) * u1) / np.sin(angle), angle[..., 0]


def test_the_pairs_from_layer_d_share_a_cache_layer_and_every_layer_keeps_its_projections():
    assert cache_layers(merged("minicache:1", 6).model) == (0, 1, 1, 2, 2, 3)
    assert joint_layers(merged("minicache:1", 6).model) == (1, 2)  # 5 alone: layerwise
    assert cache_layers(merged("minicache", 6).model) == (0, 1, 2, 3, 3, 4)  # from half
    cfg = merged("minicache:2")
    params = kvlab.init_params(cfg.model, __import__("jax").random.key(0))
    assert all({"key", "value"} <= params[f"block_{i}"]["attention"].keys() for i in range(4))
    plain = merged("layerwise")
    tokens = random_tokens(cfg, (2, 12), 1)
    # without a cache nothing is merged: the model is the layerwise one
    np.testing.assert_array_equal(
        build(cfg)[2]({"params": build(plain)[1]}, tokens)[0],
        build(plain)[2]({"params": build(plain)[1]}, tokens)[0],
    )


def write_steps(layer, pairs, chunks):
    """`layer` with the pairs' tokens (each [B, K, T, W], the two layers' keys and
    values) written chunk by chunk, as a run's last layer writes them."""
    lengths, start = jnp.zeros((pairs[0][0].shape[0],), jnp.int32), 0
    for size in chunks:
        placement = place_after(lengths, layer.capacity, size, jnp.full_like(lengths, size))
        step = tuple(tuple(x[:, :, start : start + size] for x in member) for member in pairs)
        layer = layer.write(step, placement)
        lengths, start = lengths + size, start + size
    return layer, place_after(lengths, layer.capacity, 1, jnp.ones_like(lengths))


@settings(max_examples=15, deadline=None)
@given(
    t=st.sampled_from([0.0, 0.3, 0.6, 1.0]),
    keep=st.integers(0, 6),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_a_layer_reads_the_slerp_direction_at_its_magnitude_and_its_kept_tokens_whole(
    t, keep, chunks, seed
):
    """Written in any chunks, each member reads every token as SLERP(u0, u1; t) x its
    own |x| (the definition, float64), except the `keep` tokens of largest mean
    angle over heads, keys and values (the same whatever the chunking), which it
    reads exactly; its own magnitude and direction whole when t puts the direction
    on its side (t = 0: the first layer's; 1: the second's)."""
    rng = np.random.default_rng(seed)
    n = sum(chunks)
    pairs = [
        tuple(rng.normal(size=(2, 2, n, 16)).astype(np.float32) for _ in "kv") for _ in range(2)
    ]
    cfg = merged(f"minicache:2,t={t},keep={keep / 16}")
    layer = MiniCache().build(cfg.model.topology.partition(":")[2], cfg.model, cfg.cache, 2, 16)
    assert layer.kept_positions.shape == (2, keep)
    layer, placement = write_steps(layer, [tuple(map(jnp.asarray, p)) for p in pairs], chunks)
    angles = []
    for tensor in range(2):
        x0, x1 = (np.float64(pairs[m][tensor]) for m in range(2))
        if 0 < t < 1:
            direction, angle = slerp_reference(x0, x1, t)
        else:
            direction = (x1 if t else x0) / np.linalg.norm(x1 if t else x0, axis=-1, keepdims=True)
            angle = slerp_reference(x0, x1, 0.5)[1]
        angles.append(angle)
        for member in range(2):
            regions, _ = layer.read((x0[:, :, :1],) * 2, placement, member)
            read = np.asarray(regions[0][0][tensor])[:, :, :n]
            mine = (x0, x1)[member]
            want = direction * np.linalg.norm(mine, axis=-1, keepdims=True)
            np.testing.assert_allclose(read, want, atol=2e-5 * np.abs(mine).max(), rtol=1e-4)
            if (t, member) in ((0.0, 0), (1.0, 1)):
                np.testing.assert_allclose(read, mine, atol=1e-5, rtol=1e-5)
    distance = np.mean(np.stack(angles), axis=(0, 2)) / np.pi  # [B, n]
    positions = np.asarray(layer.kept_positions)
    for row in range(2):
        chosen = positions[row][positions[row] >= 0]
        assert len(chosen) == min(keep, n)
        assert sorted(chosen) == sorted(np.argsort(-distance[row], kind="stable")[: len(chosen)])
    for member in range(2):
        regions, _ = layer.read((pairs[0][0][:, :, :1],) * 2, placement, member)
        if keep:  # the kept tokens are masked out of the merged block and read whole
            (kept_k, kept_v), mask = regions[1]
            merged_mask = np.asarray(regions[0][1])[:, 0]
            for row in range(2):
                for slot, position in enumerate(positions[row]):
                    if position < 0:
                        continue
                    assert not merged_mask[row, position]
                    np.testing.assert_array_equal(
                        kept_k[row, :, slot], pairs[member][0][row, :, position]
                    )
                    np.testing.assert_array_equal(
                        kept_v[row, :, slot], pairs[member][1][row, :, position]
                    )


def test_keeping_every_token_is_the_layerwise_cache():
    """With room to keep every token whole, a prefill and three decode steps give the
    layerwise cache's logits; merged, they do not. Bytes counted are the tree's."""
    tokens = random_tokens(VARIANTS["gqa"](), (2, 15), seed=4)
    plain = merged("layerwise")
    want = last_logits(plain, plain.cache, tokens, 12)
    whole = merged("minicache:1,keep=0.5")  # 16 of the capacity of 32
    np.testing.assert_allclose(last_logits(whole, whole.cache, tokens, 12), want, atol=2e-5)
    lossy = merged("minicache:1,keep=0")
    assert np.abs(last_logits(lossy, lossy.cache, tokens, 12) - want).max() > 1e-2


def test_it_holds_a_direction_and_two_magnitudes_per_token_and_head():
    """A merged pair holds, per row, K x S x (W + 2) numbers per tensor and its kept
    tokens (2 layers x K x R x W per tensor, an int32 position and a float32
    distance each): about half the pair's layerwise bytes."""
    cfg = merged("minicache:2,keep=0.125")
    m, batch, length = cfg.model, 3, 64
    element = 4  # float32
    layer = m.num_kv_heads * length * m.head_dim * 2 * element  # k and v, one layer
    kept = math.ceil(0.125 * length)
    pair = 2 * m.num_kv_heads * (length * (m.head_dim + 2) + 2 * kept * m.head_dim) * element
    pair += kept * 8
    rows = 8  # a length and error flags per row
    assert kvlab.cache_bytes(m, cfg.cache, batch, length) == batch * (2 * layer + pair + rows)
    cache = kvlab.init_cache(m, cfg.cache, batch, length)
    assert kvlab.tree_bytes(cache) == kvlab.cache_bytes(m, cfg.cache, batch, length)
    assert pair < 0.7 * 2 * layer


def test_a_cache_it_cannot_merge_is_refused_naming_the_field():
    cfg = merged("minicache:2")

    def refused(match, model=None, **cache):
        cache_cfg = cfg.cache.copy_and_resolve_references()
        evict = cache.pop("evict", {})
        cache_cfg.update(cache)
        cache_cfg.evict.update(evict)
        model_cfg = cfg.model.copy_and_resolve_references()
        model_cfg.update(model or {})
        with pytest.raises(ValueError, match=match):
            kvlab.init_cache(model_cfg, cache_cfg, 1, 32)

    refused(r"cache.kind='paged' under model.topology='minicache:2'", kind="paged")
    refused(r"cache.k_axis='channel' .*MiniCache quantizes each token's numbers", k_bits=8)
    token = dict(k_axis="token", v_axis="token")
    refused(r"cache.v_rank=8 .*not in a basis", v_bits=8, v_rank=8, bases="b.npz", **token)
    refused(r"cache.k_before_rope=True .*after RoPE", k_bits=4, k_before_rope=True, **token)
    refused(r"cache.v_outliers=1", v_bits=4, v_outliers=1, **token)
    refused(r"cache.group_size=5 ", k_bits=4, group_size=5, **token)
    refused(r"cache.v_transform='hadamard'", v_transform="hadamard")
    refused(r"cache.evict.method='snapkv'", evict={"method": "snapkv", "ratio": 0.5})
    for topology, match in (
        ("minicache:0", r"1 <= D <= 2"),
        ("minicache:3", r"1 <= D <= 2"),
        ("minicache:1,t=1.5", r"t=1.5 is not in \[0, 1\]"),
        ("minicache:1,keep=1", r"keep=1.0 is not in \[0, 1\)"),
        ("minicache:1,share=2", r"\['share'\] are not options"),
        ("minicache:x", r"is not D\[,t=T\]\[,keep=K\]"),
    ):
        with pytest.raises(ValueError, match=match):
            kvlab.config.validate_model_config({**cfg.model.to_dict(), "topology": topology})
    # a cache of as many layers built for another topology is not one for the merged model
    five = merged("minicache:1", 5)
    shared = kvlab.init_cache(merged("cla:2", 5).model, cfg.cache, 1, 32)
    with pytest.raises(ValueError, match="cache layer 1 is not one the model's topology"):
        build(five)[2]({"params": build(five)[1]}, random_tokens(cfg, (1, 4)), cache=shared)


def test_quantized_directions_are_within_half_a_step_and_counted():
    """With cache.k_bits / v_bits below 16 each merged direction is quantized per token
    in groups of cache.group_size: written the same tokens, every direction read
    back is within half its group's step, (max - min) / (2^b - 1), of the 16-bit
    layer's, the magnitudes and kept tokens are the same, and the bytes are the
    tree's: packed codes and a float32 scale and zero point a group, beside the
    magnitudes and kept tokens in cache.dtype."""
    cfg = merged("minicache:2,keep=0.125")
    rng = np.random.default_rng(7)
    pairs = [tuple(jnp.asarray(rng.normal(size=(2, 2, 12, 16)), jnp.float32) for _ in "kv")] * 2
    pairs[1] = tuple(x + jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in pairs[0])

    def coded(bits):
        cache = cfg.cache.copy_and_resolve_references()
        cache.update(k_bits=bits, v_bits=bits, k_axis="token", v_axis="token")
        cache.update(group_size=8, scale_dtype="float32")
        return cache

    layers = {}
    for bits in (16, 4, 2):
        cache_cfg = cfg.cache if bits == 16 else coded(bits)
        layer = MiniCache().build("2,keep=0.125", cfg.model, cache_cfg, 2, 16)
        layers[bits], _ = write_steps(layer, pairs, [5, 7])
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 16)
        assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, 16) == kvlab.tree_bytes(cache)
    exact = layers[16]
    full = kvlab.tree_bytes(exact.directions)  # k, v: 2 rows x 2 KV heads x 16 slots x 16 float32
    for tensor in range(2):
        directions = np.asarray(exact.directions[tensor].payload)[:, :, :12]
        groups = directions.reshape(*directions.shape[:-1], 2, 8)
        span = groups.max(-1, keepdims=True) - groups.min(-1, keepdims=True)
        for bits in (4, 2):
            layer = layers[bits]
            read = np.asarray(layer.directions[tensor].dequantize())[:, :, :12]
            error = np.abs(read.reshape(groups.shape) - groups)
            assert (error <= span / (2**bits - 1) / 2 * (1 + 1e-5) + 1e-6).all()
            assert error.max() > 0
            np.testing.assert_array_equal(layer.norms[tensor], exact.norms[tensor])
            np.testing.assert_array_equal(layer.kept[tensor], exact.kept[tensor])
            # per token and head: 16 numbers at b bits and 2 groups' float32 scale and zero
            assert kvlab.tree_bytes(layer.directions) == full // 64 * (2 * bits + 16)


def test_a_merged_cache_exports_for_tpu_and_cuda_and_round_trips():
    """16-bit directions, and (round trip) 4-bit ones beside fp8 values."""
    cfg = merged("minicache:2")
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)
    quantized = merged("minicache:2,keep=0.1")
    quantized.cache.update(k_bits=4, v_bits=8, v_format="fp8", k_axis="token", v_axis="token")
    assert_round_trips(quantized)
