"""KVzip (kvlab/cache/evict/kvzip.py) against its definition (arXiv:2505.23416, as
kvpress's KVzipPress scores one chunk): the probes (a request to repeat the
context, then the context again) fed after the context in the step that
compresses it score each context token by the largest probability any probe
query gave it; they leave nothing in the cache."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvlab
from kvlab.cache.evict.duo_attention import needed_budget
from kvlab.eval import calibrate
from kvlab.registry import SCORERS
from tests.cache.test_after_prefill import kept
from tests.cache.test_duo_attention import _rope
from tests.cache.test_evict import evicting
from tests.helpers import VARIANTS, build, random_tokens, right_padded

CONTEXT, MAX_LEN, HEADROOM = 40, 64, 8
KVZIP = SCORERS.get("kvzip")


def encode(text):  # a tokenizer for the test's vocabulary
    return [ord(ch) % 50 for ch in text]


def compressed(cfg, contexts, ratio, bits=16, storage=None, **fields):
    """(cache, cache_cfg, params) after one step of each row's context and probes
    (padded); `storage`: cache fields over the evicting section's."""
    cache_cfg = evicting(cfg, "kvzip", bits, when="after_prefill", ratio=ratio, headroom=HEADROOM)
    cache_cfg.evict.update(fields)
    cache_cfg.update(storage or {})
    rows = [[*c, *KVZIP.probe_tokens(encode, list(c))] for c in contexts]
    tokens = right_padded(rows)
    _, params, apply = build(cfg)
    cache = kvlab.init_cache(cfg.model, cache_cfg, len(rows), MAX_LEN)
    lengths = jnp.asarray([len(c) for c in contexts], jnp.int32)
    counts = jnp.asarray([len(r) for r in rows], jnp.int32)
    _, cache = apply({"params": params}, tokens, cache=cache, num_tokens=counts, compress=lengths)
    return cache, cache_cfg, params


def reference_scores(cfg, params, context):
    """float64 from the parameters, the first layer: per KV head and context token,
    the largest softmax probability (causal over context and probes) any probe
    query of the head's group gave it; the first `sinks` (4) score 2."""
    m = cfg.model
    tokens = np.asarray([*context, *KVZIP.probe_tokens(encode, list(context))])
    block = params["block_0"]
    x = np.asarray(params["embed"]["embedding"], np.float64)[tokens]  # [T, D]
    h = x / np.sqrt((x**2).mean(-1, keepdims=True) + m.norm_eps)
    h = h * np.asarray(block["attention_norm"]["scale"], np.float64)
    q = np.einsum("td,dnh->tnh", h, np.asarray(block["attention"]["query"]["kernel"], np.float64))
    k = np.einsum("td,dkh->tkh", h, np.asarray(block["attention"]["key"]["kernel"], np.float64))
    positions = np.arange(len(tokens), dtype=np.float64)
    q, k = _rope(q, positions, m.rope_theta), _rope(k, positions, m.rope_theta)
    groups = m.num_heads // m.num_kv_heads
    logits = np.einsum("qnh,knh->nqk", q, np.repeat(k, groups, axis=1)) / np.sqrt(m.head_dim)
    logits = np.where(np.tril(np.ones((len(tokens),) * 2, bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)  # [N, T, T]
    n = len(context)
    peak = weights[:, n:, :n].max(1).reshape(m.num_kv_heads, groups, n).max(1)  # [K, n]
    peak[:, :4] = 2.0
    return peak


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_the_first_layer_keeps_the_tokens_its_probes_peak_on(ratio):
    """The first layer's pool holds, over its two KV heads together, the
    floor(ratio x length) x 2 tokens of highest float64 score (reference_scores); rows of
    40 and 29 tokens compressed in one padded step keep what each alone keeps, and
    end at their contexts' lengths."""
    cfg = VARIANTS["gqa"]()
    contexts = [random_tokens(cfg, (CONTEXT,), seed=1), random_tokens(cfg, (29,), seed=2)]
    cache, cache_cfg, params = compressed(cfg, contexts, ratio, recent=0)
    np.testing.assert_array_equal(cache.lengths, [40, 29])
    assert not np.asarray(cache.errors).any()
    for row, context in enumerate(contexts):
        score = reference_scores(cfg, params, context)
        target = int(ratio * len(context)) * cfg.model.num_kv_heads
        order = np.argsort(-score.reshape(-1), kind="stable")
        best = score.reshape(-1)[order]
        assert best[target - 1] - best[target] > 1e-6  # no tie at the cut
        head, position = np.divmod(order[:target], len(context))
        expect = [sorted(position[head == h].tolist()) for h in range(cfg.model.num_kv_heads)]
        assert kept(cache.layers[0])[row] == expect
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, MAX_LEN) == kvlab.tree_bytes(cache)


@pytest.mark.parametrize(
    "variant, bits, storage",
    [("gqa", 16, {"kind": "paged", "page_size": 8}), ("gqa", 4, None), ("mla_absorbed", 16, None)],
)
def test_it_composes_with_pages_quantized_tokens_and_a_latent(variant, bits, storage):
    """In pages (the same tokens as the dense cache), over 4-bit tokens or a latent:
    rows end at their contexts, each layer keeps its target over its heads together
    (a latent: one head), and the bytes counted are the tree's."""
    cfg = VARIANTS[variant]()
    contexts = [random_tokens(cfg, (CONTEXT,), seed=1), random_tokens(cfg, (29,), seed=2)]
    cache, cache_cfg, _ = compressed(cfg, contexts, 0.5, bits, storage, recent=0)
    np.testing.assert_array_equal(cache.lengths, [40, 29])
    assert not np.asarray(cache.errors).any()
    heads = cfg.model.num_kv_heads if variant == "gqa" else 1
    for layer in cache.layers:
        held = np.asarray(layer.stored(cache.lengths)).sum(-1)
        np.testing.assert_array_equal(held, [20 * heads, 14 * heads])
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 2, MAX_LEN) == kvlab.tree_bytes(cache)
    if storage:
        dense, _, _ = compressed(cfg, contexts, 0.5, recent=0)
        for paged, plain in zip(cache.layers, dense.layers, strict=True):
            assert kept(paged) == kept(plain)


