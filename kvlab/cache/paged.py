"""The paged KV cache: one pool of fixed-size pages per layer, and block tables.

PagedAttention (vLLM, arXiv:2309.06180): a row's tokens live in pages of
`cache.page_size` (L) tokens taken from a shared pool, so memory is handed out
as sequences grow instead of reserved at max_len for each.

    PagedCache
      layers        one storage per layer:
                    PagedLayer (every tensor 16-bit): per cached tensor a pool
                      [KH, num_pages, L, W], the layout of JAX's Pallas
                      paged-attention kernels (k_pages[K, P, L, H]);
                    PagedQuantizedLayer: per tensor the payload, scale and zero
                      pools (token-indexed arrays page by L tokens, channel-axis
                      scales by L / group_size token groups) and the row's
                      full-precision ring, which stays per row (kvlab/cache/quant.py)
      block_tables  int32[B, n]  row b's slot s lives in page block_tables[b, s // L]
                                 at offset s % L; -1 where the row holds no page
      lengths       int32[B]     tokens written per row

Pages are handed out on the host (kvlab/cache/allocator.py, prefix.py);
`init_cache` gives each row its own n = ceil(max_len / L) pages, so a paged
cache works through the normal API and gives the dense cache's logits. On CPU
the pages a step reads are gathered into the dense layout and the one
attention function reads them; a GPU/TPU kernel can read the pools in place.
A write to a slot whose page is -1 is dropped (never wrapped onto another
page), and the capacity check is the dense cache's.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Int

from kvlab.cache import quant
from kvlab.cache.dense import Cache, DenseLayer, cached_tensors
from kvlab.cache.placement import Placement
from kvlab.config import dtype_of


def gather_pages(pool: Array, pages: Int[Array, "B n"], length: int) -> Array:
    """The dense view [B, KH, length, X] of a pool [KH, P, Lp, X] through block tables.

    Pages a row does not hold (-1) read page 0; lengths mask what they hold.
    """
    heads, num_pages, per_page = pool.shape[:3]
    batch, n = pages.shape
    view = pool[:, jnp.clip(pages, 0, num_pages - 1)]  # [KH, B, n, Lp, X]
    view = jnp.moveaxis(view, 0, 1).reshape(batch, heads, n * per_page, *pool.shape[3:])
    return view[:, :, :length]


def scatter_entries(pool: Array, pages: Int[Array, "B n"], new: Array, slots: Int[Array, "B T"]):
    """Writes new [B, KH, T, X] at the rows' slots [B, T] of a pool [KH, P, Lp, X].

    Slots past the block table or on a page the row does not hold are dropped.
    """
    num_pages, per_page = pool.shape[1:3]
    n = pages.shape[1]
    held = jnp.take_along_axis(pages, jnp.clip(slots // per_page, 0, n - 1), axis=1)
    page = jnp.where((slots < n * per_page) & (held >= 0), held, num_pages)  # num_pages: drop
    values = jnp.moveaxis(new, 1, 0).astype(pool.dtype)  # [KH, B, T, X]
    return pool.at[:, page, slots % per_page].set(values, mode="drop")


def scatter_view(pool: Array, pages: Int[Array, "B n"], view: Array) -> Array:
    """Writes a whole dense view [B, KH, length, X] back into the rows' pages."""
    batch, length = pages.shape[0], view.shape[2]
    slots = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return scatter_entries(pool, pages, view, slots)


