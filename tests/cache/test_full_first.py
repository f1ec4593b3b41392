"""A row's first positions kept in cache.dtype beside the codes (cache.<prefix>_full_first,
KVQuant's attention sink and IntactKV): read exactly, everything after them as before."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.quant import (
    FirstTokens,
    Layout,
    QuantizedTensor,
    Storage,
    init_layer,
    quantize_tokens,
)
from kvlab.eval import calibrate
from tests.cache.test_quant import chunkings
from tests.helpers import (
    LAYOUTS,
    ROOT,
    VARIANTS,
    build,
    random_tokens,
    same_logits,
    tiny_config,
)
from tests.test_export import assert_exports, inference

# KIVI's layout (keys per channel, 4 recent tokens in full precision), KVQuant's
# without its calibration (keys before RoPE with an outlier a token, nf levels), and
# KVQuant's (calibrated key ranges, fitted levels: `calibrated`).
STORAGES = {
    "kivi": dict(k_axis="channel", v_axis="token", group_size=4, residual=4),
    "nf before rope": dict(
        k_format="nf",
        v_format="nf",
        k_axis="token",
        v_axis="token",
        group_size=8,
        k_before_rope=True,
        k_outliers=1,
        v_outliers=1,
    ),  # fmt: skip
    "kvquant": dict(
        k_format="codebook",
        v_format="codebook",
        k_axis="calibrated",
        v_axis="token",
        group_size=8,
        symmetric=True,
        k_before_rope=True,
        k_outliers=1,
        v_outliers=1,
    ),  # fmt: skip
}


def cache_of(cfg, storage: str, bits: int, first: int, folder):
    """cfg's cache section at `bits` in `storage`, each tensor's first `first` positions
    kept; KVQuant's ranges and levels fitted on the model's read of random tokens."""
    cache = cfg.cache.copy_and_resolve_references()
    cache.update(STORAGES[storage], dtype="bfloat16", k_bits=bits, v_bits=bits)
    cache.update(k_full_first=first, v_full_first=first)
    if storage == "kvquant":
        _, params, _ = build(cfg)
        tokens = random_tokens(cfg, (2, 64), seed=9)
        cache.scales = str(folder / "scales.npz")
        calibrate.save_scales(cache.scales, calibrate.scales(cfg.model, cache, params, tokens))
        cache.codebooks = str(folder / "codebooks.npz")
        books = calibrate.codebooks(cfg.model, cache, params, tokens)
        calibrate.save_codebooks(cache.codebooks, books)
    return cache


def chunked_logits(cfg, cache_cfg, tokens, chunks, width: int):
    """Logits [B, T, V] of `tokens` fed in `chunks`, each padded to `width` tokens (one
    program for every chunking), through a cache of `cache_cfg`."""
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, tokens.shape[0], 24)
    out, start = [], 0
    for size in chunks:
        piece = np.zeros((tokens.shape[0], width), np.int32)
        piece[:, :size] = tokens[:, start : start + size]
        logits, cache = apply(
            {"params": params}, piece, cache=cache, num_tokens=jnp.full((2,), size)
        )
        out.append(np.asarray(logits[:, :size]))
        start += size
    cache.check()
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize(
    "storage, dtype", [("nf before rope", "bfloat16"), ("kvquant", "bfloat16"), ("kivi", "float32")]
)
def test_with_every_position_kept_two_bits_give_the_16_bit_caches_logits(storage, dtype, tmp_path):
    """Past the sequence's length every token is read from its copy in cache.dtype, as
    the 16-bit cache reads its tokens: the same logits in every chunking. (KIVI's ring
    in bfloat16 is not: attention rounds the probabilities of a bfloat16 block to
    bfloat16 against its softmax's peak, and a ring splits a chunk's tokens between
    softmaxes as the 16-bit cache does not, with or without first tokens.)"""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 12), seed=3)
    two_bits = cache_of(cfg, storage, 2, 24, tmp_path)
    plain = cfg.cache.copy_and_resolve_references()
    two_bits.dtype = plain.dtype = dtype
    without = cache_of(cfg, storage, 2, 0, tmp_path)
    for chunks in ([12], [5, 1, 6], [1] * 12):
        want = chunked_logits(cfg, plain, tokens, chunks, 12)
        got = chunked_logits(cfg, two_bits, tokens, chunks, 12)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        # ... where without them the codes lose much
        assert np.abs(chunked_logits(cfg, without, tokens, chunks, 12) - want).max() > 0.05


def layer_spec(axis: str, first: int) -> Storage:
    return Storage(
        bits=2, format="int", axis=axis, group_size=4, symmetric=False,
        scale_dtype="bfloat16", dtype="bfloat16", full_first=first,
    )  # fmt: skip


@settings(max_examples=4, deadline=None)  # each example compiles its layer step twice
@given(
    first=st.integers(1, 13),
    axes=st.sampled_from([("token", "token"), ("channel", "token"), ("token", "channel")]),
    residual_groups=st.integers(0, 1),
    chunks=chunkings(14, 6),
    seed=st.integers(0, 2**16),
)
def test_the_first_positions_read_back_exactly_and_the_others_as_without(
    first, axes, residual_groups, chunks, seed
):
    """A 2-bit layer fed bfloat16 keys and values in chunks: its payload and scales are
    the bytes the layer without first tokens stores; read, positions below N are the
    stored bfloat16 numbers (scores: the 16-bit cache's products) and the others what
    the layer without them reads."""
    length, width, heads, dim = 14, 6, 2, 8
    group = 4 if "channel" in axes else 1
    layout = Layout(length, residual_groups * 4, group)
    rng = np.random.default_rng(seed)
    # [B, KH, N + width, Wd] keys and values in the cache dtype; queries [B, KH, 3, Wd]
    k, v = (
        jnp.asarray(rng.standard_normal((2, heads, length + width, dim)), jnp.bfloat16)
        for _ in range(2)
    )
    q = jnp.asarray(rng.standard_normal((2, heads, 3, dim)), jnp.float32)

    @jax.jit
    def step(cache, k, v, size):  # one program for every chunk size
        placement = cache.place(k.shape[2], jnp.full((2,), size))
        layer = cache.layers[0]
        _, pending = layer.read((k, v), placement)
        layer = layer.write(pending, placement)
        return cache.replace(layers=(layer,), lengths=cache.lengths + size)

    def run(n: int):
        specs = tuple(layer_spec(axis, n) for axis in axes)
        cache = kvlab.Cache(
            layers=(init_layer(specs, layout, 2, [(heads, dim)] * 2),),
            lengths=jnp.zeros(2, jnp.int32),
            errors=jnp.zeros(2, jnp.int32),
            tensors=(),
            transforms=("none", "none"),
        )
        start = 0
        for size in chunks:
            piece = slice(start, start + width)
            cache = step(cache, k[:, :, piece], v[:, :, piece], size)
            start += size
        return cache.layers[0]

    kept, plain = run(first), run(0)
    settled = layout.settled(length)
    n = min(first, layout.payload_len)
    for index, (mine, theirs, stored) in enumerate(
        zip(kept.tensors, plain.tensors, (k, v), strict=True)
    ):
        for name in ("payload", "scale", "zero"):
            np.testing.assert_array_equal(getattr(mine, name), getattr(theirs, name), name)
        assert mine.first_tokens.shape == (2, heads, n, dim)
        reader = FirstTokens(mine.reader(), mine.first_tokens)
        read = np.asarray(reader.dequantize())[:, :, :settled]
        exact = np.asarray(stored[:, :, :n], np.float32)
        np.testing.assert_array_equal(read[:, :, :n], exact[:, :, : min(n, settled)])
        without = np.asarray(theirs.reader().dequantize())[:, :, :settled]
        np.testing.assert_array_equal(read[:, :, n:], without[:, :, n:])
        if index == 0:  # scores over the first keys: the 16-bit cache's products
            products = jnp.einsum(
                "BKMd,BKNd->BKMN", q.astype(jnp.bfloat16), stored[:, :, :n],
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            scores = np.asarray(reader.scores(q))
            np.testing.assert_array_equal(scores[..., :n], np.asarray(products))
            np.testing.assert_array_equal(
                scores[..., n:settled], np.asarray(theirs.reader().scores(q))[..., n:settled]
            )


@settings(max_examples=10, deadline=None)
@given(
    first=st.integers(1, 12),
    start=st.integers(0, 2),
    per_row=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_slice_reads_what_the_whole_reads_there(first, start, per_row, seed):
    """What attention streams (`chunk`: 8 stored tokens from a multiple of 4) scores,
    sums and dequantizes as the whole reader's same tokens, rows holding positions
    from a start per row or not (float32 first tokens: a slice widens them)."""
    rng = np.random.default_rng(seed)
    spec = dataclasses.replace(layer_spec("token", first), dtype="float32", group_size=4)
    x = jnp.asarray(rng.standard_normal((2, 2, 16, 8)), jnp.float32)
    payload, scale, zero = quantize_tokens(x, spec)
    rest = QuantizedTensor(payload, scale, zero, None, spec).reader()
    offset = jnp.asarray([0, 3]) if per_row else 0
    whole = FirstTokens(rest, x[:, :, :first], offset)
    piece = whole.chunk(4 * start, 8)
    q = jnp.asarray(rng.standard_normal((2, 2, 3, 8)), jnp.float32)
    w = jnp.asarray(rng.random((2, 2, 3, 8)), jnp.float32)
    part = slice(4 * start, 4 * start + 8)
    tolerance = dict(atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(piece.scores(q), whole.scores(q)[..., part], **tolerance)
    np.testing.assert_allclose(piece.dequantize(), whole.dequantize()[:, :, part], **tolerance)
    spread = jnp.zeros((2, 2, 3, 16)).at[..., part].set(w)
    np.testing.assert_allclose(piece.weighted_sum(w), whole.weighted_sum(spread), **tolerance)


@pytest.mark.parametrize("layout", ["paged", "native", "chunked"])
def test_it_is_the_dense_cache_in_pages_under_the_native_kernels_and_chunks(layout):
    """KIVI's 2-bit layout with each row's first 3 positions kept: in pages, the dense
    cache's logits; under the native kernels (which decline it), the reference's; a
    token at a time, the one prefill's. The bytes counted are the tree's."""
    cfg = VARIANTS["gqa"]()
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(STORAGES["kivi"], k_bits=2, v_bits=2, k_full_first=3, v_full_first=3)
    same_logits(cfg, cache_cfg, random_tokens(cfg, (2, 15), seed=4), LAYOUTS[layout])


@settings(max_examples=25, deadline=None)
@given(
    first=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    storage=st.sampled_from(["kivi", "nf before rope"]),
    bits=st.tuples(st.sampled_from([16, 8, 4, 2]), st.sampled_from([16, 4, 2])),
    kind=st.sampled_from(["dense", "paged"]),
    batch=st.integers(1, 3),
    max_len=st.integers(1, 40),
)
def test_the_bytes_counted_are_the_trees_and_the_first_tokens_by_hand(
    first, storage, bits, kind, batch, max_len
):
    """cache_bytes is tree_bytes, dense or paged; each quantized tensor's first
    positions add N x KH x Wd numbers of cache.dtype per row and layer, N at most the
    payload's rows (a 16-bit tensor keeps none)."""
    assume(storage == "kivi" or 16 not in bits)  # keys before RoPE, outliers: quantized
    cfg = tiny_config(num_kv_heads=2)
    cache = cfg.cache.copy_and_resolve_references()
    cache.update(STORAGES[storage], dtype="bfloat16", k_bits=bits[0], v_bits=bits[1], kind=kind)
    cache.update(page_size=8)
    plain = kvlab.cache_bytes(cfg.model, cache, batch, max_len)
    first = [n if b < 16 else 0 for n, b in zip(first, bits, strict=True)]
    cache.update(k_full_first=first[0], v_full_first=first[1])
    built = kvlab.init_cache(cfg.model, cache, batch, max_len)
    counted = kvlab.cache_bytes(cfg.model, cache, batch, max_len)
    assert counted == kvlab.tree_bytes(built)
    layout = kvlab.cache.quant.quantized_layout(cfg.model, cache, max_len)
    rows = 0 if layout is None else layout.payload_len
    m = cfg.model
    kept = sum(min(n, rows) for n in first) * m.num_kv_heads * m.head_dim * 2
    assert counted - plain == m.num_layers * batch * kept


def test_the_label_names_the_first_positions():
    cfg = tiny_config(num_kv_heads=2)
    cache = cfg.cache.copy_and_resolve_references()
    cache.update(STORAGES["kivi"], k_bits=2, v_bits=2, k_full_first=1, v_full_first=4)
    label = kvlab.cache.accounting.cache_label(cfg.model, cache)
    assert "k int per channel and the first 1 position in float32, " in label
    assert "v int per token and the first 4 positions in float32;" in label


def test_the_kernels_decline_it_and_a_step_exports_for_tpu_and_cuda():
    """KIVI's int codes, which the Pallas kernels read (tests/test_export.py's 'KIVI
    2-bit'), with the first position kept: the prefill and the decode step lowered
    for TPU and CUDA hold no kernel (they decline the layout, the reference reads it)."""
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:tiny")
    cfg.model.num_layers = 1
    cfg.cache.update(k_bits=2, v_bits=2, k_axis="channel", residual=32, group_size=8)
    cfg.cache.update(k_full_first=1, v_full_first=1)
    cfg.model.attention_impl = "pallas"
    program, arguments = inference(kvlab.validate_config(cfg), loops=False)
    assert_exports(program, arguments, kernel=False)


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(k_full_first=1), r"cache.k_full_first=1 cannot combine with cache.k_bits=16"),
        (dict(v_full_first=-1), r"cache.v_full_first=-1 is below 0"),
        (
            dict(k_bits=4, k_full_first=1, evict=dict(method="snapkv", ratio=0.5)),
            r"cache.k_full_first=1 cannot combine with cache.evict.method='snapkv', which "
            r"keeps tokens in slots that are not their positions .*: set cache.k_full_first=0",
        ),
        (
            dict(v_bits=4, v_full_first=2, kind="paged", prefix_caching=True),
            r"cache.v_full_first=2 cannot combine with cache.prefix_caching=True",
        ),
        (
            dict(k_bits=4, k_full_first=1, window=16),
            r"cache.k_full_first=1 cannot combine with model.sliding_window=16",
        ),
        (
            dict(
                k_bits=4,
                k_full_first=1,
                window=16,
                layer_types=("sliding", "full"),
                sliding_layers="as_full",
            ),
            r"cache.k_full_first=1 cannot combine with model.sliding_window=16",
        ),  # fmt: skip
        (dict(latent_full_first=1), r"cache.latent_full_first=1 applies to a tensor"),
    ],
)
def test_it_is_refused_where_the_first_positions_cannot_be_kept(fields, words):
    """Before anything is built: by the config check, the cache's factory and the count."""
    cfg = tiny_config(num_kv_heads=2)
    fields = dict(fields)
    cfg.model.sliding_window = fields.pop("window", 0)
    cfg.model.layer_types = fields.pop("layer_types", ())
    cfg.cache.evict.update(fields.pop("evict", {}))
    cfg.cache.update(fields)
    for check in (
        lambda: kvlab.validate_config(cfg),
        lambda: kvlab.init_cache(cfg.model, cfg.cache, 1, 32),
        lambda: kvlab.cache_bytes(cfg.model, cfg.cache, 1, 32),
    ):
        with pytest.raises(ValueError, match=words):
            check()


def test_a_hybrid_models_full_layers_keep_them_beside_plain_sliding_layers():
    """cache.sliding_layers='plain' keeps the sliding rings in cache.dtype: the first
    positions are the full layers' alone (counted so)."""
    cfg = tiny_config(num_kv_heads=2, sliding_window=8, layer_types=("sliding", "full"))
    cfg.cache.update(k_bits=4, v_bits=4, k_axis="token", k_full_first=2, v_full_first=2)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 1, 32)
    assert cache.layers[1].tensors[0].first_tokens.shape == (1, 2, 2, 16)
    assert kvlab.tree_bytes(cache) == kvlab.cache_bytes(cfg.model, cfg.cache, 1, 32)
