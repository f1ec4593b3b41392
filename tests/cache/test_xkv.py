"""A basis shared by a run of adjacent layers (model.topology='xkv:G[,from=D]',
kvlab/cache/topology/xkv.py): the run's keys (before RoPE) and values side by side,
coded in cache.k_rank / cache.v_rank directions fitted offline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.cache.topology import cache_layers, joint_layers
from kvlab.eval import calibrate
from tests.helpers import VARIANTS, build, last_logits, random_tokens
from tests.test_export import assert_exports, assert_round_trips, inference


def coded(tmp_path, topology="xkv:2", rank=32, num_layers=4, params=None):
    """The tiny model with `topology`, ranks `rank` and its bases fitted on random
    tokens (saved under tmp_path)."""
    cfg = VARIANTS["gqa"]()
    cfg.model.num_layers, cfg.model.topology = num_layers, topology
    cfg.cache.update(k_rank=rank, v_rank=rank)
    if params is None:
        params = build(cfg)[1]
    found = calibrate.bases(cfg.model, cfg.cache, params, random_tokens(cfg, (4, 96), 0))
    path = str(tmp_path / f"xkv_{topology}_{rank}.npz".replace(":", "_"))
    calibrate.save_bases(path, found)
    cfg.cache.bases = path
    return cfg, found


def test_runs_of_g_layers_from_d_share_a_cache_layer():
    cfg = VARIANTS["gqa"]()
    cfg.model.num_layers = 5
    for topology, owners, joint in (
        ("xkv:2", (0, 0, 1, 1, 2), (0, 1)),  # the last layer alone keeps its own
        ("xkv:2,from=1", (0, 1, 1, 2, 2), (1, 2)),
        ("xkv:3,from=2", (0, 1, 2, 2, 2), (2,)),
    ):
        cfg.model.topology = topology
        assert cache_layers(cfg.model) == owners and joint_layers(cfg.model) == joint


def test_at_full_rank_it_is_the_layerwise_cache(tmp_path):
    """With G x W directions (every direction of the run) each layer reads back what it
    wrote: a prefill and three decode steps give the layerwise cache's logits;
    the bases are orthonormal [runs, K, G W, rank]. Bytes counted are the tree's."""
    cfg, found = coded(tmp_path, rank=32)
    assert found["k"].shape == (2, 2, 32, 32)
    for run in found["k"]:
        for head in run:
            np.testing.assert_allclose(head.T @ head, np.eye(32), atol=1e-5)
    tokens = random_tokens(cfg, (2, 15), seed=4)
    plain = VARIANTS["gqa"]()
    plain.model.num_layers = 4
    want = last_logits(plain, plain.cache, tokens, 12)
    np.testing.assert_allclose(last_logits(cfg, cfg.cache, tokens, 12), want, atol=2e-5)


def low_rank_params(cfg, rank: int):
    """Params whose key and value projections have rank `rank` per KV head."""
    params = jax.tree.map(lambda x: x, build(cfg)[1])
    rng = np.random.default_rng(3)
    for i in range(cfg.model.num_layers):
        attention = params[f"block_{i}"]["attention"]
        for name in ("key", "value"):
            d, k, w = attention[name]["kernel"].shape
            kernel = np.einsum(
                "dkr,krw->dkw", rng.normal(size=(d, k, rank)) / np.sqrt(d),
                rng.normal(size=(k, rank, w)) / np.sqrt(rank),
            )  # fmt: skip
            attention[name]["kernel"] = jnp.asarray(kernel, jnp.float32)
    return params


def test_a_run_whose_keys_span_r_directions_is_exact_in_r(tmp_path):
    """Each layer's keys (before RoPE) and values in 4 directions a head: a run of two
    spans 8, so 8 fitted directions give the layerwise logits within float
    rounding (keys coded before RoPE: after it they span every direction) and 6
    do not."""
    cfg = VARIANTS["gqa"]()
    cfg.model.num_layers = 2
    params = low_rank_params(cfg, 4)
    tokens = random_tokens(cfg, (2, 15), seed=4)

    def logits(model_cfg, cache_cfg):  # a prefill of 8, then a token a step
        cache = kvlab.init_cache(model_cfg.model, cache_cfg, 2, 32)
        out = []
        for start, end in [(0, 8)] + [(t, t + 1) for t in range(8, 15)]:
            step, cache = build(model_cfg)[2]({"params": params}, tokens[:, start:end], cache=cache)
            out.append(np.asarray(step))
        cache.check()
        return np.concatenate(out, axis=1)

    want = logits(cfg, cfg.cache)
    errors = {}
    for rank in (8, 6):
        run, _ = coded(tmp_path, rank=rank, num_layers=2, params=params)
        errors[rank] = np.abs(logits(run, run.cache) - want).max()
    assert errors[8] < 1e-4 and errors[6] > 100 * errors[8], errors


