"""Cache bytes: the analytic count and the measured one, which must agree.

    cache_bytes(model_cfg, cache_cfg, batch_size, seq_len) -> int   (analytic)
    tree_bytes(tree) -> int                                         (measured)

The analytic count follows the formula every KV-cache paper uses (REFERENCES.md):
2 (K and V) x layers x kv_heads x head_dim x seq_len x batch x bytes per element,
plus the bookkeeping the cache carries (one int32 length per row).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from kvlab.config import dtype_of, validate_cache_config, validate_model_config

LENGTH_BYTES = 4  # one int32 length per row


def cache_bytes(model_cfg: Mapping, cache_cfg: Mapping, batch_size: int, seq_len: int) -> int:
    """Bytes a cache of `batch_size` rows and capacity `seq_len` occupies."""
    validate_model_config(model_cfg)
    validate_cache_config(cache_cfg)
    element_bytes = dtype_of(cache_cfg["dtype"]).itemsize
    per_token = (
        2
        * model_cfg["num_layers"]
        * model_cfg["num_kv_heads"]
        * model_cfg["head_dim"]
        * element_bytes
    )
    return per_token * seq_len * batch_size + LENGTH_BYTES * batch_size


def tree_bytes(tree) -> int:
    """Sum of the bytes of every array leaf (concrete or `jax.eval_shape` output)."""
    return sum(
        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree_util.tree_leaves(tree)
    )
