"""Cache topology: which cache layer each model layer reads and writes.

    cfg.model.topology = "cla:2"        # every two adjacent layers share one cache layer

A topology maps the model's layers onto cache layers (`cache_layers(model)`:
the cache layer of each model layer, in order, each cache layer a run of
adjacent model layers). The first model layer of a run produces: it computes
the step's keys and values, reads its cache layer and, once the last layer of
the run has attended, commits the step's tokens to it. The others consume:
their own queries attend over the producer's read (one read serves several
attends), and they have no key or value projection of their own. The model
loop, the cache factory, byte accounting, eviction budgets and the model's
check of a cache all read this one mapping, so a topology is one class:
"layerwise" here (a cache layer per model layer), "cla" in cla.py (Cross-Layer
Attention, arXiv:2405.12981). `model.topology` names one, with its argument
after a colon ("cla:2"); kvlab.registry.TOPOLOGIES finds it.

A topology may instead have every layer of a run compute its own keys and
values (`every_layer_produces`) and store the run's tokens jointly in a cache
layer of its own kind (`joint_layers`, `build`, `layer_bytes`): each layer of
the run reads it as its member (`read(fresh, placement, member)`) and the
run's last layer writes every member's tokens at once (`write(pendings,
placement)`; kvlab.attention.core.through_layer). "minicache" in minicache.py
(MiniCache, arXiv:2405.14366) merges adjacent layers so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvlab.cache.formats import Format
from kvlab.config import layer_sections, layer_windows
from kvlab.registry import FORMATS, TOPOLOGIES


class Topology:
    """A cache layer per model layer ("layerwise"). A topology's `layers` must
    give non-decreasing cache layers, 0, 1, 2, ... each a run of model layers."""

    name = "layerwise"

    def check(self, arg: str, num_layers: int, field: str) -> None:
        """ValueError naming `field` when `arg` does not fit `num_layers` layers."""
        if arg:
            raise ValueError(
                f"{field}={self.name + ':' + arg!r}: {self.name!r} takes no argument: "
                f"set {field}={self.name!r}"
            )

    def layers(self, arg: str, num_layers: int) -> tuple[int, ...]:
        """The cache layer of each of the model's `num_layers` layers."""
        return tuple(range(num_layers))

    # A run whose layers each compute keys and values, stored jointly (module docstring).
    every_layer_produces = False
    # Whether cache.<prefix>_rank and cache.bases are its runs' (16-bit codes), not
    # the per-layer bases of quantized tensors.
    codes_in_bases = False

    def joint_layers(self, arg: str, num_layers: int) -> tuple[int, ...]:
        """The cache layers this topology builds itself (`build`): none here."""
        return ()

    def check_cache(self, arg: str, model_cfg: Mapping, cache_cfg: Mapping) -> None:
        """ValueError naming the field a cache section cannot have under this topology."""

    def build(
        self, arg: str, model_cfg: Mapping, cache_cfg: Mapping, batch: int, max_len: int, index: int
    ):
        """An empty joint cache layer: cache layer `index`, one of `joint_layers`."""
        raise NotImplementedError(f"topology {self.name!r} builds no cache layer of its own")

    def layer_bytes(
        self, arg: str, model_cfg: Mapping, cache_cfg: Mapping, rows: int, max_len: int, split
    ) -> int:
        """Bytes of one joint cache layer holding `rows` rows (`split(logical axis,
        size)`: the pieces a mesh cuts it in, kvlab.cache.accounting)."""
        raise NotImplementedError(f"topology {self.name!r} builds no cache layer of its own")


LAYERWISE = TOPOLOGIES.register(Topology())


def parse(spec: str) -> tuple[Topology, str]:
    """(the topology `model.topology` names, its argument) as 'name[:argument]'."""
    name, _, arg = spec.partition(":")
    return TOPOLOGIES.get(name), arg


def cache_layers(model_cfg: Mapping) -> tuple[int, ...]:
    """The cache layer of each model layer (module docstring)."""
    topology, arg = parse(model_cfg["topology"])
    return topology.layers(arg, model_cfg["num_layers"])


def num_cache_layers(model_cfg: Mapping) -> int:
    return cache_layers(model_cfg)[-1] + 1


def produces(model_cfg: Mapping, index: int) -> bool:
    """Whether model layer `index` computes keys and values (the first of its run,
    or every layer where the topology stores a run's tokens jointly)."""
    layers = cache_layers(model_cfg)
    first = index == 0 or layers[index - 1] != layers[index]
    return first or parse(model_cfg["topology"])[0].every_layer_produces


