"""The 'codebook' storage format (kvlab/cache/formats/codebook.py): levels per layer
fitted offline by Lloyd-Max (kvlab.eval.calibrate.codebooks) to the numbers the
cache stores, read from cache.codebooks."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.quant import dequantize_tokens, quantize_tokens
from kvlab.eval import calibrate
from tests.helpers import VARIANTS, build, random_tokens
from tests.test_export import assert_exports, assert_round_trips, inference

FOUR_BIT = dict(k_bits=4, v_bits=4, k_axis="token", v_axis="token", group_size=8)


def calibrated(cfg, tmp_path, fmt="codebook", seed=0, **storage):
    """cfg's cache section storing k and v in `fmt`, its codebooks calibrated on
    random tokens and saved under tmp_path."""
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(FOUR_BIT, k_format=fmt, v_format=fmt, **storage)
    _, params, _ = build(cfg)
    books = calibrate.codebooks(cfg.model, cache_cfg, params, random_tokens(cfg, (4, 96), seed))
    path = str(tmp_path / "codebooks.npz")
    calibrate.save_codebooks(path, books)
    cache_cfg.codebooks = path
    return cache_cfg, books


@settings(max_examples=10, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    scale=st.floats(0.1, 10.0),
    heavy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lloyd_max_levels_lose_less_than_the_grid_they_start_from(bits, scale, heavy, seed):
    """On numbers in [-1, 1] (Gaussian or heavy-tailed, squashed), the fitted levels
    are ascending and distinct, and their squared error is at most the normal-float
    grid's, from which Lloyd's algorithm starts (each step lowers it)."""
    rng = np.random.default_rng(seed)
    raw = rng.standard_t(2, 4096) if heavy else rng.standard_normal(4096)
    values = np.tanh(raw * scale / 3)
    levels = calibrate.lloyd_max(values, bits)
    grid = kvlab.cache.formats.normal_float.grid(bits)

    def error(table):
        nearest = table[np.abs(values[:, None] - table[None]).argmin(-1)]
        return ((nearest - values) ** 2).mean()

    assert len(levels) == 2**bits and (np.diff(levels) > 0).all()
    assert error(levels) <= error(grid) + 1e-12


def test_calibrated_levels_lose_less_than_nf_and_int_codes_at_equal_bytes(tmp_path):
    """Keys and values of held-out text, 4 and 2 bits, one scale per 8 numbers: the
    layer's fitted levels restore them with less squared error than the
    normal-float grid and symmetric int codes, which store the same bytes."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    held_out = kvlab.init_cache(cfg.model, cfg.cache, 2, 64)
    _, held_out = apply({"params": params}, random_tokens(cfg, (2, 64), seed=9), cache=held_out)
    for bits in (4, 2):
        cache_cfg, _ = calibrated(cfg, tmp_path, k_bits=bits, v_bits=bits)
        sizes = set()
        for layer in range(cfg.model.num_layers):
            codebook = kvlab.cache.quant.storages(cfg.model, cache_cfg, layer)
            for index, spec in enumerate(codebook):
                x = jnp.asarray(held_out.layers[layer].tensors[index], jnp.float32)
                errors = {}
                for fmt in ("codebook", "nf", "int"):
                    s = spec
                    if fmt != "codebook":
                        s = dataclasses.replace(spec, format=fmt, symmetric=True, table=())
                    restored = dequantize_tokens(*quantize_tokens(x, s), s)
                    errors[fmt] = float(jnp.mean((restored - x) ** 2))
                assert errors["codebook"] < errors["nf"], (bits, layer, index, errors)
                assert errors["codebook"] < errors["int"], (bits, layer, index, errors)
        for fmt in ("codebook", "nf", "int"):
            path = cache_cfg.codebooks if fmt == "codebook" else ""
            cache_cfg.update(k_format=fmt, v_format=fmt, symmetric=True, codebooks=path)
            sizes.add(kvlab.cache_bytes(cfg.model, cache_cfg, 2, 64))
        assert len(sizes) == 1


