"""The contract between attention modules and cache storage, declared once.

An attention module computes the step's new tokens for each tensor its layer
caches (`kvlab.config.cached_tensors`), asks the layer's storage what to
attend over, attends, and hands back what to store:

    blocks, pending = layer.read(fresh, placement)
    out = attend(q, [(keys, values, mask) for (keys, values), mask in blocks])
    layer = layer.write(ordered_after(pending, out), placement)

(`kvlab.attention.core.through_layer` runs them, also asking the layer which
queries' attention it observes and handing it their mass.) Every storage kind
(dense, quantized, paged, paged quantized, evicting) is a `CacheLayer`. A
block's keys or values are arrays, or a `Reader` of stored data that computes
attention's two products without a dequantized copy (kvlab/cache/quant/); a
pool's (AdaKV's one pool of slots for all KV heads) are `Pooled`.
docs/caches.md, "The read/write contract", says why the write comes after the
read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvlab.cache.placement import Placement

Tensors = tuple  # one entry per cached tensor, in cached_tensors order: arrays or Readers
Block = tuple[Tensors, Bool[Array, "B T|1 S"]]  # (tensors, mask: which queries see which slots)


@runtime_checkable
class Reader(Protocol):
    """Stored tokens that attention reads without materialising them as an array.

    Shapes: keys/values [B, K, S, W] logically (`shape`); queries and weights
    are folded as in `kvlab.attention.core.attend` (M = T x G queries per KV head).
    """

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical [B, K, S, W] of the stored tensor."""

    def scores(self, q: Float[Array, "B K M W"]) -> Float[Array, "B K M S"]:
        """float32 dot products of the queries with every stored token."""

    def weighted_sum(self, w: Float[Array, "B K M S"]) -> Float[Array, "B K M W"]:
        """float32 sum of the stored tokens weighted by `w`."""

    def dequantize(self) -> Float[Array, "B K S W"]:
        """The stored tokens as a float32 array (for paths that need one)."""

    @property
    def step(self) -> int:
        """Slices (`chunk`) start and end on multiples of this many tokens."""

    def chunk(self, start: Int[Array, ""], size: int) -> Any:
        """Tokens start..start+size-1 (0 <= start <= S - size, multiples of `step`)
        as an array or a Reader: attention reads long blocks a slice at a time."""


@dataclasses.dataclass(frozen=True)
class Pooled:
    """The keys or values [B, 1, S, W] (an array) of a pool whose slots each hold
    a token of one of `heads` KV heads (AdaKV, kvlab/cache/evict/layers.py): slot
    s of row b belongs to KV head tags[b, s] mod `heads` (int32 [B, S], the
    layer's position x heads + head; negative: no token), its `owner`, and only
    that head's query heads read it. A pool's block has no mask (None): the
    owners are its mask (`mask`), which attention's reference reads `array`
    under; a backend may read each slot with its own head's queries alone
    (kvlab.backends.Backend.pooled), without one."""

    array: Array
    tags: Int[Array, "B S"]
    heads: int

    @property
    def owner(self) -> Int[Array, "B S"]:
        """Each slot's KV head, -1 where it holds no token."""
        return jnp.where(self.tags >= 0, self.tags % self.heads, -1)

    def mask(self, query_heads: int) -> Bool[Array, "B 1 1 N S"]:
        """Which of `query_heads` (KV head n // G's, G = query_heads / heads)
        reads which slot."""
        group = jnp.arange(query_heads) // (query_heads // self.heads)
        return self.owner[:, None, None, None, :] == group[:, None]


class CacheLayer(Protocol):
    """One transformer layer's cache storage: an immutable pytree.

    `read` never changes the storage; `write` returns the new storage with the
    step's tokens placed at `placement.slots` (slots outside the storage are
    dropped, never wrapped).
    """

    @property
    def capacity(self) -> int:
        """S: the tokens one row may hold."""

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        """(heads, width) of each cached tensor, read from the stored arrays."""

    def read(self, fresh: Tensors, placement: Placement) -> tuple[Sequence[Block], Any]:
        """Blocks to attend over, and what `write` stores.

        fresh: the step's new tokens per cached tensor, [B, K, T, W]. The
        blocks together hold the row's cached tokens as the storage keeps them
        and the new tokens as the storage will keep them, each masked to what
        each query may see.
        """

    def observe(self, placement: Placement) -> Float[Array, "B T"] | None:
        """Weights of the queries whose attention the layer wants to see (an
        evicting layer scoring by attention, kvlab/cache/evict/), or None. A
        layer that gives weights also answers `competes(placement)`: a traced
        bool, whether this step's write reads the mass at all (None: always;
        False: never, the queries alone are read);
        attention computes it only then (kvlab.attention.core.through_layer)."""

    def write(self, pending: Any, placement: Placement, mass=None, queries=None) -> CacheLayer:
        """The storage with the step's tokens written (`pending` from `read`;
        when `observe` asked: `mass`, attend's per-block attention mass, and
        `queries`, the observed queries with their weights or None:
        kvlab.attention.core.Read.observed_queries). Layers that observe
        nothing are called with `pending` and `placement` alone."""
