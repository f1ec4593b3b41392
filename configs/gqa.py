"""Grouped-query attention (arXiv:2305.13245): query heads share K/V in groups.

    python scripts/generate.py --config configs/gqa.py:tiny
    python scripts/generate.py --config configs/gqa.py:tiny --config.model.num_kv_heads=1

tiny: 4 query heads over 2 KV heads; small: 8 over 2; base: 12 over 4.
"""

from kvlab.config import base_config

KV_HEADS = {"tiny": 2, "small": 2, "base": 4}


def get_config(arg: str = "tiny"):
    cfg = base_config(arg)
    cfg.model.num_kv_heads = KV_HEADS[arg]
    return cfg
