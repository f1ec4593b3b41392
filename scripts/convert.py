"""Converts a model's attention to one that caches less and writes a Hugging Face folder.

    python scripts/convert.py --hf path/to/hf_model --to gqa:2 --out runs/gqa2_hf
    python scripts/convert.py --workdir runs/mha --to gqa:1 --out runs/mqa_hf

The source is a local Hugging Face checkpoint (--hf, kvlab.load_hf) or a kvlab
training run's latest checkpoint (--workdir, kvlab.train.load_params).
`--to gqa:N` pools its KV heads into N (kvlab.convert.to_gqa: the mean of each
group; 1 = MQA). The result goes to --out through kvlab.save_hf (config.json and
model.safetensors, plus the source folder's tokenizer files), a folder that
transformers loads and that `scripts/train.py --hf OUT` uptrains and
`scripts/eval.py --hf OUT` evaluates. Pooled heads are a starting point: GQA's
paper uptrains with ~5% of the pre-training compute.

MHA -> MLA conversion (`--to mla:...`, MHA2MLA, arXiv:2502.14837) is not
implemented yet.
"""

import os
import shutil

from absl import flags

import kvlab
from kvlab import cli
from kvlab.convert import to_gqa
from kvlab.train import load_params

_HF = flags.DEFINE_string("hf", None, "A Hugging Face checkpoint folder to convert.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "A training run to convert (its latest checkpoint)."
)
_TO = flags.DEFINE_string("to", None, "What to convert to: gqa:N (N KV heads; 1 = MQA).")
_OUT = flags.DEFINE_string("out", None, "A new folder for the converted Hugging Face checkpoint.")
flags.mark_flag_as_required("to")
flags.mark_flag_as_required("out")

# Files of a Hugging Face folder besides the weights (tokenizer, generation), copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def num_kv_heads(target: str) -> int:
    """N of --to gqa:N; every other target refused with what to pass instead."""
    kind, _, value = target.partition(":")
    if kind == "mla":
        raise ValueError(
            f"--to={target}: MHA->MLA conversion (MHA2MLA, arXiv:2502.14837) is not implemented "
            "yet: convert to gqa:N, or train an MLA model (configs/mla.py)"
        )
    if kind != "gqa" or not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"--to={target} is not a conversion: pass gqa:N with N KV heads, e.g. gqa:1"
        )
    return int(value)


def load_source():
    """(config, params, tokenizer folder or None) of --hf or --workdir."""
    if (_HF.value is None) == (_WORKDIR.value is None):
        raise ValueError(
            f"--hf={_HF.value} and --workdir={_WORKDIR.value}: pass exactly one of them "
            "(a Hugging Face folder or a training run)"
        )
    if _HF.value is not None:
        cfg, params = kvlab.load_hf(_HF.value)
        return cfg, params, _HF.value
    cfg, params = load_params(_WORKDIR.value)
    return cfg, params, cfg.data.tokenizer or None


def main(argv):
    del argv
    heads = num_kv_heads(_TO.value)
    out = _OUT.value
    if os.path.exists(os.path.join(out, "config.json")):
        raise ValueError(f"--out={out} already holds a checkpoint (config.json): pick a new folder")
    cfg, params, tokenizer = load_source()
    source_heads = cfg.model.num_kv_heads
    converted, params = to_gqa(cfg, params, heads)
    kvlab.save_hf(converted, params, out)
    if tokenizer is not None and os.path.isdir(tokenizer):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer, name)):
                shutil.copyfile(os.path.join(tokenizer, name), os.path.join(out, name))
    elif tokenizer is not None:  # data.tokenizer named the tokenizer.json file itself
        shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.json"))
    print(
        f"{_HF.value or _WORKDIR.value}: {cli.count(source_heads, 'KV head')} -> "
        f"{cli.attention_label(converted.model)}; written to {out}"
    )


if __name__ == "__main__":
    cli.run(main)
