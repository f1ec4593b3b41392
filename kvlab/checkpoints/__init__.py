"""Weights from outside kvlab and between attention kinds.

    cfg, params = kvlab.load_hf("path/to/model")               # hf/: transformers folders
    kvlab.save_hf(cfg, params, "out/model")                    # and back
    cfg, params, tokenizer = kvlab.load_gguf("model.gguf")     # gguf.py: llama.cpp's files
    cfg, params = kvlab.checkpoints.to_gqa(cfg, params, num_kv_heads=2)   # convert.py
    cfg, params = kvlab.checkpoints.convert.convert(cfg, params, "mla:64")

hf/ maps transformers' config.json and tensors to kvlab's model section and
parameters (docs/checkpoints.md); gguf.py reads llama.cpp's GGUF files through
hf/'s tensor layouts; convert.py turns a trained model's attention into one
that caches less (MHA -> GQA/MQA pooling, -> MLA by SVD). None of them trains
or evaluates: kvlab.train starts from what they load (train.init_from), and
the sweeps evaluate what they convert.
"""

from kvlab.checkpoints.convert import to_gqa, to_mla
from kvlab.checkpoints.gguf import load_gguf
from kvlab.checkpoints.hf import config_from_hf, load_hf, save_hf

__all__ = ["config_from_hf", "load_gguf", "load_hf", "save_hf", "to_gqa", "to_mla"]
