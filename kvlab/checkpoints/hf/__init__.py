"""Hugging Face transformers checkpoints in and out of kvlab.

    cfg, params = kvlab.load_hf("path/to/model", dtype=None)   # a local save_pretrained folder
    kvlab.save_hf(cfg, params, "out/model", tokenizer=None)    # transformers loads it back
    cfg = config_from_hf(cfg, "path/to/model")                 # the scripts' --hf: no tensor read

A checkpoint is a folder as `save_pretrained` writes it: config.json and the
weights in model.safetensors, or in shards named by model.safetensors.index.json.
Families read and written: llama, mistral, qwen2, qwen3, deepseek_v2, deepseek_v3.

    config.py    config.json <-> kvlab's model section, field by field (HFConfig,
                 model_section, config_from_hf)
    layouts.py   checkpoint tensors <-> kvlab parameters (TensorLink, tensor_links,
                 check_params); kvlab.checkpoints.gguf places its tensors through them too
    read.py      safetensors in: load_hf, refuse_nonfinite, imported_params
    write.py     the family a model exports as, its config.json, save_hf

Nothing is dropped silently: every config.json field that changes what the
model computes is mapped or checked, every tensor must be there with the shape
config.json implies and none may be left over. Errors name the field or
tensor, its value and what is supported.
"""

from kvlab.checkpoints.hf.config import FAMILIES, HFConfig, config_from_hf, dtype_name
from kvlab.checkpoints.hf.layouts import TensorLink, check_params, tensor_links
from kvlab.checkpoints.hf.read import imported_params, load_hf, refuse_nonfinite
from kvlab.checkpoints.hf.write import save_hf

__all__ = [
    "FAMILIES",
    "HFConfig",
    "TensorLink",
    "check_params",
    "config_from_hf",
    "dtype_name",
    "imported_params",
    "load_hf",
    "refuse_nonfinite",
    "save_hf",
    "tensor_links",
]
