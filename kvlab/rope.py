"""Rotary position embedding (RoFormer, arXiv:2104.09864) and its context-length scalings.

Channels are rotated in two halves (the Llama / GPT-NeoX layout): channel i
pairs with channel i + H/2 and turns by `position * inverse_frequency[i]`,
where plain RoPE has `inverse_frequency[i] = theta ** (-2i / H)`.

A scaling (`model.rope_scaling`) changes the inverse frequencies, and yarn also
multiplies cos and sin by an attention factor. The rules are those of Hugging
Face transformers (`modeling_rope_utils`), so imported checkpoints compute what
they computed there:

- 'none': plain RoPE.
- 'linear': position interpolation (arXiv:2306.15595): every frequency / factor.
- 'llama3': Llama 3.1's bands by wavelength 2 pi / frequency: wavelengths below
  original_max_len / high_freq_factor keep their frequency, those above
  original_max_len / low_freq_factor take frequency / factor, and those between
  blend the two linearly in original_max_len / wavelength.
- 'yarn' (arXiv:2309.00071, as DeepSeek-V2 uses it): frequency / factor below
  a correction dimension, the plain frequency above another, a linear ramp
  between; the correction dimensions are where a frequency turns beta_fast and
  beta_slow times over original_max_len tokens. cos and sin are multiplied by
  yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) (by
  yarn_mscale(factor, 1) unless both are non-zero), and latent attention
  multiplies its softmax scale by yarn_mscale(factor, mscale_all_dim) twice
  (`softmax_mscale`).

    rope_frequencies(head_width, theta, scaling | None) -> RopeFrequencies
        (inverse_frequency float32[H/2], attention_factor)
    apply_rope(x [B, T, N, H], positions int32[B, T], theta, scaling | None) -> [B, T, N, H]
    rotate(x, positions, inverse_frequency [H/2] or [N, H/2], attention_factor) -> [B, T, N, H]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

SCALING_TYPES = ("none", "linear", "llama3", "yarn")


class RopeFrequencies(NamedTuple):
    """What a scaling makes of RoPE for one head width H."""

    inverse_frequency: Float[Array | np.ndarray, " H/2"]  # radians per position and pair
    attention_factor: float  # cos and sin are multiplied by it (1.0 but for yarn)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(
    head_width: int, theta: float, scaling: Mapping | None = None
) -> RopeFrequencies:
    """The inverse frequencies and cos/sin factor of RoPE over `head_width` channels.

    `scaling` is a `model.rope_scaling` section; None or type 'none' is plain RoPE,
    `theta ** (-2i / H)` in float32 on the device. The scalings are computed on the
    host in float32 with transformers' operations in its order (each power rounded
    from float64, which torch's float32 power matches to within an ulp), so their
    frequencies equal transformers' bit for bit but for an occasional last bit.
    """
    half = head_width // 2
    kind = "none" if scaling is None else scaling["type"]
    if kind == "none":
        # [H/2]
        return RopeFrequencies(theta ** (-jnp.arange(half, dtype=jnp.float32) / half), 1.0)
    if kind not in SCALING_TYPES:
        raise ValueError(
            f"model.rope_scaling.type={kind!r} is not supported: use one of "
            + ", ".join(repr(k) for k in SCALING_TYPES)
        )
    # [H/2]: theta ** (2i / H) as transformers computes it
    exponent = np.arange(0, head_width, 2, dtype=np.float32) / np.float32(head_width)
    position_frequency = _power(theta, exponent)
    if kind == "yarn":
        return _yarn(head_width, theta, position_frequency, scaling)
    inverse_frequency = np.float32(1.0) / position_frequency
    if kind == "linear":
        return RopeFrequencies(inverse_frequency / np.float32(scaling["factor"]), 1.0)
    return RopeFrequencies(_llama3(inverse_frequency, scaling), 1.0)


def _power(base: float, exponent: np.ndarray) -> np.ndarray:
    """float32 base ** exponent, rounded from float64."""
    return (np.float64(base) ** exponent.astype(np.float64)).astype(np.float32)


def _llama3(inverse_frequency: np.ndarray, scaling: Mapping) -> np.ndarray:
    """Llama 3.1: short wavelengths kept, long ones interpolated, a smooth band between."""
    factor, context = scaling["factor"], scaling["original_max_len"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    # Python numbers meet float32 arrays as float32, as in torch.
    wavelength = 2 * math.pi / inverse_frequency
    long = wavelength > context / low
    interpolated = np.where(long, inverse_frequency / factor, inverse_frequency)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * interpolated / factor + smooth * interpolated
    medium = ~(wavelength < context / high) & ~long
    return np.where(medium, smoothed, interpolated).astype(np.float32)


def _yarn(
    head_width: int, theta: float, position_frequency: np.ndarray, scaling: Mapping
) -> RopeFrequencies:
    """YaRN: interpolation below the low correction dimension, extrapolation above the high."""
    factor, context = scaling["factor"], scaling["original_max_len"]
    mscale, mscale_all_dim = scaling["mscale"], scaling["mscale_all_dim"]
    if mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        """The channel pair whose frequency turns `rotations` times over the original context."""
        return head_width * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), head_width - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    # [H/2]: 0 up to the low pair (extrapolate), 1 from the high one (interpolate)
    ramp = np.clip((np.arange(head_width // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    extrapolation = 1.0 / position_frequency
    interpolation = 1.0 / (factor * position_frequency)
    inverse_frequency = (
        interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    )
    return RopeFrequencies(inverse_frequency.astype(np.float32), float(attention_factor))


def softmax_mscale(scaling: Mapping | None) -> float:
    """What DeepSeek-V2's latent attention multiplies its softmax scale by, twice:
    yarn_mscale(factor, mscale_all_dim) for a scaled RoPE with mscale_all_dim set,
    else 1 (transformers applies it for any type but 'none')."""
    if scaling is None or scaling["type"] == "none" or not scaling["mscale_all_dim"]:
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])


def apply_rope(
    x: Float[Array, "B T N H"],
    positions: Int[Array, "B T"],
    theta: float,
    scaling: Mapping | None = None,
    span: int = 1,
) -> Float[Array, "B T N H"]:
    """Rotates each head's channels by angles that grow with the token position
    (`span` > 1: the mean rotation over a position and the span - 1 after it).

    `scaling` is a `model.rope_scaling` section (None: plain RoPE).
    """
    return rotate(x, positions, *rope_frequencies(x.shape[-1], theta, scaling), span=span)


def rotate(
    x: Float[Array, "B T N H"],
    positions: Int[Array, "B T"],
    inverse_frequency: Float[Array | np.ndarray, "*N H/2"],
    attention_factor: float = 1.0,
    span: int = 1,
) -> Float[Array, "B T N H"]:
    """RoPE with given inverse frequencies: the same for every head ([H/2]) or
    each head its own ([N, H/2], latent attention's kept pairs, `model.mla.rope_pairs`).
    With `span` > 1, the mean of the rotations at positions p .. p + span - 1: the
    rotation is linear in its cosines and sines, so the mean map is the one with
    their means."""
    if isinstance(span, bool) or not (isinstance(span, int) and span >= 1):
        raise ValueError(f"span={span!r} is not a positive int: pass the positions to average")
    if span == 1:  # [B, T, 1 or N, H/2]
        angles = positions.astype(jnp.float32)[:, :, None, None] * inverse_frequency
        sin, cos = jnp.sin(angles), jnp.cos(angles)
    else:  # [B, T, 1 or N, H/2, span], each position's offset added before the product
        offsets = jnp.arange(span, dtype=jnp.float32)
        at = positions.astype(jnp.float32)[:, :, None, None, None] + offsets
        angles = at * jnp.asarray(inverse_frequency)[..., None]
        sin, cos = jnp.sin(angles).mean(-1), jnp.cos(angles).mean(-1)
    if attention_factor != 1.0:
        sin, cos = sin * attention_factor, cos * attention_factor
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
