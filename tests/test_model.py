"""The model over a cache computes what the plain causal forward computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from tests.helpers import (
    TOLERANCE,
    VARIANTS,
    build,
    random_tokens,
    run_in_chunks,
    small_model_configs,
    tiny_config,
)

# The tests over VARIANTS share shapes, so each variant compiles the plain
# forward (T = 24) and the cached steps (T = 8, T = 1, T = 24) once for all.
BATCH, LENGTH, WIDTH, MAX_LEN = 3, 24, 8, 32


def fresh_cache(cfg):
    return kvlab.init_cache(cfg.model, cfg.cache, batch_size=BATCH, max_len=MAX_LEN)


def feed(apply, params, cache, tokens, chunk_sizes):
    """Like run_in_chunks, but each chunk longer than one token goes in padded to WIDTH."""
    logits, start = [], 0
    for size in chunk_sizes:
        width = 1 if size == 1 else WIDTH
        out, cache = apply(
            {"params": params},
            tokens[:, start : start + width],
            cache=cache,
            num_tokens=jnp.full((tokens.shape[0],), size),
        )
        logits.append(out[:, :size])
        start += size
    return jnp.concatenate(logits, axis=1), cache


def max_diff(a, b):
    return float(jnp.max(jnp.abs(a - b)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_incremental_decode_equals_full_forward(variant):
    cfg = VARIANTS[variant]()
    model, params, apply = build(cfg)
    tokens = random_tokens(cfg, (BATCH, LENGTH + WIDTH))
    full, none = apply({"params": params}, tokens[:, :LENGTH])
    assert none is None and full.shape == (BATCH, LENGTH, cfg.model.vocab_size)
    assert full.dtype == jnp.float32
    # A prefill of 8 tokens, then 16 single-token decode steps.
    cached, cache = feed(apply, params, fresh_cache(cfg), tokens, [8] + [1] * 16)
    assert max_diff(cached, full) <= TOLERANCE
    np.testing.assert_array_equal(cache.lengths, [LENGTH] * BATCH)


@settings(max_examples=5)  # each example compiles whole models
@given(cfg=small_model_configs(), data=st.data())
def test_random_configs_decode_and_chunked_prefill_equal_forward(cfg, data):
    length = 12
    chunks = []  # random chunk sizes, each fed padded to one width so it compiles once
    while sum(chunks) < length:
        chunks.append(data.draw(st.integers(1, min(5, length - sum(chunks))), label="chunk"))
    model, params, apply = build(cfg, seed=data.draw(st.integers(0, 3), label="seed"))
    tokens = random_tokens(cfg, (2, length + 5), seed=len(chunks))
    full, _ = apply({"params": params}, tokens[:, :length])

    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=length + 1)
    chunked, start = [], 0
    for size in chunks:
        logits, cache = apply(
            {"params": params},
            tokens[:, start : start + 5],
            cache=cache,
            num_tokens=jnp.full((2,), size),
        )
        chunked.append(logits[:, :size])
        start += size
    assert max_diff(jnp.concatenate(chunked, axis=1), full) <= TOLERANCE

    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=length)
    fused = kvlab.fuse_projections(params)  # the same model (test_fused_projections_...)
    stepwise, _ = run_in_chunks(apply, fused, cache, tokens, [1] * length)
    assert max_diff(stepwise, full) <= TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_equals_prefill_at_once(variant):
    cfg = VARIANTS[variant]()
    model, params, apply = build(cfg)
    tokens = random_tokens(cfg, (BATCH, LENGTH + WIDTH))
    at_once, cache_a = run_in_chunks(apply, params, fresh_cache(cfg), tokens, [LENGTH])
    in_chunks, cache_b = feed(apply, params, fresh_cache(cfg), tokens, [7, 1, 8, 8])
    assert max_diff(at_once, in_chunks) <= TOLERANCE
    for stored_a, stored_b in zip(
        jax.tree_util.tree_leaves(cache_a), jax.tree_util.tree_leaves(cache_b), strict=True
    ):
        assert max_diff(stored_a, stored_b) <= TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_row_of_a_ragged_batch_equals_the_row_alone(variant):
    cfg = VARIANTS[variant]()
    model, params, apply = build(cfg)
    prompt_lengths = np.array([5, 1, 8])
    prompts = random_tokens(cfg, (BATCH, WIDTH), seed=3)  # right "padding" is random junk
    # Three decode steps; row 1 sits out the second one.
    steps = random_tokens(cfg, (BATCH, 3), seed=4)
    active = np.array([[1, 1, 1], [1, 0, 1], [1, 1, 1]])

    def run(rows):
        """Prompt and steps with only `rows` taking part (the others get num_tokens 0)."""
        taking_part = np.isin(np.arange(BATCH), rows)
        cache = fresh_cache(cfg)
        prompt_logits, cache = apply(
            {"params": params},
            prompts,
            cache=cache,
            num_tokens=jnp.asarray(prompt_lengths * taking_part),
        )
        step_logits = []
        for i in range(3):
            logits, cache = apply(
                {"params": params},
                steps[:, i : i + 1],
                cache=cache,
                num_tokens=jnp.asarray(active[:, i] * taking_part),
            )
            step_logits.append(logits[:, 0])
        return prompt_logits, step_logits, cache

    prompt_logits, step_logits, cache = run(rows=[0, 1, 2])
    np.testing.assert_array_equal(cache.lengths, prompt_lengths + active.sum(1))
    # Each row's whole sequence, as one batch of plain forwards (padding follows it).
    sequences = np.zeros((BATCH, LENGTH), np.int32)
    for row in range(BATCH):
        fed = [steps[row, i] for i in range(3) if active[row, i]]
        sequence = np.concatenate([prompts[row, : prompt_lengths[row]], fed])
        sequences[row, : len(sequence)] = sequence
    full, _ = apply({"params": params}, sequences)

    for row in range(BATCH):
        alone_prompt, alone_steps, _ = run(rows=[row])
        n = prompt_lengths[row]
        assert max_diff(prompt_logits[row, :n], full[row, :n]) <= TOLERANCE
        assert max_diff(alone_prompt[row, :n], full[row, :n]) <= TOLERANCE
        for i, position in zip(np.flatnonzero(active[row]), range(n, LENGTH), strict=False):
            assert max_diff(step_logits[i][row], full[row, position]) <= TOLERANCE
            assert max_diff(alone_steps[i][row], full[row, position]) <= TOLERANCE


def test_bfloat16_model_and_cache_track_the_forward():
    cfg = tiny_config(dtype="bfloat16")
    cfg.cache.dtype = "bfloat16"
    model, params, apply = build(cfg)
    tokens = random_tokens(cfg, (2, 12))
    full, _ = apply({"params": params}, tokens)
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=12)
    assert cache.layers[0].tensors[0].dtype == jnp.bfloat16
    cached, _ = run_in_chunks(apply, params, cache, tokens, [4] + [1] * 8)
    assert cached.dtype == jnp.float32
    assert max_diff(cached, full) <= 0.1  # bfloat16 rounding, not a different computation


def test_overflow_is_refused_outside_jit():
    cfg = tiny_config()
    model, params, _ = build(cfg)
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=6)
    cache = cache.replace(lengths=jnp.array([4, 3]))
    with pytest.raises(ValueError, match=r"row 0 would hold 7 tokens but the cache holds 6"):
        model.apply({"params": params}, random_tokens(cfg, (2, 3)), cache=cache)
    # Padding beyond the capacity is fine: only real tokens count.
    _, cache = model.apply(
        {"params": params}, random_tokens(cfg, (2, 3)), cache=cache, num_tokens=jnp.array([2, 1])
    )
    np.testing.assert_array_equal(cache.lengths, [6, 4])


def test_overflow_under_jit_is_flagged_and_corrupts_nothing():
    cfg = tiny_config()
    model, params, _ = build(cfg)
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=6)
    tokens = random_tokens(cfg, (2, 8))
    _, cache = kvlab.prefill(model, params, cache, tokens[:, :4], jnp.array([4, 2]))
    kept = [np.asarray(layer.tensors[0]) for layer in cache.layers]  # keys
    _, cache = kvlab.prefill(model, params, cache, tokens[:, 4:], jnp.array([4, 4]))
    np.testing.assert_array_equal(cache.overflowed(), [True, False])
    np.testing.assert_array_equal(cache.lengths, [8, 6])
    # Row 0's first four tokens are where they were: nothing wrapped or clamped onto them.
    for before, layer in zip(kept, cache.layers, strict=True):
        np.testing.assert_array_equal(np.asarray(layer.tensors[0])[0, :, :4], before[0, :, :4])
    with pytest.raises(kvlab.cache.CacheError, match="row 0 was given more tokens than"):
        cache.check()


# Invalid values given to a compiled step, per row 1 of a batch of 3: (tokens of
# row 1, num_tokens of row 1, length of row 1 before the step, the flag).
INVALID = {
    "id -1": ([-1, 5, 6], 3, 2, "token id outside the vocabulary"),
    "id >= vocab": ([5, 256, 6], 3, 2, "token id outside the vocabulary"),
    "num_tokens > T": ([5, 6, 7], 4, 2, "num_tokens outside 0..T"),
    "num_tokens < 0": ([5, 6, 7], -1, 2, "num_tokens outside 0..T"),
    "negative length": ([5, 6, 7], 3, -3, "negative length"),
}


@pytest.mark.parametrize("case", INVALID)
@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_invalid_values_under_jit_are_flagged_and_write_nothing(case, kind):
    """Inside jit nothing raises: the bad row is flagged, its cache is untouched,
    its logits are NaN, and the other rows compute what they compute alone."""
    row_tokens, count, length, words = INVALID[case]
    cfg = tiny_config(num_kv_heads=2)
    cfg.cache.kind = kind
    model, params, _ = build(cfg)
    tokens = random_tokens(cfg, (3, 3), seed=1)
    tokens[1] = row_tokens
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=3, max_len=8)
    _, cache = kvlab.prefill(model, params, cache, random_tokens(cfg, (3, 2)))
    cache = cache.replace(lengths=jnp.array([2, length, 2], jnp.int32))
    before = jax.tree.map(np.asarray, cache)
    good_logits, good = kvlab.prefill(
        model, params, jax.tree.map(jnp.asarray, before), tokens, jnp.array([3, 0, 1])
    )
    logits, cache = kvlab.prefill(
        model, params, jax.tree.map(jnp.asarray, before), tokens, jnp.array([3, count, 1])
    )
    np.testing.assert_array_equal(np.asarray(cache.errors) != 0, [False, True, False])
    with pytest.raises(kvlab.cache.CacheError, match=f"row 1 .*{words}"):
        cache.check()
    assert np.isnan(np.asarray(logits[1])).all()
    np.testing.assert_array_equal(logits[0], good_logits[0])
    np.testing.assert_array_equal(logits[2, :1], good_logits[2, :1])
    # Row 1 wrote nothing and kept its length; every stored array equals the run
    # where row 1 was given no tokens at all.
    np.testing.assert_array_equal(cache.lengths, [5, length, 3])
    for got, want in zip(jax.tree.leaves(cache.layers), jax.tree.leaves(good.layers), strict=True):
        np.testing.assert_array_equal(got, want)


def test_invalid_ids_without_a_cache_give_nan_rows_under_jit():
    cfg = tiny_config()
    model, params, _ = build(cfg)
    tokens = random_tokens(cfg, (2, 4))
    tokens[0, 2] = 300
    logits, _ = jax.jit(model.apply)({"params": params}, tokens)
    assert np.isnan(np.asarray(logits[0])).all()
    alone, _ = model.apply({"params": params}, tokens[1:])
    np.testing.assert_allclose(logits[1], alone[0], atol=TOLERANCE)


def other_model_caches():
    """Caches the tiny 2-KV-head model must refuse, by what is wrong with them."""
    cfg = tiny_config(num_kv_heads=2)
    fewer = kvlab.init_cache(cfg.model, cfg.cache, 1, 8)
    fewer = fewer.replace(layers=fewer.layers[:1])
    heads = tiny_config(num_kv_heads=1)
    mla = kvlab.load_config("configs/mla.py:tiny")
    mixed = kvlab.init_cache(cfg.model, cfg.cache, 1, 8)
    bf16 = dict(cfg.cache, dtype="bfloat16")
    mixed = mixed.replace(
        layers=(mixed.layers[0], kvlab.init_cache(cfg.model, bf16, 1, 8).layers[1])
    )
    return {
        "fewer layers": (fewer, "the cache has 1 layers but model.num_layers=2"),
        "other heads": (kvlab.init_cache(heads.model, heads.cache, 1, 8), r"k 1x16, v 1x16"),
        "latent cache": (kvlab.init_cache(mla.model, mla.cache, 1, 8), "c_kv"),
        "mixed dtypes": (mixed, "cache layer 1 differs from layer 0"),
    }


@pytest.mark.parametrize("case", ["fewer layers", "other heads", "latent cache", "mixed dtypes"])
def test_a_cache_built_for_another_model_is_refused_also_under_jit(case):
    cfg = tiny_config(num_kv_heads=2)
    model, params, _ = build(cfg)
    cache, words = other_model_caches()[case]
    tokens = random_tokens(cfg, (1, 2))
    with pytest.raises(ValueError, match=words):
        model.apply({"params": params}, tokens, cache=cache)
    with pytest.raises(ValueError, match=words):
        kvlab.prefill(model, params, cache, tokens)


@pytest.mark.parametrize(
    "tokens,kwargs,words",
    [
        (np.array([[1, 256]]), {}, r"tokens\[0, 1\]=256 is outside the vocabulary 0..255"),
        (np.array([[-1, 2]]), {}, r"tokens\[0, 0\]=-1 is outside the vocabulary"),
        (np.zeros((2, 0), np.int32), {}, "at least one token"),
        (np.zeros((3,), np.int32), {}, r"pass int32\[batch, length\]"),
        (np.zeros((2, 2), np.float32), {}, "integer token ids"),
        (np.zeros((3, 2), np.int32), {"cache": True}, "batch size 3 but the cache holds 2 rows"),
        (np.zeros((2, 2), np.int32), {"num_tokens": np.array([3, 1])}, r"must lie in 0..2"),
        (np.zeros((2, 2), np.int32), {"num_tokens": np.array([1])}, "one count per row"),
    ],
)
def test_bad_inputs_raise(tokens, kwargs, words):
    cfg = tiny_config()
    model, params, _ = build(cfg)
    if "cache" in kwargs or "num_tokens" in kwargs:
        kwargs["cache"] = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=8)
    if "num_tokens" in kwargs:
        kwargs["num_tokens"] = jnp.asarray(kwargs["num_tokens"])
    with pytest.raises(ValueError, match=words):
        model.apply({"params": params}, jnp.asarray(tokens), **kwargs)


def test_untied_output_has_its_own_matrix():
    tied = kvlab.init_params(tiny_config().model, jax.random.key(0))
    untied = kvlab.init_params(tiny_config(tie_embeddings=False).model, jax.random.key(0))
    assert "unembed" not in tied and untied["unembed"]["kernel"].shape == (64, 256)


# ---------------------------------------------------------------------------
# Fused projections (kvlab.fuse_projections)


def _perturbed(params, seed):
    """Every parameter moved off its initial value (biases start at zero, scales at one)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    rng = np.random.default_rng(seed)
    moved = [leaf + 0.1 * rng.standard_normal(leaf.shape).astype(leaf.dtype) for leaf in leaves]
    return jax.tree_util.tree_unflatten(tree, moved)


