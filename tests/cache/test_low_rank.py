"""Tensors coded in a low-rank basis (cache.<prefix>_rank, cache.bases): each KV head's
token is coded as its coordinates in r directions fitted offline and read back
through them (Palu's low-rank cache; with cache.k_before_rope, keys before RoPE
as Palu keeps them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.quant import (
    PayloadReader,
    QuantizedTensor,
    Storage,
    dequantize_tokens,
    quantize_tokens,
    storages,
)
from kvlab.eval import calibrate
from tests.helpers import LAYOUTS, VARIANTS, build, last_logits, random_tokens, same_logits
from tests.test_export import assert_exports, inference

LOW_RANK = dict(k_bits=8, v_bits=8, k_axis="token", v_axis="token", group_size=4)


def fitted(cfg, tmp_path, params=None, rank=8, **storage):
    """cfg's cache section coding k and v in `rank` directions per KV head (8-bit
    codes unless `storage` says otherwise), their bases fitted on random tokens
    and saved under tmp_path."""
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(LOW_RANK, k_rank=rank, v_rank=rank)
    cache_cfg.update(storage)
    if params is None:
        _, params, _ = build(cfg)
    found = calibrate.bases(cfg.model, cache_cfg, params, random_tokens(cfg, (4, 96), 0))
    path = str(tmp_path / f"bases_{rank}_{cache_cfg.k_before_rope}.npz")
    calibrate.save_bases(path, found)
    cache_cfg.bases = path
    return cache_cfg, found


def orthonormal(rng, heads: int, width: int, rank: int) -> np.ndarray:
    """float32 [heads, width, rank] with orthonormal columns per head."""
    q, _ = np.linalg.qr(rng.normal(size=(heads, width, width)))
    return q[..., :rank].astype(np.float32)


def spec_of(basis: np.ndarray, fmt="int", bits=8, axis="token") -> Storage:
    return Storage(
        bits=bits, format=fmt, axis=axis, group_size=4, symmetric=False,
        scale_dtype="float32", dtype="float32", rank=basis.shape[-1],
        basis=tuple(tuple(tuple(float(x) for x in row) for row in head) for head in basis),
    )  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(
    fmt_bits=st.sampled_from([("int", 8), ("int", 4), ("fp8", 8), ("nf", 4)]),
    rank=st.sampled_from([4, 8, 12, 16]),
    axis=st.sampled_from(["token", "channel"]),
    seed=st.integers(0, 2**16),
)
def test_a_token_is_its_coordinates_coded_and_mapped_back(fmt_bits, rank, axis, seed):
    """Coding x [B, KH, N, Wd] in a basis B [KH, Wd, r] is coding its coordinates x B
    the plain way (rank numbers a row, their own scale groups) and reading them
    back through B^T: within float rounding of that, for every format; the part
    of x outside the basis is what is lost, and a payload row is r codes."""
    fmt, bits = fmt_bits
    rng = np.random.default_rng(seed)
    basis = orthonormal(rng, 3, 16, rank)
    spec = spec_of(basis, fmt, bits, axis)
    plain = spec_of(np.eye(rank, dtype=np.float32)[None].repeat(3, 0), fmt, bits, axis)
    plain = Storage(**{**plain.__dict__, "rank": 0, "basis": ()})
    x = rng.normal(size=(2, 3, 8, 16)).astype(np.float32) * rng.uniform(0.1, 10)
    payload, scale, zero = quantize_tokens(jnp.asarray(x), spec)
    assert payload.shape == (2, 3, 8, rank * bits // 8)
    coordinates = np.einsum("bknw,kwr->bknr", x, basis)
    want = dequantize_tokens(*quantize_tokens(jnp.asarray(coordinates), plain), plain)
    want = np.einsum("bknr,kwr->bknw", np.asarray(want), basis)
    read = np.asarray(dequantize_tokens(payload, scale, zero, spec))
    np.testing.assert_allclose(read, want, atol=2e-5 * np.abs(x).max(), rtol=0)
    # at 8-bit int, what the basis keeps comes back and what it leaves out does not
    if (fmt, bits) == ("int", 8):
        kept = np.einsum("bknr,kwr->bknw", coordinates, basis)
        assert np.abs(read - kept).max() <= 0.02 * np.abs(coordinates).max()


@settings(max_examples=20, deadline=None)
@given(
    fmt_bits=st.sampled_from([("int", 8), ("int", 4), ("int", 2), ("fp8", 8), ("nf", 4)]),
    rank=st.sampled_from([4, 8, 12]),
    axis=st.sampled_from(["token", "channel"]),
    outliers=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
)
def test_attention_reads_the_coordinates_with_the_basis_folded_in(
    fmt_bits, rank, axis, outliers, seed
):
    """Over a tensor coded in a basis, attention's products (PayloadReader, whole and
    by slices) are those over its dequantized numbers, computed as (q B) . c and
    (w c) B^T over the r coordinates (Palu's fused read) without mapping the
    tokens back."""
    fmt, bits = fmt_bits
    rng = np.random.default_rng(seed)
    basis = orthonormal(rng, 3, 16, rank)
    spec = Storage(**{**spec_of(basis, fmt, bits, axis).__dict__, "outliers": outliers})
    assert spec.folds_basis
    x = rng.normal(size=(2, 3, 8, 16)).astype(np.float32)
    tensor = QuantizedTensor(*quantize_tokens(jnp.asarray(x), spec), None, spec)
    dense = np.asarray(tensor.dequantize())
    q = rng.normal(size=(2, 3, 5, 16)).astype(np.float32)
    w = rng.random(size=(2, 3, 5, 4)).astype(np.float32)
    for start, reader in ((0, PayloadReader(tensor)), (4, PayloadReader(tensor).chunk(4, 4))):
        stop = start + (8 if start == 0 else 4)
        scores = np.einsum("bkmd,bksd->bkms", q, dense[:, :, start:stop])
        np.testing.assert_allclose(reader.scores(jnp.asarray(q)), scores, rtol=1e-4, atol=1e-4)
        weights = w[..., : stop - start] if start else np.tile(w, 2)
        out = np.einsum("bkms,bksd->bkmd", weights, dense[:, :, start:stop])
        np.testing.assert_allclose(reader.weighted_sum(jnp.asarray(weights)), out, atol=1e-4)


def low_rank_params(cfg, rank: int):
    """The tiny model's params with each KV head's key and value projection of rank
    `rank`: its keys before RoPE and its values lie in `rank` directions a head."""
    _, params, _ = build(cfg)
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda x: x, params)  # a copy to change
    for i in range(cfg.model.num_layers):
        attention = params[f"block_{i}"]["attention"]
        for name in ("key", "value"):
            kernel = np.asarray(attention[name]["kernel"])  # [D, K, W]
            d, k, w = kernel.shape
            down = rng.normal(size=(d, k, rank)) / np.sqrt(d)
            up = rng.normal(size=(k, rank, w)) / np.sqrt(rank)
            kernel = np.einsum("dkr,krw->dkw", down, up)
            attention[name]["kernel"] = jnp.asarray(kernel, jnp.float32)
    return params


def test_keys_of_low_rank_before_rope_keep_their_logits_only_coded_before_rope(tmp_path):
    """A model whose key and value projections have rank 4 per KV head: coded in 4
    directions fitted before RoPE, its logits are the 8-bit full-rank cache's (the
    bases keep every direction its keys and values take: the fitted rank-4 bases
    reconstruct them within float rounding); fitted after RoPE, which turns each
    key by its position out of that subspace, they are not (Palu's reason to
    keep keys before RoPE)."""
    cfg = VARIANTS["gqa"]()
    params = low_rank_params(cfg, rank=4)
    apply = build(cfg)[2]
    tokens = random_tokens(cfg, (2, 15), seed=4)

    def logits(cache_cfg):
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 32)
        out, cache = apply({"params": params}, tokens, cache=cache)
        cache.check()
        return np.asarray(out)

    full = logits(cfg.cache)
    before, _ = fitted(cfg, tmp_path, params, rank=4, k_before_rope=True)
    after, _ = fitted(cfg, tmp_path, params, rank=4)
    coded = cfg.cache.copy_and_resolve_references()
    coded.update(LOW_RANK, k_before_rope=True)
    error = {
        name: np.abs(logits(c) - full).max()
        for name, c in (("before", before), ("after", after), ("coded", coded))
    }
    assert error["before"] < 2 * error["coded"] + 1e-3, error
    assert error["after"] > 10 * error["before"], error


def test_the_bases_are_the_principal_directions_of_the_numbers_coded(tmp_path):
    """Per layer and head the fitted basis is orthonormal, and its rank-r map x B B^T
    loses the least of the cache's numbers: its mean squared error is the sum of
    the second moment's trailing eigenvalues, below a random basis's, and falls
    as the rank grows; at full rank it loses nothing."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (4, 96), 0)
    cache = kvlab.init_cache(cfg.model, cfg.cache.copy_and_resolve_references(), 4, 96)
    _, cache = apply({"params": params}, tokens, cache=cache)
    rng = np.random.default_rng(0)
    errors = []
    for rank in (4, 8, 16):
        _, found = fitted(cfg, tmp_path, params, rank=rank)
        per_rank = 0.0
        for index, prefix in enumerate(("k", "v")):
            for layer, basis in enumerate(found[prefix]):
                x = np.asarray(cache.layers[layer].tensors[index], np.float64)  # [B, K, T, W]
                for head, b in enumerate(basis):
                    np.testing.assert_allclose(b.T @ b, np.eye(rank), atol=1e-5)
                    numbers = x[:, head].reshape(-1, x.shape[-1])
                    lost = np.mean(np.sum((numbers - numbers @ b @ b.T) ** 2, -1))
                    moment = numbers.T @ numbers / len(numbers)
                    trailing = np.sort(np.linalg.eigvalsh(moment))[: x.shape[-1] - rank].sum()
                    np.testing.assert_allclose(lost, trailing, rtol=1e-3, atol=1e-6)
                    other = orthonormal(rng, 1, x.shape[-1], rank)[0]
                    random = np.mean(np.sum((numbers - numbers @ other @ other.T) ** 2, -1))
                    assert rank == x.shape[-1] or lost < random
                    per_rank += lost
        errors.append(per_rank)
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_it_is_the_dense_cache_in_pages_under_eviction_the_kernels_and_chunks(tmp_path, layout):
    """A prefill and three decode steps through a cache coding k and v in 8 of 16
    directions: in pages, the dense cache's logits; evicting with a budget that
    holds every token, the dense cache's; under the native kernels (which decline
    a basis), the reference's; a token at a time, the one prefill's. The bytes
    counted are the tree's (last_logits)."""
    cfg = VARIANTS["gqa"]()
    cache_cfg, _ = fitted(cfg, tmp_path)
    same_logits(cfg, cache_cfg, random_tokens(cfg, (2, 15), seed=4), LAYOUTS[layout])


