import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.rope import apply_rope, rope_frequencies, softmax_mscale, yarn_mscale
from tests.helpers import plain_rope


def scaling(kind="none", **fields):
    """A model.rope_scaling section: the defaults with `fields` changed."""
    section = kvlab.base_config().model.rope_scaling
    section.update(type=kind, **fields)
    return section


# Llama 3.1 and DeepSeek-V2 as their Hugging Face configs scale RoPE.
LLAMA31 = scaling(
    "llama3", factor=8.0, original_max_len=8192, low_freq_factor=1.0, high_freq_factor=4.0
)
DEEPSEEK_V2 = scaling(
    "yarn", factor=40.0, original_max_len=4096, mscale=0.707, mscale_all_dim=0.707
)


@st.composite
def scalings(draw):
    """Random valid scalings of every type."""
    kind = draw(st.sampled_from(["none", "linear", "llama3", "yarn"]))
    if kind == "none":
        return scaling()
    low = draw(st.sampled_from([1.0, 2.0]))
    slow = draw(st.sampled_from([0.5, 1.0, 2.0]))
    return scaling(
        kind,
        factor=draw(st.sampled_from([0.5, 1.0, 4.0, 40.0])),
        original_max_len=draw(st.sampled_from([16, 256, 4096])),
        low_freq_factor=low,
        high_freq_factor=low + draw(st.sampled_from([0.5, 3.0])),
        beta_fast=slow + draw(st.sampled_from([1.0, 31.0])),
        beta_slow=slow,
        mscale=draw(st.sampled_from([0.0, 0.707, 1.0])),
        mscale_all_dim=draw(st.sampled_from([0.0, 0.707, 1.0])),
    )


@given(
    head_dim=st.sampled_from([2, 8, 32]),
    theta=st.sampled_from([100.0, 10_000.0]),
    shift=st.integers(0, 500),
    seed=st.integers(0, 2**16),
    rope_scaling=scalings(),
)
def test_scores_depend_only_on_relative_position(head_dim, theta, shift, seed, rope_scaling):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, 1, head_dim), np.float32)
    k = rng.standard_normal((1, 1, 1, head_dim), np.float32)

    def score(q_pos, k_pos):
        rq = apply_rope(q, jnp.array([[q_pos]]), theta, rope_scaling)
        rk = apply_rope(k, jnp.array([[k_pos]]), theta, rope_scaling)
        return float(jnp.sum(rq * rk))

    np.testing.assert_allclose(score(7, 3), score(7 + shift, 3 + shift), rtol=1e-4, atol=1e-4)


def test_rotation_keeps_norm_and_position_zero_is_identity():
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 16))
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    rotated = apply_rope(x, positions, 10_000.0)
    np.testing.assert_allclose(
        jnp.linalg.norm(rotated, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5
    )
    np.testing.assert_array_equal(rotated[:, 0], x[:, 0])
    assert not np.allclose(rotated[:, 1], x[:, 1])


def test_no_scaling_is_plain_rope_to_the_bit():
    x = jax.random.normal(jax.random.key(1), (2, 5, 3, 16))
    positions = jnp.broadcast_to(jnp.arange(100, 105), (2, 5))
    expected = plain_rope(x, positions, 10_000.0)
    for section in (None, scaling()):
        np.testing.assert_array_equal(apply_rope(x, positions, 10_000.0, section), expected)
    scaled = jax.jit(lambda x, p: apply_rope(x, p, 10_000.0, scaling()))
    plain = jax.jit(lambda x, p: plain_rope(x, p, 10_000.0))
    np.testing.assert_array_equal(scaled(x, positions), plain(x, positions))


def hand_computed(head_width, theta, section, channel):
    """One channel pair's inverse frequency, in float64, from transformers' formulas."""
    plain = theta ** (-2 * channel / head_width)
    factor, context = section.factor, section.original_max_len
    if section.type == "linear":
        return plain / factor
    if section.type == "llama3":
        wavelength = 2 * math.pi / plain
        if wavelength < context / section.high_freq_factor:
            return plain
        if wavelength > context / section.low_freq_factor:
            return plain / factor
        smooth = (context / wavelength - section.low_freq_factor) / (
            section.high_freq_factor - section.low_freq_factor
        )
        return (1 - smooth) * plain / factor + smooth * plain
    # yarn: a ramp between the pairs that turn beta_fast and beta_slow times over the context
    pair = lambda turns: (  # noqa: E731
        head_width * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))
    )
    low = max(math.floor(pair(section.beta_fast)), 0)
    high = min(math.ceil(pair(section.beta_slow)), head_width - 1)
    ramp = min(max((channel - low) / (high - low), 0), 1)
    return plain / factor * ramp + plain * (1 - ramp)


