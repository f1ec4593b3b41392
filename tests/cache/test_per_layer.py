"""per_layer (kvlab/cache/evict/per_layer.py), kvpress's PerLayerCompressionPress over
any scorer: layer i keeps weights[i] / mean(weights) of the budget (of each row's
context, compressed after its prefill), choosing as its scorer alone would."""

import numpy as np
import pytest

import kvlab
from tests.cache.test_after_prefill import after_prefill, kept
from tests.cache.test_evict import evicting
from tests.helpers import VARIANTS, build, random_tokens


def prefill(cfg, cache_cfg, tokens, max_len, **kwargs):
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, tokens.shape[0], max_len)
    return apply({"params": params}, tokens, cache=cache, **kwargs)[1]


@pytest.mark.parametrize("scorer", ["snapkv"])
def test_each_layer_keeps_its_share_of_the_budget_as_its_scorer_alone_would(scorer):
    """Weights [1, 3] over a budget of 8: layer 0 holds what a budget of 4 keeps,
    layer 1 what a budget of 12 keeps (one prefill: each layer's keys are the
    plain forward's whatever the other layer evicted), at the bytes of 8 each."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 16), seed=3)
    wrapped = evicting(cfg, f"per_layer:{scorer}", budget=8, options={"weights": [1, 3]})
    cache = prefill(cfg, wrapped, tokens, 16)
    assert [layer.policy.slots for layer in cache.layers] == [4, 12]
    for i, budget in enumerate((4, 12)):
        alone = prefill(cfg, evicting(cfg, scorer, budget=budget), tokens, 16)
        assert kept(cache.layers[i]) == kept(alone.layers[i])
        assert (np.asarray(cache.layers[i].stored(cache.lengths)) == budget).all()
    uniform = evicting(cfg, scorer, budget=8)
    counted = kvlab.cache_bytes(cfg.model, wrapped, 2, 16)
    assert counted == kvlab.cache_bytes(cfg.model, uniform, 2, 16) == kvlab.tree_bytes(cache)
    label = kvlab.cache.cache_label(cfg.model, wrapped)
    assert f"per_layer:{scorer}" in label and "weights" in label


def test_a_compressed_context_keeps_each_layers_share_of_each_row():
    """after_prefill with ratio 0.5 and weights [1, 3]: layer 0 keeps floor(0.25 x n)
    of a row's n context tokens, layer 1 floor(0.75 x n), the choices of those
    budgets (rows of 12 and 9 tokens)."""
    cfg = VARIANTS["gqa"]()
    tokens = random_tokens(cfg, (2, 12), seed=6)
    lengths = np.array([12, 9])
    weights = {"weights": [1, 3]}
    wrapped = after_prefill(cfg, "per_layer:knorm", ratio=0.5, recent=0, options=weights)
    cache = prefill(cfg, wrapped, tokens, 17, num_tokens=lengths, compress=True)
    for i, share in enumerate((0.25, 0.75)):
        for b, n in enumerate(lengths):
            target = int(np.floor(share * n))
            row = tokens[b : b + 1, :n]
            alone = after_prefill(cfg, "knorm", budget=target, recent=0)
            alone = prefill(cfg, alone, row, 17, compress=True)
            assert kept(cache.layers[i])[b] == kept(alone.layers[i])[0]


@pytest.mark.parametrize(
    "method, fields, message",
    [
        ("per_layer:knorm", {"options": {"weights": [1]}}, "has 1 weight\\(s\\) for a model of 2"),
        ("per_layer:knorm", {"options": {"weights": [1, 0]}}, "weights=\\[1, 0\\] is not one"),
        ("per_layer:knorm", {"options": {}}, "weights=\\[\\] is not one positive"),
        ("per_layer:pyramidkv", {"options": {"weights": [1, 1]}}, "pyramidkv sets its own"),
        (
            "per_layer:knorm",
            {"options": {"weights": [1, 7]}, "recent": 2},
            "recent=2 keeps every token of a budget of 2 in layer 0",
        ),
        (
            "per_layer:knorm",
            {"options": {"weights": [1, 3]}, "ratio": 0.75, "when": "after_prefill"},
            "ask layer 1 to keep 1.12 of the context",
        ),
    ],
)
def test_weights_that_cannot_be_kept_are_refused_naming_the_field(method, fields, message):
    cfg = VARIANTS["gqa"]()
    fields = {"budget": 8, **fields}
    if "ratio" in fields:
        fields["budget"] = 0
    with pytest.raises(ValueError, match=message):
        kvlab.init_cache(cfg.model, evicting(cfg, method, **fields), 1, 32)


@pytest.mark.parametrize("method", ["per_layer:chunkkv:knorm", "chunkkv:per_layer:knorm"])
def test_it_nests_with_other_wrappers(method):
    cfg = VARIANTS["gqa"]()
    options = {"weights": [1, 3], "chunk_length": 4}
    cache = kvlab.init_cache(cfg.model, evicting(cfg, method, budget=8, options=options), 1, 32)
    assert [layer.policy.slots for layer in cache.layers] == [4, 12]
