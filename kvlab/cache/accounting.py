"""Cache bytes: the analytic count and the measured one, which must agree.

    cache_bytes(model_cfg, cache_cfg, batch_size, seq_len) -> int   (analytic)
    tree_bytes(tree) -> int                                         (measured)

The analytic count follows the formula every KV-cache paper uses (REFERENCES.md):
2 (K and V) x layers x kv_heads x head_dim x seq_len x batch x bytes per element;
latent attention stores (kv_rank + rope_dim) numbers per token and layer instead
(DeepSeek-V2, arXiv:2405.04434). Plus the bookkeeping the cache carries (one
int32 length per row).
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
    per_token = model_cfg["num_layers"] * elements_per_token_and_layer(model_cfg) * element_bytes
    return per_token * seq_len * batch_size + LENGTH_BYTES * batch_size


def elements_per_token_and_layer(model_cfg: Mapping) -> int:
    """Numbers cached per token in one layer: 2 x kv_heads x head_dim, or kv_rank + rope_dim."""
    if model_cfg["attention"] == "mla":
        return model_cfg["mla"]["kv_rank"] + model_cfg["mla"]["rope_dim"]
    return 2 * model_cfg["num_kv_heads"] * model_cfg["head_dim"]


def tree_bytes(tree) -> int:
    """Sum of the bytes of every array leaf (concrete or `jax.eval_shape` output)."""
    return sum(
        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree_util.tree_leaves(tree)
    )
