"""Token eviction: cache layers that keep a budget of tokens and drop the rest.

layers.py holds the layers (the ring of a window, scored slots, settling groups
of a quantized layout, AdaKV's pool), paged.py their paged twins, policy.py the
per-layer policies (what a layer keeps, its budget, what that says about a
row's slots), buffer.py a decoding layer's queries kept for its compressions,
stored.py the reads and writes of the stored tensors, scorers.py
the scorers a method is and the wrappers over them (registries,
kvlab.registry.SCORERS and WRAPPERS: a new method is one file there, e.g.
tova.py, chunkkv.py). Imports run one way, paged > layers > policy | stored |
a method's file > scorers (pyproject.toml's contract for kvlab.cache.evict).
docs/caches.md, "Evicting caches", describes them; docs/adding-a-method.md how
a scorer is added.
"""

from kvlab.cache.evict.buffer import QueryBuffer
from kvlab.cache.evict.layers import EvictingLayer, init_layer, reset_rows, top_k_last
from kvlab.cache.evict.paged import PagedEvictingLayer, copy_pages, init_paged_layer
from kvlab.cache.evict.policy import (
    BATCH_SHARE,
    BATCH_STEPS,
    MAX_SCORED_LEN,
    RING_METHODS,
    Policy,
    banded,
    layer_budgets,
    model_ring,
    observed_queries,
    policies,
    resolve_budget,
    ring_positions,
    scorer_of,
    scorer_options,
    storage_heads,
    stored_tokens,
    window_groups,
)
from kvlab.cache.evict.scorers import Candidates, Channels, Scorer, Wrapper
from kvlab.cache.evict.stored import ChannelReader, PrunedKeys

__all__ = [
    "BATCH_SHARE",
    "BATCH_STEPS",
    "MAX_SCORED_LEN",
    "RING_METHODS",
    "Candidates",
    "ChannelReader",
    "Channels",
    "EvictingLayer",
    "PagedEvictingLayer",
    "Policy",
    "PrunedKeys",
    "QueryBuffer",
    "Scorer",
    "Wrapper",
    "banded",
    "copy_pages",
    "init_layer",
    "init_paged_layer",
    "layer_budgets",
    "model_ring",
    "observed_queries",
    "policies",
    "reset_rows",
    "resolve_budget",
    "ring_positions",
    "scorer_of",
    "scorer_options",
    "storage_heads",
    "stored_tokens",
    "top_k_last",
    "window_groups",
]
