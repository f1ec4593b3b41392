"""kvpress's protocol through kvlab's caches (kvlab.eval.benchmark): a context
compressed once, its questions answered greedily from it."""

from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab.data.ruler import ruler_records
from kvlab.eval.benchmark import benchmark_cache, kvpress_evict, run_benchmark
from tests.helpers import ROOT, VARIANTS, build, random_tokens


class Bytes:
    """A byte tokenizer for the tiny byte-level models."""

    end_token = None

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def records():
    """Two contexts, the first asked twice (its two records share one cache)."""
    found = ruler_records(Bytes().encode, ("niah_single_1", "vt"), 200, samples=1)
    for r in found:
        r["max_new_tokens"] = 6
    again = dict(found[0], question="\nAgain?", answer=["x"])
    return [found[0], found[1], again]


def test_the_protocol_generates_what_generate_does_and_compression_saves_bytes():
    cfg = VARIANTS["gqa"]()
    model, params, _ = build(cfg)
    tokenizer, asked = Bytes(), records()
    full = run_benchmark(
        cfg.model, params, tokenizer, asked, benchmark_cache(cfg.cache, "none", 1, 0)
    )
    # The full cache: context, then question, then greedy tokens = generate on the whole prompt.
    for record, row in zip(asked, full, strict=True):
        prompt = np.asarray(
            [tokenizer.encode(record["context"] + record["question"] + record["answer_prefix"])],
            np.int32,
        )
        out = kvlab.generate(model, params, prompt, cache_cfg=cfg.cache, max_new_tokens=6)
        assert row["prediction"] == tokenizer.decode(np.asarray(out)[0, prompt.shape[1] :].tolist())
    kept = run_benchmark(
        cfg.model, params, tokenizer, asked, benchmark_cache(cfg.cache, "snapkv", 1.0, 0)
    )
    assert [r["prediction"] for r in kept] == [r["prediction"] for r in full]
    quarter = run_benchmark(
        cfg.model,
        params,
        tokenizer,
        asked,
        benchmark_cache(cfg.cache, "knorm", 0.25, 0),
        batch_size=1,
    )
    # a quarter of a 256-token context beside the headroom (the longest question, 150
    # bytes, and the answer: 41% of the capacity), a position per slot
    assert quarter[0]["bytes_per_token"] < 0.65 * full[0]["bytes_per_token"]
    # one at a time or together, sharing a context or not: the same answers
    alone = [
        run_benchmark(
            cfg.model, params, tokenizer, [r], benchmark_cache(cfg.cache, "knorm", 0.25, 0)
        )[0]
        for r in asked
    ]
    assert [r["prediction"] for r in alone] == [r["prediction"] for r in quarter]
    aware = run_benchmark(
        cfg.model,
        params,
        tokenizer,
        asked,
        benchmark_cache(cfg.cache, "snapkv", 1.0, 0),
        query_aware=True,
    )
    assert [r["prediction"] for r in aware] == [r["prediction"] for r in full]
    # contexts prefilled 64 tokens a step (kvpress's BlockPress), nothing evicted: the
    # full cache's answers
    blocks = run_benchmark(
        cfg.model,
        params,
        tokenizer,
        asked,
        benchmark_cache(cfg.cache, "snapkv", 1.0, 0),
        block_size=64,
    )
    assert [r["prediction"] for r in blocks] == [r["prediction"] for r in full]
    # KVzip's probes (the context repeated) fed after each context leave nothing behind
    zipped = benchmark_cache(cfg.cache, "kvzip", 1.0, 0)
    zipped.evict.options.layerwise = True  # each layer its share: no calibration read
    repeated = run_benchmark(cfg.model, params, tokenizer, asked, zipped)
    assert [r["prediction"] for r in repeated] == [r["prediction"] for r in full]
    assert repeated[0]["bytes_per_token"] == kept[0]["bytes_per_token"]
    with pytest.raises(ValueError, match="whole in one step"):
        run_benchmark(cfg.model, params, tokenizer, asked, zipped, query_aware=True)
    cache = benchmark_cache(cfg.cache, "knorm", 0.25, 0)
    with pytest.raises(ValueError, match="block_size=64: set 0"):
        run_benchmark(cfg.model, params, tokenizer, asked, cache, block_size=64, query_aware=True)


def test_caches_that_evict_every_step_or_while_decoding_run_the_protocol():
    """A cache of cache.evict.when='every_step' (no room beside its budget) and one of
    'decoding' (the context stored whole) answer every record; a budget of every
    token answers as the full cache does, a small one costs fewer bytes."""
    cfg = VARIANTS["gqa"]()
    _, params, _ = build(cfg)
    tokenizer, asked = Bytes(), records()
    full = run_benchmark(
        cfg.model, params, tokenizer, asked, benchmark_cache(cfg.cache, "none", 1, 0)
    )
    rows = {}
    for when, budget in (("every_step", 400), ("every_step", 32), ("decoding", 400)):
        cache = cfg.cache.copy_and_resolve_references()
        cache.evict.update(method="knorm", budget=budget, when=when, interval=4)
        rows[when, budget] = run_benchmark(cfg.model, params, tokenizer, asked, cache)
    for whole in (("every_step", 400), ("decoding", 400)):
        assert [r["prediction"] for r in rows[whole]] == [r["prediction"] for r in full]
    small = rows["every_step", 32]
    assert len(small) == len(asked) and small[0]["bytes_per_token"] < full[0]["bytes_per_token"]