def test_the_probes_leave_nothing_behind():
    """Kept whole (ratio 1), the context after its probes answers as the full cache:
    the question's logits equal a cache without eviction fed context then question."""
    cfg = VARIANTS["gqa"]()
    context, question = random_tokens(cfg, (24,), seed=3), random_tokens(cfg, (1, 6), seed=4)
    cache, _, params = compressed(cfg, [context], 1.0)
    _, _, apply = build(cfg)
    got, after = apply({"params": params}, question, cache=cache)
    full = kvlab.init_cache(cfg.model, cfg.cache, 1, MAX_LEN)
    _, full = apply({"params": params}, context[None], cache=full)
    want, _ = apply({"params": params}, question, cache=full)
    np.testing.assert_allclose(got, want, atol=3e-6)
    assert int(after.lengths[0]) == 30


def test_a_context_that_fills_the_cache_takes_its_probes_past_the_capacity():
    """The probes are not held: a context of max_len tokens with its probes after it
    (past max_len) is no overflow; a context longer than max_len is flagged under
    jit and refused outside it."""
    cfg = VARIANTS["gqa"]()
    cache, cache_cfg, params = compressed(cfg, [random_tokens(cfg, (MAX_LEN,), seed=5)], 0.5)
    assert int(cache.lengths[0]) == MAX_LEN and not np.asarray(cache.errors).any()
    long = random_tokens(cfg, (MAX_LEN + 1,), seed=5)
    cache, _, _ = compressed(cfg, [long], 0.5)
    assert np.asarray(cache.errors)[0] & kvlab.cache.dense.OVERFLOW
    model, _, _ = build(cfg)
    tokens = np.asarray([[*long, *KVZIP.probe_tokens(encode, list(long))]], np.int32)
    empty = kvlab.init_cache(cfg.model, cache_cfg, 1, MAX_LEN)
    with pytest.raises(ValueError, match=f"would hold {MAX_LEN + 1} tokens"):
        model.apply({"params": params}, tokens, cache=empty, compress=np.asarray([MAX_LEN + 1]))


def test_tokens_past_the_headroom_evict_without_probes():
    """After the compression, steps carry no probes: a row fed more tokens than its
    headroom evicts (its pool of 2 x 22 slots full), keeping its sinks, no flag."""
    cfg = VARIANTS["gqa"]()
    cache, _, params = compressed(cfg, [random_tokens(cfg, (CONTEXT,), seed=1)], 0.25)
    _, _, apply = build(cfg)
    for t in range(16):
        logits, cache = apply({"params": params}, random_tokens(cfg, (1, 1), seed=t), cache=cache)
        assert np.isfinite(logits).all()
    assert int(cache.lengths[0]) == 56 and not np.asarray(cache.errors).any()
    for layer in cache.layers:
        assert layer.policy.slots == 44 and int(layer.stored(cache.lengths).sum()) == 44
        assert all(head[:4] == [0, 1, 2, 3] for head in kept(layer)[0])


