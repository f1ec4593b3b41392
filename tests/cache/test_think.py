"""ThinK (kvlab/cache/evict/think.py) against its definition (arXiv:2407.21018, as
kvpress's ThinKPress prunes after a scorer): per row and KV head, the key
channels of largest mean(q^2) over the context's last queries x mean(k^2) over
the kept keys stay; the slots hold only them, and attention reads the rest as zero."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache.evict import ChannelReader, PrunedKeys
from tests.cache.test_after_prefill import kept
from tests.cache.test_duo_attention import _rope
from tests.cache.test_evict import evicting
from tests.helpers import VARIANTS, build, random_tokens, right_padded, tiny_config
from tests.test_export import assert_round_trips

MAX_LEN, HEADROOM = 64, 8


def compressed(cfg, contexts, method="think:snapkv", ratio=0.5, **fields):
    """(cache, cache_cfg, prefill logits) after one padded step compressing each
    row's context (after_prefill, keeping `ratio` of it)."""
    cache_cfg = evicting(cfg, method, when="after_prefill", ratio=ratio, headroom=HEADROOM)
    cache_cfg.evict.update(fields)
    tokens = right_padded(contexts)
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, len(contexts), MAX_LEN)
    counts = jnp.asarray([len(c) for c in contexts], jnp.int32)
    logits, cache = apply({"params": params}, tokens, cache=cache, num_tokens=counts, compress=True)
    return cache, cache_cfg, logits


def first_layer_qk(cfg, params, tokens):
    """float64 queries [T, N, H] and keys [T, K, H] of the first layer, after RoPE."""
    m = cfg.model
    block = params["block_0"]
    x = np.asarray(params["embed"]["embedding"], np.float64)[np.asarray(tokens)]
    h = x / np.sqrt((x**2).mean(-1, keepdims=True) + m.norm_eps)
    h = h * np.asarray(block["attention_norm"]["scale"], np.float64)
    q = np.einsum("td,dnh->tnh", h, np.asarray(block["attention"]["query"]["kernel"], np.float64))
    k = np.einsum("td,dkh->tkh", h, np.asarray(block["attention"]["key"]["kernel"], np.float64))
    positions = np.arange(len(tokens), dtype=np.float64)
    return _rope(q, positions, m.rope_theta), _rope(k, positions, m.rope_theta)


def reference_channels(cfg, params, tokens, kept_positions, window=32, ratio=0.5):
    """Per KV head, the sorted channels ThinK keeps (float64 from the parameters)."""
    m = cfg.model
    q, k = first_layer_qk(cfg, params, tokens)
    groups = m.num_heads // m.num_kv_heads
    energy = (q[-window:] ** 2).mean(0).reshape(m.num_kv_heads, groups, -1).mean(1)  # [K, H]
    out = []
    for head, positions in enumerate(kept_positions):
        score = energy[head] * (k[positions, head] ** 2).mean(0)
        order = np.argsort(-score, kind="stable")
        count = m.head_dim - int(m.head_dim * ratio)
        assert score[order[count - 1]] - score[order[count]] > 1e-9  # no tie at the cut
        out.append(sorted(order[:count].tolist()))
    return out


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_the_first_layer_keeps_the_channels_of_most_query_and_key_energy(ratio):
    """Rows of 40 and 29 tokens compressed in one padded step: each KV head's kept
    channels are the float64 reference's over the tokens its scorer kept and the
    last 32 queries of its row (all of a row shorter than that)."""
    cfg = VARIANTS["gqa"]()
    _, params, _ = build(cfg)
    contexts = [random_tokens(cfg, (40,), seed=1), random_tokens(cfg, (29,), seed=2)]
    options = {"key_channel_compression_ratio": ratio}
    cache, cache_cfg, _ = compressed(cfg, contexts, options=options)
    keys = cache.layers[0].tensors[0]
    assert isinstance(keys, PrunedKeys)
    assert keys.kept.shape[-1] == cfg.model.head_dim - int(cfg.model.head_dim * ratio)
    for row, context in enumerate(contexts):
        want = reference_channels(cfg, params, context, kept(cache.layers[0])[row], ratio=ratio)
        assert np.asarray(keys.channels[row]).tolist() == want
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, MAX_LEN) == kvlab.tree_bytes(cache)


