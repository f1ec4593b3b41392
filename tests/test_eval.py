"""Evaluation through the cache: a 16-bit cache scores what the plain forward
scores, at any chunk size; quantized caches cost quality and save bytes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.data import make_dataset
from kvlab.eval import evaluate, full_precision
from kvlab.train import evaluate_forward
from tests.helpers import build, mla_config, run_config, tiny_config, write_corpus


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    cfg = run_config(corpus)
    return make_dataset(cfg.data, "validation", 32).eval_batches(batch_size=3, num_batches=2)


MODELS = {
    "gqa": lambda: tiny_config(num_kv_heads=2),
    "mla": lambda: mla_config(absorb=True),
}


@settings(max_examples=3)
@given(name=st.sampled_from(sorted(MODELS)), chunk=st.sampled_from([1, 5, 8, 32, 100]))
def test_a_16_bit_cache_scores_what_the_forward_scores(batches, name, chunk):
    cfg = MODELS[name]()
    model, params, _ = build(cfg)
    through_cache = evaluate(cfg.model, cfg.cache, params, batches, chunk=chunk)
    forward = evaluate_forward(model, params, batches)
    assert through_cache["targets"] == forward["targets"] == 3 * 2 * 32
    assert through_cache["loss"] == pytest.approx(forward["loss"], rel=1e-5)
    assert through_cache["accuracy"] == pytest.approx(forward["accuracy"], abs=1e-9)
    assert through_cache["bits_per_byte"] == pytest.approx(forward["loss"] / np.log(2), rel=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fewer_bits_cost_quality_and_save_bytes(batches, name):
    cfg = MODELS[name]()
    _, params, _ = build(cfg)
    prefixes = kvlab.config.cached_prefixes(cfg.model)
    results = {}
    for bits in (16, 8, 2):
        cache = full_precision(cfg.cache)
        for prefix in prefixes:
            cache[f"{prefix}_bits"] = bits
        results[bits] = evaluate(cfg.model, cache, params, batches, chunk=8)
    errors = {b: abs(results[b]["loss"] - results[16]["loss"]) for b in (8, 2)}
    assert 0 < errors[8] < errors[2]
    sizes = [results[b]["cache_bytes_per_token"] for b in (16, 8, 2)]
    assert sizes[0] > sizes[1] > sizes[2]
    for result in results.values():
        assert result["cache_bytes_per_token"] == result["cache_bytes_per_token_measured"]


def test_bytes_per_token_counts_one_sequence_of_the_window():
    cfg = tiny_config()
    result = kvlab.eval.cache_bytes_per_token(cfg.model, cfg.cache, 128)
    layers, heads, width = cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_dim
    kv = 2 * layers * heads * width * 4  # float32 K and V
    assert result["cache_bytes_per_token"] == (128 * kv + kvlab.cache.accounting.ROW_BYTES) / 128


def test_bad_chunks_and_empty_batches_are_refused(batches):
    cfg = tiny_config()
    _, params, _ = build(cfg)
    with pytest.raises(ValueError, match="eval.chunk=0"):
        evaluate(cfg.model, cfg.cache, params, batches, chunk=0)
    with pytest.raises(ValueError, match="no evaluation batches"):
        evaluate(cfg.model, cfg.cache, params, [], chunk=4)


def test_mqar_accuracy_counts_the_queries():
    cfg = run_config(None, source="mqar")
    cfg.data.mqar.update(num_pairs=4, vocab_size=64)
    _, params, _ = build(cfg)
    data = make_dataset(cfg.data, "validation", cfg.train.seq_len)
    batches = data.eval_batches(batch_size=4, num_batches=1)
    result = evaluate(cfg.model, cfg.cache, params, batches, chunk=8)
    assert data.metric == "accuracy"
    assert result["targets"] == 4 * 4
    _, _, apply = build(cfg)
    logits, _ = apply({"params": params}, batches[0]["inputs"])
    hits = (np.argmax(logits, -1) == batches[0]["targets"]) * batches[0]["weights"]
    assert result["accuracy"] == pytest.approx(float(hits.sum()) / 16)
