"""Perplexity against cache bytes per token: head sharing x latent rank x bit-widths.

    python scripts/sweep.py --config configs/sweeps/cache_pareto.py:tiny --workdir runs/cache_pareto
    python scripts/sweep.py --config configs/sweeps/cache_pareto.py:small --workdir DIR \
        --sweep_index 0 --sweep_count 4          # one slice of four; then:
    python scripts/sweep.py --config configs/sweeps/cache_pareto.py:small --workdir DIR --merge
    python scripts/sweep.py --config configs/sweeps/cache_pareto.py:tiny3 --workdir DIR  # 3 seeds

Every model is trained once on the standard library's sources (bytes) and then
evaluated on the held-out test files through every cache that applies to it.
tiny: five 2-layer models (MHA, GQA with 2 KV heads, MQA, MLA with latent rank
64 and 32) trained for 500 steps each on two CPU cores, the whole sweep in
under ten minutes; small and base are sized for an accelerator. The 16-bit
baseline is bfloat16 on every variant (cache.dtype), so bytes compare honestly.
A number after the size (tiny3, small5) trains every model with that many
seeds (sweep.seeds: train.seed 0, 1, 2, ...); summary.csv then reports the
mean and a 95% interval per model and cache over seeds and windows.
"""

import re

import ml_collections

from kvlab.config import base_config

STEPS = {"tiny": 500, "small": 20_000, "base": 50_000}


def get_config(arg: str = "tiny"):
    match = re.fullmatch(r"([a-z]+)(\d*)", arg)
    if not match or match[1] not in STEPS:
        raise ValueError(
            f"config argument {arg!r}: use a size ({', '.join(STEPS)}) and optionally "
            "a number of seeds, e.g. tiny or tiny3"
        )
    arg, seeds = match[1], int(match[2] or 1)
    cfg = base_config(arg)
    cfg.train.steps = STEPS[arg]
    cfg.train.warmup = STEPS[arg] // 10
    cfg.train.eval_every = STEPS[arg] // 4
    cfg.train.checkpoint_every = STEPS[arg] // 2
    cfg.eval.split = "test"
    cfg.cache.dtype = "bfloat16"  # "16bit" means 16 bits, on every variant
    name = f"cache_pareto_{arg}" + (str(seeds) if seeds > 1 else "")
    cfg.sweep = ml_collections.ConfigDict(dict(name=name, seeds=seeds))
    return cfg


def get_grid(cfg):
    heads = cfg.model.num_heads
    head_dim = cfg.model.head_dim
    mla = {
        "model.attention": "mla",
        "model.num_kv_heads": heads,
        "model.mla.rope_dim": head_dim // 2,
        "model.mla.nope_dim": head_dim,
        "model.mla.v_head_dim": head_dim,
        "model.head_dim": head_dim + head_dim // 2,
    }
    models = {
        "mha": {"model.num_kv_heads": heads},
        f"gqa{heads // 2}": {"model.num_kv_heads": heads // 2},
        "mqa": {"model.num_kv_heads": 1},
        f"mla{4 * head_dim}": {**mla, "model.mla.kv_rank": 4 * head_dim},
        f"mla{2 * head_dim}": {**mla, "model.mla.kv_rank": 2 * head_dim},
    }
    group = cfg.cache.group_size

    def kv(k_bits, v_bits, **more):
        return {"cache.k_bits": k_bits, "cache.v_bits": v_bits, **more}

    def latent(latent_bits, rope_bits):
        return {"cache.latent_bits": latent_bits, "cache.rope_bits": rope_bits}

    caches = {
        "16bit": {},
        # keys per channel, values per token (KIVI's axes), no residual window
        "K8V8": kv(8, 8),
        "K8V4": kv(8, 4),
        "K4V8": kv(4, 8),
        "K4V4": kv(4, 4),
        "K4V4-token": kv(4, 4, **{"cache.k_axis": "token"}),
        "K2V2-kivi": kv(2, 2, **{"cache.residual": group}),
        # latent per token, the shared RoPE key per channel
        "L8R16": latent(8, 16),
        "L8R8": latent(8, 8),
        "L4R16": latent(4, 16),
        "L4R8": latent(4, 8),
        "L2R16": latent(2, 16),
    }
    return {"models": models, "caches": caches}
