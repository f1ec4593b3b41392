"""CriticalKV (kvlab/cache/evict/criticalkv.py), a wrapper over any scorer, against
its definition (arXiv:2502.03805, as kvpress's CriticalKVPress computes it): the
scorer's best half of the kept share first, the rest by (score + epsilon) times
the L1 norm of each value's output projection, averaged over a KV head's query heads."""

import numpy as np
import pytest

import kvlab
from tests.cache.test_evict import assert_composes, evicting, layer0_keys, layer0_values, run
from tests.helpers import VARIANTS, build, random_tokens


def test_one_prefill_keeps_the_first_stage_then_the_heaviest_outputs():
    """criticalkv over knorm, 16 tokens into 8: the 4 smallest keys, then the 4 best
    (-|k| + 1e-4) x mean over the query heads of |W_o^h v|_1, recomputed here."""
    cfg = VARIANTS["gqa"]()
    model = cfg.model
    tokens = random_tokens(cfg, (2, 16), seed=6)
    _, params, _ = build(cfg)
    keys, values = layer0_keys(cfg, params, tokens), layer0_values(cfg, params, tokens)
    kernel = np.asarray(params["block_0"]["attention"]["out"]["kernel"], np.float64)  # [N, H, D]
    groups = model.num_heads // model.num_kv_heads
    cache_cfg = evicting(cfg, "criticalkv:knorm", budget=8, recent=0)
    _, cache = run(cfg, cache_cfg, tokens, [16])
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    for b in range(2):
        for h in range(model.num_kv_heads):
            score = -np.linalg.norm(keys[b, :, h], axis=-1)
            first = set(np.argsort(-score, kind="stable")[:4].tolist())
            heads = range(h * groups, (h + 1) * groups)
            weight = np.mean([np.abs(values[b, :, h] @ kernel[n]).sum(-1) for n in heads], 0)
            weighed = np.where(np.isin(np.arange(16), list(first)), np.inf, (score + 1e-4) * weight)
            np.testing.assert_array_equal(kept[b, h], np.sort(np.argsort(-weighed)[:8]))
            assert first <= set(kept[b, h].tolist())


@pytest.mark.parametrize("scorer", ["h2o", "adakv"])
def test_it_wraps_stateful_and_pooled_scorers(scorer):
    assert_composes(VARIANTS["gqa"](), f"criticalkv:{scorer}")


def test_bad_options_and_a_latent_model_are_refused():
    cfg = VARIANTS["gqa"]()
    for options, message in (
        ({"first_stage_ratio": 1.5}, "options.first_stage_ratio=1.5 is not a share"),
        ({"epsilon": -1.0}, "options.epsilon=-1.0 is negative"),
        ({"epsilon": float("nan")}, "options.epsilon=nan is not of its default's kind"),
    ):
        with pytest.raises(ValueError, match=message):
            kvlab.init_cache(
                cfg.model, evicting(cfg, "criticalkv:knorm", budget=8, options=options), 1, 32
            )
    latent = VARIANTS["mla_absorbed"]()
    with pytest.raises(ValueError, match="cannot score a model.attention='mla' cache"):
        kvlab.init_cache(latent.model, evicting(latent, "criticalkv:knorm", budget=8), 1, 32)
