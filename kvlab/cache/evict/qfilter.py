"""Q-Filters (arXiv:2503.02812): keys scored by one calibrated direction per KV head.

    filters = kvlab.eval.calibrate.q_filters(model_cfg, params, tokens)  # offline
    kvlab.eval.calibrate.save_filters(path, filters)
    cfg.cache.evict.method = "qfilter"  # kvlab.registry.SCORERS ships it by this name
    cfg.cache.evict.options = {"filters": path}

Queries of a head point mostly one way: the first right singular vector of
its queries (after RoPE) over calibration text, signed so that most queries
project onto it positively, stands for the query any key will meet. A key's
score is its dot product with that direction (averaged over a KV head's query
heads; stored as the filter f with the opposite sign, score = -f . k, as
kvpress's QFilterPress reads its filters). It reads the keys alone, no
attention, so it runs with any attention kernel; the filters are a float32
array [cache layers, KV heads, head_dim] in an .npz file written with the run
(kvlab.eval.calibrate, scripts/benchmark.py). The cache's key transform turns
the filters as it turns the keys. Grouped-query attention only (a latent has
no per-head keys to filter); a settled group scores the mean of its tokens'.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from kvlab.cache.evict.scorers import Candidates, Scorer, read_artefact
from kvlab.registry import SCORERS

FIX = (
    "write them with kvlab.eval.calibrate.save_filters (scripts/benchmark.py "
    "calibrates them for --methods qfilter)"
)


class QFilter(Scorer):
    """Minus each key's dot product with its layer and KV head's filter."""

    name, calibrated, static = "qfilter", True, True
    attention_kinds = ("gqa",)
    defaults = types.MappingProxyType({"filters": ""})

    def check(self, options, field: str) -> None:
        read_filters(options["filters"])

    def score(self, c: Candidates) -> Array:
        path = c.options["filters"]
        filters = read_filters(path)
        keys = c.keys()  # [B, K, C, g, W]
        if filters.shape[0] <= c.layer or filters.shape[1:] != (keys.shape[1], keys.shape[-1]):
            raise ValueError(
                f"cache.evict.options.filters={path!r} holds filters {filters.shape} "
                f"[layers, KV heads, head_dim], not for cache layer {c.layer} of "
                f"{keys.shape[1]} KV heads of {keys.shape[-1]}: calibrate them for this model"
            )
        direction = jnp.asarray(filters[c.layer])  # [K, W]
        if c.key_transform is not None:
            direction = c.key_transform.forward(direction)
        return -jnp.einsum("bkcgw,kw->bkcg", keys, direction).mean(-1)


def read_filters(path: str) -> np.ndarray:
    """float32[layers, K, W]: the Q-Filters stored at `path` (read once per version)."""
    return read_artefact(path, "filters", "[layers, KV heads, head_dim]", "filters", FIX)


SCORERS.register(QFilter())
