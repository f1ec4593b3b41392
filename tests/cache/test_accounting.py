import jax
import ml_collections
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from tests.helpers import ROOT, mla_config, small_model_configs, tiny_config


@given(
    cfg=small_model_configs(),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    batch=st.integers(1, 4),
    max_len=st.integers(1, 40),
)
def test_analytic_bytes_equal_measured_bytes(cfg, dtype, batch, max_len):
    cfg.cache.dtype = dtype
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=batch, max_len=max_len)
    assert kvlab.cache_bytes(cfg.model, cfg.cache, batch, max_len) == kvlab.tree_bytes(cache)


@given(
    config=st.sampled_from(["gqa", "mqa", "mla"]),
    variant=st.sampled_from(["small", "base"]),
    batch=st.sampled_from([1, 8, 64]),
    max_len=st.sampled_from([2048, 32_768, 131_072]),
)
def test_large_caches_agree_without_allocating(config, variant, batch, max_len):
    cfg = kvlab.load_config(f"{ROOT}/configs/{config}.py:{variant}")
    abstract = jax.eval_shape(lambda: kvlab.init_cache(cfg.model, cfg.cache, batch, max_len))
    assert kvlab.cache_bytes(cfg.model, cfg.cache, batch, max_len) == kvlab.tree_bytes(abstract)


def test_formula_by_hand():
    # 2 (K, V) x 2 layers x 2 KV heads x 16 head_dim x 100 tokens x 3 rows x 4 bytes,
    # plus each row's length and error flags (int32 each)
    cfg = tiny_config(num_kv_heads=2)
    assert kvlab.cache_bytes(cfg.model, cfg.cache, 3, 100) == 2 * 2 * 2 * 16 * 100 * 3 * 4 + 3 * (
        4 + 4
    )
    cfg.cache.dtype = "bfloat16"
    assert kvlab.cache_bytes(cfg.model, cfg.cache, 3, 100) == 2 * 2 * 2 * 16 * 100 * 3 * 2 + 3 * (
        4 + 4
    )


def test_latent_formula_by_hand():
    # layers x (kv_rank + rope_dim) x tokens x rows x bytes + lengths
    cfg = mla_config(kv_rank=64, rope_dim=8)
    assert kvlab.cache_bytes(cfg.model, cfg.cache, 3, 100) == 2 * (64 + 8) * 100 * 3 * 4 + 3 * (
        4 + 4
    )


def test_sharing_heads_divides_the_cache():
    mha, mqa = tiny_config(num_kv_heads=4), tiny_config(num_kv_heads=1)
    payload = lambda cfg: (
        kvlab.cache_bytes(cfg.model, cfg.cache, 1, 1000) - kvlab.cache.accounting.ROW_BYTES
    )  # noqa: E731
    assert payload(mha) == 4 * payload(mqa)


def test_tree_bytes_counts_params():
    cfg = tiny_config()
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    count = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert kvlab.tree_bytes(params) == 4 * count


