"""Hybrid attention (model.layer_types): sliding layers beside full ones, each its cache.

A sliding layer sees its last model.sliding_window positions and caches a ring of
that many slots; a full layer sees every position and caches as the cache section
says (16-bit, quantized, evicting). transformers' Qwen2 with the same layer_types
computes the same logits (tests/checkpoints/hf/test_live.py, "qwen2_hybrid").
"""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.evict import EvictingLayer
from kvlab.cache.quant import QuantizedTensor
from tests.helpers import build, random_tokens, run_in_chunks, tiny_config

WINDOW = 3
MAX_LEN = 24
TYPES = ("sliding", "full", "sliding", "full")


def hybrid(types=TYPES, attention="gqa", sinks=0, **cache_fields):
    """The tiny model with `types` layers (window 3, `sinks` first positions kept)
    and cache fields changed."""
    model = dict(num_layers=len(types), sliding_window=WINDOW, sliding_sinks=sinks)
    if attention == "mla":
        cfg = kvlab.load_config("configs/mla.py:tiny")
        cfg.model.update(layer_types=types, **model)
    else:
        cfg = tiny_config(layer_types=types, **model)
    evict = cache_fields.pop("evict", {})
    cfg.cache.update(cache_fields)
    cfg.cache.evict.update(evict)
    return kvlab.validate_config(cfg)


def chunked(cfg, tokens, chunks):
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cfg.cache, tokens.shape[0], MAX_LEN)
    assert kvlab.cache_bytes(cfg.model, cfg.cache, tokens.shape[0], MAX_LEN) == kvlab.tree_bytes(
        cache
    )
    return run_in_chunks(apply, params, cache, tokens, chunks)


def chunkings(total: int):
    return st.lists(st.integers(1, 6), min_size=1, max_size=total).map(
        lambda sizes: _cover(sizes, total)
    )


def _cover(sizes, total):
    out, left = [], total
    for size in sizes:
        if left == 0:
            break
        out.append(min(size, left))
        left -= out[-1]
    return out + ([left] if left else [])


@settings(max_examples=8, deadline=None)
@given(
    types=st.lists(st.sampled_from(["sliding", "full"]), min_size=2, max_size=3).filter(
        lambda t: len(set(t)) == 2
    ),
    chunks=chunkings(11),
    attention=st.sampled_from(["gqa", "mla"]),
    sinks=st.sampled_from([0, 2]),
)
def test_the_cache_in_any_chunks_equals_the_plain_forward(types, chunks, attention, sinks):
    """Each sliding layer bands its attention (keeping its first `sinks` positions
    in view) and each full one does not, with or without a cache: the plain forward
    and the cache fed in any chunks agree, and the sliding layers store rings of
    the window and sinks (the full ones every position)."""
    cfg = hybrid(tuple(types), attention, sinks)
    tokens = random_tokens(cfg, (2, 11))
    _, params, apply = build(cfg)
    plain, _ = apply({"params": params}, tokens)
    out, cache = chunked(cfg, tokens, chunks)
    # float32 sums in another order for each chunk shape: a latent model's logits
    # near 1 have differed by 5.007e-6 (chunks [2, 9])
    np.testing.assert_allclose(out, plain, atol=2e-5, rtol=0)
    for kind, layer in zip(types, cache.layers, strict=True):
        assert layer.capacity == MAX_LEN
        slots = jax.tree.leaves(layer)[0].shape[2]
        assert slots == (WINDOW + sinks if kind == "sliding" else MAX_LEN)


def test_only_the_sliding_layers_band_their_attention():
    """Logits before the window fills equal the full model's; past it they differ
    from both the full model and a model whose every layer slides."""
    cfg = hybrid()
    tokens = random_tokens(cfg, (2, 11))
    _, params, apply = build(cfg)
    out, _ = apply({"params": params}, tokens)
    others = {}
    for name, window, types in (("full", 0, ()), ("sliding", WINDOW, ())):
        alike = cfg.copy_and_resolve_references()
        alike.model.update(sliding_window=window, layer_types=types)
        _, same, alike_apply = build(alike)
        others[name], _ = alike_apply({"params": same}, tokens)
    for other in others.values():
        np.testing.assert_allclose(out[:, :WINDOW], other[:, :WINDOW], atol=5e-6, rtol=0)
        assert np.abs(np.asarray(out) - np.asarray(other))[:, WINDOW:].max(-1).min() > 1e-3