def test_kvpress_defaults_keep_no_recent_window():
    cfg = VARIANTS["gqa"]()
    cache = benchmark_cache(cfg.cache, "snapkv", 0.5, 40)
    assert cache.evict.recent == cache.evict.obs_window == 64  # its window stays
    assert cache.evict.when == "after_prefill" and cache.evict.headroom == 40
    assert kvpress_evict("knorm") == {"recent": 0}
    ours = benchmark_cache(cfg.cache, "snapkv", 0.5, 40, kvpress=False)
    assert ours.evict.recent == cfg.cache.evict.recent


@pytest.mark.parametrize("method", ["snapkv", "chunkkv:knorm"])
def test_the_kvpress_configs_compress_a_prompt_once_with_kvpress_defaults(method):
    """configs/kvpress.py:<method>: the preset's fields; kept whole (ratio 1) the
    compressed prompt and the appended answer give the full cache's greedy tokens,
    and half of it costs fewer bytes."""
    cfg = kvlab.load_config(f"{ROOT}/configs/kvpress.py:{method}")
    evict = cfg.cache.evict
    assert evict.method == method and evict.when == "after_prefill" and evict.ratio == 0.5
    assert {k: evict[k] for k in kvpress_evict(method) if k != "options"} == {
        k: v for k, v in kvpress_evict(method).items() if k != "options"
    }
    model, params, _ = build(cfg)
    prompt = random_tokens(cfg, (2, 200), seed=1)
    whole = cfg.cache.copy_and_resolve_references()
    whole.evict.ratio = 1.0
    full = cfg.cache.copy_and_resolve_references()
    full.evict.update(method="none", when="every_step", headroom=0)
    full.evict.options = {}
    outputs = [
        np.asarray(kvlab.generate(model, params, prompt, cache_cfg=c, max_new_tokens=6))
        for c in (whole, full)
    ]
    np.testing.assert_array_equal(*outputs)
    half, kept = (kvlab.cache_bytes(cfg.model, c, 2, 206) for c in (cfg.cache, whole))
    assert half < kept


def test_the_kvpress_decoding_config_stores_the_prompt_whole_and_compresses_while_decoding():
    """configs/kvpress.py:knorm,tiny,decoding: DecodingPress's fields over the preset;
    a 150-token prompt stays whole, and after 16 decode steps each head holds 128."""
    cfg = kvlab.load_config(f"{ROOT}/configs/kvpress.py:knorm,tiny,decoding")
    evict = cfg.cache.evict
    assert (evict.when, evict.budget, evict.interval, evict.recent) == ("decoding", 128, 16, 0)
    _, params, apply = build(cfg)
    tokens = random_tokens(cfg, (1, 167), seed=2)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 1, 192)
    assert cache.layers[0].policy.slots == 192  # any prompt fits whole
    _, cache = apply({"params": params}, tokens[:, :150], cache=cache)
    held = lambda: {int(x) for layer in cache.layers for x in layer.stored(cache.lengths).ravel()}  # noqa: E731
    assert held() == {150}
    for t in range(150, 166):
        assert held() == {t}
        _, cache = apply({"params": params}, tokens[:, t : t + 1], cache=cache)
    assert held() == {128}


@pytest.mark.parametrize("method", ["snapkv", "expected_attention"])
def test_every_kvpress_decoding_preset_builds_and_buffers_what_decodingpress_scores_by(method):
    """SnapKV's preset (its window of 64 kept, which the tiny target must exceed)
    and Expected Attention's (the queries of an interval's decode steps, at most
    DecodingPress's 256 hidden states) build, their buffers counted in the bytes."""
    for variant, buffered in (("tiny", 16), ("small", 256)):
        cfg = kvlab.load_config(f"{ROOT}/configs/kvpress.py:{method},{variant},decoding")
        window = 64 if method == "snapkv" else buffered
        assert cfg.cache.evict.obs_window == window
        (policy, *_) = kvlab.cache.evict.policies(cfg.model, cfg.cache, 4096)
        assert policy.buffers == window
        if variant == "tiny":
            cache = kvlab.init_cache(cfg.model, cfg.cache, 1, 192)
            assert kvlab.cache_bytes(cfg.model, cfg.cache, 1, 192) == kvlab.tree_bytes(cache)
    with pytest.raises(ValueError, match="names the protocol 'later'"):
        kvlab.load_config(f"{ROOT}/configs/kvpress.py:knorm,tiny,later")