def test_calibrating_a_cache_that_evicts_and_names_its_codebooks_gives_the_same_levels(
    tmp_path,
):
    """The levels come from the tensors as stored, whole: a cache section that already
    names its codebooks, quantizes its values as ints and compresses after its
    prefill calibrates to the same keys' levels."""
    cfg = VARIANTS["gqa"]()
    cache_cfg, books = calibrated(cfg, tmp_path)
    cache_cfg.update(v_format="int")
    cache_cfg.evict.update(method="snapkv", when="after_prefill", ratio=0.5, headroom=4)
    _, params, _ = build(cfg)
    again = calibrate.codebooks(cfg.model, cache_cfg, params, random_tokens(cfg, (4, 96), 0))
    assert set(again) == {"k"}
    np.testing.assert_array_equal(again["k"], books["k"])


def test_each_layer_reads_its_own_levels(tmp_path):
    """Every cache layer's storage carries its row of the file; the layers differ."""
    cfg = VARIANTS["gqa"]()
    cache_cfg, books = calibrated(cfg, tmp_path)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, 32)
    for layer, stored in enumerate(cache.layers):
        for tensor, prefix in zip(stored.tensors, ("k", "v"), strict=True):
            np.testing.assert_allclose(tensor.spec.table, books[prefix][layer], rtol=0, atol=0)
    assert cache.layers[0].tensors[0].spec.table != cache.layers[1].tensors[0].spec.table


@pytest.mark.parametrize(
    "storage",
    [
        {"kind": "paged", "page_size": 8},
        {"evict": {"method": "snapkv", "budget": 24, "recent": 2}},
        {"attention_impl": "native"},
    ],
    ids=["paged", "evicting", "native"],
)
def test_it_is_the_dense_cache_in_pages_under_eviction_and_the_kernels(tmp_path, storage):
    """A prefill and three decode steps through the codebook cache: in pages, the
    dense cache's logits; evicting with a budget that holds every token, the
    dense cache's too; under the native kernels (which decline codes they do not
    dequantize), the reference's. The bytes counted are the tree's."""
    cfg = VARIANTS["gqa"]()
    cache_cfg, _ = calibrated(cfg, tmp_path)
    tokens = random_tokens(cfg, (2, 15), seed=4)

    def run(cfg, cache_cfg):
        _, params, apply = build(cfg)
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 32)
        logits, cache = apply({"params": params}, tokens[:, :12], cache=cache)
        out = [logits[:, -1]]
        for t in range(12, 15):
            logits, cache = apply({"params": params}, tokens[:, t : t + 1], cache=cache)
            out.append(logits[:, -1])
        assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, 32) == kvlab.tree_bytes(cache)
        return np.stack(out)

    want = run(cfg, cache_cfg)
    other_cfg, other_cache = (
        cfg.copy_and_resolve_references(),
        cache_cfg.copy_and_resolve_references(),
    )
    if "attention_impl" in storage:
        other_cfg.model.attention_impl = storage["attention_impl"]
    elif "evict" in storage:
        other_cache.evict.update(storage["evict"])
    else:
        other_cache.update(storage)
    np.testing.assert_allclose(run(other_cfg, other_cache), want, atol=2e-5, rtol=0)