@pytest.mark.parametrize("layout", ["paged", "chunked"])
def test_keys_before_rope_in_a_basis_are_the_dense_cache_in_pages_and_chunks(tmp_path, layout):
    cfg = VARIANTS["gqa"]()
    cache_cfg, _ = fitted(cfg, tmp_path, k_before_rope=True, residual=4, k_bits=4)
    same_logits(cfg, cache_cfg, random_tokens(cfg, (2, 15), seed=4), LAYOUTS[layout])


def test_it_stores_rank_codes_and_their_scales():
    """Per layer and tensor, B x KH x S x r codes of `bits` and a scale and zero point
    per group of r: the cache at rank 8 of 16 holds half the codes and scales of
    the same format over all 16 channels."""
    cfg = VARIANTS["gqa"]()
    m = cfg.model
    cache_cfg = cfg.cache.copy_and_resolve_references()
    cache_cfg.update(LOW_RANK, k_rank=8, v_rank=4, scale_dtype="bfloat16")
    numbers = m.num_layers * 3 * m.num_kv_heads * 64 * (8 + 4)  # codes of k, then v
    rows = 3 * 8  # a length and error flags per row
    scales = numbers // 4 * 2 * 2  # a bfloat16 scale and zero point per 4 numbers
    assert kvlab.cache_bytes(m, cache_cfg, 3, 64) == numbers + scales + rows
    full = cache_cfg.copy_and_resolve_references()
    full.update(k_rank=0, v_rank=0)
    every = m.num_layers * 3 * m.num_kv_heads * 64 * 2 * m.head_dim
    assert kvlab.cache_bytes(m, full, 3, 64) == every + every // 4 * 2 * 2 + rows


