"""The paged KV cache: one pool of fixed-size pages per layer, and block tables.

PagedAttention (vLLM, arXiv:2309.06180): a row's tokens live in pages of
`cache.page_size` (L) tokens taken from a shared pool, so memory is handed out
as sequences grow instead of reserved at max_len for each. The pools are laid
out as JAX's Pallas paged-attention kernels take them ([K, P, L, H]); the
layout of each storage kind is in docs/design.md ("The cache pytree").

Pages are handed out on the host (kvlab/cache/allocator.py, prefix.py). On CPU
the pages a step reads are gathered into the dense layout and the one
attention function reads them; a GPU/TPU kernel can read the pools in place.
Writes go to the written slots' pages only, through the one cache write
(`write_tokens` over the pool seen as one long row of slots). A write to a
slot whose page is -1 is dropped, never wrapped onto another page.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Int

from kvlab.cache import quant
from kvlab.cache.dense import Cache, DenseLayer
from kvlab.cache.placement import Placement, write_tokens


def gather_pages(pool: Array, pages: Int[Array, "B n"], length: int) -> Array:
    """The dense view [B, KH, length, X] of a pool [KH, P, Lp, X] through block tables.

    Pages a row does not hold (-1) read page 0; lengths mask what they hold.
    """
    heads, num_pages, per_page = pool.shape[:3]
    batch, n = pages.shape
    view = pool[:, jnp.clip(pages, 0, num_pages - 1)]  # [KH, B, n, Lp, X]
    view = jnp.moveaxis(view, 0, 1).reshape(batch, heads, n * per_page, *pool.shape[3:])
    return view[:, :, :length]


def write_pages(
    pool: Array,
    new: Array,
    slots: Int[Array, "B T"],
    pages: Int[Array, "B n"],
    size: int | None = None,
):
    """Writes new [B, KH, T, X] at the rows' slots [B, T] (or per head [B, E, T],
    E = 1 or KH) of a pool [KH, P, Lp, X].

    Slot s of row b is entry s % Lp of page pages[b, s // Lp]. Slots outside
    0..size-1 (a row's entries, default all its block table reaches) or on a
    page the row does not hold (-1) are dropped, as the dense cache drops them,
    even where the row's last page has room past `size`.
    """
    heads, num_pages, per_page = pool.shape[:3]
    n = pages.shape[1]
    table = pages if slots.ndim == 2 else pages[:, None, :]  # per-head slots [B, E, T]
    held = jnp.take_along_axis(table, jnp.clip(slots // per_page, 0, n - 1), axis=-1)
    size = n * per_page if size is None else min(size, n * per_page)
    kept = (slots >= 0) & (slots < size) & (held >= 0)
    entries = jnp.where(kept, held * per_page + slots % per_page, -1)  # -1: dropped
    # The pool as one row of P * Lp entries, written at the B * T entries.
    flat = pool.reshape(1, heads, num_pages * per_page, *pool.shape[3:])
    values = jnp.moveaxis(new, 1, 0).reshape(1, heads, -1, *new.shape[3:])  # [1, KH, B*T, X]
    if slots.ndim == 3:  # [1, E, B*T]: each head's own entries
        entries = jnp.moveaxis(entries, 1, 0).reshape(1, entries.shape[1], -1)
    else:
        entries = entries.reshape(1, -1)
    written = write_tokens(flat, values, entries, axis=2)
    return written.reshape(pool.shape)


@struct.dataclass
class PagedLayer:
    """One layer's 16-bit tensors in page pools, each [KH, num_pages, L, W]."""

    pools: tuple
    capacity: int = struct.field(pytree_node=False)

    def read(self, fresh: tuple, placement: Placement):
        views = tuple(gather_pages(p, placement.pages, self.capacity) for p in self.pools)
        return DenseLayer(views).read(fresh, placement)

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((p.shape[0], p.shape[3]) for p in self.pools)

    def observe(self, placement: Placement) -> None:
        """Keeps every token: no query's attention is needed."""
        return None

    def write(self, fresh: tuple, placement: Placement, mass=None) -> PagedLayer:
        pools = tuple(
            write_pages(p, x, placement.slots, placement.pages, self.capacity)
            for p, x in zip(self.pools, fresh, strict=True)
        )
        return PagedLayer(pools, self.capacity)


_POOLED = ("payload", "scale", "zero")  # the QuantizedTensor arrays that page


@struct.dataclass
class PagedQuantizedLayer:
    """One layer's quantized tensors: payload, scale and zero pools, and per-row rings.

    `tensors` are QuantizedTensors whose payload/scale/zero are pools
    [KH, num_pages, entries per page, X]; `lengths` gives each array's dense
    length (quant.Layout: P rows, or P / g scale rows on the channel axis).
    """

    tensors: tuple
    layout: quant.Layout = struct.field(pytree_node=False)
    lengths: tuple = struct.field(pytree_node=False)  # per tensor: (payload, scale) view lengths

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    def _view(self, pages) -> quant.QuantizedLayer:
        tensors = []
        for tensor, (rows, scale_rows) in zip(self.tensors, self.lengths, strict=True):
            sizes = {"payload": rows, "scale": scale_rows, "zero": scale_rows}
            arrays = {
                name: None
                if getattr(tensor, name) is None
                else gather_pages(getattr(tensor, name), pages, sizes[name])
                for name in _POOLED
            }
            tensors.append(tensor.replace(**arrays))
        return quant.QuantizedLayer(tuple(tensors), self.layout)

    def read(self, fresh: tuple, placement: Placement):
        return self._view(placement.pages).read(fresh, placement)

    def tensor_shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((t.payload.shape[0], t.width) for t in self.tensors)

    def observe(self, placement: Placement) -> None:
        """Keeps every token: no query's attention is needed."""
        return None

    def write(self, flush: quant.Flush, placement: Placement, mass=None) -> PagedQuantizedLayer:
        """Writes the flushed groups into their pages and the rest into the rings."""
        put = functools.partial(write_pages, pages=placement.pages)
        tensors = quant.write_flush(self.tensors, self.layout, flush, placement, put)
        return PagedQuantizedLayer(tensors, self.layout, self.lengths)


@struct.dataclass
class PagedCache(Cache):
    """Per-layer page pools, block tables and row lengths (module docstring)."""

    block_tables: Int[Array, "B n"]  # page of each run of page_size slots; -1: none

    def place(self, length: int, num_tokens: Int[Array, " B"]) -> Placement:
        """As the dense cache places tokens, with the block tables for the layers."""
        return super().place(length, num_tokens)._replace(pages=self.block_tables)


def pages_per_row(cache_cfg: Mapping, max_len: int) -> int:
    return -(-max_len // cache_cfg["page_size"])


def pool_size(cache_cfg: Mapping, batch_size: int, max_len: int) -> int:
    """Pages in the pool: cache.num_pages, or (0) enough for every row at max_len."""
    return cache_cfg["num_pages"] or batch_size * pages_per_row(cache_cfg, max_len)
