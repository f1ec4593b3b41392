"""The KV cache pytree: contiguous per-layer buffers and per-row lengths.

The cache is an immutable pytree threaded through `model.apply`; every step
returns a new one. Row b holds `lengths[b]` tokens at positions
0..lengths[b]-1; the next tokens given to the model are written after them, so
rows of a batch may hold different lengths (ragged batches).

    Cache
      layers   tuple of one storage per transformer layer, holding the
               tensors `cached_tensors` names, each [B, KH, S, W]:
               model.attention='gqa' (MHA, GQA, MQA):
                 k       [B, K, S, H]   keys, after RoPE
                 v       [B, K, S, H]   values
               model.attention='mla' (arXiv:2405.04434):
                 c_kv    [B, 1, S, R]   the normalised K/V latent (R = mla.kv_rank)
                 k_rope  [B, 1, S, Hr]  the RoPE key all heads share (Hr = mla.rope_dim)
               as a DenseLayer (cache.dtype) when every tensor is 16-bit,
               else a quant.QuantizedLayer (payloads, scales, a ring of recent
               tokens: kvlab/cache/quant.py)
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
from jaxtyping import Int

from kvlab.cache import quant
from kvlab.cache.placement import Placement, causal_mask, write_tokens
from kvlab.config import dtype_of, validate_cache_config, validate_model_config


def cached_tensors(model_cfg: Mapping) -> tuple[tuple[str, int, int], ...]:
    """(name, heads, width) of each tensor one layer caches per token.

    Grouped-query attention: keys and values, K heads of head_dim. Latent
    attention: the latent c_kv (width kv_rank) and the shared RoPE key k_rope
    (width rope_dim), each with a single head axis of size 1.
    """
    if model_cfg["attention"] == "mla":
        mla = model_cfg["mla"]
        return (("c_kv", 1, mla["kv_rank"]), ("k_rope", 1, mla["rope_dim"]))
    heads, width = model_cfg["num_kv_heads"], model_cfg["head_dim"]
    return (("k", heads, width), ("v", heads, width))


@struct.dataclass
class DenseLayer:
    """One layer's cached tensors in the cache dtype, each [B, KH, S, W] (`cached_tensors`)."""

    tensors: tuple

    @property
    def capacity(self) -> int:
        return self.tensors[0].shape[2]

    def read(self, fresh: tuple, placement: Placement):
        """What the step's queries attend over, and what `write` will store.

        fresh: the step's new tokens per tensor, [B, KH, T, W]. Returns blocks
        [(tensors, mask)]: the cache as it is (mask [B, 1, S]: written slots)
        and the new tokens as the cache will hold them (placement.fresh_mask);
        and those new tokens, for `write`.
        """
        fresh = tuple(x.astype(t.dtype) for x, t in zip(fresh, self.tensors, strict=True))
        written = jnp.arange(self.capacity) < placement.lengths[:, None]  # [B, S]
        return [(self.tensors, written[:, None, :]), (fresh, placement.fresh_mask)], fresh

    def write(self, fresh: tuple, placement: Placement) -> DenseLayer:
        """Stores the new tokens at `placement.slots` (see write_tokens)."""
        return DenseLayer(
            tuple(
                write_tokens(t, x, placement.slots, axis=2)
                for t, x in zip(self.tensors, fresh, strict=True)
            )
        )


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
        return place_after(self.lengths, self.capacity, length, num_tokens)


def place_after(
    lengths: Int[Array, " B"], capacity: int, length: int, num_tokens: Int[Array, " B"]
) -> Placement:
    """T new tokens per row (num_tokens[b] real) at the slots after each row's length."""
    steps = jnp.arange(length, dtype=jnp.int32)
    relative = jnp.broadcast_to(steps, (lengths.shape[0], length))
    # Padding goes to slot S, which every cache write drops.
    slots = jnp.where(steps < num_tokens[:, None], lengths[:, None] + steps, capacity)
    return Placement(
        positions=lengths[:, None] + steps,
        fresh_mask=causal_mask(relative, num_tokens, length),
        slots=slots,
        lengths=lengths,
        num_tokens=num_tokens,
    )


def _check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not a positive integer: pass an int >= 1")


def init_cache(model_cfg: Mapping, cache_cfg: Mapping, batch_size: int, max_len: int) -> Cache:
    """An empty cache for `batch_size` rows of up to `max_len` tokens each
    (a paged.PagedCache when cache.kind='paged')."""
    validate_model_config(model_cfg)
    validate_cache_config(cache_cfg, model_cfg)
    _check_size("batch_size", batch_size)
    _check_size("max_len", max_len)
    if cache_cfg["kind"] == "paged":
        from kvlab.cache.paged import init_paged_cache  # paged.py builds on this module

        return init_paged_cache(model_cfg, cache_cfg, batch_size, max_len)
    shapes = [(heads, width) for _, heads, width in cached_tensors(model_cfg)]
    layout = quant.quantized_layout(model_cfg, cache_cfg, max_len)
    if layout is None:
        dtype = dtype_of(cache_cfg["dtype"])
        new_layer = lambda: DenseLayer(  # noqa: E731
            tuple(jnp.zeros((batch_size, h, max_len, w), dtype) for h, w in shapes)
        )
    else:
        specs = quant.storages(model_cfg, cache_cfg)
        new_layer = lambda: quant.init_layer(specs, layout, batch_size, shapes)  # noqa: E731
    layers = tuple(new_layer() for _ in range(model_cfg["num_layers"]))
    return Cache(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32))
