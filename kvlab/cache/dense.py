"""Contiguous KV cache: one buffer per layer for K and one for V.

The cache is an immutable pytree threaded through `model.apply`; every step
returns a new one. Row b holds `lengths[b]` tokens at positions
0..lengths[b]-1; the next tokens given to the model are written after them, so
rows of a batch may hold different lengths (ragged batches).

    Cache
      layers   tuple of one storage per transformer layer:
        KVLayer (model.attention='gqa': MHA, GQA, MQA)
          k       [B, K, S, H]   keys, after RoPE, in cache.dtype
          v       [B, K, S, H]   values
        LatentLayer (model.attention='mla', arXiv:2405.04434)
          c_kv    [B, S, R]      the normalised K/V latent (R = mla.kv_rank)
          k_rope  [B, S, Hr]     the RoPE key shared by all heads (Hr = mla.rope_dim)
      lengths  int32[B]        tokens written per row

S is the capacity (max_len). The buffers are head-major, the layout the
attention function reads fastest (see kvlab/attention/core.py) and the one
Pallas paged-attention kernels use for their pages ([K, P, L, H]). A length
above S records an overflow: the tokens that did not fit were dropped, never
wrapped or clamped onto other slots (see `write_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Int, Shaped

from kvlab.cache.placement import Placement, causal_mask
from kvlab.config import dtype_of, validate_cache_config, validate_model_config


def write_tokens(
    buffer: Shaped[Array, "B ..."],
    new: Shaped[Array, "B T ..."],
    slots: Int[Array, "B T"],
    axis: int = 1,
) -> Shaped[Array, "B ..."]:
    """Writes token t of row b at position slots[b, t] along the buffer's `axis`.

    `new` holds the tokens in [B, T, ...] order, "..." being the buffer's other
    axes in their order (for a [B, K, S, H] buffer and axis 2: new is
    [B, T, K, H]). Slots outside 0..S-1 are dropped.

    The one write into any cache buffer. `jax.lax.dynamic_update_slice` would
    move an out-of-range write back onto the last rows without a word; a
    scatter in "drop" mode writes exactly the slots asked for and nothing else,
    so padding tokens (slot S) and overflowing tokens vanish instead of
    overwriting real ones.
    """
    rows = jnp.arange(buffer.shape[0])[:, None]
    index = (rows,) + (slice(None),) * (axis - 1) + (slots,)
    return buffer.at[index].set(new.astype(buffer.dtype), mode="drop")


@struct.dataclass
class KVLayer:
    """One layer's keys and values: k, v [B, K, S, H] in the cache dtype."""

    k: Array
    v: Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def append(self, k: Array, v: Array, slots: Int[Array, "B T"]) -> KVLayer:
        """Writes k, v [B, T, K, H] at `slots` (see write_tokens)."""
        return KVLayer(
            k=write_tokens(self.k, k, slots, axis=2), v=write_tokens(self.v, v, slots, axis=2)
        )

    def roundtrip(self, k: Array, v: Array) -> tuple[Array, Array]:
        """What reading k, v back after `append` would give: the cache dtype."""
        return k.astype(self.k.dtype), v.astype(self.v.dtype)


@struct.dataclass
class LatentLayer:
    """One layer's latent attention cache: c_kv [B, S, R] and k_rope [B, S, Hr]."""

    c_kv: Array
    k_rope: Array

    @property
    def capacity(self) -> int:
        return self.c_kv.shape[1]

    def append(self, c_kv: Array, k_rope: Array, slots: Int[Array, "B T"]) -> LatentLayer:
        """Writes c_kv [B, T, R] and k_rope [B, T, Hr] at `slots` (see write_tokens)."""
        return LatentLayer(
            c_kv=write_tokens(self.c_kv, c_kv, slots),
            k_rope=write_tokens(self.k_rope, k_rope, slots),
        )

    def roundtrip(self, c_kv: Array, k_rope: Array) -> tuple[Array, Array]:
        """What reading the new entries back after `append` would give."""
        return c_kv.astype(self.c_kv.dtype), k_rope.astype(self.k_rope.dtype)


@struct.dataclass
class Cache:
    """Per-layer storage plus the tokens each row holds (module docstring)."""

    layers: tuple
    lengths: Int[Array, " B"]

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def overflowed(self) -> jax.Array:
        """bool[B]: rows that were given more tokens than the capacity holds."""
        return self.lengths > self.capacity

    def place(self, length: int, num_tokens: Int[Array, " B"]) -> Placement:
        """Places T new tokens per row (num_tokens[b] real) after the cached ones."""
        steps = jnp.arange(length, dtype=jnp.int32)
        relative = jnp.broadcast_to(steps, (self.batch_size, length))
        # Padding goes to slot S, which write_tokens drops.
        slots = jnp.where(steps < num_tokens[:, None], self.lengths[:, None] + steps, self.capacity)
        written = jnp.arange(self.capacity) < self.lengths[:, None]  # [B, S]
        return Placement(
            positions=self.lengths[:, None] + steps,
            fresh_mask=causal_mask(relative, num_tokens, length),
            slots=slots,
            cached_mask=written[:, None, :],
        )


def _check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not a positive integer: pass an int >= 1")


def init_cache(model_cfg: Mapping, cache_cfg: Mapping, batch_size: int, max_len: int) -> Cache:
    """An empty cache for `batch_size` rows of up to `max_len` tokens each."""
    validate_model_config(model_cfg)
    validate_cache_config(cache_cfg)
    _check_size("batch_size", batch_size)
    _check_size("max_len", max_len)
    dtype = dtype_of(cache_cfg["dtype"])
    if model_cfg["attention"] == "mla":
        mla = model_cfg["mla"]
        new_layer = lambda: LatentLayer(  # noqa: E731
            c_kv=jnp.zeros((batch_size, max_len, mla["kv_rank"]), dtype),
            k_rope=jnp.zeros((batch_size, max_len, mla["rope_dim"]), dtype),
        )
    else:
        # [B, K, S, H]
        shape = (batch_size, model_cfg["num_kv_heads"], max_len, model_cfg["head_dim"])
        new_layer = lambda: KVLayer(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))  # noqa: E731
    layers = tuple(new_layer() for _ in range(model_cfg["num_layers"]))
    return Cache(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32))
