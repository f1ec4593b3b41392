"""Building empty caches: one entry point for every cache kind, on one device or a mesh.

    init_cache(model_cfg, cache_cfg, batch_size, max_len, *, own_pages=True,
               mesh=None, rules=None) -> Cache | PagedCache
    cache_axes(cache) -> the cache's tree of PartitionSpec(logical axis names)
    cache_shardings(cache, mesh, rules=None) -> its tree of NamedShardings

What each layer stores follows from the model (`kvlab.config.cached_tensors`)
and the cache section: the tensors' widths and heads, their storage
(`quant.storages`: 16-bit or quantized) and layout (`quant.quantized_layout`),
and the kind (contiguous rows, or page pools with block tables). The layouts
are documented in docs/caches.md ("The cache pytree").

On a mesh (kvlab/sharding.py, docs/scale-out.md) every per-row array
[B, KH, ...] (dense tensors; quantized payloads, scales, zero points and
rings) is split by rows over `cache_batch` (default: mesh axes data x fsdp) and by
heads over `cache_heads` (tensor), and page pools [KH, P, L, X] by heads and
`cache_pages` (default replicated: any row may hold any page); a payload, its
scales and its ring are split alike. Lengths, error flags and block tables
follow the rows. A dimension the axes do not divide is replicated along them
(sharding.fit): MQA's and MLA's one cached head sit whole on every tensor device.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from kvlab import sharding
from kvlab.cache import evict, paged, quant, topology
from kvlab.cache.dense import Cache, DenseLayer
from kvlab.config import (
    cached_tensors,
    check_count,
    dtype_of,
    frozen,
    validate_cache_config,
    validate_model_config,
)


def compiled_builder(
    model_cfg, cache_cfg, batch_size, max_len, own_pages=True, mesh=None, rules=None
):
    """`init_cache` as one compiled program (laid out on `mesh` when given), kept
    per cache shape: building the same cache again (each `kvlab.generate` call)
    compiles nothing and runs one program instead of an op per array."""
    config = (frozen(model_cfg), frozen(cache_cfg))
    return _builder(*config, batch_size, max_len, own_pages, mesh, rules)


@functools.lru_cache(maxsize=32)
def _builder(model_cfg, cache_cfg, batch_size, max_len, own_pages, mesh, rules):
    build = lambda: init_cache(model_cfg, cache_cfg, batch_size, max_len, own_pages=own_pages)  # noqa: E731
    if mesh is None:
        return jax.jit(build)
    return jax.jit(build, out_shardings=cache_shardings(jax.eval_shape(build), mesh, rules))


def init_cache(
    model_cfg: Mapping,
    cache_cfg: Mapping,
    batch_size: int,
    max_len: int,
    *,
    own_pages: bool = True,
    mesh: Mesh | None = None,
    rules: tuple | None = None,
) -> Cache:
    """An empty cache for `batch_size` rows of up to `max_len` tokens each.

    cache.kind='paged' gives a paged.PagedCache (a hybrid model's sliding layers
    keep their rings per row, outside the pools). Its rows each own
    ceil(max_len / page_size) pages; with own_pages=False the block tables start
    empty (-1) and the pool (cache.num_pages) may be smaller than that: a
    scheduler (kvlab.Engine) hands the pages out.

    With `mesh`, the cache is built in place laid out on it (`cache_shardings`,
    by `rules`, default kvlab.sharding.axis_rules()): no device holds more than
    its part.
    """
    if mesh is not None:
        return compiled_builder(model_cfg, cache_cfg, batch_size, max_len, own_pages, mesh, rules)()
    validate_model_config(model_cfg)
    validate_cache_config(cache_cfg, model_cfg)
    batch_size = check_count("batch_size", batch_size)
    max_len = check_count("max_len", max_len)
    tensors = cached_tensors(model_cfg)
    shapes = [(t.heads, t.width) for t in tensors]
    dtype = dtype_of(cache_cfg["dtype"])
    rows = dict(
        lengths=jnp.zeros((batch_size,), jnp.int32),
        errors=jnp.zeros((batch_size,), jnp.int32),
        tensors=tensors,
        transforms=tuple(cache_cfg[f"{t.prefix}_transform"] for t in tensors),
    )
    # Each layer's sections (a hybrid model's sliding and full layers differ), its
    # policy and its storages, with the levels a format fitted per layer reads (codebooks).
    sections = topology.sections(model_cfg, cache_cfg)
    plan = evict.policies(model_cfg, cache_cfg, max_len) or (None,) * len(sections)
    specs = [quant.storages(m, c, layer) for layer, (m, c) in enumerate(sections)]
    layers, in_pages = [], []
    joint = topology.joint_layers(model_cfg)
    shape, arg = topology.parse(model_cfg["topology"])
    for i, (layer_model, layer_cache) in enumerate(sections):
        if i in joint:  # a run's tokens stored together, as its topology builds them
            layers.append(shape.build(arg, model_cfg, cache_cfg, batch_size, max_len, i))
            continue
        if layer_cache["kind"] == "paged":
            in_pages.append(i)
            layers.append(None)
            continue
        layout = quant.quantized_layout(layer_model, layer_cache, max_len)
        if plan[i] is not None:
            layers.append(_evicting_layer(plan[i], specs[i], shapes, dtype, batch_size))
        elif layout is None:
            zeros = [jnp.zeros((batch_size, h, max_len, w), dtype) for h, w in shapes]
            layers.append(DenseLayer(tuple(zeros)))
        else:
            layers.append(quant.init_layer(specs[i], layout, batch_size, shapes))
    if not in_pages:
        return Cache(layers=tuple(layers), **rows)

    # The layers in page pools (a hybrid model's full ones: its sliding rings stay per
    # row), all evicting or none: one kind's sections.
    paged_plan = [plan[i] for i in in_pages]
    paged_specs = [specs[i] for i in in_pages]
    if paged_plan[0] is not None:
        pooled, tables = _paged_evicting_layers(
            paged_plan, paged_specs, shapes, dtype, cache_cfg, batch_size, own_pages
        )
    else:
        layout = quant.quantized_layout(*sections[in_pages[0]], max_len)
        page = cache_cfg["page_size"]
        n = paged.pages_per_row(cache_cfg, max_len)
        num_pages = paged.pool_size(cache_cfg, batch_size, max_len)
        _check_pool(cache_cfg, num_pages, batch_size, n, own_pages, f"max_len={max_len}")
        if layout is None:
            new_layer = lambda _: paged.PagedLayer(  # noqa: E731
                tuple(jnp.zeros((h, num_pages, page, w), dtype) for h, w in shapes), max_len
            )
        else:
            new_layer = lambda spec: _paged_quantized_layer(  # noqa: E731
                quant.init_layer(spec, layout, 1, shapes), batch_size, num_pages, page
            )
        pooled, tables = (
            [new_layer(spec) for spec in paged_specs],
            _tables(batch_size, n, own_pages),
        )
    for i, layer in zip(in_pages, pooled, strict=True):
        layers[i] = layer
    return paged.PagedCache(layers=tuple(layers), block_tables=tables, **rows)


def _evicting_layer(policy, specs, shapes, dtype, batch_size: int) -> evict.EvictingLayer:
    """Slots for `policy.slots` tokens per storage head (a pool: one head of K x budget);
    a settling policy: slots groups of g rows per storage head and a ring per KV head."""
    tensors = []
    for spec, (heads, width) in zip(specs, shapes, strict=True):
        if policy.settles:
            rows = policy.slots * policy.granularity
            tensor = quant.empty_tensor(
                spec, batch_size, 1 if policy.pooled else heads, width, rows, 0
            )
            ring = jnp.zeros((batch_size, heads, policy.layout.ring_len, width), dtype)
            tensors.append(tensor.replace(ring=ring))
            continue
        heads = 1 if policy.pooled else heads
        if policy.key_channels and not tensors:  # pruned keys (ThinK): the first tensor
            kept = policy.key_channels
            zeros = jnp.zeros((batch_size, heads, policy.slots, kept), dtype)
            tensors.append(evict.PrunedKeys(zeros, _channels(batch_size, heads, kept), width))
        elif spec.quantized:
            layout = quant.Layout(policy.slots, 0, 1)
            tensors.append(quant.init_tensor(spec, layout, batch_size, heads, width))
        else:
            tensors.append(jnp.zeros((batch_size, heads, policy.slots, width), dtype))
    return evict.init_layer(policy, tuple(tensors), batch_size, dtype)


def _channels(batch_size: int, heads: int, kept: int) -> jnp.ndarray:
    """Pruned keys' channel ids before a row's first write chooses them."""
    return jnp.broadcast_to(jnp.arange(kept, dtype=jnp.int32), (batch_size, heads, kept))


def _paged_evicting_layers(plan, specs, shapes, dtype, cache_cfg, batch_size, own_pages):
    """Layers whose pools of pages hold each row's slots (as many as the widest layer's),
    and their block tables; `specs` each layer's storages."""
    page = cache_cfg["page_size"]
    slots = max(p.rows for p in plan)
    n = paged.pages_per_row(cache_cfg, slots)
    num_pages = paged.pool_size(cache_cfg, batch_size, slots)
    _check_pool(cache_cfg, num_pages, batch_size, n, own_pages, f"{slots} kept tokens")
    layers = []
    for policy, layer_specs in zip(plan, specs, strict=True):
        pools = []
        for spec, (heads, width) in zip(layer_specs, shapes, strict=True):
            pool_heads = 1 if policy.pooled else heads
            if policy.key_channels and not pools:  # pruned keys (ThinK): channels per row
                kept = policy.key_channels
                zeros = jnp.zeros((pool_heads, num_pages, page, kept), dtype)
                pools.append(evict.PrunedKeys(zeros, _channels(batch_size, heads, kept), width))
            elif spec.quantized or policy.settles:
                # one page's arrays (per-channel scales: page / g rows) as the template
                one_page = quant.empty_tensor(spec, 1, pool_heads, width, page, 0)
                arrays = {
                    name: None if array is None else _pool(array, num_pages, array.shape[2])
                    for name in ("payload", "scale", "zero")
                    for array in [getattr(one_page, name)]
                }
                ring = None
                if policy.settles:  # the unsettled tokens: per row and KV head
                    ring = jnp.zeros((batch_size, heads, policy.layout.ring_len, width), dtype)
                pools.append(one_page.replace(ring=ring, **arrays))
            else:
                pools.append(jnp.zeros((pool_heads, num_pages, page, width), dtype))
        layers.append(evict.init_paged_layer(policy, tuple(pools), batch_size, dtype))
    return layers, _tables(batch_size, n, own_pages)


