"""Paged evicting layers: an EvictingLayer's slots kept in page pools.

A PagedEvictingLayer (cache.kind='paged' with an evicting cache) keeps the slot
rows of each row (`Policy.rows`) in `ceil(rows / L)` pages of L rows, not
max_len / L; its positions, scores and a settling layout's ring stay per row.
It reads and writes through the dense EvictingLayer of layers.py: `view`
gathers a row's pages into one, the scores and the competition are that
layer's, and the winners are written back into the pages. `copy_pages` copies
pages for the serving engine's copy-on-write of shared prefix pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from kvlab.cache.evict.buffer import QueryBuffer
from kvlab.cache.evict.layers import EvictingLayer, init_buffer
from kvlab.cache.evict.policy import (
    Policy,
    empty_ring_scores,
    empty_since,
    empty_slots,
    empty_weights,
    observed_queries,
    overflows,
    stored_tokens,
)
from kvlab.cache.evict.stored import PrunedKeys, tensor_width
from kvlab.cache.paged import gather_pages, write_pages
from kvlab.cache.placement import Placement
from kvlab.cache.quant import QuantizedTensor, quantize_tokens

_POOLED = ("payload", "scale", "zero")  # the QuantizedTensor arrays that page


def _entries(array: Array, rows: int, page: int) -> int:
    """Entries of a row's `rows` token rows in a pool array holding array.shape[2]
    per page of `page` rows (per-channel scales: one per group of tokens)."""
    return rows * array.shape[2] // page


def _gather(pool, pages: Array, rows: int, page: int):
    """A pool's dense view [B, KH, rows, X] (a quantized tensor's arrays alike; its
    ring stays per row)."""
    if isinstance(pool, PrunedKeys):  # its channels are per row already
        return pool.replace(kept=gather_pages(pool.kept, pages, rows))
    if not isinstance(pool, QuantizedTensor):
        return gather_pages(pool, pages, rows)
    views = {
        name: None
        if getattr(pool, name) is None
        else gather_pages(getattr(pool, name), pages, _entries(getattr(pool, name), rows, page))
        for name in _POOLED
    }
    return pool.replace(**views)


def _put_pages(pool, new: Array, slots: Array, pages: Array, size: int):
    """`new` [B, KH, T, W] written at the rows' slots, in their pages."""
    if isinstance(pool, PrunedKeys):
        return pool.replace(kept=write_pages(pool.kept, pool.narrow(new), slots, pages, size))
    if not isinstance(pool, QuantizedTensor):
        return write_pages(pool, new, slots, pages, size)
    if not pool.spec.quantized:
        return pool.replace(payload=write_pages(pool.payload, new, slots, pages, size))
    payload, scale, zero = quantize_tokens(new, pool.spec)
    return pool.replace(
        payload=write_pages(pool.payload, payload, slots, pages, size),
        scale=None if scale is None else write_pages(pool.scale, scale, slots, pages, size),
        zero=None if zero is None else write_pages(pool.zero, zero, slots, pages, size),
    )


