"""Recall against cache bytes per token: MHA, GQA, MQA and MLA at equal parameter counts.

    python scripts/sweep.py --config configs/sweeps/recall.py:tiny --workdir runs/recall

Four attention designs, each trained with sweep.seeds = 3 seeds on multi-query
associative recall (data.source='mqar', Zoology arXiv:2312.04927) and scored
by recall accuracy (the value predicted after each query key) on the test
split, through the 16-bit cache and quantized caches of 8, 4 and 2 bits:

- mha (4 KV heads), gqa2 (2), mqa (1) and mla32 (latent rank 32 and one
  shared RoPE key of 8: 40 numbers per token and layer, near MQA's 32); each
  one's SwiGLU width (model.mlp_dim) is set so that its parameter count
  matches MHA's (matched_mlp_dim; within 0.2% at tiny), so a design that caches
  less spends what it saves on the feed-forward;
- caches: 16bit (cache.dtype bfloat16 on every design, so bytes compare
  honestly), K8V8 and K4V4 with KIVI's axes (keys per channel, values per
  token), K2V2-kivi (the same at 2 bits with a 16-bit residual window of
  group_size tokens, as KIVI keeps); for MLA the latent per token and the
  RoPE key per channel at L8R8, L4R4 and L2R2-res (2 bits, the same window).

summary.csv has per (model, cache) the mean accuracy over the seeds with a
95% interval, and the change against the model's own 16-bit cache with a
paired interval (kvlab/sweep/summary.py). Each unit is also scored on MQAR at twice
the training length (eval.tasks, column task_mqar_128): as many pairs, with
their queries spread over a window the model never trained on.

tiny: 2-layer models of ~105k parameters, 64-token sequences of 8 pairs over
31 keys and 32 values, queries at uniform gaps (data.mqar.power 1), 3,000
steps; 12 trainings and 48 units, 23 minutes on two CPU cores shared with
another sweep (experiments/results/recall_tiny/README.md).
"""

import math

import jax
import ml_collections

from kvlab.config import base_config

STEPS = {"tiny": 3_000}
SEEDS = 3


def get_config(arg: str = "tiny"):
    if arg not in STEPS:
        raise ValueError(
            f"config argument {arg!r}: the recall sweep has sizes {', '.join(STEPS)} "
            "(e.g. configs/sweeps/recall.py:tiny)"
        )
    cfg = base_config(arg)
    steps = STEPS[arg]
    cfg.data.source = "mqar"
    cfg.data.mqar.update(vocab_size=64, num_pairs=8, power=1.0)
    cfg.model.vocab_size = cfg.data.mqar.vocab_size  # MQAR's ids alone: parameters go to attention
    cfg.train.update(
        steps=steps,
        seq_len=64,
        warmup=steps // 20,
        eval_every=steps // 2,
        checkpoint_every=steps,
    )
    cfg.eval.update(split="test", num_batches=8)  # 128 sequences, 1,024 queries
    cfg.eval.update(tasks=("mqar",), task_lengths=(2 * cfg.train.seq_len,))
    cfg.cache.dtype = "bfloat16"  # "16bit" means 16 bits, on every design
    cfg.sweep = ml_collections.ConfigDict(dict(name=f"recall_{arg}", seeds=SEEDS))
    return cfg


def parameter_count(model_cfg) -> int:
    """Parameters of kvlab.Transformer(model_cfg), from shapes alone (nothing allocated)."""
    from kvlab import init_params

    shapes = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))


def with_model(cfg, overrides: dict):
    """cfg.model with a model entry's 'model.*' overrides applied (a copy)."""
    model = ml_collections.ConfigDict(cfg.model.to_dict())
    for axis, value in overrides.items():
        *path, field = axis.split(".")[1:]
        section = model
        for part in path:
            section = section[part]
        section[field] = value
    return model


def matched_mlp_dim(cfg, overrides: dict, target: int) -> int:
    """The model.mlp_dim that brings the entry's parameter count nearest `target`."""
    model = with_model(cfg, overrides)
    count = parameter_count(model)
    model.mlp_dim += 1
    per_unit = parameter_count(model) - count  # SwiGLU: 3 x embed_dim per layer
    return cfg.model.mlp_dim + round((target - count) / per_unit)


def get_grid(cfg):
    heads = cfg.model.num_heads
    head_dim = cfg.model.head_dim
    designs = {
        "mha": {"model.num_kv_heads": heads},
        f"gqa{heads // 2}": {"model.num_kv_heads": heads // 2},
        "mqa": {"model.num_kv_heads": 1},
        f"mla{2 * head_dim}": {
            "model.attention": "mla",
            "model.num_kv_heads": heads,
            "model.head_dim": head_dim + head_dim // 2,
            "model.mla.nope_dim": head_dim,
            "model.mla.rope_dim": head_dim // 2,
            "model.mla.v_head_dim": head_dim,
            "model.mla.kv_rank": 2 * head_dim,
        },
    }
    budget = parameter_count(with_model(cfg, designs["mha"]))
    models = {
        name: {**axes, "model.mlp_dim": matched_mlp_dim(cfg, axes, budget)}
        for name, axes in designs.items()
    }
    residual = {"cache.residual": cfg.cache.group_size}

    def kv(bits, **more):  # KIVI's axes: keys per channel, values per token
        return {"cache.k_bits": bits, "cache.v_bits": bits, **more}

    def latent(bits, **more):  # the latent per token, the RoPE key per channel
        return {"cache.latent_bits": bits, "cache.rope_bits": bits, **more}

    caches = {
        "16bit": {},
        "K8V8": kv(8),
        "K4V4": kv(4),
        "K2V2-kivi": kv(2, **residual),
        "L8R8": latent(8),
        "L4R4": latent(4),
        "L2R2-res": latent(2, **residual),
    }
    return {"models": models, "caches": caches}