@pytest.mark.parametrize(
    "head_width, theta, section",
    [
        (64, 10_000.0, scaling("linear", factor=4.0)),
        (128, 500_000.0, LLAMA31),
        (64, 10_000.0, DEEPSEEK_V2),
        (128, 1_000_000.0, scaling("yarn", factor=4.0, original_max_len=32768, mscale=0.0)),
    ],
    ids=["linear", "llama3", "yarn_deepseek", "yarn_qwen"],
)
def test_frequencies_match_the_hand_computed_formulas(head_width, theta, section):
    inverse_frequency = np.asarray(rope_frequencies(head_width, theta, section).inverse_frequency)
    assert inverse_frequency.shape == (head_width // 2,)
    assert inverse_frequency.dtype == np.float32
    expected = [hand_computed(head_width, theta, section, i) for i in range(head_width // 2)]
    np.testing.assert_allclose(inverse_frequency, expected, rtol=1e-6)


# Inverse frequencies transformers 5.24 computes (ROPE_INIT_FUNCTIONS, torch float32).
TRANSFORMERS_LLAMA31 = {  # theta 500000, head_dim 128
    0: 1.0,
    20: 0.016560440883040428,  # kept
    29: 0.0021665706299245358,  # the smooth band
    31: 0.0008567514596506953,
    34: 0.0001785077911335975,
    40: 3.428102354519069e-05,  # interpolated
    63: 3.068925877869333e-07,
}
TRANSFORMERS_DEEPSEEK_V2 = {  # theta 10000, qk_rope_head_dim 64
    0: 1.0,
    10: 0.05623412877321243,  # kept
    14: 0.012447956018149853,  # the ramp
    18: 0.002249365206807852,
    22: 0.00017782794020604342,
    31: 3.3338035336782923e-06,  # interpolated
}


@pytest.mark.parametrize(
    "head_width, theta, section, expected",
    [
        (128, 500_000.0, LLAMA31, TRANSFORMERS_LLAMA31),
        (64, 10_000.0, DEEPSEEK_V2, TRANSFORMERS_DEEPSEEK_V2),
    ],
    ids=["llama3", "yarn"],
)
def test_frequencies_equal_what_transformers_computes(head_width, theta, section, expected):
    inverse_frequency = np.asarray(rope_frequencies(head_width, theta, section).inverse_frequency)
    channels = list(expected)
    np.testing.assert_allclose(
        inverse_frequency[channels], [expected[c] for c in channels], rtol=1.2e-7
    )


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_factor_one_is_plain_rope(kind):
    section = scaling(kind, factor=1.0, original_max_len=64)
    frequencies = rope_frequencies(32, 10_000.0, section)
    plain = rope_frequencies(32, 10_000.0, None)
    assert frequencies.attention_factor == 1.0
    np.testing.assert_allclose(frequencies.inverse_frequency, plain.inverse_frequency, rtol=1e-6)
    x = jax.random.normal(jax.random.key(2), (2, 5, 3, 32))
    positions = jnp.broadcast_to(jnp.arange(1000, 1005), (2, 5))
    np.testing.assert_allclose(
        apply_rope(x, positions, 10_000.0, section), plain_rope(x, positions, 10_000.0), atol=1e-4
    )


@given(rope_scaling=scalings(), head_width=st.sampled_from([4, 16, 64]))
def test_scaled_frequencies_lie_between_plain_and_interpolated(rope_scaling, head_width):
    scaled = np.asarray(rope_frequencies(head_width, 10_000.0, rope_scaling).inverse_frequency)
    plain = np.asarray(rope_frequencies(head_width, 10_000.0, None).inverse_frequency)
    factor = rope_scaling.factor if rope_scaling.type != "none" else 1.0
    lower, upper = np.minimum(plain, plain / factor), np.maximum(plain, plain / factor)
    assert np.all(scaled >= lower * (1 - 1e-6)) and np.all(scaled <= upper * (1 + 1e-6))


def test_yarn_attention_factor_scales_cos_and_sin():
    # Qwen2.5's yarn (no mscale): 0.1 ln(factor) + 1; DeepSeek-V2's (mscale = mscale_all_dim): 1.
    qwen = scaling("yarn", factor=4.0, original_max_len=32768, mscale=0.0)
    assert rope_frequencies(128, 1e6, qwen).attention_factor == pytest.approx(1.138629436111989)
    assert rope_frequencies(64, 1e4, DEEPSEEK_V2).attention_factor == 1.0
    uneven = scaling("yarn", factor=40.0, original_max_len=4096, mscale=1.0, mscale_all_dim=0.5)
    expected = (0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1)
    assert rope_frequencies(64, 1e4, uneven).attention_factor == pytest.approx(expected)
    x = jax.random.normal(jax.random.key(3), (2, 5, 3, 16))
    rotated = apply_rope(x, jnp.broadcast_to(jnp.arange(5), (2, 5)), 1e6, qwen)
    np.testing.assert_allclose(
        jnp.linalg.norm(rotated, axis=-1),
        1.138629436111989 * jnp.linalg.norm(x, axis=-1),
        rtol=1e-5,
    )


def test_softmax_mscale_is_deepseeks():
    # DeepSeek-V2: factor 40, mscale_all_dim 0.707; transformers' scaling is 0.1147213867929261.
    mscale = softmax_mscale(DEEPSEEK_V2)
    assert mscale == yarn_mscale(40.0, 0.707) == pytest.approx(1 + 0.0707 * math.log(40))
    assert (128 + 64) ** -0.5 * mscale * mscale == pytest.approx(0.1147213867929261, rel=1e-15)
    assert softmax_mscale(None) == softmax_mscale(scaling()) == 1.0
    assert softmax_mscale(scaling("yarn", factor=40.0, original_max_len=4096)) == 1.0
    assert yarn_mscale(0.5, 0.707) == yarn_mscale(1.0, 0.707) == 1.0


@settings(max_examples=10, deadline=None)
@given(span=st.integers(1, 40), per_head=st.booleans(), seed=st.integers(0, 2**16))
def test_a_span_is_the_mean_of_the_rotations_over_it(span, per_head, seed):
    """rotate(x, p, span=F) is the mean of rotate(x, p + f) over f < F, with one set of
    frequencies or a set per head; a span below 1 is refused by name."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 5000, (2, 3)), jnp.int32)
    inverse = rng.uniform(1e-3, 1, (4, 4) if per_head else (4,)).astype(np.float32)
    got = kvlab.rope.rotate(x, positions, inverse, 1.25, span=span)
    each = [kvlab.rope.rotate(x, positions + f, inverse, 1.25) for f in range(span)]
    np.testing.assert_allclose(got, np.mean(each, axis=0), atol=2e-5, rtol=0)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"span={bad!r} is not a positive int"):
            kvlab.rope.rotate(x, positions, inverse, span=bad)