def check_joint_cache(method: str, model_cfg: Mapping, cache_cfg: Mapping, more=()) -> None:
    """ValueError naming the first field a cache of joint layers that keep every token
    of a grouped-query model in untransformed rows of their own cannot have
    (`method` names the topology's method); `more`: further (field, value, bad,
    why, fix) checks (what its codes cannot have: `quantized_code_checks`)."""
    evict = cache_cfg["evict"]["method"]
    problems = [
        ("model.attention", model_cfg["attention"], model_cfg["attention"] != "gqa",
         "stores grouped-query keys and values", "'gqa'"),
        ("cache.kind", cache_cfg["kind"], cache_cfg["kind"] != "dense",
         "keeps rows of its own, not pages", "'dense'"),
        ("cache.evict.method", evict, evict != "none", "keeps every token", "'none'"),
        ("model.sliding_window", model_cfg["sliding_window"], bool(model_cfg["sliding_window"]),
         "keeps every token, not a window's ring", "0"),
        *[
            (f"cache.{p}_transform", cache_cfg[f"{p}_transform"],
             cache_cfg[f"{p}_transform"] != "none", "stores its numbers untransformed", "'none'")
            for p in ("k", "v")
        ],
        *more,
    ]  # fmt: skip
    for field, value, bad, why, fix in problems:
        if bad:
            raise ValueError(
                f"{field}={value!r} under model.topology={model_cfg['topology']!r}: {method} "
                f"{why}: set {fix}"
            )


def quantized_code_checks(
    cache_cfg: Mapping, prefix: str, width: int, width_name: str, where: str, keys: str
) -> list[tuple]:
    """`check_joint_cache`'s (field, value, bad, why, fix) of what a joint layer's
    codes of tensor `prefix`, quantized per token in groups of its `width`
    numbers (named `width_name`, coded in `where`; `keys`: how it codes keys
    with respect to RoPE), cannot have: the channel or calibrated axis, levels
    fitted per layer, outliers, first tokens, cache.k_before_rope, a sketch,
    groups or bits that do not pack."""
    bits, group = cache_cfg[f"{prefix}_bits"], cache_cfg["group_size"]
    name, axis = cache_cfg[f"{prefix}_format"], cache_cfg[f"{prefix}_axis"]
    fitted = type(FORMATS.get(name)).table is not Format.table  # levels per layer's channels
    return [
        (f"cache.{prefix}_axis", axis, axis != "token",
         f"quantizes each token's numbers in {where}", "'token'"),
        (f"cache.{prefix}_format", name, fitted,
         f"codes numbers in {where}, not the layer's channels its levels were fitted on",
         "'int', 'nf' or 'fp8'"),
        (f"cache.{prefix}_outliers", cache_cfg[f"{prefix}_outliers"],
         bool(cache_cfg[f"{prefix}_outliers"]), "keeps no numbers beside its codes", "0"),
        (f"cache.{prefix}_full_first", cache_cfg[f"{prefix}_full_first"],
         bool(cache_cfg[f"{prefix}_full_first"]), "keeps no positions beside its codes", "0"),
        *([("cache.k_before_rope", True, cache_cfg["k_before_rope"], f"codes keys {keys}",
            "False"),
           ("cache.k_sketch", cache_cfg["k_sketch"], bool(cache_cfg["k_sketch"]),
            "keeps no residual sketch beside its codes", "0")] if prefix == "k" else []),
        ("cache.group_size", group, width % group != 0,
         f"groups a token's {width_name}={width} numbers", f"a divisor of {width}"),
        (f"cache.{prefix}_bits", bits, width * bits % 8 != 0,
         f"packs {width_name}={width} numbers into whole bytes",
         f"a width that is a multiple of {8 // math.gcd(8, bits)} or another bit-width"),
    ]  # fmt: skip


def joint_layers(model_cfg: Mapping) -> tuple[int, ...]:
    """The cache layers the model's topology builds itself (module docstring)."""
    topology, arg = parse(model_cfg["topology"])
    return topology.joint_layers(arg, model_cfg["num_layers"])


def cache_windows(model_cfg: Mapping) -> tuple[int, ...]:
    """The attention window of each cache layer (its run's, kvlab.config.layer_windows;
    0: full attention)."""
    windows, owner = layer_windows(model_cfg), cache_layers(model_cfg)
    return tuple(windows[owner.index(c)] for c in range(owner[-1] + 1))


def sections(model_cfg: Mapping, cache_cfg: Mapping) -> tuple[tuple[Mapping, Mapping], ...]:
    """The (model, cache) sections each cache layer is built, counted and read as
    (kvlab.config.layer_sections): the same pair for every layer of a model whose
    layers are alike; a hybrid model's sliding and full layers each their own."""
    kinds = layer_sections(model_cfg, cache_cfg)
    return tuple(kinds[w] for w in cache_windows(model_cfg))
