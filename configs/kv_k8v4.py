"""Keys in 8 bits, values in 4: spend the bits where attention is most sensitive.

    python scripts/generate.py --config configs/kv_k8v4.py:tiny
    python scripts/cache_size.py --config configs/kv_k8v4.py:base

Errors in keys pass through the softmax, so keys are the more sensitive half of
the cache (KIVI, arXiv:2402.02750; KVQuant, arXiv:2401.18079): int8 keys, int4
values, both with a scale and zero point per token and group of channels.
"""

from kvlab.config import base_config


def get_config(arg: str = "tiny"):
    cfg = base_config(arg)
    cfg.cache.update(k_bits=8, v_bits=4, k_axis="token", v_axis="token")
    return cfg