def test_sliding_sinks_are_streamingllm_as_the_layers_mask():
    """A model whose every layer slides over 3 positions and keeps its first 2 in
    view computes, without a cache and through its ring in any chunks, what the
    full model computes through cache.evict.method='sinks' (2 sinks, budget 5):
    StreamingLLM's cache, as the layers' own mask. Without the sinks the logits
    past the window differ."""
    cfg = hybrid(("sliding", "sliding"), sinks=2)
    tokens = random_tokens(cfg, (2, 11))
    _, params, apply = build(cfg)
    plain, _ = apply({"params": params}, tokens)
    ring, cache = chunked(cfg, tokens, [4, 1, 6])
    np.testing.assert_allclose(ring, plain, atol=5e-6, rtol=0)
    full = tiny_config(num_layers=2)
    full.cache.evict.update(method="sinks", sinks=2, budget=WINDOW + 2)
    streaming, _ = chunked(kvlab.validate_config(full), tokens, [4, 1, 6])
    np.testing.assert_allclose(streaming, plain, atol=5e-6, rtol=0)
    alone, _ = build(hybrid(("sliding", "sliding")))[2]({"params": params}, tokens)
    assert np.abs(np.asarray(alone) - np.asarray(plain))[:, WINDOW + 1 :].max(-1).min() > 1e-3
    label = kvlab.cache.accounting.cache_label(cfg.model, cfg.cache)
    assert "the last 3 tokens and the first 2 (sliding window)" in label


@pytest.mark.parametrize("sliding_layers", ["plain", "as_full"])
def test_quantization_applies_to_the_full_layers_unless_asked(sliding_layers):
    """4-bit per-token codes: the full layers store codes and the sliding rings stay
    in cache.dtype ('plain') or store codes too ('as_full'); per-token codes do not
    depend on the chunks, so any chunks give one prefill's logits; the bytes are
    the tree's, and 'plain' costs the rings' 16 bits."""
    cfg = hybrid(k_bits=4, v_bits=4, k_axis="token", sliding_layers=sliding_layers)
    tokens = random_tokens(cfg, (2, 11))
    whole, cache = chunked(cfg, tokens, [11])
    out, _ = chunked(cfg, tokens, [4, 1, 6])
    np.testing.assert_allclose(out, whole, atol=5e-6, rtol=0)
    for kind, layer in zip(TYPES, cache.layers, strict=True):
        quantized = isinstance(layer.tensors[0], QuantizedTensor)
        assert quantized == (kind == "full" or sliding_layers == "as_full")
    _, params, apply = build(cfg)
    plain, _ = apply({"params": params}, tokens)
    assert np.abs(np.asarray(whole) - np.asarray(plain)).max() > 1e-3  # the codes matter
    sizes = {
        name: kvlab.cache_bytes(cfg.model, dict(cfg.cache, sliding_layers=name), 2, MAX_LEN)
        for name in ("plain", "as_full")
    }
    assert sizes["as_full"] < sizes["plain"]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        dict(k_bits=4, v_bits=4, k_axis="token"),
        dict(evict=dict(method="snapkv", budget=5, recent=2)),
    ],
    ids=["16-bit", "4-bit", "snapkv"],
)
def test_pages_hold_the_full_layers_and_give_the_dense_logits(fields):
    """A paged cache keeps the full layers in page pools (block tables reversed) and
    the sliding layers' rings per row: the dense cache's logits, its bytes counted."""
    dense = hybrid(**fields)
    tokens = random_tokens(dense, (2, 11))
    want, _ = chunked(dense, tokens, [4, 7])
    paged = hybrid(kind="paged", page_size=4, **fields)
    _, params, apply = build(paged)
    cache = kvlab.init_cache(paged.model, paged.cache, 2, MAX_LEN)
    assert kvlab.cache_bytes(paged.model, paged.cache, 2, MAX_LEN) == kvlab.tree_bytes(cache)
    cache = cache.replace(block_tables=cache.block_tables[::-1, ::-1])
    got, cache = run_in_chunks(apply, params, cache, tokens, [4, 7])
    np.testing.assert_allclose(got, want, atol=5e-6, rtol=0)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds[0] == kinds[2] == "EvictingLayer" and kinds[1] == kinds[3] != "EvictingLayer"
    assert "Paged" in kinds[1]


