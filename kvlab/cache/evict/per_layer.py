"""Per-layer budgets over any scorer (kvpress's PerLayerCompressionPress).

    cfg.cache.evict.method = "per_layer:snapkv"   # any scorer (kvlab.registry.WRAPPERS)
    cfg.cache.evict.ratio = 0.5                   # the mean share kept, as for every method
    cfg.cache.evict.options = {"weights": [0.5, 1.0, 1.5]}  # one per cache layer

Layer i keeps weights[i] / mean(weights) times the budget: with
cache.evict.budget, round(budget x that) tokens per KV head; with
cache.evict.ratio, a share ratio x that of the cache (every_step) or of each
row's context when it is compressed (after_prefill: floor(share x length), as
kvpress keeps int(length x (1 - compression_ratios[i]))). The cache's bytes are
the sum of the layers' budgets, so the mean stays the budget a uniform method
gets: per-layer allocations are compared at equal bytes. kvpress's
compression_ratios c translate as weights 1 - c and ratio mean(1 - c). The
scorer ranks as it does alone; the wrapper sets only how many stay per layer.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from kvlab.cache.evict.scorers import Wrapper
from kvlab.registry import WRAPPERS


class PerLayer(Wrapper):
    """Layer i's budget: the mean budget x weights[i] / mean(weights)."""

    name = "per_layer"
    defaults = types.MappingProxyType({"weights": ()})

    def check(self, options: Mapping, field: str) -> None:
        weights = options["weights"]
        if not weights or min(weights) <= 0:
            raise ValueError(
                f"{field}.weights={list(weights)!r} is not one positive weight per cache "
                "layer: set e.g. [0.5, 1.5] for a model of two cache layers"
            )

    def shares(self, layers: int, evict: Mapping, context: int) -> tuple[float, ...]:
        weights = tuple(float(w) for w in evict["options"]["weights"])
        if len(weights) != layers:
            raise ValueError(
                f"cache.evict.options.weights has {len(weights)} weight(s) for a model of "
                f"{layers} cache layer(s): set one per cache layer"
            )
        mean = sum(weights) / layers
        shares = tuple(w / mean for w in weights)
        if evict["when"] == "after_prefill" and not evict["budget"]:
            most = evict["ratio"] * max(shares)
            if most > 1:
                raise ValueError(
                    f"cache.evict.options.weights ask layer {shares.index(max(shares))} to keep "
                    f"{most:.3g} of the context (cache.evict.ratio={evict['ratio']} x "
                    f"{max(shares):.3g}): set weights closer together or a smaller ratio"
                )
        return shares


WRAPPERS.register(PerLayer())