def test_a_cache_it_cannot_code_is_refused_naming_the_field(tmp_path):
    cfg, found = coded(tmp_path, rank=16)

    def refused(match, evict=None, **cache):
        cache_cfg = cfg.cache.copy_and_resolve_references()
        cache_cfg.update(cache)
        cache_cfg.evict.update(evict or {})
        with pytest.raises(ValueError, match=match):
            kvlab.init_cache(cfg.model, cache_cfg, 1, 32)

    refused(r"cache.k_axis='channel' under model.topology='xkv:2': .* set 'token'", k_bits=8)
    token = dict(k_axis="token", v_axis="token")
    refused(r"cache.k_transform='hadamard'", k_transform="hadamard")
    refused(r"cache.v_format='codebook' .* 'int', 'nf' or 'fp8'", v_bits=4, v_format="codebook",
            codebooks=str(tmp_path / "books.npz"), **token)  # fmt: skip
    refused(r"cache.v_outliers=1", v_bits=4, v_outliers=1, **token)
    refused(r"cache.k_full_first=1", k_bits=4, k_full_first=1, **token)
    refused(r"cache.k_before_rope=True .* codes keys before RoPE", k_bits=4, k_before_rope=True,
            **token)  # fmt: skip
    refused(r"cache.k_sketch=64", k_bits=4, k_sketch=64, **token)
    refused(r"cache.group_size=16 .*k_rank=8 .* a divisor of 8", k_bits=4, k_rank=8, **token)
    refused(r"cache.v_bits=3 .*v_rank=12 .* a multiple of 8", v_bits=3, v_format="nf",
            v_rank=12, group_size=4, **token)  # fmt: skip
    refused(r"cache.kind='paged'", kind="paged")
    refused(r"cache.evict.method='snapkv'", evict={"method": "snapkv", "ratio": 0.5})
    refused(r"cache.v_rank=33 .*set 1..32", v_rank=33)
    refused(r"cache.k_rank=0 .*set 1..32", k_rank=0)
    refused(r"cache.bases='' .*calibrate.save_bases", bases="")
    wrong = str(tmp_path / "wrong.npz")
    calibrate.save_bases(wrong, {"k": found["k"][:1], "v": found["v"]})
    refused(r"'k' is \(1, 2, 32, 16\), not finite \[2, 2, 32, 16\]", bases=wrong)
    skewed = str(tmp_path / "skewed.npz")
    calibrate.save_bases(skewed, {"k": found["k"] * 3, "v": found["v"]})
    refused(r"not orthonormal", bases=skewed)
    for topology, match in (("xkv:1", "codes no run"), ("xkv:2,from=3", "codes no run"),
                            ("xkv:2,at=1", r"is not G\[,from=D\]")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            kvlab.config.validate_model_config({**cfg.model.to_dict(), "topology": topology})


def quantized(cfg, k_bits: int, v_bits: int, group: int = 8):
    """`cfg`'s cache with the runs' codes at `k_bits` / `v_bits`, per token in groups of
    `group` coordinates, float32 scales."""
    cache = cfg.cache.copy_and_resolve_references()
    cache.update(k_bits=k_bits, v_bits=v_bits, k_axis="token", v_axis="token")
    cache.update(group_size=group, scale_dtype="float32")
    return cache


def test_quantized_codes_are_each_tokens_coordinates_within_half_a_step(tmp_path):
    """With cache.k_bits / v_bits below 16 each token's coordinates in the run's basis
    are quantized in groups of cache.group_size: after a prefill (whose hidden
    states no cache changes) every coordinate read back is within half its group's
    step, (max - min) / (2^b - 1), of the 16-bit cache's, and the bytes are the
    tree's: packed codes and a float32 scale and zero point per group. Fewer bits
    move the decode steps' logits further from the 16-bit codes'."""
    cfg, _ = coded(tmp_path, rank=16)
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 16), seed=6)
    caches = {}
    for bits in (16, 4, 2):
        cache_cfg = cfg.cache if bits == 16 else quantized(cfg, bits, bits)
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, 16)
        _, caches[bits] = apply({"params": params}, tokens[:, :12], cache=cache)
        caches[bits].check()
        assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, 16) == kvlab.tree_bytes(caches[bits])
    for layer in range(2):
        for tensor in range(2):
            exact = np.asarray(caches[16].layers[layer].codes[tensor].payload)[:, :, :12]
            groups = exact.reshape(*exact.shape[:-1], 2, 8)
            span = groups.max(-1, keepdims=True) - groups.min(-1, keepdims=True)
            for bits in (4, 2):
                read = np.asarray(caches[bits].layers[layer].codes[tensor].dequantize())
                error = np.abs(read[:, :, :12].reshape(groups.shape) - groups)
                assert (error <= span / (2**bits - 1) / 2 * (1 + 1e-5) + 1e-6).all()
                assert error.max() > 0
    # per joint layer, 2 rows x 2 KV heads x 16 slots: 16 coordinates of a key and of a
    # value at b bits, then 2 groups of each, a float32 scale and zero point a group
    for bits in (4, 2):
        assert kvlab.tree_bytes(caches[bits].layers[0]) == 2 * 2 * 16 * 2 * (16 * bits // 8 + 16)
    logits = {b: last_logits(cfg, cfg.cache if b == 16 else quantized(cfg, b, b), tokens, 12)
              for b in (16, 8, 2)}  # fmt: skip
    errors = {b: np.abs(logits[b] - logits[16]).max() for b in (8, 2)}
    assert 0 < errors[8] < errors[2] / 4, errors


def test_a_coded_cache_exports_for_tpu_and_cuda_and_round_trips(tmp_path):
    """Quantized codes (int keys at 4 bits, fp8 values) and 16-bit ones (per prompt,
    below) lower for TPU and CUDA and round-trip through the cache's files."""
    cfg, _ = coded(tmp_path, rank=16)
    cfg.cache = quantized(cfg, 4, 8)
    cfg.cache.v_format = "fp8"
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)
    assert_round_trips(cfg)


