"""Registries of named plug-ins: how a method is added to kvlab in one file.

    SCORERS.register(Tova())          # a class of kvlab/cache/evict/scorers.py's kind
    SCORERS.get("tova")               # registered, or its shipped module imported now
    SCORERS.names()                   # what cache.evict.method may name (with the layouts)

Each registry holds objects of one kind under their `name`. A name is found
among those registered, then among the modules shipped with kvlab (imported
on first use: each registers what it defines), then in the entry-point group
of installed packages (`name = "package.module:object"`; read again only when
sys.path or one of its folders changes, as an install or removal changes it:
listing every installed distribution's entry points costs about 16 ms, and
one config validation asks for registries' names a dozen times). Config validation
names a registry's names; nothing else is listed by hand, so a new method is
its file, its test and one line in `shipped` (or an entry point, or a
`register` call in the researcher's own code).

This module imports nothing from kvlab, so every layer may read a registry;
the shipped modules sit wherever their code belongs and are imported by name.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from collections.abc import Mapping
from typing import Any


class Registry:
    """Plug-ins of one kind. `field` is the config field that names one (for
    errors), `shipped` maps a name to the kvlab module that registers it, and
    `group` is the entry-point group other packages register theirs in."""

    def __init__(self, kind: str, field: str, shipped: Mapping[str, str], group: str):
        self.kind, self.field, self.group = kind, field, group
        self.shipped = dict(shipped)
        self._registered: dict[str, Any] = {}
        self._installed: tuple[tuple, dict[str, Any]] | None = None  # (_installs(), by name)

    def register(self, plugin: Any) -> Any:
        """Makes `plugin` the one `get(plugin.name)` returns; returns it."""
        name = getattr(plugin, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{plugin!r} has no `name`: a {self.kind} is registered under it")
        self._registered[name] = plugin
        return plugin

    def _entry_points(self) -> dict[str, Any]:
        """The group's entry points by name, read again when `_installs()` changed."""
        state = _installs()
        if self._installed is None or self._installed[0] != state:
            found = importlib.metadata.entry_points(group=self.group)
            self._installed = (state, {e.name: e for e in found})
        return self._installed[1]

    def names(self) -> tuple[str, ...]:
        """Every name `get` can give, registered ones first."""
        return tuple(dict.fromkeys([*self._registered, *self.shipped, *self._entry_points()]))

    def get(self, name: str) -> Any:
        """The plug-in called `name`, importing its module on first use; ValueError
        naming the config field for a name none has."""
        if name not in self._registered:
            if name in self.shipped:
                importlib.import_module(self.shipped[name])  # registers it
            elif name in self._entry_points():
                self.register(self._entry_points()[name].load())
        if name not in self._registered:
            raise ValueError(
                f"{self.field}={name!r} is not {_article(self.kind)} {self.kind} kvlab knows: "
                "use one of "
                f"{', '.join(map(repr, self.names()))}, or register yours "
                f"(kvlab.registry, entry-point group {self.group!r})"
            )
        return self._registered[name]


def _installs() -> tuple:
    """sys.path and the modification time of each of its folders (None where there is
    none): installing or removing a package changes its folder's."""
    state = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


def _article(noun: str) -> str:
    return "an" if noun[:1] in "aeiou" else "a"


# Eviction scorers (kvlab/cache/evict/scorers.py): cache.evict.method, beside the
# layouts that score nothing ('none', 'window', 'sinks').
SCORERS = Registry(
    "eviction scorer",
    "cache.evict.method",
    shipped={
        **dict.fromkeys(
            ("h2o", "snapkv", "pyramidkv", "adakv", "knorm", "random"),
            "kvlab.cache.evict.scorers",
        ),
        "tova": "kvlab.cache.evict.tova",
        "keydiff": "kvlab.cache.evict.keydiff",
        "lagkv": "kvlab.cache.evict.lagkv",
        "expected_attention": "kvlab.cache.evict.expected_attention",
        "qfilter": "kvlab.cache.evict.qfilter",
        "duo_attention": "kvlab.cache.evict.duo_attention",
        "kvzip": "kvlab.cache.evict.kvzip",
        "kvzip_head": "kvlab.cache.evict.kvzip_head",
        "fast_kvzip": "kvlab.cache.evict.fast_kvzip",
    },
    group="kvlab.scorers",
)


# Eviction wrappers (kvlab/cache/evict/scorers.py, Wrapper): methods over any scorer,
# named before it in cache.evict.method ('chunkkv:snapkv').
WRAPPERS = Registry(
    "eviction wrapper",
    "cache.evict.method",
    shipped={
        "chunkkv": "kvlab.cache.evict.chunkkv",
        "criticalkv": "kvlab.cache.evict.criticalkv",
        "per_layer": "kvlab.cache.evict.per_layer",
        "think": "kvlab.cache.evict.think",
    },
    group="kvlab.wrappers",
)


# Key/value transforms (kvlab/cache/transforms/): cache.<prefix>_transform, applied
# to a cached tensor before it is stored and folded into what reads it.
TRANSFORMS = Registry(
    "key/value transform",
    "cache.<prefix>_transform",
    shipped={
        "none": "kvlab.cache.transforms",
        "hadamard": "kvlab.cache.transforms.hadamard",
        "orthogonal": "kvlab.cache.transforms.orthogonal",
    },
    group="kvlab.transforms",
)


# Storage formats (kvlab/cache/formats/): cache.<prefix>_format, how a quantized
# tensor's numbers become codes and back.
FORMATS = Registry(
    "storage format",
    "cache.<prefix>_format",
    shipped={
        **dict.fromkeys(("int", "fp8"), "kvlab.cache.formats"),
        "nf": "kvlab.cache.formats.normal_float",
        "codebook": "kvlab.cache.formats.codebook",
    },
    group="kvlab.formats",
)


# Cache topologies (kvlab/cache/topology/): model.topology ('name[:argument]'), which
# cache layer each model layer reads and writes.
TOPOLOGIES = Registry(
    "cache topology",
    "model.topology",
    shipped={
        "layerwise": "kvlab.cache.topology",
        "cla": "kvlab.cache.topology.cla",
        "minicache": "kvlab.cache.topology.minicache",
        "xkv": "kvlab.cache.topology.xkv",
    },
    group="kvlab.topologies",
)
