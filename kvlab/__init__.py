"""kvlab: experiments on the transformer KV cache in JAX/Flax.

The public API (README.md, "The API"; docs/architecture.md for the rest):

    cfg = kvlab.load_config("configs/gqa.py:tiny")
    model = kvlab.Transformer(cfg.model)
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    params = kvlab.fuse_projections(params)   # optional: q/k/v and gate/up in one product each
    cache = kvlab.init_cache(cfg.model, cfg.cache, batch_size=2, max_len=256)
    logits, cache = model.apply({"params": params}, tokens, cache=cache)
    out = kvlab.generate(model, params, prompts, cache_cfg=cfg.cache, max_new_tokens=32)
    kvlab.cache_bytes(cfg.model, cfg.cache, batch_size=2, seq_len=256) == kvlab.tree_bytes(cache)
    engine = kvlab.Engine(cfg.model, cfg.cache, params, max_slots=8)   # cache.kind='paged'
    outputs = engine.generate(list_of_token_lists, max_new_tokens=32)
    cfg, params = kvlab.load_hf("path/to/hf_model")      # a transformers checkpoint folder
    kvlab.save_hf(cfg, params, "out/hf_model")           # and back
    cfg = kvlab.config_from_hf(cfg, "path/to/hf_model")  # a config that runs it (no tensor read)
    cfg, params, tokenizer = kvlab.load_gguf("model.gguf")   # llama.cpp's files (extra 'real')
    cfg, params = kvlab.to_gqa(cfg, params, num_kv_heads=2)  # or to_mla: cache less

The packages, bottom to top (docs/architecture.md, "Layers and imports"): the model
(kvlab.model, kvlab.attention, kvlab.cache), kvlab.sampling and kvlab.data; kvlab.serve
(scheduler and engine), kvlab.checkpoints (hf, gguf, convert); kvlab.train; kvlab.eval
(perplexity, long-context tasks, probes); kvlab.sweep and kvlab.cli on top.
Kernels beyond plain JAX are backends chosen by model.attention_impl (kvlab.backends:
kvlab/kernels/pallas, kvlab/kernels/native).
"""

from kvlab.cache import Cache, cache_bytes, init_cache, tree_bytes
from kvlab.checkpoints import config_from_hf, load_gguf, load_hf, save_hf, to_gqa, to_mla
from kvlab.config import base_config
from kvlab.data import load_config, validate_config
from kvlab.model import (
    Transformer,
    fuse_projections,
    init_params,
    unfuse_projections,
)
from kvlab.sampling import Greedy, Temperature, TopK, TopP, decode_step, generate, prefill
from kvlab.serve import Engine

__all__ = [
    "Cache",
    "Engine",
    "Greedy",
    "Temperature",
    "TopK",
    "TopP",
    "Transformer",
    "base_config",
    "cache_bytes",
    "config_from_hf",
    "decode_step",
    "fuse_projections",
    "generate",
    "init_cache",
    "init_params",
    "load_config",
    "load_gguf",
    "load_hf",
    "prefill",
    "save_hf",
    "to_gqa",
    "to_mla",
    "tree_bytes",
    "unfuse_projections",
    "validate_config",
]
