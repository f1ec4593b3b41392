"""Converts a model's attention to one that caches less.

    python scripts/convert.py --hf path/to/hf_model --to gqa:2 --out runs/gqa2_hf
    python scripts/convert.py --workdir runs/mha --to gqa:1 --out runs/mqa_hf
    python scripts/convert.py --workdir runs/mha --to mla:16,rope=1,select=norm --out runs/mla16

The source is a local Hugging Face checkpoint (--hf, kvlab.load_hf) or a kvlab
training run's latest checkpoint (--workdir, kvlab.train.load_params).

- `--to gqa:N` pools its KV heads into N (kvlab.checkpoints.to_gqa: the mean of
  each group; 1 = MQA). The result goes to --out through kvlab.save_hf
  (config.json and model.safetensors, plus the source folder's tokenizer
  files), a folder that transformers loads, `scripts/train.py --hf OUT`
  uptrains and `scripts/eval.py --hf OUT` evaluates.
- `--to mla:R[,rope=P][,select=S][,factor=F]` converts to latent attention
  with a latent of width R, P RoPE pairs kept per KV head (default 1) chosen
  by S (norm, uniform, high or low; default norm, ranked over --calibration
  windows of the source's training text), K and V factored by the SVD of the
  weights (F=weights, the default) or weighted by the calibration windows'
  attention inputs (F=activations: less error at low rank);
  kvlab.checkpoints.to_mla (MHA2MLA), with --to read by
  kvlab.checkpoints.convert.convert. No transformers family holds the result,
  so --out becomes a kvlab run whose step-0 checkpoint holds it
  (kvlab.train.start_workdir): `scripts/eval.py --workdir OUT` evaluates it,
  `scripts/train.py --init_from OUT --workdir UP` uptrains it.

Converted models are a starting point: GQA's paper uptrains with ~5% of the
pre-training compute, MHA2MLA with 0.3-0.6% of the pre-training tokens.
"""

import os
import shutil

from absl import flags

import kvlab
from kvlab import cli
from kvlab.checkpoints.convert import CALIBRATION_WINDOWS, convert, parse_target
from kvlab.config import base_config
from kvlab.train import load_params, start_workdir

_HF = flags.DEFINE_string("hf", None, "A Hugging Face checkpoint folder to convert.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "A training run to convert (its latest checkpoint)."
)
_TO = flags.DEFINE_string(
    "to",
    None,
    "What to convert to: gqa:N (N KV heads; 1 = MQA) or mla:R[,rope=P][,select=S][,factor=F].",
)
_OUT = flags.DEFINE_string("out", None, "A new folder for the converted model.")
_CALIBRATION = flags.DEFINE_integer(
    "calibration",
    CALIBRATION_WINDOWS,
    "Training windows that rank RoPE pairs for mla:...,select=norm.",
)
flags.mark_flag_as_required("to")
flags.mark_flag_as_required("out")

# Files of a Hugging Face folder besides the weights (tokenizer, generation), copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def load_source():
    """(config, params, tokenizer folder or None) of --hf or --workdir."""
    if (_HF.value is None) == (_WORKDIR.value is None):
        raise ValueError(
            f"--hf={_HF.value} and --workdir={_WORKDIR.value}: pass exactly one of them "
            "(a Hugging Face folder or a training run)"
        )
    if _HF.value is not None:
        # The checkpoint's model and tokenizer (data.tokenizer) for calibration text.
        _, params = kvlab.load_hf(_HF.value)
        return cli.with_hf(base_config(), _HF.value), params, _HF.value
    cfg, params = load_params(_WORKDIR.value)
    return cfg, params, cfg.data.tokenizer or None


def main(argv):
    del argv
    kind, _ = parse_target(_TO.value)
    out = _OUT.value
    if os.path.exists(os.path.join(out, "config.json")):
        raise ValueError(f"--out={out} already holds a checkpoint (config.json): pick a new folder")
    cfg, params, tokenizer = load_source()
    converted, params = convert(cfg, params, _TO.value, calibration=_CALIBRATION.value)
    if kind == "gqa":
        kvlab.save_hf(converted, params, out)
        copy_tokenizer(tokenizer, out)
    else:
        start_workdir(converted, params, out)
    before = kvlab.cache_bytes(cfg.model, cfg.cache, 1, cfg.train.seq_len)
    after = kvlab.cache_bytes(converted.model, converted.cache, 1, cfg.train.seq_len)
    print(
        f"{_HF.value or _WORKDIR.value}: {cli.attention_label(cfg.model)} -> "
        f"{cli.attention_label(converted.model)}, cache {after / before:.3f} of the source's; "
        f"written to {out}"
    )


def copy_tokenizer(tokenizer: str | None, out: str) -> None:
    """The source's tokenizer files into the Hugging Face folder `out`."""
    if tokenizer is not None and os.path.isdir(tokenizer):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer, name)):
                shutil.copyfile(os.path.join(tokenizer, name), os.path.join(out, name))
    elif tokenizer is not None:  # data.tokenizer named the tokenizer.json file itself
        shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.json"))


if __name__ == "__main__":
    cli.run(main)