def test_without_usable_levels_the_cache_is_refused_naming_the_field(tmp_path):
    cfg = VARIANTS["gqa"]()
    cache_cfg, books = calibrated(cfg, tmp_path)

    def refused(match, **fields):
        broken = cache_cfg.copy_and_resolve_references()
        broken.update(fields)
        with pytest.raises(ValueError, match=match):
            kvlab.init_cache(cfg.model, broken, 1, 32)

    refused(r"cache.codebooks, which is empty", codebooks="")
    refused(r"cannot be read", codebooks=str(tmp_path / "missing.npz"))
    refused(r"not finite \[2 cache layers, 4 levels\] for cache.k_bits=2", k_bits=2)
    only_v = str(tmp_path / "only_v.npz")
    calibrate.save_codebooks(only_v, {"v": books["v"]})
    refused(r"holds no levels for 'k'", codebooks=only_v)
    repeated = str(tmp_path / "repeated.npz")
    calibrate.save_codebooks(repeated, {"k": np.zeros_like(books["k"]), "v": books["v"]})
    refused(r"not distinct numbers in \[-1, 1\]", codebooks=repeated)
    with pytest.raises(ValueError, match="cache.codebooks=.* is read by no tensor"):
        refused_fields = {**cache_cfg.to_dict(), "k_format": "int", "v_format": "int"}
        kvlab.config.validate_cache_config(refused_fields, cfg.model)
    with pytest.raises(ValueError, match="cache.codebooks"):
        kvlab.config.validate_cache_config({**cache_cfg.to_dict(), "codebooks": 3}, cfg.model)


def test_calibrating_nothing_is_refused():
    cfg = VARIANTS["gqa"]()
    _, params, _ = build(cfg)
    with pytest.raises(ValueError, match="format='codebook'"):
        calibrate.codebooks(cfg.model, cfg.cache, params, random_tokens(cfg, (1, 16)))


def test_a_latent_model_calibrates_and_runs(tmp_path):
    """MLA's latent and RoPE key in codebook codes (their own arrays in the file)."""
    cfg = VARIANTS["mla_absorbed"]()
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(
        latent_bits=4, rope_bits=4, latent_format="codebook", rope_format="codebook",
        latent_axis="token", rope_axis="token", group_size=8,
    )  # fmt: skip
    _, params, apply = build(cfg)
    books = calibrate.codebooks(cfg.model, cache_cfg, params, random_tokens(cfg, (2, 64)))
    assert set(books) == {"latent", "rope"}
    path = str(tmp_path / "mla.npz")
    calibrate.save_codebooks(path, books)
    cache_cfg.codebooks = path
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, 32)
    logits, _ = apply({"params": params}, random_tokens(cfg, (1, 10), seed=2), cache=cache)
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_codebook_cache_exports_for_tpu_and_cuda(tmp_path, impl):
    """The prefill and the decode step over codebook codes, lowered for TPU and CUDA
    from this host: no CPU-only call, and no Pallas kernel (they decline the codes)."""
    cfg = VARIANTS["gqa"]()
    cfg.cache, _ = calibrated(cfg, tmp_path)
    cfg.model.attention_impl = impl
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)


@pytest.mark.parametrize("groups", [1, 4])
def test_an_exported_step_over_codebook_codes_round_trips(tmp_path, groups):
    """Each layer's levels (Storage.table; per channel group: nested) survive
    jax.export's serialization."""
    cfg = VARIANTS["gqa"]()
    cfg.cache, books = calibrated(cfg, tmp_path)
    if groups > 1:
        cfg.cache.codebooks = str(tmp_path / "grouped.npz")
        calibrate.save_codebooks(cfg.cache.codebooks, tiled(books, groups))
    assert_round_trips(cfg)


def tiled(books: dict, groups: int) -> dict:
    """Each layer's levels repeated for `groups` channel groups: [layers, G, 2^bits]."""
    return {k: np.repeat(v[:, None], groups, axis=1) for k, v in books.items()}


