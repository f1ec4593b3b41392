"""Multi-head attention (arXiv:1706.03762): num_kv_heads = num_heads.

python scripts/generate.py --config configs/mha.py:tiny
"""

from kvlab.config import base_config


def get_config(arg: str = "tiny"):
    cfg = base_config(arg)
    cfg.model.num_kv_heads = cfg.model.num_heads
    return cfg
