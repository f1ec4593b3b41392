"""Rotary position embedding (RoFormer, arXiv:2104.09864).

Channels are rotated in two halves (the Llama / GPT-NeoX layout): channel i
pairs with channel i + H/2 and turns by `position * theta ** (-2i / H)`.

    apply_rope(x [B, T, N, H], positions int32[B, T], theta) -> [B, T, N, H]
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def apply_rope(
    x: Float[Array, "B T N H"], positions: Int[Array, "B T"], theta: float
) -> Float[Array, "B T N H"]:
    """Rotates each head's channels by angles that grow with the token position."""
    half = x.shape[-1] // 2
    inverse_frequency = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [H/2]
    # [B, T, 1, H/2]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inverse_frequency
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
