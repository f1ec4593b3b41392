"""Cache bytes: the analytic count and the measured one, which must agree.

    cache_bytes(model_cfg, cache_cfg, batch_size, seq_len) -> int   (analytic)
    tree_bytes(tree) -> int                                         (measured)

The analytic count follows the formula every KV-cache paper uses (REFERENCES.md):
2 (K and V) x layers x kv_heads x head_dim x seq_len x batch x bytes per element;
latent attention stores (kv_rank + rope_dim) numbers per token and layer instead
(DeepSeek-V2, arXiv:2405.04434). A quantized cache counts, per tensor, its
packed payload (bits / 8 bytes a number), one scale (and zero point) per group
and the full-precision ring of recent tokens, laid out as kvlab/cache/quant.py
describes. Plus the bookkeeping the cache carries (one int32 length per row).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from kvlab.cache.dense import cached_tensors
from kvlab.cache.quant import quantized_layout, storages
from kvlab.config import dtype_of, validate_cache_config, validate_model_config

LENGTH_BYTES = 4  # one int32 length per row


def cache_bytes(model_cfg: Mapping, cache_cfg: Mapping, batch_size: int, seq_len: int) -> int:
    """Bytes a cache of `batch_size` rows and capacity `seq_len` occupies."""
    validate_model_config(model_cfg)
    validate_cache_config(cache_cfg, model_cfg)
    layout = quantized_layout(model_cfg, cache_cfg, seq_len)
    per_row = 0  # bytes of one row in one layer
    for (_, heads, width), spec in zip(
        cached_tensors(model_cfg), storages(model_cfg, cache_cfg), strict=True
    ):
        element_bytes = dtype_of(spec.dtype).itemsize
        if layout is None:
            per_row += heads * seq_len * width * element_bytes
            continue
        rows = layout.payload_len  # P settled tokens, then W recent ones in full precision
        per_row += heads * layout.ring_len * width * element_bytes
        if not spec.quantized:
            per_row += heads * rows * width * element_bytes
            continue
        per_row += heads * rows * width * spec.bits // 8
        groups = rows * width // spec.group_size  # one scale per group, either axis
        per_row += (
            heads * groups * dtype_of(spec.scale_dtype).itemsize * (2 if spec.has_zero else 1)
        )
    return model_cfg["num_layers"] * per_row * batch_size + LENGTH_BYTES * batch_size


def elements_per_token_and_layer(model_cfg: Mapping) -> int:
    """Numbers cached per token in one layer: 2 x kv_heads x head_dim, or kv_rank + rope_dim."""
    return sum(heads * width for _, heads, width in cached_tensors(model_cfg))


def tree_bytes(tree) -> int:
    """Sum of the bytes of every array leaf (concrete or `jax.eval_shape` output)."""
    return sum(
        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree_util.tree_leaves(tree)
    )
