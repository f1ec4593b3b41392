"""The paged KV cache: one pool of fixed-size pages per layer, and block tables.

PagedAttention (vLLM, arXiv:2309.06180): a row's tokens live in pages of
`cache.page_size` (L) tokens taken from a shared pool, so memory is handed out
as sequences grow instead of reserved at max_len for each. The pools are laid
out as JAX's Pallas paged-attention kernels take them ([K, P, L, H]); the
layout of each storage kind is in docs/caches.md ("The cache pytree").

Pages are handed out on the host (kvlab/cache/allocator.py, prefix.py). On CPU
the pages a step reads are gathered into the dense layout and the one
attention function reads them; a GPU/TPU kernel can read the pools in place.
Writes go to the written slots' pages only, through the one cache write
(`write_tokens` over the pool seen as one long row of slots). A write to a
slot whose page is -1 is dropped, never wrapped onto another page.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
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


def gather_span(pool: Array, pages: Int[Array, "B n"], start, size: int) -> Array:
    """Entries start..start+size-1 ([B, KH, size, X]) of each row's dense view of a
    pool [KH, P, Lp, X] (start traced, start + size <= n * Lp): only the pages
    covering them are gathered."""
    per_page, n = pool.shape[2], pages.shape[1]
    count = min(-(-(size + per_page - 1) // per_page), n)  # pages any `size` entries span
    first = jnp.clip(start // per_page, 0, n - count)
    table = jax.lax.dynamic_slice_in_dim(pages, first, count, axis=1)
    view = gather_pages(pool, table, count * per_page)
    return jax.lax.dynamic_slice_in_dim(view, start - first * per_page, size, axis=2)


@dataclasses.dataclass(frozen=True)
class PagedReader:
    """A 16-bit pool's tokens as rows see them through their block tables
    (kvlab.cache.protocols.Reader): gathered whole for short reads, a slice of
    pages at a time when attention streams a long block."""

    pool: Array  # [KH, P, Lp, W]
    pages: Array  # [B, n]
    length: int  # S: the view's tokens per row

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pages.shape[0], self.pool.shape[0], self.length, self.pool.shape[3])

    @property
    def dtype(self):
        return self.pool.dtype

    @property
    def step(self) -> int:
        return 1

    def dequantize(self) -> Array:
        return gather_pages(self.pool, self.pages, self.length)

    def scores(self, q: Array) -> Array:
        keys = self.dequantize()
        return jnp.einsum(
            "BKMH,BKSH->BKMS", q.astype(keys.dtype), keys, preferred_element_type=jnp.float32
        )

    def weighted_sum(self, w: Array) -> Array:
        values = self.dequantize()
        return jnp.einsum(
            "BKMS,BKSH->BKMH", w.astype(values.dtype), values, preferred_element_type=jnp.float32
        )

    def chunk(self, start, size: int) -> Array:
        return gather_span(self.pool, self.pages, start, size)


@dataclasses.dataclass(frozen=True)
class PagedPayloadReader:
    """A quantized tensor's payload, scale and zero pools read through the block
    tables (kvlab.cache.protocols.Reader), as PayloadReader reads a row's own."""

    tensor: quant.QuantizedTensor  # payload, scale, zero: pools [KH, P, entries per page, X]
    pages: Array  # [B, n]
    rows: int  # P: payload rows per row
    scale_rows: int  # scale rows per row (P, or P / g on the channel axis)

    def _gathered(self) -> quant.PayloadReader:
        t = self.tensor
        sizes = {"payload": self.rows, "scale": self.scale_rows, "zero": self.scale_rows}
        arrays = {
            name: None
            if getattr(t, name) is None
            else gather_pages(getattr(t, name), self.pages, sizes[name])
            for name in _POOLED
        }
        return quant.PayloadReader(t.replace(**arrays, ring=None))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pages.shape[0], self.tensor.payload.shape[0], self.rows, self.tensor.width)

    @property
    def step(self) -> int:
        return self.tensor.spec.group_size if self.tensor.spec.axis == "channel" else 1

    def dequantize(self) -> Array:
        return self._gathered().dequantize()

    def scores(self, q: Array) -> Array:
        return self._gathered().scores(q)

    def weighted_sum(self, w: Array) -> Array:
        return self._gathered().weighted_sum(w)

    def chunk(self, start, size: int):
        take = lambda pool, first, count: gather_span(pool, self.pages, first, count)  # noqa: E731
        return quant.read_slice(self.tensor, take, start, size)


@struct.dataclass
class PagedLayer:
    """One layer's 16-bit tensors in page pools, each [KH, num_pages, L, W]."""

    pools: tuple
    capacity: int = struct.field(pytree_node=False)

    def read(self, fresh: tuple, placement: Placement):
        views = tuple(PagedReader(p, placement.pages, self.capacity) for p in self.pools)
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
    """One layer's quantized tensors: payload, scale and zero pools, and per-row rings
    (and first tokens, cache.<prefix>_full_first).

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

    def read(self, fresh: tuple, placement: Placement):
        """QuantizedLayer.read over the pools: the settled tokens through the block
        tables (PagedPayloadReader), the rings per row."""
        readers = tuple(
            PagedPayloadReader(t, placement.pages, rows, scale_rows)
            if t.spec.quantized
            else PagedReader(t.payload, placement.pages, rows)
            for t, (rows, scale_rows) in zip(self.tensors, self.lengths, strict=True)
        )
        return quant.QuantizedLayer(self.tensors, self.layout).read(
            fresh, placement, readers=readers
        )

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
