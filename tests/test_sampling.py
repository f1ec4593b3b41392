"""Samplers, jitted steps and generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from tests.helpers import TOLERANCE, VARIANTS, build, count_compiles, random_tokens, tiny_config

# ---------------------------------------------------------------------------
# Samplers

distinct_logits = st.lists(st.integers(-500, 500), min_size=2, max_size=12, unique=True).map(
    lambda xs: np.array([xs], np.float32) / 100
)

KEYS = jax.random.split(jax.random.key(0), 64)


def draws(sampler, logits):
    """The sampler's pick for 64 different keys."""
    return np.asarray(jax.vmap(lambda key: sampler(jnp.asarray(logits), key))(KEYS))[:, 0]


@given(logits=distinct_logits)
def test_greedy_is_argmax(logits):
    assert set(draws(kvlab.Greedy(), logits)) == {int(np.argmax(logits))}


@given(logits=distinct_logits, k=st.integers(1, 4))
def test_top_k_only_samples_the_k_most_likely(logits, k):
    kth_largest = np.sort(logits[0])[::-1][min(k, logits.shape[1]) - 1]
    allowed = set(np.flatnonzero(logits[0] >= kth_largest).tolist())  # ties with the k-th stay
    assert set(draws(kvlab.TopK(k), logits)) <= allowed


@given(logits=distinct_logits, p=st.floats(0.05, 0.95))
def test_top_p_only_samples_the_nucleus(logits, p):
    order = np.argsort(-logits[0])
    probs = np.exp(logits[0][order] - logits[0].max())
    probs /= probs.sum()
    # The smallest prefix of the sorted tokens whose mass reaches p.
    size = int(np.searchsorted(np.cumsum(probs), p - 1e-6)) + 1
    assert set(draws(kvlab.TopP(p), logits)) <= set(order[:size].tolist())


def test_temperature_sampling_follows_the_softmax():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
    keys = jax.random.split(jax.random.key(1), 20_000)
    picks = jax.vmap(lambda key: kvlab.Temperature(1.0)(logits, key))(keys)[:, 0]
    frequencies = np.bincount(np.asarray(picks), minlength=4) / len(keys)
    np.testing.assert_allclose(frequencies, [0.1, 0.2, 0.3, 0.4], atol=0.015)
    # A low temperature sharpens towards the argmax; TopP(1) is plain sampling.
    cold = jax.vmap(lambda key: kvlab.Temperature(0.05)(logits, key))(keys[:500])
    assert (np.asarray(cold) == 3).mean() > 0.99
    top_p_picks = jax.vmap(lambda key: kvlab.TopP(1.0)(logits, key))(keys)[:, 0]
    np.testing.assert_array_equal(top_p_picks, picks)


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda: kvlab.Temperature(0.0), "Temperature.temperature=0.0 must be > 0"),
        (lambda: kvlab.TopK(0), "TopK.k=0"),
        (lambda: kvlab.TopK(2, temperature=-1.0), "TopK.temperature=-1.0"),
        (lambda: kvlab.TopP(0.0), r"TopP.p=0.0 must lie in \(0, 1\]"),
        (lambda: kvlab.TopP(1.5), "TopP.p=1.5"),
    ],
)
def test_bad_sampler_settings(make, words):
    with pytest.raises(ValueError, match=words):
        make()


# ---------------------------------------------------------------------------
# Generation


def assert_greedy_under_full_forward(apply, params, out, prompt_lengths, new_tokens):
    """Every generated token is an argmax (up to float noise) of the full forward.

    One causal forward over the whole output: what follows a row's tokens
    (padding) cannot change the logits before it."""
    logits, _ = apply({"params": params}, out)
    for row, start in enumerate(prompt_lengths):
        for position in range(start, start + new_tokens):
            previous = logits[row, position - 1]
            assert previous[out[row, position]] >= previous.max() - TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generate_equals_stepwise_argmax_of_the_forward(variant):
    cfg = VARIANTS[variant]()
    model, params, apply = build(cfg)
    # Three rows, prompts up to 8 and 16 new tokens: the [3, 24] forward below is the
    # shape test_model.py compiles too.
    prompt_lengths = np.array([8, 2, 4])
    prompts = random_tokens(cfg, (3, 8), seed=5)
    out = np.asarray(
        kvlab.generate(
            model,
            params,
            prompts,
            cache_cfg=cfg.cache,
            max_new_tokens=16,
            prompt_lengths=prompt_lengths,
            pad_token=7,
        )
    )
    assert out.shape == (3, 24) and out.dtype == np.int32
    for row, length in enumerate(prompt_lengths):
        np.testing.assert_array_equal(out[row, :length], prompts[row, :length])
        np.testing.assert_array_equal(out[row, length + 16 :], 7)  # padding after the row
    assert_greedy_under_full_forward(apply, params, out, prompt_lengths, 16)


def test_each_row_stops_at_its_end_token():
    cfg = tiny_config()
    model, params, _ = build(cfg)
    prompts = random_tokens(cfg, (4, 3), seed=11)
    free = np.asarray(kvlab.generate(model, params, prompts, cache_cfg=cfg.cache, max_new_tokens=8))
    end = int(free[0, 3 + 2])  # row 0's third generated token
    out = np.asarray(
        kvlab.generate(
            model,
            params,
            prompts,
            cache_cfg=cfg.cache,
            max_new_tokens=8,
            end_token=end,
            pad_token=0,
        )
    )
    for row in range(4):
        generated = free[row, 3:]
        hits = np.flatnonzero(generated == end)
        stop = hits[0] + 1 if len(hits) else 8
        np.testing.assert_array_equal(out[row, : 3 + stop], free[row, : 3 + stop])
        np.testing.assert_array_equal(out[row, 3 + stop :], 0)
    assert (out[0, 6:] == 0).all()