def test_it_is_refused_where_no_step_compresses_and_for_a_bad_sink_count():
    """Refused before anything compiles: every step's eviction, a compression without
    the contexts' lengths (no probes to tell), a negative sink count."""
    cfg = VARIANTS["gqa"]()
    cache_cfg = evicting(cfg, "kvzip", when="after_prefill", ratio=0.5)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, MAX_LEN)
    model, params, _ = build(cfg)
    with pytest.raises(ValueError, match="feed each context, then its probes"):
        model.apply({"params": params}, random_tokens(cfg, (1, 8)), cache=cache, compress=True)
    with pytest.raises(ValueError, match="when='after_prefill'"):
        kvlab.init_cache(cfg.model, evicting(cfg, "kvzip", ratio=0.5), 1, MAX_LEN)
    bad = evicting(cfg, "kvzip", when="after_prefill", ratio=0.5, options={"sinks": -1})
    with pytest.raises(ValueError, match=r"options.sinks=-1"):
        kvlab.init_cache(cfg.model, bad, 1, MAX_LEN)


def assert_ranked_together(cache, ranked, ratio: float) -> None:
    """Each layer of `cache` (one row, compressed to `ratio`) holds the best of its
    tokens by `ranked` [L, K, T] over its heads together, as many as all layers'
    tokens ranked together put in it (kvpress's layerwise=False prunes the
    int(n x (1 - ratio)) lowest of all n) to its KV heads' slots (fewer by under
    2 x K); the layers hold unequal counts."""
    _, heads, length = ranked.shape
    every = np.sort(ranked.ravel())
    cut = every[int(every.size * (1 - ratio))]  # the lowest pruned, the rest kept
    counts = []
    for layer, score in enumerate(ranked):
        got = kept(cache.layers[layer])[0]
        count = sum(len(head) for head in got)
        order = np.argsort(-score.reshape(-1), kind="stable")
        best = score.reshape(-1)[order]
        assert best[count - 1] - best[count] > 1e-5  # no tie at the cut
        head, position = np.divmod(order[:count], length)
        assert got == [sorted(position[head == h].tolist()) for h in range(heads)], layer
        ranked_together = int((score >= cut).sum())
        assert 0 <= ranked_together - count < 2 * heads, (layer, ranked_together, count)
        counts.append(count)
    assert len(set(counts)) > 1, counts


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_unequal_layer_shares_follow_the_calibrated_contexts_ranking(ratio, tmp_path):
    """layerwise=False, calibrated on the compressed context itself
    (calibrate.kvzip_calibration, which scores as the compressing step does): each
    layer keeps its best tokens over its heads together, as many as all layers'
    tokens ranked together put in it (kvpress's layerwise=False), to its KV
    heads' slots (fewer by under 2 x K); the layers keep unequal counts; no
    calibration file, or one of another depth, is refused naming the option."""
    cfg = VARIANTS["gqa"]()
    context = random_tokens(cfg, (CONTEXT,), seed=1)
    _, params, _ = build(cfg)
    scores = calibrate.kvzip_calibration(cfg.model, params, context[None], encode)
    heads = cfg.model.num_kv_heads
    assert scores.shape == (cfg.model.num_layers, 1, heads, CONTEXT)
    calibrate.save_kvzip_scores(tmp_path / "scores.npz", scores)
    options = {"layerwise": False, "scores": str(tmp_path / "scores.npz")}
    cache, cache_cfg, _ = compressed(cfg, [context], ratio, recent=0, options=options)
    ranked = np.where(np.arange(CONTEXT) < 4, 2.0, scores[:, 0])  # [L, K, T], sinks first
    assert_ranked_together(cache, ranked, ratio)
    assert kvlab.cache_bytes(cfg.model, cache_cfg, 1, MAX_LEN) == kvlab.tree_bytes(cache)
    calibrate.save_kvzip_scores(tmp_path / "deeper.npz", np.zeros((3, 1, heads, 5)))
    for scores_file, message in (
        ("", r"options.scores='' names no file"),
        (str(tmp_path / "deeper.npz"), r"KVzip scores of 3 layer\(s\), for a model of 2"),
    ):
        bad = evicting(
            cfg,
            "kvzip",
            when="after_prefill",
            ratio=0.5,
            options={"layerwise": False, "scores": scores_file},
        )
        with pytest.raises(ValueError, match=message):
            kvlab.init_cache(cfg.model, bad, 1, MAX_LEN)


