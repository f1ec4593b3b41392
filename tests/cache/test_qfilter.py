"""Q-Filters (kvlab/cache/evict/qfilter.py and kvlab/eval/calibrate.py) against their
definition (arXiv:2503.02812): per query head, the principal direction of its
queries after RoPE on calibration text, signed along most of them and averaged
over a KV head's query heads; keys are kept by their dot product with it."""

import jax
import numpy as np
import pytest

import kvlab
from kvlab.eval.calibrate import q_filters, save_filters
from tests.cache.test_evict import assert_composes, evicting, layer0_keys, run
from tests.helpers import VARIANTS, build, intermediates, random_tokens


def calibrated(cfg, folder, seed=9):
    """Filters of cfg's model from random calibration tokens, written to `folder`."""
    _, params, _ = build(cfg)
    path = str(folder / "qfilters.npz")
    save_filters(path, q_filters(cfg.model, params, random_tokens(cfg, (2, 48), seed=seed)))
    return path


def test_each_filter_is_the_signed_principal_direction_of_its_heads_queries():
    """Recomputed through the eigenvectors of each head's query Gram matrix."""
    cfg = VARIANTS["gqa"]()
    model = cfg.model
    _, params, _ = build(cfg)
    tokens = random_tokens(cfg, (2, 48), seed=9)
    filters = q_filters(model, params, tokens)
    assert filters.shape == (model.num_layers, model.num_kv_heads, model.head_dim)
    captured = intermediates(cfg, params, tokens)
    positions = np.broadcast_to(np.arange(48), (2, 48))
    groups = model.num_heads // model.num_kv_heads
    for layer in range(model.num_layers):
        q = captured[f"block_{layer}"]["attention"]["query"]["__call__"][0]
        q = kvlab.rope.apply_rope(q, positions, model.rope_theta, model.rope_scaling)
        q = np.asarray(q, np.float64).reshape(96, model.num_heads, model.head_dim)
        heads = []
        for n in range(model.num_heads):
            _, vectors = np.linalg.eigh(q[:, n].T @ q[:, n])
            top = vectors[:, -1]
            heads.append(-top if (q[:, n] @ top > 0).mean() > 0.5 else top)
        expected = np.reshape(heads, (model.num_kv_heads, groups, -1)).mean(1)
        np.testing.assert_allclose(filters[layer], expected, atol=1e-4, rtol=0)


def test_one_prefill_keeps_the_keys_most_aligned_with_the_queries(tmp_path):
    cfg = VARIANTS["gqa"]()
    path = calibrated(cfg, tmp_path)
    tokens = random_tokens(cfg, (2, 16), seed=3)
    _, params, _ = build(cfg)
    keys = layer0_keys(cfg, params, tokens)  # [B, T, K, H]
    cache_cfg = evicting(cfg, "qfilter", budget=6, recent=0, options={"filters": path})
    _, cache = run(cfg, cache_cfg, tokens, [16])
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    direction = np.load(path)["filters"][0]  # [K, H]
    for b in range(2):
        for h in range(cfg.model.num_kv_heads):
            score = -keys[b, :, h] @ direction[h]
            np.testing.assert_array_equal(kept[b, h], np.sort(np.argsort(-score)[:6]))


def test_a_rotated_cache_turns_the_filters_with_its_keys(tmp_path):
    cfg = VARIANTS["gqa"]()
    path = calibrated(cfg, tmp_path)
    tokens = random_tokens(cfg, (2, 16), seed=4)
    plain = evicting(cfg, "qfilter", budget=6, recent=0, options={"filters": path})
    rotated = plain.copy_and_resolve_references()
    rotated.k_transform = "hadamard"
    _, a = run(cfg, plain, tokens, [16])
    _, b = run(cfg, rotated, tokens, [16])
    for x, y in zip(a.layers, b.layers, strict=True):
        np.testing.assert_array_equal(
            np.sort(np.asarray(x.positions), -1), np.sort(np.asarray(y.positions), -1)
        )


def test_it_runs_over_kivi_groups_and_pages_within_its_budget(tmp_path):
    cfg = VARIANTS["gqa"]()
    assert_composes(cfg, "qfilter", options={"filters": calibrated(cfg, tmp_path)})


def test_missing_or_mismatched_filters_are_refused(tmp_path):
    cfg = VARIANTS["gqa"]()
    with pytest.raises(
        ValueError, match="options.filters='' names no file: write them with kvlab.eval.calibrate"
    ):
        kvlab.init_cache(cfg.model, evicting(cfg, "qfilter", budget=6, options={}), 1, 32)
    missing = str(tmp_path / "none.npz")
    with pytest.raises(ValueError, match="none.npz' names no file"):
        kvlab.init_cache(
            cfg.model, evicting(cfg, "qfilter", budget=6, options={"filters": missing}), 1, 32
        )
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="is no .npz file with an array 'filters'"):
        options = {"filters": str(broken)}
        kvlab.init_cache(cfg.model, evicting(cfg, "qfilter", budget=6, options=options), 1, 32)
    other = VARIANTS["mqa"]()  # one KV head, not two
    path = calibrated(other, tmp_path)
    with pytest.raises(ValueError, match=r"not for cache layer 0 of 2 KV heads"):
        run(
            cfg,
            evicting(cfg, "qfilter", budget=6, options={"filters": path}),
            random_tokens(cfg, (1, 9)),
        )
    with pytest.raises(ValueError, match="are not finite"):
        save_filters(tmp_path / "nan.npz", np.full((2, 2, 16), np.nan))
    latent = VARIANTS["mla_absorbed"]()
    with pytest.raises(ValueError, match="cannot score a model.attention='mla' cache"):
        options = {"filters": path}
        kvlab.init_cache(
            latent.model, evicting(latent, "qfilter", budget=6, options=options), 1, 32
        )
    with pytest.raises(ValueError, match="only grouped-query attention"):
        q_filters(
            latent.model, kvlab.init_params(latent.model, jax.random.key(0)), np.zeros((1, 4))
        )
