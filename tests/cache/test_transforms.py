"""Key/value transforms (kvlab/cache/transforms): applied before storing, folded
into the reads, they change no logit at 16 bits; a Hadamard rotation is the
normalized Walsh-Hadamard matrix times fixed signs, a random orthogonal one a
seeded Haar matrix of any width, and both spread outlier channels so 4-bit keys
lose less."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from kvlab.cache.transforms.hadamard import Hadamard, signs, walsh_hadamard
from kvlab.cache.transforms.orthogonal import Orthogonal, rotation
from kvlab.eval import evaluate, evaluate_reference, full_cache
from tests.helpers import VARIANTS, build, random_tokens, run_in_chunks


def sylvester(n: int) -> np.ndarray:
    """The n x n Hadamard matrix by Sylvester's construction, unnormalized."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@given(log_width=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_hadamard_is_the_signed_walsh_hadamard_matrix_and_orthogonal(log_width, seed):
    n = 2**log_width
    x = np.random.default_rng(seed).standard_normal((3, 5, n)).astype(np.float32)
    np.testing.assert_allclose(walsh_hadamard(x), x @ sylvester(n) / np.sqrt(n), atol=1e-5)
    rotation = np.diag(signs(n)) @ sylvester(n) / np.sqrt(n)  # R = D H / sqrt(n)
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(n), atol=1e-6)
    forward = Hadamard().forward(jnp.asarray(x))
    np.testing.assert_allclose(forward, x @ rotation, atol=1e-5)
    np.testing.assert_allclose(Hadamard().inverse(forward), x, atol=1e-5)
    q = np.random.default_rng(seed + 1).standard_normal((3, 5, n)).astype(np.float32)
    np.testing.assert_allclose(  # dot products are unchanged
        (Hadamard().forward(jnp.asarray(q)) * forward).sum(-1), (q * x).sum(-1), atol=1e-4
    )


@given(width=st.sampled_from([1, 3, 12, 64, 80, 576]), seed=st.integers(0, 2**16))
def test_orthogonal_is_a_seeded_orthogonal_matrix_of_any_width(width, seed):
    """The same matrix every time for a width (seeded), orthogonal, inverted by its
    transpose, dot products unchanged."""
    r = rotation(width)
    np.testing.assert_allclose(r @ r.T, np.eye(width), atol=1e-5)
    assert np.array_equal(r, rotation.__wrapped__(width))  # recomputed: the same
    x = np.random.default_rng(seed).standard_normal((3, width)).astype(np.float32)
    q = np.random.default_rng(seed + 1).standard_normal((3, width)).astype(np.float32)
    forward = Orthogonal().forward(jnp.asarray(x))
    np.testing.assert_allclose(forward, x @ r, atol=1e-4)
    np.testing.assert_allclose(Orthogonal().inverse(forward), x, atol=1e-4)
    np.testing.assert_allclose(
        (Orthogonal().forward(jnp.asarray(q)) * forward).sum(-1), (q * x).sum(-1), atol=1e-3
    )


def rotated(cache_cfg, prefixes, transform="hadamard", **cache_fields):
    """A copy of `cache_cfg` with these fields, storing `prefixes` rotated."""
    cache = cache_cfg.copy_and_resolve_references()
    cache.update(cache_fields)
    cache.update({f"{p}_transform": transform for p in prefixes})
    return cache


@pytest.mark.parametrize("transform", ["hadamard", "orthogonal"])
@pytest.mark.parametrize("name", ["gqa", "mla_absorbed", "mla_expanded"])
def test_a_16_bit_cache_under_rotations_gives_the_same_logits(name, transform):
    """Chunks of a prefill and decode steps through a cache whose every tensor
    is stored rotated equal the plain forward's logits within float rounding,
    dense and paged, and the bytes are the unrotated cache's."""
    cfg = VARIANTS[name]()
    model_cfg = cfg.model
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 9))
    want, _ = apply({"params": params}, tokens)
    prefixes = kvlab.config.cached_prefixes(model_cfg)
    for fields in ({}, {"kind": "paged", "page_size": 4}):
        cache_cfg = rotated(cfg.cache, prefixes, transform, **fields)
        cache = kvlab.init_cache(model_cfg, cache_cfg, 2, 16)
        assert cache.transforms == (transform, transform)
        got, cache = run_in_chunks(apply, params, cache, tokens, [4, 1, 4])
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
        plain = kvlab.init_cache(model_cfg, cfg.cache.copy_and_resolve_references(), 2, 16)
        if not fields:
            assert kvlab.tree_bytes(cache) == kvlab.tree_bytes(plain)
        assert kvlab.tree_bytes(cache) == kvlab.cache_bytes(model_cfg, cache_cfg, 2, 16)


def test_rotated_keys_with_outlier_channels_lose_less_at_4_bits():
    """Keys with a few channels 30 times larger than the rest: one scale per
    token at 4 bits rounds the others to nothing. Rotated first, the outliers
    spread over every channel, and the next-token distributions move less from
    the full cache's (KL), through the same evaluation: Hadamard's even spread
    (every rotated channel a +-1/sqrt(n) share of each) to less than half, a
    random rotation's uneven one less far (QuaRot's finding)."""
    cfg = VARIANTS["gqa"]()
    _, params, _ = build(cfg)
    kernel = params["block_0"]["attention"]["key"]["kernel"]  # [D, K, H]
    params = jax.tree.map(lambda x: x, params)  # a new tree: build's params are shared
    params["block_0"]["attention"]["key"]["kernel"] = kernel.at[..., :2].multiply(30.0)
    tokens = random_tokens(cfg, (4, 33), seed=1)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], weights=np.ones((4, 32), np.float32))
    four = cfg.cache.copy_and_resolve_references()
    four.update(k_bits=4, k_axis="token", group_size=16)
    reference = evaluate_reference(cfg.model, full_cache(four), params, [batch], chunk=8)
    kl = {
        transform: evaluate(
            cfg.model,
            rotated(four, ["k"], transform),
            params,
            [batch],
            chunk=8,
            reference=reference,
        )["kl_mean"]
        for transform in ("none", "hadamard", "orthogonal")
    }
    assert kl["hadamard"] < kl["none"] / 2, kl
    assert kl["hadamard"] < kl["orthogonal"] < kl["none"], kl


def test_a_transform_that_does_not_fit_is_refused_naming_the_field():
    cfg = VARIANTS["gqa"]()
    cfg.cache.k_transform = "rotate"
    with pytest.raises(ValueError, match=r"cache.k_transform='rotate' is not supported"):
        kvlab.validate_config(cfg)
    cfg.cache.k_transform = "hadamard"
    cfg.model.head_dim = 12
    with pytest.raises(ValueError, match=r"cache.k_transform='hadamard' rotates power-of-two"):
        kvlab.config.validate_cache_config(cfg.cache, cfg.model)
    mla = VARIANTS["mla_absorbed"]()
    mla.cache.k_transform = "hadamard"
    with pytest.raises(ValueError, match=r"cache.k_transform='hadamard' applies to a tensor"):
        kvlab.config.validate_cache_config(mla.cache, mla.model)