def test_generate_feeds_each_rows_probes_after_its_prompt():
    """kvlab.generate(probes=) over a kvzip cache: each row's prompt, its probes
    right after it (compress= the prompt), then greedy steps give the tokens of
    that prefill fed by hand; without probes it is refused naming probes=, and
    probes over a cache that reads none are refused."""
    cfg = VARIANTS["gqa"]()
    model, params, apply = build(cfg)
    contexts = [random_tokens(cfg, (CONTEXT,), seed=7), random_tokens(cfg, (29,), seed=8)]
    probes = [KVZIP.probe_tokens(encode, list(c)) for c in contexts]
    cache_cfg = evicting(cfg, "kvzip", when="after_prefill", ratio=0.5, headroom=HEADROOM)
    prompts, lengths = right_padded(contexts), np.array([CONTEXT, 29])
    rows = [[*c, *p] for c, p in zip(contexts, probes, strict=True)]
    fed = right_padded(rows)
    fresh = kvlab.init_cache(cfg.model, cache_cfg, 2, MAX_LEN)
    logits, cache = apply(
        {"params": params},
        fed,
        cache=fresh,
        num_tokens=jnp.asarray([len(r) for r in rows]),
        compress=jnp.asarray(lengths),
    )
    token = jnp.argmax(logits[jnp.arange(2), lengths - 1], -1)
    want = [token]
    for _ in range(3):
        logits, cache = apply({"params": params}, token[:, None], cache=cache)
        token = jnp.argmax(logits[:, 0], -1)
        want.append(token)
    out = kvlab.generate(
        model,
        params,
        prompts,
        cache_cfg=cache_cfg,
        max_new_tokens=4,
        prompt_lengths=lengths,
        max_len=MAX_LEN,
        probes=probes,
    )
    for row, length in enumerate(lengths):
        np.testing.assert_array_equal(out[row, length : length + 4], np.stack(want)[:, row])
        np.testing.assert_array_equal(out[row, :length], prompts[row, :length])
    arguments = dict(cache_cfg=cache_cfg, max_new_tokens=4, prompt_lengths=lengths, max_len=MAX_LEN)
    with pytest.raises(ValueError, match="probes="):
        kvlab.generate(model, params, prompts, **arguments)
    with pytest.raises(ValueError, match="reads no probes"):
        kvlab.generate(
            model, params, prompts, **{**arguments, "cache_cfg": cfg.cache}, probes=probes
        )
    with pytest.raises(ValueError, match="1 rows for 2 prompts"):
        kvlab.generate(model, params, prompts, **arguments, probes=probes[:1])
    with pytest.raises(ValueError, match=r"probes\[1\] is empty"):
        kvlab.generate(model, params, prompts, **arguments, probes=[probes[0], []])


def test_the_head_level_variant_scores_each_head_by_its_largest_token_score(tmp_path):
    """KVzip's head-level eviction (kvzip_head): calibrate.kvzip_heads gives the
    first layer's KV heads the largest float64 KVzip score (reference_scores) of any
    context token past the sinks, averaged over two contexts; as patterns, the
    lower-scoring half of the model's heads streams (DuoAttention's pool at the
    budget its heads need) and the others keep every token."""
    cfg = VARIANTS["gqa"]()
    _, params, apply = build(cfg)
    contexts = np.stack([random_tokens(cfg, (CONTEXT,), seed=s) for s in (3, 4)])
    heads = kvlab.eval.calibrate.kvzip_heads(cfg.model, params, contexts, encode)
    assert heads.shape == (cfg.model.num_layers, cfg.model.num_kv_heads)
    expected = np.mean([reference_scores(cfg, params, c)[:, 4:].max(-1) for c in contexts], 0)
    np.testing.assert_allclose(heads[0], expected, rtol=1e-4)
    path = str(tmp_path / "kvzip_heads.npz")
    kvlab.eval.calibrate.save_patterns(path, heads)
    options = {"patterns": path, "head_ratio": 0.5, "sink_size": 2, "recent_size": 4}
    budget = needed_budget(options, cfg.model.num_layers, CONTEXT)  # what its heads need
    cache_cfg = evicting(cfg, "kvzip_head", recent=0, budget=budget, options=options)
    cache = kvlab.init_cache(cfg.model, cache_cfg, 1, CONTEXT)
    _, cache = apply({"params": params}, contexts[:1], cache=cache)
    streaming = heads <= np.median(heads)
    window = [0, 1, *range(CONTEXT - 4, CONTEXT)]
    for layer, streams in zip(cache.layers, streaming, strict=True):
        for held, streams_here in zip(kept(layer)[0], streams, strict=True):
            if streams_here:  # its sinks and latest, and what the pool's rounding spares
                assert set(window) <= set(held) and len(held) < CONTEXT // 2
            else:
                assert list(held) == list(range(CONTEXT))