def test_eviction_applies_to_the_full_layers():
    """snapkv with a budget of 5: the full layers keep 5 scored slots, the sliding
    ones stay rings of the window, and the first (sliding) layer stores what it
    stores without eviction; a budget that holds every token is the full cache."""
    tokens_count = 11
    kept = hybrid(evict=dict(method="snapkv", budget=5, recent=2))
    everything = hybrid(evict=dict(method="snapkv", budget=tokens_count, recent=2))
    plain = hybrid()
    tokens = random_tokens(plain, (2, tokens_count))
    reference, untouched = chunked(plain, tokens, [6, 5])
    same, _ = chunked(everything, tokens, [6, 5])
    np.testing.assert_allclose(same, reference, atol=5e-6, rtol=0)
    out, cache = chunked(kept, tokens, [6, 5])
    assert np.abs(out - reference).max() > 1e-4
    methods = [(layer.policy.method, layer.policy.slots) for layer in cache.layers]
    assert methods == [("window", WINDOW), ("snapkv", 5)] * 2
    assert isinstance(cache.layers[0], EvictingLayer)
    for got, want in zip(
        jax.tree.leaves(cache.layers[0]), jax.tree.leaves(untouched.layers[0]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    label = kvlab.cache.accounting.cache_label(kept.model, kept.cache)
    assert "snapkv keeping 5 tokens per KV head" in label and "in 2 full layers" in label
    assert f"the last {WINDOW} tokens in 2 sliding layers (in float32)" in label


def test_a_cache_for_another_layer_pattern_is_refused():
    """A cache whose layers are all full, or built for another pattern, is refused
    before anything runs: the sliding layer would otherwise see every position."""
    cfg = hybrid()
    model, params, _ = build(cfg)
    tokens = random_tokens(cfg, (1, 4))
    for types, window in (((), 0), (("full", "sliding", "full", "sliding"), WINDOW)):
        other = cfg.copy_and_resolve_references()
        other.model.update(sliding_window=window, layer_types=types)
        cache = kvlab.init_cache(other.model, other.cache, 1, MAX_LEN)
        with pytest.raises(ValueError, match=r"cache layer 0 is not a ring of the model's window"):
            model.apply({"params": params}, tokens, cache=cache)
    sinks = hybrid(sinks=2)  # the same layers, keeping two sinks: the ring must hold them
    cache = kvlab.init_cache(cfg.model, cfg.cache, 1, MAX_LEN)
    with pytest.raises(ValueError, match=r"keeps model.sliding_sinks=2"):
        kvlab.Transformer(sinks.model).apply({"params": params}, tokens, cache=cache)


REFUSALS = {
    "an unknown kind": (
        dict(layer_types=("sliding", "global")),
        r"model.layer_types=.* is not a tuple of 'full' / 'sliding'",
    ),
    "too few": (dict(layer_types=("sliding",)), r"names 1 layers but model.num_layers=2"),
    "no window": (
        dict(layer_types=("sliding", "full"), sliding_window=0),
        r"has sliding layers but model.sliding_window=0",
    ),
    "a window no layer reads": (
        dict(layer_types=("full", "full")),
        r"model.sliding_window=3 is read by no layer",
    ),
    "sinks without a window": (
        dict(layer_types=(), sliding_window=0, sliding_sinks=2),
        r"model.sliding_sinks=2 keeps positions beside a window, but model.sliding_window=0",
    ),
    "a shared cache layer of two kinds": (
        dict(layer_types=("sliding", "full"), topology="cla:2"),
        r"layers 0 and 1, which share a cache layer under model.topology='cla:2'",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_layer_types_are_refused(case):
    changes, message = REFUSALS[case]
    model = tiny_config().model
    model.update({"sliding_window": WINDOW, **changes})
    with pytest.raises(ValueError, match=message):
        kvlab.config.validate_model_config(model)


def test_caches_a_hybrid_model_cannot_hold_are_refused():
    cfg = hybrid(kind="paged")
    with pytest.raises(ValueError, match=r"cache.prefix_caching=True cannot serve model.layer"):
        kvlab.config.validate_cache_config(dict(cfg.cache, prefix_caching=True), cfg.model)
    alike = tiny_config()
    with pytest.raises(ValueError, match=r"cache.sliding_layers='as_full' applies to a model"):
        kvlab.config.validate_cache_config(dict(alike.cache, sliding_layers="as_full"), alike.model)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    with pytest.raises(ValueError, match=r"cannot be exported as llama or mistral"):
        kvlab.save_hf(cfg, params, "/nonexistent/never-written")
    sinks = hybrid(sinks=2)
    with pytest.raises(ValueError, match=r"model.sliding_sinks=2 cannot be exported"):
        kvlab.save_hf(sinks, params, "/nonexistent/never-written")