@pytest.mark.parametrize(
    "storage",
    [
        dict(k_bits=4, v_bits=4),
        dict(k_bits=2, v_bits=2, k_axis="channel"),  # read per code position elsewhere
        dict(k_bits=4, v_bits=4, kind="paged", page_size=8),
    ],
    ids=["token-4", "channel-2", "paged"],
)
def test_levels_per_channel_group_alike_read_as_the_layers_levels(tmp_path, storage):
    """Levels per channel group that are each the layer's levels code and read
    every number as the layer's levels do: the same logits, through a prefill and
    decode steps, in scales per token or per channel and in pages."""
    cfg = VARIANTS["gqa"]()
    cache_cfg, books = calibrated(cfg, tmp_path, **storage)
    grouped_cfg = cache_cfg.copy_and_resolve_references()
    grouped_cfg.codebooks = str(tmp_path / "grouped.npz")
    calibrate.save_codebooks(grouped_cfg.codebooks, tiled(books, 4))
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 20), seed=3)

    def logits(cache_cfg):
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 32)
        out, cache = apply({"params": params}, tokens[:, :16], cache=cache)
        outs = [out]
        for t in range(16, 20):
            out, cache = apply({"params": params}, tokens[:, t : t + 1], cache=cache)
            outs.append(out)
        assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, 32) == kvlab.tree_bytes(cache)
        return np.concatenate(outs, axis=1)

    assert kvlab.cache.quant.storages(cfg.model, grouped_cfg, 0)[0].channel_tables == 4
    np.testing.assert_array_equal(logits(grouped_cfg), logits(cache_cfg))


@settings(max_examples=8, deadline=None)
@given(
    axis=st.sampled_from(["token", "channel"]),
    groups=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**16),
)
def test_each_channel_group_codes_in_its_own_levels(axis, groups, seed):
    """Numbers whose channel groups differ in shape (Gaussian groups, groups of two
    tight clusters): each number is read back as a level of its own group's
    codebook times its scale, and at 2 bits levels fitted per group lose less
    (relative to the scales, what Lloyd-Max fits) than one codebook fitted to all
    of them (four levels cannot serve both shapes)."""
    rng = np.random.default_rng(seed)
    width, run, bits = 16, 16 // groups, 2
    x = rng.standard_normal((2, 2, 256, width))
    for g in range(1, groups, 2):  # odd groups: two clusters at +-(g + 1)
        cols = slice(g * run, (g + 1) * run)
        x[..., cols] = np.sign(x[..., cols]) * (g + 1) + 0.01 * rng.standard_normal(run)
    x = jnp.asarray(x, jnp.float32)
    base = kvlab.cache.quant.Storage(
        bits=bits, format="codebook", axis=axis, group_size=8, symmetric=True,
        scale_dtype="float32", dtype="float32",
    )  # fmt: skip
    grouped, ax = kvlab.cache.quant.storage.by_groups(np.asarray(x), base)
    top = np.abs(grouped).max(axis=ax, keepdims=True)
    scaled = (grouped / top).reshape(x.shape)
    runs = [scaled[..., g * run : (g + 1) * run].ravel() for g in range(groups)]
    per_group = tuple(tuple(float(v) for v in calibrate.lloyd_max(r, bits)) for r in runs)
    shared = tuple(float(v) for v in calibrate.lloyd_max(scaled.ravel(), bits))
    errors, levels = {}, {}
    for name, table in (("groups", per_group), ("shared", shared)):
        spec = dataclasses.replace(base, table=table)
        restored = np.asarray(dequantize_tokens(*quantize_tokens(x, spec), spec))
        restored, _ = kvlab.cache.quant.storage.by_groups(restored, spec)
        levels[name] = (restored / top).reshape(x.shape)
        errors[name] = float(np.mean((levels[name] - scaled) ** 2))
    for g, table in enumerate(per_group):
        found = levels["groups"][..., g * run : (g + 1) * run].reshape(-1, 1)
        assert np.abs(found - np.asarray(table)[None]).min(-1).max() < 1e-5, g
    assert errors["groups"] < errors["shared"], errors