CACHE_FIELDS = dict(
    k_bits=st.sampled_from([16, 8, 4, 2]),
    k_transform=st.sampled_from(["none", "hadamard", "orthogonal"]),
    v_transform=st.sampled_from(["none", "hadamard", "orthogonal"]),
    v_bits=st.sampled_from([16, 8, 4]),
    k_format=st.sampled_from(["int", "fp8"]),
    k_axis=st.sampled_from(["token", "channel"]),
    v_axis=st.sampled_from(["token", "channel"]),
    group_size=st.sampled_from([16, 32]),
    residual=st.sampled_from([0, 32]),
    symmetric=st.booleans(),
    scale_dtype=st.sampled_from(["bfloat16", "float32"]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    kind=st.sampled_from(["dense", "paged"]),
    page_size=st.sampled_from([8, 16]),
    prefix_caching=st.booleans(),
    k_full_first=st.sampled_from([0, 1, 4]),
)
EVICT_FIELDS = dict(
    method=st.sampled_from(["none", "window", "sinks", "h2o", "snapkv", "adakv", "random"]),
    budget=st.sampled_from([0, 64]),
    ratio=st.sampled_from([0.25, 0.5]),
    sinks=st.sampled_from([2, 4]),
    recent=st.sampled_from([0, 8]),
    obs_window=st.sampled_from([4, 8]),
    adakv_floor=st.sampled_from([0.2, 0.5]),
    seed=st.sampled_from([0, 1]),
)
caches = st.fixed_dictionaries({**CACHE_FIELDS, "evict": st.fixed_dictionaries(EVICT_FIELDS)})


def stored_choices(cache: dict) -> tuple:
    """What a cache stores and keeps, field by field: the fields that matter (a tensor's
    format and axis only below 16 bits, the dtype where something is kept in it, ...)."""
    quantized = [p for p in ("k", "v") if cache[f"{p}_bits"] < 16]
    key = [cache["k_bits"], cache["v_bits"], cache["kind"], cache["k_transform"]]
    key.append(cache["v_transform"])
    key += [(cache.get(f"{p}_format", "int"), cache[f"{p}_axis"]) for p in quantized]
    key += [cache.get(f"{p}_full_first", 0) for p in quantized]
    if quantized:
        key += [cache["group_size"], cache["symmetric"], cache["scale_dtype"], cache["residual"]]
    if len(quantized) < 2 or cache["residual"]:
        key.append(cache["dtype"])
    if cache["kind"] == "paged":
        key += [cache["page_size"], cache["prefix_caching"]]
    evict = cache["evict"]
    key.append(evict["method"])
    if evict["method"] != "none":
        key.append(evict["budget"] or evict["ratio"])
    fields = {"sinks": ["sinks"], "random": ["recent", "seed"], "adakv": ["recent", "obs_window"]}
    fields.update(h2o=["recent"], snapkv=["recent", "obs_window"])
    key += [evict[f] for f in fields.get(evict["method"], [])]
    if evict["method"] == "adakv":
        key.append(evict["adakv_floor"])
    return tuple(key)


@given(first=caches, second=caches)
def test_cache_label_names_every_choice_that_changes_the_cache(first, second):
    cfg = tiny_config(num_kv_heads=2)
    labels = []
    for cache in (first, second):
        cache_cfg = kvlab.config.base_config("tiny").cache
        evict = cache.pop("evict")
        cache_cfg.update(cache)
        cache_cfg.evict.update(evict)
        cache["evict"] = evict
        labels.append(kvlab.cache.cache_label(cfg.model, cache_cfg))
        assert labels[-1].startswith(kvlab.cache.bits_label(cfg.model, cache_cfg) + " (")
    # One label per cache: equal labels only for caches that store and keep the same.
    assert (labels[0] == labels[1]) == (stored_choices(first) == stored_choices(second))


def test_cache_label_examples():
    kivi = kvlab.load_config(f"{ROOT}/configs/kv_kivi2.py:tiny")
    kivi.cache.evict.update(method="snapkv", ratio=0.25)
    assert kvlab.cache.cache_label(kivi.model, kivi.cache) == (
        "K2V2 (k int per channel, v int per token; groups of 16, bfloat16 scales; residual 32 "
        "in float32), dense, snapkv keeping 25% of the tokens per KV head (recent 8, "
        "observation window 8, pooling 5, interval budget/16 up to 64)"
    )
    kivi.cache.evict.update(method="h2o", interval=1)  # h2o's own interval: the same label
    by_step = kvlab.cache.cache_label(kivi.model, kivi.cache)
    kivi.cache.evict.interval = 0
    assert kvlab.cache.cache_label(kivi.model, kivi.cache) == by_step
    assert by_step.endswith("h2o keeping 25% of the tokens per KV head (recent 8)")
    mla = mla_config()
    mla.model.sliding_window = 16
    assert kvlab.cache.cache_label(mla.model, mla.cache) == (
        "L32R32 (latent and rope in float32), dense, the last 16 tokens (sliding window)"
    )


@pytest.mark.parametrize(
    "attention, dtype, bits, label",
    [
        ("gqa", "float32", {}, "K32V32"),
        ("gqa", "bfloat16", {}, "K16V16"),
        ("gqa", "float16", {"k_bits": 8}, "K8V16"),
        ("gqa", "float32", {"k_bits": 4, "v_bits": 2}, "K4V2"),
        ("mla", "float32", {"latent_bits": 4}, "L4R32"),
        ("mla", "bfloat16", {"rope_bits": 8}, "L16R8"),
    ],
)
def test_the_bits_label_counts_the_bits_really_stored(attention, dtype, bits, label):
    cfg = ml_collections.ConfigDict({"model": {"attention": attention}, "cache": {"dtype": dtype}})
    if attention == "mla":
        cfg.model.update(num_kv_heads=4, head_dim=24)
    cfg.cache.update(bits)
    cfg = kvlab.validate_config(cfg)
    assert kvlab.cache.bits_label(cfg.model, cfg.cache) == label
