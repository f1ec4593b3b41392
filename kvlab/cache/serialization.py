"""Caches as pytrees of an exported program: `jax.export` serializes them.

    exported = jax.export.export(jax.jit(step), platforms=("tpu",))(params, cache, tokens)
    data = exported.serialize()                 # the cache's tree in its calling convention
    step_again = jax.export.deserialize(data)   # any process that imported kvlab

An exported function's `in_tree` and `out_tree` hold each node's type and its
static fields (a layer's capacity, a tensor's Storage, an evicting layer's
Policy). Every cache pytree class is registered here under its module and
name, its static fields written as JSON: numbers, strings, tuples, and kvlab's
frozen dataclasses and named tuples by their type's module and name, read back
only from kvlab's own modules.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

from jax import export

from kvlab.cache.dense import Cache, DenseLayer
from kvlab.cache.evict import EvictingLayer, PagedEvictingLayer, PrunedKeys, QueryBuffer
from kvlab.cache.paged import PagedCache, PagedLayer, PagedQuantizedLayer
from kvlab.cache.quant import Flush, QuantizedLayer, QuantizedTensor
from kvlab.cache.topology.minicache import MergedLayer
from kvlab.cache.topology.xkv import SharedBasisLayer

PYTREES = (
    Cache,
    DenseLayer,
    QuantizedTensor,
    QuantizedLayer,
    Flush,
    PagedCache,
    PagedLayer,
    PagedQuantizedLayer,
    EvictingLayer,
    PagedEvictingLayer,
    PrunedKeys,
    QueryBuffer,
    MergedLayer,  # topologies' own layers (kvlab/cache/topology)
    SharedBasisLayer,
)


def _encode(value: Any) -> Any:
    """A static field as JSON-able data."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    kind = type(value)
    if dataclasses.is_dataclass(value) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        fields = (
            [f.name for f in dataclasses.fields(value)]
            if dataclasses.is_dataclass(value)
            else list(value._fields)
        )
        return {
            "type": f"{kind.__module__}:{kind.__qualname__}",
            "fields": {name: _encode(getattr(value, name)) for name in fields},
        }
    if isinstance(value, tuple):
        return {"tuple": [_encode(x) for x in value]}
    raise TypeError(f"a cache's static field holds {value!r}, which kvlab does not serialize")


def _decode(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    if "tuple" in data:
        return tuple(_decode(x) for x in data["tuple"])
    module, _, name = data["type"].partition(":")
    if module != "kvlab" and not module.startswith("kvlab."):
        raise ValueError(f"a serialized cache names the type {data['type']!r}, not kvlab's")
    kind = getattr(importlib.import_module(module), name)
    return kind(**{key: _decode(value) for key, value in data["fields"].items()})


def _register(kind: type) -> None:
    export.register_pytree_node_serialization(
        kind,
        serialized_name=f"{kind.__module__}.{kind.__qualname__}",
        serialize_auxdata=lambda aux: json.dumps(_encode(aux)).encode(),
        deserialize_auxdata=lambda data: _decode(json.loads(data)),
    )


for _kind in PYTREES:
    _register(_kind)
