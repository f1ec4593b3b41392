"""Cross-Layer Attention (Brandon et al., arXiv:2405.12981): adjacent layers share keys and values.

    cfg.model.topology = "cla:2"   # kvlab.registry.TOPOLOGIES ships "cla" by this name

Each run of `share` adjacent layers (the last run may be shorter) keeps one
cache layer: the run's first layer computes keys and values and the others
attend over them with their own queries, so the cache holds ceil(L / share)
layers instead of L, and the consuming layers have no key or value
projection. A whole topology in one file: the model loop, the cache, byte
accounting and eviction budgets read `layers` (kvlab/cache/topology).
"""

from __future__ import annotations

from kvlab.cache.topology import Topology
from kvlab.registry import TOPOLOGIES


class CrossLayer(Topology):
    """Runs of `share` adjacent layers, one cache layer each."""

    name = "cla"

    def check(self, arg: str, num_layers: int, field: str) -> None:
        if not arg.isdigit() or int(arg) < 2:
            raise ValueError(
                f"{field}={self.name + ':' + arg!r} does not name N >= 2 adjacent layers to "
                f"share a cache layer: set {field}='cla:N' (e.g. 'cla:2'), or 'layerwise'"
            )

    def layers(self, arg: str, num_layers: int) -> tuple[int, ...]:
        share = int(arg)
        return tuple(i // share for i in range(num_layers))


TOPOLOGIES.register(CrossLayer())