def per_prompt(rank: int, num_layers: int = 2):
    """The tiny model with xkv:2,fit=prompt at `rank` (no bases file)."""
    cfg = VARIANTS["gqa"]()
    cfg.model.num_layers, cfg.model.topology = num_layers, "xkv:2,fit=prompt"
    cfg.cache.update(k_rank=rank, v_rank=rank)
    return cfg


def test_bases_fitted_per_prompt_are_exact_where_the_prompt_spans_its_run():
    """xKV's own fit: each row's bases from its prefill. Keys (before RoPE) and
    values in 4 directions a head and layer: an 8-token prompt spans its run's 8,
    so the bases it fits code the prompt and every later token exactly (the
    layerwise logits within float rounding), and 6 do not; each row has its own
    bases (kept in the cache, its bytes counted)."""
    plain = VARIANTS["gqa"]()
    plain.model.num_layers = 2
    params = low_rank_params(plain, 4)
    tokens = random_tokens(plain, (2, 15), seed=5)

    def logits(cfg):  # a prefill of 8, then a token a step
        cache = kvlab.init_cache(cfg.model, cfg.cache, 2, 32)
        out = []
        for start, end in [(0, 8)] + [(t, t + 1) for t in range(8, 15)]:
            step, cache = build(cfg)[2]({"params": params}, tokens[:, start:end], cache=cache)
            out.append(np.asarray(step))
        cache.check()
        return np.concatenate(out, axis=1), cache

    want, _ = logits(plain)
    errors = {}
    for rank in (8, 6):
        cfg = per_prompt(rank)
        got, cache = logits(cfg)
        errors[rank] = np.abs(got - want).max()
        assert kvlab.cache_bytes(cfg.model, cfg.cache, 2, 32) == kvlab.tree_bytes(cache)
        keys = np.asarray(cache.layers[0].fitted[0])  # [B, K, G W, r], orthonormal columns
        for row in keys:
            for head in row:
                np.testing.assert_allclose(head.T @ head, np.eye(rank), atol=1e-5)
        assert np.abs(keys[0] - keys[1]).max() > 0.1  # two prompts, two bases
    assert errors[8] < 1e-4 and errors[6] > 100 * errors[8], errors


def test_per_prompt_bases_read_no_file_and_export(tmp_path):
    cfg = per_prompt(16)
    cfg.cache.bases = str(tmp_path / "bases.npz")
    with pytest.raises(ValueError, match=r"cache.bases=.*fits each row's bases from its prompt"):
        kvlab.init_cache(cfg.model, cfg.cache, 1, 32)
    cfg.cache.bases = ""
    with pytest.raises(ValueError, match=r"is not G\[,from=D\]\[,fit=prompt\]"):
        kvlab.config.validate_model_config({**cfg.model.to_dict(), "topology": "xkv:2,fit=data"})
    program, arguments = inference(cfg, loops=False)
    assert_exports(program, arguments, kernel=False)
    assert_round_trips(cfg)
