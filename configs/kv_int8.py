"""An 8-bit KV cache: keys and values as int8 with a scale per token and group of channels.

    python scripts/generate.py --config configs/kv_int8.py:tiny
    python scripts/cache_size.py --config configs/kv_int8.py:base
    python scripts/bench_decode.py --config configs/kv_int8.py:tiny

8-bit is close to lossless (KVQuant, arXiv:2401.18079; KIVI, arXiv:2402.02750):
symmetric codes, one bfloat16 scale per group_size channels of each token, written
as soon as a token arrives. The model is base.py's (MHA); any head sharing or MLA
model composes, e.g. --config.model.num_kv_heads=2.
"""

from kvlab.config import base_config


def get_config(arg: str = "tiny"):
    cfg = base_config(arg)
    cfg.cache.update(k_bits=8, v_bits=8, k_axis="token", v_axis="token", symmetric=True)
    return cfg