@struct.dataclass
class PagedLayer:
    """One layer's 16-bit tensors in page pools, each [KH, num_pages, L, W]."""

    pools: tuple
    capacity: int = struct.field(pytree_node=False)

    def read(self, fresh: tuple, placement: Placement):
        views = tuple(gather_pages(p, placement.pages, self.capacity) for p in self.pools)
        return DenseLayer(views).read(fresh, placement)

    def write(self, fresh: tuple, placement: Placement) -> PagedLayer:
        pools = tuple(
            scatter_entries(p, placement.pages, x, placement.slots)
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

    def write(self, flush: quant.Flush, placement: Placement) -> PagedQuantizedLayer:
        # CPU reference: the row's pages are rewritten whole from the updated
        # dense view (a kernel would write the flushed groups in place).
        written = self._view(placement.pages).write(flush, placement)
        tensors = []
        for pooled, dense in zip(self.tensors, written.tensors, strict=True):
            arrays = {
                name: None
                if getattr(pooled, name) is None
                else scatter_view(getattr(pooled, name), placement.pages, getattr(dense, name))
                for name in _POOLED
            }
            tensors.append(pooled.replace(ring=dense.ring, **arrays))
        return PagedQuantizedLayer(tuple(tensors), self.layout, self.lengths)


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


def _pool(batch_dense: Array, num_pages: int, per_page: int) -> Array:
    """A zero pool [KH, num_pages, per_page, X] for arrays shaped like batch_dense [1, KH, ., X]."""
    heads, width = batch_dense.shape[1], batch_dense.shape[3]
    return jnp.zeros((heads, num_pages, per_page, width), batch_dense.dtype)


def init_paged_cache(
    model_cfg: Mapping, cache_cfg: Mapping, batch_size: int, max_len: int, own_pages: bool = True
) -> PagedCache:
    """An empty paged cache whose rows each own n = ceil(max_len / page_size) pages.

    With own_pages=False the block tables start empty (-1) and the pool may be
    smaller than batch_size * n pages: a scheduler (kvlab.Engine) hands them out.
    """
    page = cache_cfg["page_size"]
    n = pages_per_row(cache_cfg, max_len)
    num_pages = pool_size(cache_cfg, batch_size, max_len)
    if own_pages and num_pages < batch_size * n:
        raise ValueError(
            f"cache.num_pages={num_pages} is too few: {batch_size} rows of max_len={max_len} "
            f"need {n} pages of cache.page_size={page} each, {batch_size * n} in all; set "
            f"cache.num_pages >= {batch_size * n} (or 0), or share a smaller pool through "
            "kvlab.Engine"
        )
    shapes = [(heads, width) for _, heads, width in cached_tensors(model_cfg)]
    layout = quant.quantized_layout(model_cfg, cache_cfg, max_len)
    if layout is None:
        dtype = dtype_of(cache_cfg["dtype"])
        new_layer = lambda: PagedLayer(  # noqa: E731
            tuple(jnp.zeros((h, num_pages, page, w), dtype) for h, w in shapes), max_len
        )
    else:
        specs = quant.storages(model_cfg, cache_cfg)
        new_layer = lambda: _quantized_layer(specs, layout, shapes, batch_size, num_pages, page)  # noqa: E731
    layers = tuple(new_layer() for _ in range(model_cfg["num_layers"]))
    tables = jnp.arange(batch_size * n, dtype=jnp.int32).reshape(batch_size, n)
    if not own_pages:
        tables = jnp.full((batch_size, n), -1, jnp.int32)
    return PagedCache(
        layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32), block_tables=tables
    )


def _quantized_layer(specs, layout, shapes, batch_size, num_pages, page) -> PagedQuantizedLayer:
    """Fresh pools shaped after a one-row dense quantized layer (rings per row)."""
    dense = quant.init_layer(specs, layout, 1, shapes)
    tensors, lengths = [], []
    for tensor in dense.tensors:
        per_scale_row = tensor.spec.group_size if tensor.spec.axis == "channel" else 1
        pooled = {"payload": _pool(tensor.payload, num_pages, page)}
        for name in ("scale", "zero"):
            array = getattr(tensor, name)
            pooled[name] = None if array is None else _pool(array, num_pages, page // per_scale_row)
        ring = None
        if tensor.ring is not None:
            ring = jnp.zeros((batch_size, *tensor.ring.shape[1:]), tensor.ring.dtype)
        tensors.append(tensor.replace(ring=ring, **pooled))
        scale_rows = 0 if tensor.scale is None else tensor.scale.shape[2]
        lengths.append((tensor.payload.shape[2], scale_rows))
    return PagedQuantizedLayer(tuple(tensors), layout, tuple(lengths))
