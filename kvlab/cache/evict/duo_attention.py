"""DuoAttention (arXiv:2410.10819): retrieval heads keep the context, streaming heads
keep their first and latest tokens.

    patterns = kvlab.eval.calibrate.duo_patterns(model_cfg, params, tokens)  # offline
    kvlab.eval.calibrate.save_patterns(path, patterns)
    cfg.cache.evict.method = "duo_attention"  # kvlab.registry.SCORERS ships it by this name
    cfg.cache.evict.options = {"patterns": path, "head_ratio": 0.5}

Each KV head of each layer has a calibrated score (kvlab.eval.calibrate.duo_patterns:
kvpress's on-the-fly estimate; a float32 array [cache layers, KV heads] in an
.npz file); the round(head_ratio x heads) lowest-scoring heads of the whole
model are streaming heads (kvpress's head_compression_ratio), the others
retrieval heads. A streaming head keeps its first `sink_size` and last
`recent_size` positions (kvpress's on-the-fly 128 and 256), a retrieval head
every token. The bytes are real: a layer's heads share one pool (as AdaKV's),
the layers' budgets shared by what their heads need for a context of the
budget's length (`shares`: retrieval heads the context, streaming ones their
window), so a layer of more retrieval heads gets more slots, and the mean is
cache.evict.budget (or ratio) as for every method. In the pool, every head's
first sink_size tokens rank first, a streaming head's latest next, retrieval
heads' other tokens next, a streaming head's other tokens last, each newest
first: with the budget DuoAttention needs, it keeps exactly DuoAttention's
tokens; a larger budget widens the streaming heads' recent windows, a smaller
one drops the retrieval heads' oldest tokens after their sinks, then the
streaming heads' oldest latest ones; the sinks go last. Grouped-query
attention only; a settled group of a quantized layout ranks by its first
position (in a window if any of its tokens is).
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from kvlab.cache.evict.scorers import Candidates, Scorer, read_artefact
from kvlab.registry import SCORERS

FIX = (
    "write them with kvlab.eval.calibrate.save_patterns (scripts/benchmark.py calibrates "
    "them for --methods duo_attention and kvzip_head)"
)
TIER = float(2**22)  # ranks apart (positions below 2**22 rank exactly within a rank)


class DuoAttention(Scorer):
    """Sinks, then streaming heads' latest, then retrieval heads' tokens, then the
    rest, each newest first."""

    name, pooled, calibrated, stepwise = "duo_attention", True, True, True
    attention_kinds = ("gqa",)
    prefix_unsafe = "its heads share one pool, so a prefix's tokens are not in slot order"
    defaults = types.MappingProxyType(
        {"patterns": "", "head_ratio": 0.5, "sink_size": 128, "recent_size": 256}
    )

    def check(self, options: Mapping, field: str) -> None:
        if not 0 <= options["head_ratio"] <= 1:
            raise ValueError(
                f"{field}.head_ratio={options['head_ratio']} is not a share of the heads in "
                "[0, 1]: set the share of heads that stream"
            )
        for name in ("sink_size", "recent_size"):
            if options[name] < 0:
                raise ValueError(f"{field}.{name}={options[name]} is negative: set >= 0")
        read_patterns(options["patterns"])

    def shares(self, layers: int, evict: Mapping, context: int) -> tuple[float, ...]:
        need = needs({**self.defaults, **dict(evict["options"].items())}, layers, context)
        if not need.any():
            return (1.0,) * layers
        return tuple(float(n) for n in need / need.mean())

    def score(self, c: Candidates) -> Array:
        options = c.options
        retrieval = retrieval_heads(options["patterns"], options["head_ratio"])
        if retrieval.shape[0] <= c.layer or retrieval.shape[1] != c.kv_heads:
            raise ValueError(
                f"cache.evict.options.patterns={options['patterns']!r} holds patterns "
                f"{retrieval.shape} [layers, KV heads], not for cache layer {c.layer} of "
                f"{c.kv_heads} KV heads: calibrate them for this model"
            )
        # [B, E, C]: a compare per streaming head (fused), not a lookup per candidate
        # (XLA:CPU's gather of one flag per candidate of a pool is a pass of its own).
        streaming = jnp.zeros(c.heads.shape, bool)
        for head in np.flatnonzero(~retrieval[c.layer]):
            streaming = streaming | (c.heads == head)
        sinks = c.positions < options["sink_size"]
        latest = c.positions + (c.group - 1) >= c.end - options["recent_size"]
        rank = jnp.where(streaming, jnp.where(latest, 2.0, 0.0), 1.0)
        return jnp.where(sinks, 3.0, rank) * TIER + c.positions.astype(jnp.float32)


def needs(options: Mapping, layers: int, context: int) -> np.ndarray:
    """int[layers]: the tokens each layer's heads keep of a `context`-token row
    (a retrieval head all, a streaming head its sinks and latest), by `options`."""
    retrieval = retrieval_heads(options["patterns"], options["head_ratio"])
    if retrieval.shape[0] != layers:
        raise ValueError(
            f"cache.evict.options.patterns={options['patterns']!r} holds patterns for "
            f"{retrieval.shape[0]} layers, not {layers}: calibrate them for this model"
        )
    window = min(options["sink_size"] + options["recent_size"], context)
    return retrieval.sum(1) * context + (~retrieval).sum(1) * window


def needed_budget(options: Mapping, layers: int, context: int) -> int:
    """The cache.evict.budget (tokens per KV head, the mean) at which DuoAttention with
    `options` keeps all its tokens of every row of up to `context` tokens: what its
    heads need, and one more for the rounding of the layers' shares."""
    options = {**DuoAttention.defaults, **dict(options.items())}
    heads = retrieval_heads(options["patterns"], options["head_ratio"]).size
    return math.ceil(needs(options, layers, context).sum() / heads) + 1


def read_patterns(path: str) -> np.ndarray:
    """float32[layers, K]: the heads' calibrated scores stored at `path`."""
    return read_artefact(path, "patterns", "[layers, KV heads]", "patterns", FIX)


def retrieval_heads(path: str, head_ratio: float) -> np.ndarray:
    """bool[layers, K]: the retrieval heads, all but the round(head_ratio x heads)
    lowest-scoring (kvpress's streaming mask; among equal scores the earlier streams)."""
    patterns = read_patterns(path)
    streaming = np.argsort(patterns, axis=None, kind="stable")[: round(patterns.size * head_ratio)]
    retrieval = np.ones(patterns.size, bool)
    retrieval[streaming] = False
    return retrieval.reshape(patterns.shape)


SCORERS.register(DuoAttention())
