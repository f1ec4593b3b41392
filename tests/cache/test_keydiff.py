"""KeyDiff (kvlab/cache/evict/keydiff.py) against its definition (arXiv:2504.15364):
each step that overflows the budget drops the keys most similar (by cosine) to
the mean of the normalised keys of its KV head, its new block's included."""

import numpy as np

from tests.cache.test_evict import evicting, kivi, layer0_keys, run
from tests.helpers import VARIANTS, build, random_tokens


def test_each_block_drops_the_keys_closest_to_the_mean_direction():
    """A block of 7, then token by token through a budget of 5 (recent 0): each
    step drops, per KV head, the candidates of highest cosine with the mean of
    the kept and new keys' unit vectors, recomputed here in float64."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 13), seed=3)
    _, params, _ = build(cfg)
    keys = layer0_keys(cfg, params, tokens)
    chunks = [7] + [1] * 6
    _, cache = run(cfg, evicting(cfg, "keydiff", budget=5, recent=0), tokens, chunks)
    kept_by_layer = np.sort(np.asarray(cache.layers[0].positions), axis=-1)  # [B, K, 5]
    for b in range(2):
        for h in range(cfg.model.num_kv_heads):
            kept, end = [], 0
            for size in chunks:
                candidates = [*kept, *range(end, end + size)]
                end += size
                key = keys[b, candidates, h]
                unit = key / np.linalg.norm(key, axis=-1)[:, None]
                anchor = unit.mean(0)
                cosine = unit @ anchor / np.linalg.norm(anchor)
                drop = len(candidates) - 5
                gone = set(np.argsort(-cosine, kind="stable")[:drop]) if drop > 0 else set()
                kept = [c for i, c in enumerate(candidates) if i not in gone]
            np.testing.assert_array_equal(kept_by_layer[b, h], sorted(kept))


def test_it_runs_over_kivi_groups_pages_and_a_latent_and_keeps_everything_a_budget_holds():
    """Settling groups of a KIVI cache score the mean of their tokens' cosines; a
    latent model scores its latents; with a budget that holds the sequence the
    logits are the full cache's."""
    for name in ("gqa", "mla_absorbed"):
        cfg = VARIANTS[name]()
        tokens = random_tokens(cfg, (2, 28))
        full, _ = run(cfg, cfg.cache, tokens, [14, 14], 32)
        held, _ = run(cfg, evicting(cfg, "keydiff", budget=32), tokens, [14, 14], 32)
        np.testing.assert_allclose(held, full, atol=1e-5)
    cache_cfg = kivi(cfg, "keydiff", 0, budget=16)
    cache_cfg.update(kind="paged", page_size=8)
    out, cache = run(cfg, cache_cfg, tokens, [14, 14], 32)
    assert np.isfinite(out).all()
    assert (np.asarray(cache.layers[0].stored(cache.lengths)) <= 16).all()
