"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434): cache a latent.

    python scripts/generate.py --config configs/mla.py:tiny
    python scripts/generate.py --config configs/mla.py:tiny --config.model.mla.absorb=False
    python scripts/bench_decode.py --config configs/mla.py:small --config.model.dtype=float32 \
        --config.cache.dtype=float32
    python scripts/cache_size.py --config configs/mla.py:base --compare

The cache holds kv_rank + rope_dim numbers per token and layer. With DeepSeek-V2's
proportions (kv_rank = 4 nope_dim, rope_dim = nope_dim / 2) that is 4.5 x nope_dim,
as much as GQA with 2.25 groups of nope_dim-wide heads. `base` has DeepSeek-V2's
attention widths (kv_rank 512, rope_dim 64, nope_dim 128, v_head_dim 128, low-rank
queries) on the base model's 12 heads.
"""

from kvlab.config import base_config

MLA = {
    "tiny": dict(kv_rank=64, q_rank=0, rope_dim=8, nope_dim=16, v_head_dim=16),
    "small": dict(kv_rank=256, q_rank=384, rope_dim=32, nope_dim=64, v_head_dim=64),
    "base": dict(kv_rank=512, q_rank=768, rope_dim=64, nope_dim=128, v_head_dim=128),
}


def get_config(arg: str = "tiny"):
    cfg = base_config(arg)
    cfg.model.attention = "mla"
    cfg.model.mla.update(MLA[arg])
    cfg.model.head_dim = cfg.model.mla.nope_dim + cfg.model.mla.rope_dim
    cfg.model.num_kv_heads = cfg.model.num_heads
    return cfg