def test_a_latent_model_codes_its_latent_in_a_basis(tmp_path):
    """MLA's latent (one head of kv_rank numbers) coded in its directions: at full
    rank it reads back as coded (8-bit codes of a rotation: within 0.05 of the
    logits); in half of them it loses what the others held."""
    cfg = VARIANTS["mla_absorbed"]()
    _, params, apply = build(cfg)
    rank = cfg.model.mla.kv_rank
    tokens = random_tokens(cfg, (1, 10), seed=2)
    full, _ = apply({"params": params}, tokens)
    errors = []
    for r in (rank // 2, rank):
        cache_cfg = cfg.cache.copy_and_resolve_references()
        cache_cfg.update(latent_bits=8, latent_rank=r, latent_axis="token", group_size=8)
        found = calibrate.bases(cfg.model, cache_cfg, params, random_tokens(cfg, (2, 64)))
        assert found["latent"].shape == (cfg.model.num_layers, 1, rank, r)
        path = str(tmp_path / f"latent_{r}.npz")
        calibrate.save_bases(path, found)
        cache_cfg.bases = path
        logits, _ = apply(
            {"params": params}, tokens, cache=kvlab.init_cache(cfg.model, cache_cfg, 1, 32)
        )
        errors.append(np.abs(np.asarray(logits) - np.asarray(full)).max())
    assert errors[1] < 0.05 and errors[0] > 10 * errors[1], errors


def test_scales_and_codebooks_fit_the_coordinates(tmp_path):
    """Calibrated scales and fitted levels of a tensor in a basis are those of its
    coordinates: [layers, KH, rank] ranges, the largest |x B|."""
    cfg = VARIANTS["gqa"]()
    _, params, _ = build(cfg)
    cache_cfg, found = fitted(cfg, tmp_path, k_format="fp8", v_format="fp8")
    cache_cfg.update(k_axis="calibrated", v_axis="calibrated")
    tokens = random_tokens(cfg, (4, 96), 0)
    ranges = calibrate.scales(cfg.model, cache_cfg, params, tokens)
    assert ranges["k"].shape == (cfg.model.num_layers, cfg.model.num_kv_heads, 8)
    path = str(tmp_path / "scales.npz")
    calibrate.save_scales(path, ranges)
    cache_cfg.scales = path
    layer = storages(cfg.model, cache_cfg, 0)[1]
    assert layer.rank == 8 and np.asarray(layer.ranges).shape == (2, 8)
    logits = last_logits(cfg, cache_cfg, random_tokens(cfg, (2, 15), seed=4), 12)
    assert np.isfinite(logits).all()


def test_without_usable_bases_the_cache_is_refused_naming_the_field(tmp_path):
    cfg = VARIANTS["gqa"]()
    cache_cfg, found = fitted(cfg, tmp_path)

    def refused(match, **fields):
        broken = cache_cfg.copy_and_resolve_references()
        broken.update(fields)
        with pytest.raises(ValueError, match=match):
            kvlab.init_cache(cfg.model, broken, 1, 32)

    refused(r"cache.bases, which is empty", bases="")
    refused(r"cannot be read", bases=str(tmp_path / "missing.npz"))
    only_v = str(tmp_path / "only_v.npz")
    calibrate.save_bases(only_v, {"v": found["v"]})
    refused(r"holds no bases for 'k'", bases=only_v)
    other = str(tmp_path / "other.npz")
    calibrate.save_bases(other, {"k": found["k"][..., :4], "v": found["v"]})
    refused(r"not finite \[2 cache layers, 2 heads, 16 channels, 8 directions\]", bases=other)
    skewed = str(tmp_path / "skewed.npz")
    calibrate.save_bases(skewed, {"k": found["k"] * 2, "v": found["v"]})
    refused(r"not orthonormal", bases=skewed)

    def invalid(match, **fields):
        with pytest.raises(ValueError, match=match):
            kvlab.config.validate_cache_config({**cache_cfg.to_dict(), **fields}, cfg.model)

    invalid(r"cache.k_rank=8 .*cache.k_bits=16", k_bits=16)
    invalid(r"cache.k_rank=17 exceeds model.head_dim=16", k_rank=17)
    invalid(r"cache.k_rank", k_rank=-1)
    invalid(r"cache.bases=.* is read by no tensor", k_rank=0, v_rank=0)
    invalid(r"cache.group_size=3 does not divide cache.k_rank=8", group_size=3)
    invalid(r"cache.k_sketch=16 cannot combine with cache.k_rank=8", k_sketch=16)
    adakv = {**cache_cfg.evict.to_dict(), "method": "adakv", "budget": 8, "recent": 2}
    invalid(r"cache.evict.method='adakv' .* pool .*cache.k_rank=8 \(a basis per KV head\)",
            evict=adakv)  # fmt: skip
    with pytest.raises(ValueError, match="no cached tensor is coded in a basis"):
        calibrate.bases(cfg.model, cfg.cache, build(cfg)[1], random_tokens(cfg, (1, 16)))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_low_rank_cache_exports_for_tpu_and_cuda(tmp_path, impl):
    """The prefill and the decode step over codes in a basis, keys before RoPE, lowered
    for TPU and CUDA from this host: no CPU-only call, no Pallas kernel."""
    cfg = VARIANTS["gqa"]()
    cfg.cache, _ = fitted(cfg, tmp_path, k_before_rope=True)
    cfg.model.attention_impl = impl
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)
