"""Converting a trained model's attention to one that caches less.

    cfg, params = kvlab.convert.to_gqa(cfg, params, num_kv_heads=2)

MHA -> GQA / MQA (GQA, arXiv:2305.13245): each group of consecutive KV heads
becomes one head whose key and value projections (and biases) are the mean of
the group's. Query head n reads KV head n // G, so the query heads that read a
group's heads before read the pooled head after. Pooling is exact when the
heads of each group are already equal; otherwise the converted model is a
starting point for uptraining (the paper uptrains with ~5% of pre-training
compute). Conversion to latent attention (MHA2MLA, arXiv:2502.14837) is not
here yet: docs/design.md says what it needs.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import ml_collections

from kvlab.config import check_count, validate_config


def to_gqa(
    cfg: ml_collections.ConfigDict, params: Mapping, num_kv_heads: int
) -> tuple[ml_collections.ConfigDict, dict]:
    """(config, params) of the same model with `num_kv_heads` KV heads, pooled by mean.

    The source must use grouped-query attention with a multiple of
    `num_kv_heads` KV heads; the config is copied, never changed in place.
    """
    num_kv_heads = check_count("num_kv_heads", num_kv_heads)
    source = cfg.model
    if source.attention != "gqa":
        raise ValueError(
            f"model.attention={source.attention!r}: to_gqa pools the KV heads of "
            "grouped-query attention; convert a model with model.attention='gqa'"
        )
    if source.num_kv_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} does not divide the source's model.num_kv_heads="
            f"{source.num_kv_heads}: pick a divisor (1 = MQA)"
        )
    ratio = source.num_kv_heads // num_kv_heads
    converted = cfg.copy_and_resolve_references()
    converted.model.num_kv_heads = num_kv_heads
    validate_config(converted)

    def pool(path, leaf):
        names = [getattr(key, "key", None) for key in path]
        if "attention" not in names or not {"key", "value"} & set(names):
            return leaf
        # kernel [D, K, H] or bias [K, H]: the head axis is second to last
        heads = leaf.shape[:-2] + (num_kv_heads, ratio) + leaf.shape[-1:]
        return leaf.reshape(heads).mean(axis=-2, dtype="float32").astype(leaf.dtype)

    return converted, jax.tree_util.tree_map_with_path(pool, dict(params))
