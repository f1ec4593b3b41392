"""Evaluation through the cache: a 16-bit cache scores what the plain forward
scores, at any chunk size; quantized caches cost quality and save bytes; the
distance to the full cache (KL, top-1 agreement, change in perplexity) is what
numpy computes from both caches' logits, and exactly nothing for the full cache."""

import numpy as np
import pytest
from flax import traverse_util
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.data import make_dataset
from kvlab.eval import check_finite, compare_logits, evaluate, evaluate_reference, full_cache
from kvlab.train import evaluate_forward
from tests.helpers import build, mla_config, run_config, run_in_chunks, tiny_config, write_corpus


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
@given(
    name=st.sampled_from(sorted(MODELS)),
    chunk=st.sampled_from([1, 5, 8, 32, 100]),
    prefill=st.sampled_from([0, 3, 20, 32, 40]),
)
def test_a_16_bit_cache_scores_what_the_forward_scores(batches, name, chunk, prefill):
    cfg = MODELS[name]()
    model, params, _ = build(cfg)
    through_cache = evaluate(cfg.model, cfg.cache, params, batches, chunk=chunk, prefill=prefill)
    forward = evaluate_forward(model, params, batches)
    assert through_cache["targets"] == forward["targets"] == 3 * 2 * 32
    assert through_cache["loss"] == pytest.approx(forward["loss"], rel=1e-5)
    assert through_cache["accuracy"] == pytest.approx(forward["accuracy"], abs=1e-9)
    assert through_cache["bits_per_byte"] == pytest.approx(forward["loss"] / np.log(2), rel=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fewer_bits_cost_quality_and_save_bytes(references, batches, name):
    cfg, params, reference = references[name]
    results = {}
    for bits in (16, 8, 2):
        cache = every_tensor_at(cfg, bits)
        results[bits] = evaluate(cfg.model, cache, params, batches, chunk=8, reference=reference)
    errors = {b: abs(results[b]["loss"] - results[16]["loss"]) for b in (8, 2)}
    assert 0 < errors[8] < errors[2]
    kl = [results[b]["kl_mean"] for b in (16, 8, 2)]
    assert 0 == kl[0] < kl[1] < kl[2]
    agreement = [results[b]["top1_agreement"] for b in (16, 8, 2)]
    assert 1 == agreement[0] >= agreement[1] >= agreement[2]
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


@given(seq_len=st.integers(1, 300), chunk=st.integers(1, 70), prefill=st.integers(0, 400))
def test_a_window_goes_in_as_its_prefill_then_chunks(seq_len, chunk, prefill):
    steps = kvlab.eval.perplexity.spans(seq_len, chunk, prefill)
    assert [start for start, _ in steps] == [0] + [stop for _, stop in steps[:-1]]
    assert steps[-1][1] == seq_len
    if prefill:
        assert steps[0] == (0, min(prefill, seq_len))
    assert all(0 < stop - start <= chunk for start, stop in steps[bool(prefill) :])


def test_bad_chunks_and_empty_batches_are_refused(batches):
    cfg = tiny_config()
    _, params, _ = build(cfg)
    with pytest.raises(ValueError, match="eval.chunk=0"):
        evaluate(cfg.model, cfg.cache, params, batches, chunk=0)
    for prefill in (-1, 2.5, True):
        with pytest.raises(ValueError, match=f"eval.prefill={prefill!r}"):
            evaluate(cfg.model, cfg.cache, params, batches, chunk=4, prefill=prefill)
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


# ---------------------------------------------------------------------------
# Distribution metrics against the full cache

NOTHING = {"kl_mean": 0.0, "kl_p99": 0.0, "top1_agreement": 1.0, "delta_ppl": 0.0}


def distance(result: dict) -> dict:
    return {key: result[key] for key in NOTHING}


def every_tensor_at(cfg, bits: int):
    cache = full_cache(cfg.cache)
    for prefix in kvlab.config.cached_prefixes(cfg.model):
        cache[f"{prefix}_bits"] = bits
    return cache


@pytest.fixture(scope="module")
def references(batches):
    """Per model: (config, params, its full cache evaluated as the reference, chunk 8)."""
    made = {}
    for name, make in MODELS.items():
        cfg = make()
        _, params, _ = build(cfg)
        full = full_cache(cfg.cache)
        made[name] = cfg, params, evaluate_reference(cfg.model, full, params, batches, chunk=8)
    return made


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
    noise=st.sampled_from([0.0, 1e-3, 1.0]),
)
def test_compare_logits_is_the_kl_numpy_computes_and_exactly_nothing_for_equal_logits(
    seed, scale, noise
):
    rng = np.random.default_rng(seed)
    reference = (scale * rng.standard_normal((2, 3, 16))).astype(np.float32)
    logits = (reference + noise * rng.standard_normal(reference.shape)).astype(np.float32)
    targets = rng.integers(0, 16, (2, 3)).astype(np.int32)
    weights = rng.integers(0, 2, (2, 3)).astype(np.float32)

    same, kl = compare_logits(reference, reference, targets, weights)
    assert np.all(np.asarray(kl) == 0.0)
    assert float(same["kl"]) == 0.0 and float(same["agree"]) == float(same["weight"])
    assert float(same["nll"]) == float(same["reference_nll"])

    sums, kl = compare_logits(logits, reference, targets, weights)
    p, q = log_softmax(reference), log_softmax(logits)
    want = (np.exp(p) * (p - q)).sum(-1)
    np.testing.assert_allclose(kl, want, rtol=1e-4, atol=1e-5 * scale)
    assert float(sums["kl"]) == pytest.approx((want * weights).sum(), rel=1e-4, abs=1e-4 * scale)
    agree = (p.argmax(-1) == q.argmax(-1)) * weights
    assert float(sums["agree"]) == agree.sum()
    nll = -np.take_along_axis(q, targets[..., None], -1)[..., 0]
    assert float(sums["nll"]) == pytest.approx((nll * weights).sum(), rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_full_cache_is_exactly_nothing_away_from_itself(references, batches, name):
    cfg, params, reference = references[name]
    assert distance(reference.result) == NOTHING
    again = evaluate(
        cfg.model, full_cache(cfg.cache), params, batches, chunk=8, reference=reference
    )
    assert distance(again) == NOTHING
    assert again["ppl"] == reference.result["ppl"]
    plain = evaluate(cfg.model, full_cache(cfg.cache), params, batches, chunk=8, windows=True)
    assert set(again) - set(plain) == set(NOTHING)  # without a reference: the keys of old
    assert plain["loss"] == pytest.approx(again["loss"], rel=1e-6)
    # Per window (each row of each batch): sums that add up to the totals.
    windows = plain.pop("windows")
    assert len(windows) == sum(len(batch["inputs"]) for batch in batches)
    weight = sum(w["weight"] for w in windows)
    assert weight == plain["targets"]
    assert sum(w["nll"] for w in windows) / weight == pytest.approx(plain["loss"], rel=1e-6)
    assert sum(w["correct"] for w in windows) / weight == pytest.approx(plain["accuracy"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_distance_of_a_2_bit_cache_is_what_numpy_computes_from_both_caches_logits(
    references, batches, name, monkeypatch
):
    cfg, params, reference = references[name]
    cache = every_tensor_at(cfg, 2)
    result = evaluate(cfg.model, cache, params, batches, chunk=8, reference=reference, windows=True)

    # Both caches by hand: each window prefilled in one step, log-softmax in float64.
    _, _, apply = build(cfg)
    kl, agree, nll, weights = [], [], {"ref": [], "cache": []}, []
    for batch in batches:
        size, length = batch["inputs"].shape
        logp = {}
        for which, cache_cfg in (("ref", full_cache(cfg.cache)), ("cache", cache)):
            empty = kvlab.init_cache(cfg.model, cache_cfg, size, length)
            logits, _ = run_in_chunks(apply, params, empty, batch["inputs"], [length])
            logp[which] = log_softmax(logits)
            target = np.take_along_axis(logp[which], batch["targets"][..., None], -1)[..., 0]
            nll[which].append(-target)
        kl.append((np.exp(logp["ref"]) * (logp["ref"] - logp["cache"])).sum(-1))
        agree.append(logp["ref"].argmax(-1) == logp["cache"].argmax(-1))
        weights.append(batch["weights"])
    kl, agree, weights = (np.concatenate(x) for x in (kl, agree, weights))
    ppl = {k: np.exp((np.concatenate(v) * weights).sum() / weights.sum()) for k, v in nll.items()}

    assert result["kl_mean"] == pytest.approx((kl * weights).sum() / weights.sum(), rel=1e-3)
    assert result["kl_p99"] == pytest.approx(np.percentile(kl[weights > 0], 99), rel=1e-3)
    assert result["kl_p99"] >= result["kl_mean"] > 0
    tokens = float(weights.sum())
    assert result["top1_agreement"] == pytest.approx(
        (agree * weights).sum() / tokens, abs=2 / tokens
    )
    assert result["delta_ppl"] == pytest.approx(ppl["cache"] - ppl["ref"], rel=1e-3, abs=1e-3)
    assert result["delta_ppl"] == pytest.approx(result["ppl"] - reference.result["ppl"], abs=1e-9)
    rows = (np.concatenate(nll["cache"]) * weights).sum(-1)  # per window (row)
    np.testing.assert_allclose([w["nll"] for w in result["windows"]], rows, rtol=1e-4)

    # Too many logits to keep: the reference runs in lockstep, to the same numbers.
    monkeypatch.setattr(kvlab.eval.perplexity, "KEEP_REFERENCE_BYTES", 0)
    full = full_cache(cfg.cache)
    lockstep = evaluate(cfg.model, cache, params, batches, chunk=8, reference=full, windows=True)
    assert lockstep == result


def test_a_reference_of_another_model_chunk_or_batches_is_refused(references, batches):
    cfg, params, reference = references["gqa"]
    mla, mla_params, _ = references["mla"]
    with pytest.raises(ValueError, match=r"reference cache \(reference=\) is invalid .*k_bits=8"):
        evaluate(
            mla.model, mla.cache, mla_params, batches, chunk=8, reference=every_tensor_at(cfg, 8)
        )
    with pytest.raises(ValueError, match=r"reference= ran a model with other parameters: model\."):
        evaluate(mla.model, mla.cache, mla_params, batches, chunk=8, reference=reference)
    with pytest.raises(ValueError, match="reference= ran with other chunk: 8 there, 4 here"):
        evaluate(cfg.model, cfg.cache, params, batches, chunk=4, reference=reference)
    with pytest.raises(ValueError, match="reference= ran with other prefill: 0 there, 16 here"):
        evaluate(cfg.model, cfg.cache, params, batches, chunk=8, prefill=16, reference=reference)
    with pytest.raises(ValueError, match=r"other batches \(tokens or weights\)"):
        evaluate(cfg.model, cfg.cache, params, batches[:1], chunk=8, reference=reference)


def test_a_model_with_the_same_parameters_scores_against_the_references(
    references, batches, monkeypatch
):
    """The model made hybrid (model.layer_types: its first layer sliding) shares the
    reference's parameters: scored against the full model's logits, a window
    that sees every position agrees with them (KL 0 up to float rounding) and a
    window of 2 does not; with the reference in lockstep (its own model run
    beside), the same numbers."""
    cfg, params, reference = references["gqa"]

    def hybrid(window):
        model = cfg.model.copy_and_resolve_references()
        model.update(sliding_window=window, layer_types=("sliding", "full"))
        return model

    wide = evaluate(hybrid(64), cfg.cache, params, batches, chunk=8, reference=reference)
    narrow = evaluate(hybrid(2), cfg.cache, params, batches, chunk=8, reference=reference)
    assert wide["kl_mean"] < 1e-6 and wide["top1_agreement"] == 1.0
    assert narrow["kl_mean"] > 1e-3
    monkeypatch.setattr(kvlab.eval.perplexity, "KEEP_REFERENCE_BYTES", 0)
    beside = evaluate_reference(cfg.model, full_cache(cfg.cache), params, batches, chunk=8)
    assert beside.logits is None
    lockstep = evaluate(hybrid(2), cfg.cache, params, batches, chunk=8, reference=beside)
    assert lockstep == pytest.approx(narrow, rel=1e-6)


def test_a_result_that_is_not_finite_is_refused_naming_what_ran(batches):
    cfg = tiny_config(num_kv_heads=2)
    _, params, _ = build(cfg)
    good = evaluate(cfg.model, cfg.cache, params, batches, chunk=32)
    assert check_finite(good, "model 'gqa', cache 'K32V32'") is good
    flat = traverse_util.flatten_dict(params)  # a new tree: build's params are shared
    kernel = ("block_0", "mlp", "up", "kernel")
    flat[kernel] = flat[kernel].at[0, 0].set(np.nan)
    bad = evaluate(cfg.model, cfg.cache, traverse_util.unflatten_dict(flat), batches, chunk=32)
    with pytest.raises(ValueError) as error:
        check_finite(bad, "model 'gqa', cache 'K32V32'")
    assert str(error.value).startswith(
        "model 'gqa', cache 'K32V32': the evaluation gave loss=nan (ppl nan)"
    )
    with pytest.raises(ValueError, match=r"gave kl_mean=inf \(ppl 2.0\)"):
        check_finite({"loss": 0.7, "ppl": 2.0, "kl_mean": np.inf}, "x")