def test_it_keeps_the_scorers_tokens_and_stores_their_kept_channels():
    """Over SnapKV: the prefill's logits and the kept tokens are SnapKV's alone (the
    prefill attends to whole keys); the stored keys are SnapKV's with the pruned
    channels zero, in half the key bytes (the channel ids beside them)."""
    cfg = VARIANTS["gqa"]()
    contexts = [random_tokens(cfg, (40,), seed=3), random_tokens(cfg, (33,), seed=4)]
    think, think_cfg, think_logits = compressed(cfg, contexts)
    snap, snap_cfg, snap_logits = compressed(cfg, contexts, "snapkv")
    np.testing.assert_array_equal(think_logits, snap_logits)
    for pruned, whole in zip(think.layers, snap.layers, strict=True):
        assert kept(pruned) == kept(whole)
        keys = pruned.tensors[0]
        expanded = np.asarray(keys.expand(keys.kept))
        mask = np.zeros(expanded.shape, bool)
        for b, h in np.ndindex(*keys.channels.shape[:2]):
            mask[b, h, :, np.asarray(keys.channels[b, h])] = True
        want = np.where(mask, np.asarray(whole.tensors[0], np.float32), 0.0)
        np.testing.assert_array_equal(expanded, want)
    m = cfg.model
    saved = m.num_layers * 2 * m.num_kv_heads * think.layers[0].slots * (m.head_dim // 2)
    saved = saved * jnp.dtype(think_cfg.dtype).itemsize - m.num_layers * 2 * m.num_kv_heads * 8 * 4
    assert kvlab.tree_bytes(snap) - kvlab.tree_bytes(think) == saved
    assert (
        kvlab.cache_bytes(m, snap_cfg, 2, MAX_LEN) - kvlab.cache_bytes(m, think_cfg, 2, MAX_LEN)
        == saved
    )


def test_later_tokens_read_alike_whatever_the_chunks():
    """After the compression the question's keys are stored, and seen by their own
    step's queries, without the pruned channels: five tokens at once or one by one
    give the same logits and the same cache; the channels stay the prefill's."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    cache, _, _ = compressed(cfg, [random_tokens(cfg, (40,), seed=5)])
    question = random_tokens(cfg, (1, 5), seed=6)
    together, after = apply({"params": params}, question, cache=cache)
    steps, single = [], cache
    for t in range(5):
        out, single = apply({"params": params}, question[:, t : t + 1], cache=single)
        steps.append(out)
    np.testing.assert_allclose(np.concatenate(steps, 1), together, atol=2e-5, rtol=0)
    for a, b, before in zip(after.layers, single.layers, cache.layers, strict=True):
        np.testing.assert_array_equal(a.tensors[0].channels, before.tensors[0].channels)
        # one token's key projection and five tokens' run in different matrix
        # routines, whose float32 sums round differently (a few parts in 1e6)
        np.testing.assert_allclose(a.tensors[0].kept, b.tensors[0].kept, rtol=1e-5, atol=1e-6)


def test_pruning_nothing_is_the_scorer_alone_and_more_costs_more():
    """key_channel_compression_ratio 0 stores whole keys (the scorer's cache, its
    logits after); pruning more channels moves the question's logits further from
    the full cache's."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    context, question = random_tokens(cfg, (40,), seed=7), random_tokens(cfg, (1, 6), seed=8)
    full = kvlab.init_cache(cfg.model, cfg.cache, 1, MAX_LEN)
    _, full = apply({"params": params}, context[None], cache=full)
    reference = jax.nn.log_softmax(apply({"params": params}, question, cache=full)[0])

    def divergence(method, ratio):
        options = {} if method == "snapkv" else {"key_channel_compression_ratio": ratio}
        cache, _, _ = compressed(cfg, [context], method, ratio=1.0, options=options)
        got = jax.nn.log_softmax(apply({"params": params}, question, cache=cache)[0])
        return float((jnp.exp(reference) * (reference - got)).sum(-1).mean()), cache

    none, cache = divergence("think:snapkv", 0.0)
    assert not isinstance(cache.layers[0].tensors[0], PrunedKeys) and none < 1e-9
    kls = [divergence("think:snapkv", r)[0] for r in (0.25, 0.75)]
    assert 1e-6 < kls[0] < kls[1]


def test_every_step_chooses_in_the_first_chunk_over_a_scorer_that_observes_nothing():
    """cache.evict.when='every_step' over KNorm: the channels are chosen in a row's
    first write (its first chunk: its last 32 queries, the keys it keeps) and kept
    through the chunks after it."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    cache_cfg = evicting(cfg, "think:knorm", budget=24)
    tokens = random_tokens(cfg, (1, 50), seed=9)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, MAX_LEN)
    _, cache = apply({"params": params}, tokens[:, :36], cache=cache)
    first = np.asarray(cache.layers[0].tensors[0].channels[0]).tolist()
    assert first == reference_channels(cfg, params, tokens[0, :36], kept(cache.layers[0])[0])
    _, cache = apply({"params": params}, tokens[:, 36:], cache=cache)
    assert np.asarray(cache.layers[0].tensors[0].channels[0]).tolist() == first
    assert int(cache.lengths[0]) == 50 and not np.asarray(cache.errors).any()


@pytest.mark.parametrize("values", [16, 4])
def test_in_pages_and_beside_quantized_values_it_is_the_dense_cache(values):
    """In pages of 8 (kept channels paged, channel ids per row), and with 4-bit
    values: the dense cache's tokens, channels and logits through a compression and
    three decode steps; bytes counted as the tree's."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 40), seed=12)
    steps = random_tokens(cfg, (2, 3), seed=13)
    runs = []
    for storage in ({}, {"kind": "paged", "page_size": 8}):
        cache_cfg = evicting(cfg, "think:snapkv", when="after_prefill", ratio=0.5, headroom=8)
        cache_cfg.update(storage)
        if values < 16:
            cache_cfg.update(v_bits=values, v_axis="token", group_size=8)
        cache = kvlab.init_cache(cfg.model, cache_cfg, 2, MAX_LEN)
        logits, cache = apply({"params": params}, tokens, cache=cache, compress=True)
        out = [logits[:, -1]]
        for t in range(3):
            logits, cache = apply({"params": params}, steps[:, t : t + 1], cache=cache)
            out.append(logits[:, -1])
        assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, MAX_LEN) == kvlab.tree_bytes(cache)
        runs.append((np.stack(out, 1), cache))
    (dense_logits, dense), (paged_logits, paged) = runs
    np.testing.assert_allclose(paged_logits, dense_logits, atol=2e-5, rtol=0)
    for a, b in zip(dense.layers, paged.layers, strict=True):
        assert kept(a) == kept(b)
        np.testing.assert_array_equal(a.tensors[0].channels, b.pools[0].channels)


