"""KIVI (arXiv:2402.02750): 2-bit keys per channel, 2-bit values per token, a full-precision window.

    python scripts/generate.py --config configs/kv_kivi2.py:tiny
    python scripts/cache_size.py --config configs/kv_kivi2.py:base

Keys get one scale and zero point per channel and group of group_size tokens
(outlier channels stay in their own range); values one per token and group of
channels. The most recent `residual` tokens, and those of an unfinished key
group, stay in full precision and move to 2-bit storage a whole group at a time.
tiny: groups of 16, residual 32; small and base: groups of 32, residual 128.
"""

from kvlab.config import base_config


def get_config(arg: str = "tiny"):
    cfg = base_config(arg)
    group = 16 if arg == "tiny" else 32
    cfg.cache.update(
        k_bits=2,
        v_bits=2,
        k_axis="channel",
        v_axis="token",
        symmetric=False,
        group_size=group,
        residual=2 * group if arg == "tiny" else 128,
    )
    return cfg
