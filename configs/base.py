"""Multi-head attention (every query head has its own K/V head), 16-bit cache.

    python scripts/generate.py --config configs/base.py:tiny
    python scripts/cache_size.py --config configs/base.py:base

Variants: tiny (CPU, seconds), small and base (GPU/TPU sizes).
"""

from kvlab.config import base_config


def get_config(arg: str = "tiny"):
    return base_config(arg)
