"""Token eviction: cache layers that keep a budget of tokens and drop the rest.

layers.py holds the layers (the ring of a window, scored slots, settling
groups of a quantized layout, AdaKV's pool, their paged twins) and the
per-layer policies; scorers.py the scorers a method is (a registry,
kvlab.registry.SCORERS: a new method is one file there, e.g. tova.py).
docs/caches.md, "Evicting caches", describes both; docs/adding-a-method.md
how a scorer is added.
"""

from kvlab.cache.evict.layers import (
    MAX_SCORED_LEN,
    RING_METHODS,
    EvictingLayer,
    PagedEvictingLayer,
    Policy,
    banded,
    copy_pages,
    init_layer,
    init_paged_layer,
    layer_budgets,
    observed_queries,
    policies,
    reset_rows,
    resolve_budget,
    ring_positions,
    scorer_of,
    storage_heads,
    stored_tokens,
    window_groups,
)
from kvlab.cache.evict.scorers import Candidates, Scorer

__all__ = [
    "MAX_SCORED_LEN",
    "RING_METHODS",
    "Candidates",
    "EvictingLayer",
    "PagedEvictingLayer",
    "Policy",
    "Scorer",
    "banded",
    "copy_pages",
    "init_layer",
    "init_paged_layer",
    "layer_budgets",
    "observed_queries",
    "policies",
    "reset_rows",
    "resolve_budget",
    "ring_positions",
    "scorer_of",
    "storage_heads",
    "stored_tokens",
    "window_groups",
]
