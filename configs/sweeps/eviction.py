"""Token eviction against quantization at equal cache bytes: perplexity and recall.

    python experiments/eviction.py --workdir runs/eviction           # sweep, plots, summary
    python scripts/sweep.py --config configs/sweeps/eviction.py:tiny --workdir runs/eviction

Models trained once each: MHA, GQA with half the KV heads, MQA and MLA (latent
rank 4 x head_dim) on the standard library's sources (bytes), scored by
perplexity on the held-out test files; and an MHA trained on multi-query
associative recall (data.source='mqar', Zoology arXiv:2312.04927), scored by
recall accuracy. Each is evaluated through:

- the 16-bit cache (cache.dtype bfloat16 on every variant, so bytes compare
  honestly);
- quantized caches (kvlab/cache/quant/): K8V8, K4V4, K2V2 with keys grouped
  per token (the layout eviction composes with), K4V4-kivi and K2V2-kivi with
  keys per channel (KIVI, arXiv:2402.02750; K2V2-kivi keeps a 16-bit residual
  window of group_size tokens); for MLA, the latent at 8, 4 and 2 bits;
- every eviction policy of kvlab/cache/evict/ (window, sinks, and every
  registered scorer: kvlab.config.evict_methods(), but those calibrated offline for a
  model, qfilter and duo_attention, and kvzip, which scores a context by probes fed
  after it) keeping 75%, 50%, 25% and 12.5% of the window's tokens
  (cache.evict.ratio), labelled '<method><percent>', on the models whose attention kind
  it scores;
- eviction and quantization together, labelled '<method><percent>+<bits>'.

The evaluation prefills each window through the cache in chunks of eval.chunk
tokens, so an evicting cache is compressed between chunks and later chunks see
only what it kept. tiny: 54 units and 20 per eviction method (every registered
scorer is swept: 234 with the nine methods of the committed results), about 35
minutes on two shared CPU cores for those 234 (training 18, evaluation 15); small
and base are sized for an accelerator.
"""

import ml_collections

from kvlab.config import base_config, evict_methods
from kvlab.registry import SCORERS

STEPS = {"tiny": 600, "small": 20_000, "base": 50_000}
MQAR_STEPS = {"tiny": 4_000, "small": 20_000, "base": 20_000}
# Every method but 'none', a registered scorer's included, but those that read an artefact
# calibrated offline for a model (qfilter: these models are trained by the sweep itself)
# and those scoring a context by probes fed after it (kvzip: a perplexity window has none).
METHODS = tuple(
    m
    for m in evict_methods()[1:]
    if m in ("window", "sinks")
    or not (SCORERS.get(m).calibrated or SCORERS.get(m).observes == "probes")
)
RATIOS = (0.75, 0.5, 0.25, 0.125)
# (method, ratio, quantized entry) evaluated together.
COMBINATIONS = (
    ("snapkv", 0.5, "K4V4"),
    ("snapkv", 0.5, "K8V8"),
    ("snapkv", 0.25, "K8V8"),
    ("h2o", 0.5, "K8V8"),
    ("h2o", 0.25, "K8V8"),
    ("window", 0.5, "K8V8"),
    ("snapkv", 0.5, "L4R16"),
    ("h2o", 0.5, "L8R16"),
)


def get_config(arg: str = "tiny"):
    cfg = base_config(arg)
    cfg.train.steps = STEPS[arg]
    cfg.train.warmup = STEPS[arg] // 10
    cfg.train.eval_every = STEPS[arg] // 2
    cfg.train.checkpoint_every = STEPS[arg]
    cfg.eval.split = "test"
    # Prefill steps of 8 tokens (= cache.evict.obs_window): a scored cache chooses
    # what to keep after every step, close to what decoding sees; larger chunks
    # would let each chunk's tokens see each other whatever the budget.
    cfg.eval.chunk = 8
    cfg.cache.dtype = "bfloat16"  # "16bit" means 16 bits, on every variant
    cfg.sweep = ml_collections.ConfigDict(
        dict(name=f"eviction_{arg}", mqar_steps=MQAR_STEPS[arg])  # the MQAR model's steps
    )
    return cfg


def label(method: str, ratio: float) -> str:
    """'snapkv50', 'h2o12.5': the method and the percentage of tokens it keeps."""
    return f"{method}{100 * ratio:g}"


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
        "model.mla.kv_rank": 4 * head_dim,
    }
    # Recall needs the pairs far back in the window: 2 x num_pairs context tokens,
    # then every key again, at gaps drawn uniformly (power 1) so that most queries
    # come long after their pair (kvlab/data/mqar.py). 31 keys and 32 values.
    steps = cfg.sweep.mqar_steps
    mqar = {
        "data.source": "mqar",
        "data.mqar.vocab_size": 64,
        "data.mqar.num_pairs": cfg.train.seq_len // 16,
        "data.mqar.power": 1.0,
        "eval.num_batches": 2 * cfg.eval.num_batches,  # recall is scored on the queries only
        "train.steps": steps,
        "train.warmup": steps // 20,
        "train.eval_every": max(1, steps // 4),
        "train.checkpoint_every": steps,
    }
    models = {
        "mha": {"model.num_kv_heads": heads},
        f"gqa{heads // 2}": {"model.num_kv_heads": heads // 2},
        "mqa": {"model.num_kv_heads": 1},
        f"mla{4 * head_dim}": mla,
        "mqar-mha": {"model.num_kv_heads": heads, **mqar},
    }
    group = cfg.cache.group_size

    def kv(bits, axis="token", **more):
        return {
            "cache.k_bits": bits,
            "cache.v_bits": bits,
            "cache.k_axis": axis,
            "cache.v_axis": "token",
            **more,
        }

    quantized = {
        # keys and values grouped per token: what eviction composes with
        "K8V8": kv(8),
        "K4V4": kv(4),
        "K2V2": kv(2),
        # KIVI's axes, keys per channel (no eviction with these)
        "K4V4-kivi": kv(4, "channel"),
        "K2V2-kivi": kv(2, "channel", **{"cache.residual": group}),
        # latent attention: the latent per token, the shared RoPE key at 16 bits
        "L8R16": {"cache.latent_bits": 8},
        "L4R16": {"cache.latent_bits": 4},
        "L2R16": {"cache.latent_bits": 2},
    }

    def evict(method, ratio):  # every step (interval 1): each cache holds its whole budget
        return {"cache.evict.method": method, "cache.evict.ratio": ratio, "cache.evict.interval": 1}

    caches = {"16bit": {}, **quantized}
    for method in METHODS:
        for ratio in RATIOS:
            caches[label(method, ratio)] = evict(method, ratio)
    for method, ratio, bits in COMBINATIONS:
        caches[f"{label(method, ratio)}+{bits}"] = {**evict(method, ratio), **quantized[bits]}
    return {"models": models, "caches": caches}