def _projections(params):
    """The names of every parameter dict that holds projections, by path."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    return {"/".join(k.key for k in path[:-1]) for path, _ in flat}


@settings(max_examples=4)  # each example compiles two forwards
@given(
    cfg=small_model_configs(),
    option=st.sampled_from(["plain", "qkv_bias", "qk_norm", "experts"]),
    seed=st.integers(0, 3),
)
def test_fused_projections_compute_the_same_model(cfg, option, seed):
    if option == "experts":  # the shared experts' SwiGLU fuses, the routed ones stay
        cfg.model.moe.update(
            num_experts=4, expert_dim=8, num_shared_experts=1, first_dense_layers=1
        )
    elif cfg.model.attention == "gqa" and option != "plain":
        cfg.model[option] = True
    kvlab.config.validate_model_config(cfg.model)
    model = kvlab.Transformer(cfg.model)
    params = _perturbed(kvlab.init_params(cfg.model, jax.random.key(seed)), seed)
    fused = kvlab.fuse_projections(params)

    names = _projections(fused)
    gqa = cfg.model.attention == "gqa"
    assert any(n.endswith("attention/qkv") for n in names) == gqa
    assert not any(n.endswith(("/gate", "/up")) for n in names)
    assert not gqa or not any(n.endswith(("/query", "/key", "/value")) for n in names)
    assert any(n.endswith("mlp/gate_up") for n in names)
    assert kvlab.tree_bytes(fused) == kvlab.tree_bytes(params)
    if gqa:  # query head n = k * G + g sits at [:, k, g], then the key and value of head k
        heads, kv_heads = cfg.model.num_heads, cfg.model.num_kv_heads
        qkv = fused["block_0"]["attention"]["qkv"]["kernel"]
        query = params["block_0"]["attention"]["query"]["kernel"]
        for n in range(heads):
            k, g = divmod(n, heads // kv_heads)
            np.testing.assert_array_equal(qkv[:, k, g], query[:, n])
        key = params["block_0"]["attention"]["key"]["kernel"]
        np.testing.assert_array_equal(qkv[:, :, -2], key)
    # Back again, exactly; fusing twice changes nothing.
    unfused = kvlab.unfuse_projections(fused)
    assert jax.tree_util.tree_structure(unfused) == jax.tree_util.tree_structure(params)
    leaves = zip(jax.tree_util.tree_leaves(unfused), jax.tree_util.tree_leaves(params), strict=True)
    for a, b in leaves:
        np.testing.assert_array_equal(a, b)
    again = kvlab.fuse_projections(fused)
    assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(fused)

    # Through a cache: test_random_configs_decode_and_chunked_prefill_equal_forward.
    tokens = random_tokens(cfg, (2, 9), seed)
    apply = jax.jit(model.apply)
    want, _ = apply({"params": params}, tokens)
    got, _ = apply({"params": fused}, tokens)
    assert max_diff(got, want) <= TOLERANCE


def test_fusing_mismatched_projections_is_refused():
    params = kvlab.init_params(tiny_config(num_kv_heads=2).model, jax.random.key(0))
    attention = params["block_0"]["attention"]
    attention["key"] = {"kernel": attention["key"]["kernel"][:, :1]}  # one head, value keeps two
    with pytest.raises(ValueError, match=r"do not fuse.*multiple of the key/value heads"):
        kvlab.fuse_projections(params)
