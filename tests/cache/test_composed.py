"""Composed methods 'a+b' (kvlab/cache/evict/scorers.py, Composed), kvpress's
ComposedPress: the first scorer keeps its best ceil(kept / share) candidates of
a head, the second ranks those for the tokens that stay."""

import numpy as np
import pytest

import kvlab
from kvlab.eval.benchmark import kvpress_evict
from tests.cache.test_evict import assert_composes, evicting, layer0_keys, run
from tests.helpers import VARIANTS, build, random_tokens


@pytest.mark.parametrize("share, staged", [(0.5, 12), (0.75, 8), (1.0, 6)])
def test_the_second_scorer_ranks_the_first_ones_survivors(share, staged):
    """knorm+keydiff over one prefill of 24 tokens to a budget of 6: knorm's best
    ceil(6 / share) keys of each head (smallest norms), of which the 6 least
    like the mean direction of all 24 (keydiff as it scores alone) stay."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 24), seed=5)
    _, params, _ = build(cfg)
    keys = layer0_keys(cfg, params, tokens)  # [B, T, K, H]
    method = evicting(cfg, "knorm+keydiff", budget=6, recent=0, options={"share": share})
    _, cache = run(cfg, method, tokens, [24], 32)
    kept = np.sort(np.asarray(cache.layers[0].positions), axis=-1)
    for b in range(2):
        for h in range(cfg.model.num_kv_heads):
            key = keys[b, :, h]
            survivors = np.argsort(np.linalg.norm(key, axis=-1), kind="stable")[:staged]
            unit = key / np.linalg.norm(key, axis=-1)[:, None]
            anchor = unit.mean(0)
            cosine = unit @ anchor / np.linalg.norm(anchor)
            best = survivors[np.argsort(cosine[survivors], kind="stable")[:6]]
            np.testing.assert_array_equal(kept[b, h], np.sort(best))


def test_it_composes_with_observing_scorers_groups_pages_and_kvpress_presets():
    """snapkv+knorm (the attention SnapKV observes) over KIVI's groups in pages;
    kvpress's preset of a composition is both scorers' (SnapKV's window); a stage's
    per-layer budgets are the composition's."""
    cfg = VARIANTS["gqa"]()
    assert_composes(cfg, "snapkv+knorm", options={"share": 0.5})
    preset = kvpress_evict("snapkv+knorm")
    assert preset["obs_window"] == 64 and preset["options"] == {"pooling": "mean"}
    label = kvlab.cache.cache_label(cfg.model, evicting(cfg, "snapkv+knorm", budget=8))
    assert "snapkv+knorm keeping 8 tokens" in label
    layered = evicting(
        cfg, "chunkkv:knorm+per_layer:keydiff", budget=8, options={"weights": [1, 3]}
    )
    cache = kvlab.init_cache(cfg.model, layered, 1, 32)
    assert [layer.policy.slots for layer in cache.layers] == [4, 12]  # one stage's budgets


@pytest.mark.parametrize(
    "method, options, message",
    [
        ("h2o+knorm", {}, "h2o keeps a state per slot, which a composition cannot stage"),
        ("knorm+adakv", {}, "adakv pools its heads"),
        ("snapkv+tova", {}, "observe different queries \\(last and window\\)"),
        ("knorm+knorm+knorm", {}, "composes other than two scorers"),
        ("knorm+", {}, "composes other than two scorers"),
        ("knorm+nothing", {}, "composes 'nothing', which is no scorer"),
        ("knorm+keydiff", {"share": 0.0}, "options.share=0.0 is not a share in \\(0, 1\\]"),
        ("per_layer:knorm+pyramidkv", {"weights": [1, 2]}, "both stages set per-layer budgets"),
    ],
)
def test_what_cannot_be_composed_is_refused_naming_the_field(method, options, message):
    cfg = VARIANTS["gqa"]()
    with pytest.raises(ValueError, match=message):
        kvlab.init_cache(cfg.model, evicting(cfg, method, budget=8, options=options), 1, 32)
