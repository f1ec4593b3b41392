"""What the tests of kvlab/checkpoints/hf/ share: the fixtures and ways to change them.

The fixtures in tests/fixtures/hf were written by scripts/make_hf_fixtures.py
with transformers' own save_pretrained; each holds the logits transformers
computed on a token batch and its greedy continuation (reference.npz).
"""

import json
import os
import shutil

import numpy as np
import safetensors.numpy
import tokenizers
from flax import traverse_util

from tests.helpers import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "hf"


GROUPED = ["llama", "qwen2", "qwen3", "mistral"]


WINDOWED = ["mistral_window"]  # sliding window 4 over 24 tokens


LATENT = ["deepseek_v2_q_lora", "deepseek_v2", "deepseek_v3"]


ALL = GROUPED + WINDOWED + LATENT


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


def flat(params):
    return traverse_util.flatten_dict(params)


def read_tensors(folder) -> dict:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(safetensors.numpy.load_file(os.path.join(folder, name)))
    return tensors


def copy_fixture(name, tmp_path, config_changes=None, tensors=None):
    """A copy of fixture `name` with config.json fields changed (None deletes) and
    model.safetensors replaced by `tensors(old) -> new`."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        for key, value in config_changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    if tensors:
        new = tensors(read_tensors(folder))
        safetensors.numpy.save_file(new, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def smaller_vocabulary(tmp_path, vocab_size):
    """The llama fixture with its vocabulary cut to the first `vocab_size` ids."""

    def cut(tensors):
        cut = ("model.embed_tokens.weight", "lm_head.weight")
        return {k: v[:vocab_size] if k in cut else v for k, v in tensors.items()}

    return copy_fixture("llama", tmp_path, {"vocab_size": vocab_size}, tensors=cut)


def word_tokenizer(words):
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0])
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return backend
