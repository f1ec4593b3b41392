"""Building empty caches: one entry point for every cache kind.

    init_cache(model_cfg, cache_cfg, batch_size, max_len) -> Cache | PagedCache

What each layer stores follows from the model (`kvlab.config.cached_tensors`)
and the cache section: the tensors' widths and heads, their storage
(`quant.storages`: 16-bit or quantized) and layout (`quant.quantized_layout`),
and the kind (contiguous rows, or page pools with block tables). The layouts
are documented in docs/design.md ("The cache pytree").
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from kvlab.cache import paged, quant
from kvlab.cache.dense import Cache, DenseLayer
from kvlab.config import (
    cached_tensors,
    check_count,
    dtype_of,
    validate_cache_config,
    validate_model_config,
)


def init_cache(
    model_cfg: Mapping,
    cache_cfg: Mapping,
    batch_size: int,
    max_len: int,
    *,
    own_pages: bool = True,
) -> Cache:
    """An empty cache for `batch_size` rows of up to `max_len` tokens each.

    cache.kind='paged' gives a paged.PagedCache. Its rows each own
    ceil(max_len / page_size) pages; with own_pages=False the block tables start
    empty (-1) and the pool (cache.num_pages) may be smaller than that: a
    scheduler (kvlab.Engine) hands the pages out.
    """
    validate_model_config(model_cfg)
    validate_cache_config(cache_cfg, model_cfg)
    batch_size = check_count("batch_size", batch_size)
    max_len = check_count("max_len", max_len)
    tensors = cached_tensors(model_cfg)
    shapes = [(t.heads, t.width) for t in tensors]
    specs = quant.storages(model_cfg, cache_cfg)
    layout = quant.quantized_layout(model_cfg, cache_cfg, max_len)
    dtype = dtype_of(cache_cfg["dtype"])
    rows = dict(
        lengths=jnp.zeros((batch_size,), jnp.int32),
        errors=jnp.zeros((batch_size,), jnp.int32),
        tensors=tensors,
    )
    if cache_cfg["kind"] != "paged":
        if layout is None:
            new_layer = lambda: DenseLayer(  # noqa: E731
                tuple(jnp.zeros((batch_size, h, max_len, w), dtype) for h, w in shapes)
            )
        else:
            new_layer = lambda: quant.init_layer(specs, layout, batch_size, shapes)  # noqa: E731
        return Cache(layers=tuple(new_layer() for _ in range(model_cfg["num_layers"])), **rows)

    page = cache_cfg["page_size"]
    n = paged.pages_per_row(cache_cfg, max_len)
    num_pages = paged.pool_size(cache_cfg, batch_size, max_len)
    if own_pages and num_pages < batch_size * n:
        raise ValueError(
            f"cache.num_pages={num_pages} is too few: {batch_size} rows of max_len={max_len} "
            f"need {n} pages of cache.page_size={page} each, {batch_size * n} in all; set "
            f"cache.num_pages >= {batch_size * n} (or 0), or share a smaller pool through "
            "kvlab.Engine"
        )
    if layout is None:
        new_layer = lambda: paged.PagedLayer(  # noqa: E731
            tuple(jnp.zeros((h, num_pages, page, w), dtype) for h, w in shapes), max_len
        )
    else:
        new_layer = lambda: _paged_quantized_layer(  # noqa: E731
            quant.init_layer(specs, layout, 1, shapes), batch_size, num_pages, page
        )
    if own_pages:
        tables = jnp.arange(batch_size * n, dtype=jnp.int32).reshape(batch_size, n)
    else:
        tables = jnp.full((batch_size, n), -1, jnp.int32)
    layers = tuple(new_layer() for _ in range(model_cfg["num_layers"]))
    return paged.PagedCache(layers=layers, block_tables=tables, **rows)


def _paged_quantized_layer(
    one_row: quant.QuantizedLayer, batch_size: int, num_pages: int, page: int
) -> paged.PagedQuantizedLayer:
    """Pools shaped after a one-row quantized layer's arrays; rings stay per row."""
    tensors, lengths = [], []
    for tensor in one_row.tensors:
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
    return paged.PagedQuantizedLayer(tuple(tensors), one_row.layout, tuple(lengths))


def _pool(row: jnp.ndarray, num_pages: int, per_page: int) -> jnp.ndarray:
    """A zero pool [KH, num_pages, per_page, X] for arrays shaped like row [1, KH, ., X]."""
    heads, width = row.shape[1], row.shape[3]
    return jnp.zeros((heads, num_pages, per_page, width), row.dtype)