@struct.dataclass
class PagedEvictingLayer:
    """An evicting layer whose slots live in page pools (row r of a row's slots:
    entry r mod L of page block_tables[b, r div L]); positions and scores stay
    per row.

    pools        per cached tensor: [KH, P, L, W] in cache.dtype, or a QuantizedTensor
                 whose payload, scale and zero are such pools (per-channel scales:
                 L / g entries per page); a settling policy's ring stays per row;
                 pruned keys (stored.PrunedKeys): kept channels in a pool
                 [KH, P, L, Wk], the channel ids per row [B, K, Wk]
    positions, scores, policy, ring_scores, since, buffer, weights: as EvictingLayer's
    """

    pools: tuple
    positions: Array | None
    scores: Array | None
    policy: Policy = struct.field(pytree_node=False)
    ring_scores: Array | None = None
    since: Array | None = None
    buffer: QueryBuffer | None = None
    weights: Array | None = None

    @property
    def capacity(self) -> int:
        return self.policy.max_len

    @property
    def _page(self) -> int:
        return jax.tree.leaves(self.pools)[0].shape[2]  # payloads come first

    def view(self, pages: Array) -> EvictingLayer:
        """The rows' slots gathered from their pages, as a dense evicting layer."""
        p = self.policy
        tensors = tuple(_gather(pool, pages, p.rows, self._page) for pool in self.pools)
        return EvictingLayer(
            tensors,
            self.positions,
            self.scores,
            p,
            self.ring_scores,
            self.since,
            self.buffer,
            self.weights,
        )

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        pool_heads = lambda t: jax.tree.leaves(t)[0].shape[0]  # noqa: E731  payload, kept first
        heads = lambda t: self.policy.kv_heads if self.policy.pooled else pool_heads(t)  # noqa: E731
        return tuple((heads(t), tensor_width(t)) for t in self.pools)

    def stored(self, lengths: Int[Array, " B"]) -> Int[Array, "B K"]:
        return stored_tokens(self.positions, self.policy, lengths)

    def observe(self, placement: Placement) -> Float[Array, "B T"] | None:
        return observed_queries(self.policy, placement)

    def competes(self, placement: Placement) -> Array | None:
        return overflows(self.positions, self.policy, placement, self.since)

    def read(self, fresh: tuple, placement: Placement):
        return self.view(placement.pages).read(fresh, placement)

    def write(
        self, pending: tuple, placement: Placement, mass=None, queries=None
    ) -> PagedEvictingLayer:
        p, pages = self.policy, placement.pages
        view = self.view(pages)  # knorm reads the stored keys
        if p.settles:

            def put(array, new, slots):
                size = _entries(array, p.rows, self._page)
                return write_pages(array, new, slots, pages, size)

            layer = view.write_settling(pending, placement, mass, self.pools, put, queries)
            return PagedEvictingLayer(
                layer.tensors, layer.positions, layer.scores, p, layer.ring_scores
            )
        slots, positions, scores, weights = view.destinations(pending, placement, mass, queries)
        pools = self.pools
        if isinstance(pools[0], PrunedKeys):  # the channels the rows' first writes choose
            chosen = view.with_channels(pending, placement, slots, queries)[0]
            pools = (pools[0].replace(channels=chosen.channels), *pools[1:])
        pools = tuple(
            _put_pages(pool, x, slots, pages, p.slots)
            for pool, x in zip(pools, pending, strict=True)
        )
        return PagedEvictingLayer(
            pools,
            positions,
            scores,
            p,
            since=view.counted(placement),
            buffer=view.buffered(placement, queries),
            weights=weights,
        )


def init_paged_layer(
    policy: Policy, pools: tuple, batch: int, dtype=jnp.bfloat16
) -> PagedEvictingLayer:
    """An empty paged layer around zeroed `pools` (a query buffer in `dtype`)."""
    return PagedEvictingLayer(
        pools,
        *empty_slots(policy, batch),
        policy,
        empty_ring_scores(policy, batch),
        empty_since(policy, batch),
        init_buffer(policy, pools, batch, dtype),
        empty_weights(policy, batch),
    )


def copy_pages(layer, sources: Array, targets: Array):
    """A paged evicting layer with pages `sources` copied into `targets`
    (int32[C]; -1 targets copy nothing). Other layers pass through."""
    if not isinstance(layer, PagedEvictingLayer):
        return layer
    num_pages = jax.tree.leaves(layer.pools)[0].shape[1]
    targets = jnp.where(targets < 0, num_pages, targets)  # dropped
    sources = jnp.clip(sources, 0, num_pages - 1)
    copy = lambda pool: pool.at[:, targets].set(pool[:, sources], mode="drop")  # noqa: E731

    def copied(pool):
        if isinstance(pool, PrunedKeys):  # not the per-row channels
            return pool.replace(kept=copy(pool.kept))
        if not isinstance(pool, QuantizedTensor):
            return copy(pool)
        arrays = {name: getattr(pool, name) for name in _POOLED}  # not the per-row ring
        return pool.replace(**{k: None if a is None else copy(a) for k, a in arrays.items()})

    return layer.replace(pools=tuple(copied(pool) for pool in layer.pools))