def test_sampled_generation_is_seeded_and_stays_in_top_k():
    cfg = tiny_config()
    model, params, apply = build(cfg)
    prompts = random_tokens(cfg, (2, 4), seed=2)
    run = lambda seed: np.asarray(  # noqa: E731
        kvlab.generate(
            model,
            params,
            prompts,
            cache_cfg=cfg.cache,
            max_new_tokens=12,
            sampler=kvlab.TopK(3),
            rng=jax.random.key(seed),
        )
    )
    first, again, other = run(0), run(0), run(1)
    np.testing.assert_array_equal(first, again)
    assert (first != other).any()
    logits, _ = apply({"params": params}, first)
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :, :3]
    for position in range(4, 16):
        for row in range(2):
            assert first[row, position] in top3[row, position - 1]


def test_decode_compiles_once_over_a_thousand_steps():
    cfg = tiny_config()
    model, params, _ = build(cfg)
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=1010)
    tokens = random_tokens(cfg, (2, 1000), seed=9)
    logits, cache = kvlab.prefill(model, params, cache, tokens[:, :8])
    with count_compiles() as compiles:
        for step in range(1000):
            logits, cache = kvlab.decode_step(model, params, cache, tokens[:, step])
        logits.block_until_ready()
    np.testing.assert_array_equal(cache.lengths, [1008, 1008])
    assert compiles[0] == 1, f"decode compiled {compiles[0]} times over 1000 steps"


def test_generate_compiles_its_loop_once_per_shape():
    cfg = tiny_config()
    model, params, _ = build(cfg)
    prompts = random_tokens(cfg, (2, 5), seed=3)
    generate = lambda prompts, new: kvlab.generate(  # noqa: E731
        model, params, prompts, cache_cfg=cfg.cache, max_new_tokens=new, max_len=1010
    )
    loops = kvlab.sampling.generate_loop._cache_size
    before = loops()
    out = generate(prompts, 1000)
    generate(random_tokens(cfg, (2, 5), seed=4), 1000)
    generate(prompts, 300)
    assert out.shape == (2, 1005)
    assert loops() == before + 1


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"prompts": np.array([[3, 999]])}, r"tokens\[0, 1\]=999 is outside the vocabulary"),
        ({"prompts": np.zeros((2, 0), np.int32)}, "at least one token"),
        ({"prompt_lengths": np.array([2, 0])}, r"prompt_lengths\[1\]=0"),
        ({"prompt_lengths": np.array([2, 5])}, r"must lie in 0..3"),
        ({"max_len": 6}, "need 8 cache slots but max_len=6"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 is below 1"),
        ({"max_new_tokens": 2.0}, "max_new_tokens=2.0 is not an integer"),
        ({"max_new_tokens": "2"}, "max_new_tokens='2' is not an integer"),
        ({"end_token": 256}, "end_token=256 is outside the vocabulary"),
        ({"end_token": -1}, "end_token=-1 is below 0"),
        ({"max_len": 7.5}, "max_len=7.5 is not an integer"),
    ],
)
def test_generate_refuses_bad_inputs(kwargs, words):
    cfg = tiny_config()
    model, params, _ = build(cfg)
    arguments = dict(prompts=np.ones((2, 3), np.int32), max_new_tokens=5) | kwargs
    prompts = arguments.pop("prompts")
    with pytest.raises(ValueError, match=words):
        kvlab.generate(model, params, prompts, cache_cfg=cfg.cache, **arguments)


def test_generate_takes_numpy_integers():
    cfg = tiny_config()
    model, params, _ = build(cfg)
    prompts = np.ones((2, 3), np.int32)
    plain = kvlab.generate(
        model, params, prompts, cache_cfg=cfg.cache, max_new_tokens=4, end_token=255
    )
    numpy = kvlab.generate(
        model,
        params,
        prompts,
        cache_cfg=cfg.cache,
        max_new_tokens=np.int64(4),
        max_len=np.int32(7),
        end_token=np.int16(255),
    )
    np.testing.assert_array_equal(numpy, plain)


def test_logits_at_gives_the_full_logits_at_those_positions():
    """Transformer(..., logits_at=i) computes only row b's logits after token i[b]
    (generation's prefill), equal to the full logits there."""
    cfg = tiny_config()
    model, params, _ = build(cfg)
    tokens = random_tokens(cfg, (3, 7), seed=5)
    cache = kvlab.init_cache(cfg.model, cfg.cache, 3, 8)
    index = jnp.array([6, 0, 3], jnp.int32)
    apply = jax.jit(lambda c, i: model.apply({"params": params}, tokens, cache=c, logits_at=i))
    some, _ = apply(cache, index)
    full, _ = jax.jit(lambda c: model.apply({"params": params}, tokens, cache=c))(cache)
    assert some.shape == (3, 1, cfg.model.vocab_size)
    np.testing.assert_allclose(some[:, 0], full[jnp.arange(3), index], atol=1e-6)
