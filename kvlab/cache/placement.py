"""Where a step's new tokens go in a cache and what each of them may see.

    causal_mask(q_positions [B, T], kv_lengths [B], kv_size) -> bool[B, T, S]
    Placement(positions, fresh_mask, slots, cached_mask)
    place_without_cache(batch, length) -> Placement      (the plain forward)

Each cache kind places tokens itself (`Cache.place`): positions follow the
row's length, slots are where its storage puts them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def causal_mask(
    q_positions: Int[Array, "B T"], kv_lengths: Int[Array, " B"], kv_size: int
) -> Bool[Array, "B T S"]:
    """True where a query may see a key: the key is not later and is written.

    `q_positions` are the queries' positions among the keys; keys sit at
    positions 0..kv_size-1 and only the first `kv_lengths[b]` of row b exist.
    """
    key_positions = jnp.arange(kv_size)
    not_later = key_positions[None, None, :] <= q_positions[:, :, None]
    written = key_positions[None, None, :] < kv_lengths[:, None, None]
    return not_later & written


class Placement(NamedTuple):
    """Where one step's T new tokens go and what each of them may see.

    positions    int32[B, T]    absolute positions (RoPE angles follow them)
    fresh_mask   bool[B, T, T]  new token t sees new token t' <= t, if t' is real
    slots        int32[B, T]    cache slot of each token; S (dropped) for padding
    cached_mask  bool[B, 1, S]  every new token sees the row's cached tokens
    """

    positions: Int[Array, "B T"]
    fresh_mask: Bool[Array, "B T T"]
    slots: Int[Array, "B T"] | None = None
    cached_mask: Bool[Array, "B 1 S"] | None = None


def place_without_cache(batch: int, length: int) -> Placement:
    """The plain causal forward: positions 0..T-1, nothing cached."""
    steps = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return Placement(steps, causal_mask(steps, jnp.full((batch,), length), length))