@pytest.mark.parametrize("impl", ["pallas", "native"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_backends_read_pruned_keys_as_the_reference_does(impl, dtype):
    """The native kernels read the kept channels as keys of that width against the
    queries' kept channels (kvlab.kernels.native.NativeChannels: here 16 of 32
    channels in 1,040 slots of bfloat16, which the reference streams); Pallas
    declines the reader (stored.ChannelReader): a question and a decode step after
    a compression (every token kept, half the channels) give the XLA reference's
    logits."""
    cfg = tiny_config(num_kv_heads=2, head_dim=32)
    cfg.cache.dtype = dtype
    context = random_tokens(cfg, (1, 1030), seed=10)
    question = random_tokens(cfg, (1, 3), seed=11)
    _, params, apply = build(cfg)
    cache_cfg = evicting(cfg, "think:snapkv", when="after_prefill", ratio=1.0, headroom=8)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, 1040)
    _, cache = apply({"params": params}, context, cache=cache, compress=True)
    want, after = apply({"params": params}, question, cache=cache)
    want_next, _ = apply({"params": params}, question[:, :1], cache=after)
    cfg.model.attention_impl = impl
    model, _, kernel = build(cfg)
    got, after = kernel({"params": params}, question, cache=cache)
    got_next, _ = kernel({"params": params}, question[:, :1], cache=after)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    np.testing.assert_allclose(got_next, want_next, atol=2e-5, rtol=0)
    if (
        impl == "native"
        and dtype == "bfloat16"
        and kvlab.backends.get("native").unavailable_reason() is None
    ):
        program = jax.jit(model.apply).lower({"params": params}, question[:, :1], cache=after)
        assert "kvlab_scores" in program.as_text()  # the kernels read the pruned keys


@settings(max_examples=6, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    slots=st.integers(1, 9),
    width=st.sampled_from([4, 8, 16]),
    kept_share=st.floats(0.1, 1.0),
    queries=st.integers(1, 5),
    start=st.integers(0, 8),
    seed=st.integers(0, 2**16),
)
def test_the_reader_equals_attention_over_zeroed_channels(
    batch, heads, slots, width, kept_share, queries, start, seed
):
    """ChannelReader's products, whole and sliced, are those of the keys expanded with
    zeros in the channels not kept."""
    rng = np.random.default_rng(seed)
    count = max(1, int(width * kept_share))
    channels = np.sort(
        np.stack([rng.permutation(width)[:count] for _ in range(batch * heads)]), -1
    ).reshape(batch, heads, count)
    keys = PrunedKeys(
        jnp.asarray(rng.normal(size=(batch, heads, slots, count)), jnp.float32),
        jnp.asarray(channels, jnp.int32),
        width,
    )
    reader = ChannelReader(keys)
    dense = np.zeros((batch, heads, slots, width), np.float32)
    for b, h in np.ndindex(batch, heads):
        dense[b, h][:, channels[b, h]] = np.asarray(keys.kept[b, h])
    np.testing.assert_array_equal(reader.dequantize(), dense)
    q = rng.normal(size=(batch, heads, queries, width)).astype(np.float32)
    w = rng.normal(size=(batch, heads, queries, slots)).astype(np.float32)
    np.testing.assert_allclose(reader.scores(q), np.einsum("bkmd,bksd->bkms", q, dense), atol=1e-5)
    np.testing.assert_allclose(
        reader.weighted_sum(w), np.einsum("bkms,bksd->bkmd", w, dense), atol=1e-5
    )
    start = min(start, slots - 1)
    size = slots - start
    part = reader.chunk(jnp.asarray(start), size)
    np.testing.assert_array_equal(part.dequantize(), dense[:, :, start:])
    assert reader.shape == (batch, heads, slots, width)


REFUSED = {
    "adakv": ("think:adakv", {}, "pools its heads"),
    "4-bit keys": ("think:snapkv", {"k_bits": 4, "k_axis": "token"}, "quantized keys"),
    "KIVI": ("think:snapkv", {"v_bits": 4, "residual": 8, "group_size": 8}, "settles"),
    "prefix": (
        "think:snapkv",
        {"kind": "paged", "page_size": 8, "prefix_caching": True},
        "cache.prefix_caching",
    ),
    "kvzip": ("think:kvzip", {"evict.when": "after_prefill"}, "probes"),
    "composed": ("think:snapkv+knorm", {}, "composed"),
    "ratio": ("think:snapkv", {"evict.options": {"key_channel_compression_ratio": 1.0}}, "[0, 1)"),
    "window": ("think:snapkv", {"evict.options": {"channel_window": 0}}, "channel_window"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_storage_that_cannot_hold_pruned_keys_is_refused_naming_it(case):
    method, fields, why = REFUSED[case]
    cfg = VARIANTS["gqa"]()
    cache_cfg = evicting(cfg, method, ratio=0.5)
    for name, value in fields.items():
        section, _, field = name.rpartition(".")
        (cache_cfg.evict if section else cache_cfg)[field] = value
    with pytest.raises(ValueError, match=re.escape(why)):
        kvlab.init_cache(cfg.model, cache_cfg, 1, MAX_LEN)
    with pytest.raises(ValueError, match="cache"):
        kvlab.cache_bytes(cfg.model, cache_cfg, 1, MAX_LEN)


def test_a_latent_model_is_refused():
    cfg = VARIANTS["mla_absorbed"]()
    with pytest.raises(ValueError, match="think scores 'gqa'"):
        kvlab.init_cache(cfg.model, evicting(cfg, "think:snapkv", ratio=0.5), 1, MAX_LEN)


def test_an_exported_step_over_pruned_keys_round_trips():
    """Serialized by jax.export and read back (stored.PrunedKeys registered with the
    cache's pytrees), a step gives the model's logits and cache."""
    cfg = VARIANTS["gqa"]()
    cfg.cache = evicting(cfg, "think:snapkv", budget=24)
    assert_round_trips(cfg)
