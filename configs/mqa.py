"""Multi-query attention (arXiv:1911.02150): all query heads share one K/V head.

python scripts/generate.py --config configs/mqa.py:tiny
"""

from kvlab.config import base_config


def get_config(arg: str = "tiny"):
    cfg = base_config(arg)
    cfg.model.num_kv_heads = 1
    return cfg