def test_calibrating_per_channel_group_and_refusals(tmp_path):
    """calibrate.codebooks(channel_groups=G) fits [layers, G, 2^bits], groups that
    differ; G that does not divide the coded channels is refused when fitted and
    when a cache reads such a file."""
    cfg = VARIANTS["gqa"]()
    cache_cfg, _ = calibrated(cfg, tmp_path)
    _, params, _ = build(cfg)
    tokens = random_tokens(cfg, (4, 96), 0)
    books = calibrate.codebooks(cfg.model, cache_cfg, params, tokens, channel_groups=4)
    layers = cfg.model.num_layers
    assert {k: v.shape for k, v in books.items()} == {"k": (layers, 4, 16), "v": (layers, 4, 16)}
    assert not np.allclose(books["k"][:, 0], books["k"][:, 1])
    with pytest.raises(ValueError, match="channel_groups=3 does not split"):
        calibrate.codebooks(cfg.model, cache_cfg, params, tokens, channel_groups=3)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"channel_groups={bad!r} is no positive integer"):
            calibrate.codebooks(cfg.model, cache_cfg, params, tokens, channel_groups=bad)
    odd = str(tmp_path / "odd.npz")
    calibrate.save_codebooks(odd, tiled({k: v[:, 0] for k, v in books.items()}, 3))
    cache_cfg.codebooks = odd
    with pytest.raises(ValueError, match="cache.codebooks=.*3 channel groups, which do not split"):
        kvlab.init_cache(cfg.model, cache_cfg, 1, 32)


def test_three_bit_levels_lose_between_two_and_four_bits_and_pack_three_bytes(tmp_path):
    """At 3 bits (eight codes in three bytes) the fitted levels restore held-out
    keys and values with less error than at 2 bits and more than at 4, and a
    cache of them costs 3/8 of a byte a number more than at 2 bits; in pages it
    is the dense cache, and its bytes are the tree's."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    held_out = kvlab.init_cache(cfg.model, cfg.cache, 2, 64)
    _, held_out = apply({"params": params}, random_tokens(cfg, (2, 64), seed=9), cache=held_out)
    errors, sizes, caches = {}, {}, {}
    for bits in (2, 3, 4):
        (tmp_path / str(bits)).mkdir()
        cache_cfg, books = calibrated(cfg, tmp_path / str(bits), k_bits=bits, v_bits=bits)
        assert books["k"].shape == (cfg.model.num_layers, 2**bits)
        total = 0.0
        for layer in range(cfg.model.num_layers):
            for index, spec in enumerate(kvlab.cache.quant.storages(cfg.model, cache_cfg, layer)):
                x = jnp.asarray(held_out.layers[layer].tensors[index], jnp.float32)
                total += float(
                    jnp.mean((dequantize_tokens(*quantize_tokens(x, spec), spec) - x) ** 2)
                )
        errors[bits], sizes[bits] = total, kvlab.cache_bytes(cfg.model, cache_cfg, 2, 32)
        caches[bits] = cache_cfg
    assert errors[4] < errors[3] < errors[2], errors
    numbers = 2 * 32 * cfg.model.num_layers * 2 * cfg.model.num_kv_heads * cfg.model.head_dim
    assert sizes[3] - sizes[2] == numbers // 8 and sizes[4] - sizes[3] == numbers // 8
    tokens = random_tokens(cfg, (2, 14), seed=4)
    outs = []
    for cache_cfg in (caches[3], caches[3].copy_and_resolve_references()):
        if outs:
            cache_cfg.update(kind="paged", page_size=8)
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 32)
        logits, cache = apply({"params": params}, tokens[:, :12], cache=cache)
        for t in (12, 13):
            logits, cache = apply({"params": params}, tokens[:, t : t + 1], cache=cache)
        assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, 32) == kvlab.tree_bytes(cache)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-5, rtol=0)
    ints = {**cfg.cache.to_dict(), "k_bits": 3, "k_axis": "token", "group_size": 8}
    with pytest.raises(ValueError, match=r"cache.k_format='int' needs 8 or 4 or 2 bits"):
        kvlab.config.validate_cache_config(ints, cfg.model)
