"""Artefacts an eviction method computes offline from calibration text, stored with a run.

    tokens = calibration_tokens(tokenizer.encode)     # int32[8, 512]: stdlib's training files
    filters = q_filters(model_cfg, params, tokens)   # float32[cache layers, K, H]
    save_filters("runs/x/qfilters.npz", filters)     # cache.evict.options.filters

Q-Filters (arXiv:2503.02812, kvlab/cache/evict/qfilter.py): the model reads
`tokens` (int32[B, T], calibration text in its tokens, e.g. the standard
library's training files: kvlab.data.text) once; per layer, each query head's
queries after RoPE (at positions 0 .. T - 1; after the query norm where the
model has one) are stacked over the rows and positions, at most `samples` of
them drawn evenly, and their first right singular vector v, signed by the
majority sign of the queries' coordinates along it (so most queries project on
it positively), gives the filter -v; a KV head's filter is the mean of its
query heads'. A cross-layer cache layer takes its producing layer's queries.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from kvlab.attention.rope import apply_rope
from kvlab.cache import topology
from kvlab.data.text import decode_bytes, load_corpus
from kvlab.files import write_atomic
from kvlab.model import Transformer


def calibration_tokens(encode: Callable[[str], Sequence[int]], rows: int = 8, length: int = 512):
    """int32[rows, length]: the standard library's training files (kvlab.data.text's
    'train' split, never a benchmark's haystack) in a model's tokens, file after
    file, cut into rows."""
    split = load_corpus("stdlib", "")["train"]
    tokens: list[int] = []
    for start, end in zip(split.offsets[:-1], split.offsets[1:], strict=True):
        tokens += encode(decode_bytes(split.tokens[start:end]))
        if len(tokens) >= rows * length:
            return np.asarray(tokens[: rows * length], np.int32).reshape(rows, length)
    raise ValueError(f"the standard library's training files hold under {rows * length} tokens")


def q_filters(model_cfg: Mapping, params, tokens: np.ndarray, samples: int = 4096) -> np.ndarray:
    """float32[cache layers, K, H]: each layer's Q-Filters (module docstring)."""
    if model_cfg["attention"] != "gqa":
        raise ValueError(
            f"model.attention={model_cfg['attention']!r}: Q-Filters filter per-head keys, "
            "which only grouped-query attention caches"
        )
    tokens = jnp.asarray(tokens, jnp.int32)
    _, state = Transformer(model_cfg).apply(
        {"params": params}, tokens, capture_intermediates=True, mutable=["intermediates"]
    )
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    groups = model_cfg["num_heads"] // model_cfg["num_kv_heads"]
    filters = []
    for layer, cache_layer in enumerate(topology.cache_layers(model_cfg)):
        if cache_layer < len(filters):  # a consumer of a cross-layer run
            continue
        attention = state["intermediates"][f"block_{layer}"]["attention"]
        if "query" not in attention:
            raise ValueError(
                "q_filters reads the query projection: pass params before kvlab.fuse_projections"
            )
        query = attention.get("query_norm", attention["query"])["__call__"][0]
        query = apply_rope(query, positions, model_cfg["rope_theta"], model_cfg["rope_scaling"])
        stacked = np.asarray(query, np.float64).reshape(-1, *query.shape[2:])  # [B x T, N, H]
        stacked = stacked[np.linspace(0, len(stacked) - 1, min(samples, len(stacked))).astype(int)]
        per_head = []
        for head in range(stacked.shape[1]):
            u, _, vh = np.linalg.svd(stacked[:, head], full_matrices=False)
            sign = 1.0 if (u[:, 0] > 0).mean() > 0.5 else -1.0
            per_head.append(-sign * vh[0])
        filters.append(np.reshape(per_head, (-1, groups, stacked.shape[-1])).mean(1))
    return np.asarray(filters, np.float32)


def save_filters(path: str | os.PathLike, filters: np.ndarray) -> None:
    """Writes `filters` [layers, K, H] where cache.evict.options.filters reads them
    (an .npz with the array 'filters'), atomically."""
    filters = np.asarray(filters, np.float32)
    if filters.ndim != 3 or not np.isfinite(filters).all():
        raise ValueError(f"Q-Filters of shape {filters.shape} are not finite [layers, K, H]")
    buffer = io.BytesIO()
    np.savez(buffer, filters=filters)
    write_atomic(path, buffer.getvalue())