def _check_pool(cache_cfg, num_pages: int, batch_size: int, n: int, own_pages: bool, what: str):
    if own_pages and num_pages < batch_size * n:
        raise ValueError(
            f"cache.num_pages={num_pages} is too few: {batch_size} rows of {what} "
            f"need {n} pages of cache.page_size={cache_cfg['page_size']} each, {batch_size * n} "
            f"in all; set cache.num_pages >= {batch_size * n} (or 0), or share a smaller pool "
            "through kvlab.Engine"
        )


def _tables(batch_size: int, n: int, own_pages: bool) -> jnp.ndarray:
    """Block tables: row b owns pages b*n .. b*n + n-1, or none (-1) yet."""
    if own_pages:
        return jnp.arange(batch_size * n, dtype=jnp.int32).reshape(batch_size, n)
    return jnp.full((batch_size, n), -1, jnp.int32)


def _paged_quantized_layer(
    one_row: quant.QuantizedLayer, batch_size: int, num_pages: int, page: int
) -> paged.PagedQuantizedLayer:
    """Pools shaped after a one-row quantized layer's arrays; rings and first tokens
    stay per row."""
    tensors, lengths = [], []
    for tensor in one_row.tensors:
        per_scale_row = tensor.spec.group_size if tensor.spec.axis == "channel" else 1
        pooled = {"payload": _pool(tensor.payload, num_pages, page)}
        for name in ("scale", "zero"):
            array = getattr(tensor, name)
            pooled[name] = None if array is None else _pool(array, num_pages, page // per_scale_row)
        per_row = {  # the ring and the first tokens stay per row
            name: None if array is None else jnp.zeros((batch_size, *array.shape[1:]), array.dtype)
            for name in ("ring", "first_tokens")
            for array in [getattr(tensor, name)]
        }
        tensors.append(tensor.replace(**per_row, **pooled))
        scale_rows = 0 if tensor.scale is None else tensor.scale.shape[2]
        lengths.append((tensor.payload.shape[2], scale_rows))
    return paged.PagedQuantizedLayer(tuple(tensors), one_row.layout, tuple(lengths))


def _pool(row: jnp.ndarray, num_pages: int, per_page: int) -> jnp.ndarray:
    """A zero pool [KH, num_pages, per_page, X] for arrays shaped like row [1, KH, ., X]."""
    heads, width = row.shape[1], row.shape[3]
    return jnp.zeros((heads, num_pages, per_page, width), row.dtype)


# Logical axes of the cache's arrays: per row [B, KH, rows, X] and page pools [KH, P, L, X].
ROW_AXES = PartitionSpec("cache_batch", "cache_heads", None, None)
POOL_AXES = PartitionSpec("cache_heads", "cache_pages", None, None)


def _layer_axes(layer):
    if hasattr(layer, "axes"):  # a topology's own layer (kvlab/cache/topology) says
        return layer.axes()
    if isinstance(layer, (evict.EvictingLayer, evict.PagedEvictingLayer)):
        per_slot = PartitionSpec("cache_batch", "cache_heads", None)
        per_row = PartitionSpec("cache_batch")
        paged_layer = isinstance(layer, evict.PagedEvictingLayer)
        stored, axes = ("pools", POOL_AXES) if paged_layer else ("tensors", ROW_AXES)
        return layer.replace(
            **{stored: tuple(_stored_axes(t, axes) for t in getattr(layer, stored))},
            positions=None if layer.positions is None else per_slot,
            scores=None if layer.scores is None else per_slot,
            **({} if getattr(layer, "ring_scores", None) is None else {"ring_scores": per_slot}),
            **({} if getattr(layer, "since", None) is None else {"since": per_row}),
            **({} if getattr(layer, "buffer", None) is None else {"buffer": _buffer_axes()}),
            **({} if getattr(layer, "weights", None) is None else {"weights": per_slot}),
        )
    if isinstance(layer, (DenseLayer, quant.QuantizedLayer)):
        return jax.tree.map(lambda _: ROW_AXES, layer)
    if isinstance(layer, paged.PagedLayer):
        return jax.tree.map(lambda _: POOL_AXES, layer)
    if isinstance(layer, paged.PagedQuantizedLayer):
        return layer.replace(tensors=tuple(_stored_axes(t, POOL_AXES) for t in layer.tensors))
    raise TypeError(f"no mesh layout for the cache layer {type(layer).__name__}")


def _buffer_axes() -> evict.QueryBuffer:
    """A decoding layer's query buffer: split by rows and KV heads."""
    per_head = PartitionSpec("cache_batch", "cache_heads", None, None, None)
    return evict.QueryBuffer(per_head, per_head, PartitionSpec("cache_batch", None))


def _stored_axes(tensor, axes: PartitionSpec):
    """A stored tensor's axes: `axes` for its arrays, a QuantizedTensor's ring and
    first tokens per row, pruned keys' channels per row and head."""
    if isinstance(tensor, evict.PrunedKeys):
        return tensor.replace(kept=axes, channels=PartitionSpec("cache_batch", "cache_heads", None))
    spec = jax.tree.map(lambda _: axes, tensor)
    if isinstance(tensor, quant.QuantizedTensor):
        per_row = ("ring", "first_tokens")
        spec = spec.replace(
            **{name: ROW_AXES for name in per_row if getattr(tensor, name) is not None}
        )
    return spec


def cache_axes(cache: Cache) -> Cache:
    """The logical axes of `cache`'s arrays (concrete or abstract): the cache's
    own tree with a PartitionSpec of logical names in place of each array."""
    rows = PartitionSpec("cache_batch")
    fields = dict(
        layers=tuple(_layer_axes(layer) for layer in cache.layers), lengths=rows, errors=rows
    )
    if isinstance(cache, paged.PagedCache):
        fields["block_tables"] = PartitionSpec("cache_batch", None)
    return cache.replace(**fields)


def cache_shardings(cache: Cache, mesh: Mesh, rules: tuple | None = None) -> Cache:
    """The NamedShardings of `cache`'s arrays on `mesh` by `rules` (default
    kvlab.sharding.axis_rules()): the cache's tree with one in place of each array."""
    rules = sharding.axis_rules() if rules is None else rules
    return sharding.shardings(cache_axes(cache), cache, mesh, rules)
