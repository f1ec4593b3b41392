"""Datasets that need no download: byte corpora (text.py), the same corpora through a
real model's tokenizer (tokenizer.py, with data.tokenizer), synthetic recall (mqar.py)
and long-context recall tasks over that text (tasks.py: needle in a haystack, RULER's
multi-key, multi-value and variable tracking; eval.tasks).

    ds = make_dataset(cfg.data, split="train", seq_len=cfg.train.seq_len)
    batch = ds.batch(step, batch_size, seed)        # the same arguments, the same arrays
    part = ds.batch(step, batch_size, seed, rows=[0, 1])  # == batch's rows 0 and 1 (one host's)
    held_out = make_dataset(cfg.data, "validation", cfg.train.seq_len).eval_batches(16, 4)

Every batch is a dict of numpy arrays:

    inputs   int32[B, T]    tokens
    targets  int32[B, T]    targets[:, t] is the token after inputs[:, t]
    weights  float32[B, T]  1 where the target counts for the loss and metric, else 0

and, with data.tokenizer only, `target_bytes` int32[B, T]: the UTF-8 bytes of
text each target token adds (bits per byte; kvlab/train/loop.py `summarize`).

    task = make_task("needle", cfg, "validation", seq_len=1024, depth=0.5)  # eval.tasks
    task.eval_batches(4, 2)   # weights 1 on the asked value's tokens only

A dataset also has `metric` ('ppl' for text, 'accuracy' for MQAR), `vocab_size`,
`seq_len` (T) and `describe()`, a small JSON-able dict of facts about it.

A config is valid when its fields are (kvlab.config.validate_sections) and the
data they name fits the model: `validate_config` (kvlab.validate_config) checks
both, reading data.tokenizer, and `load_config` (kvlab.load_config) loads a
config file and validates it:

    cfg = load_config("configs/gqa.py:tiny")
    cfg.data.tokenizer = "path/to/model"   # a folder holding tokenizer.json
    validate_config(cfg)   # refused unless model.vocab_size holds its every token id
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_collections

from kvlab.config import check_count, import_config_file, validate_sections
from kvlab.data.mqar import MqarDataset, mqar_batch
from kvlab.data.tasks import TASKS, TaskDataset, check_tasks, make_task
from kvlab.data.text import SPLITS, Batch, ByteDataset, load_corpus
from kvlab.data.tokenizer import TokenDataset, Tokenizer, check_vocab_size, load_tokenizer

SOURCES = ("stdlib", "text", "mqar")


def make_dataset(
    data: Mapping, split: str, seq_len: int
) -> ByteDataset | TokenDataset | MqarDataset:
    """The dataset `data` (a config's `data` section) describes, for one split.

    Raises ValueError naming the field, its value and the fix when the data
    cannot give windows of seq_len tokens (missing files, too short, ...).
    """
    if split not in SPLITS:
        raise ValueError(
            f"split={split!r} is not a data split: use one of {', '.join(map(repr, SPLITS))}"
        )
    seq_len = check_count("train.seq_len", seq_len)
    source = data["source"]
    if source not in SOURCES:
        raise ValueError(
            f"data.source={source!r} is not supported: use one of {', '.join(map(repr, SOURCES))}"
        )
    if data.get("tokenizer", ""):  # refuses mqar, naming data.tokenizer
        return TokenDataset(data, split, seq_len)
    if source == "mqar":
        return MqarDataset(data["mqar"], split, seq_len)
    return ByteDataset(data, split, seq_len)


def validate_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Completes and checks `cfg` as kvlab.config.validate_sections does, then what
    the data it names says: model.vocab_size holds data.tokenizer's ids (the
    tokenizer is read: a missing one is refused) and eval.tasks' samples fit their
    lengths and the model. Returns `cfg`; raises ValueError naming the field, its
    value and the fix, before anything is compiled."""
    validate_sections(cfg)
    if cfg.data.tokenizer:  # validate_sections refused one beside data.source='mqar'
        check_vocab_size(cfg)
    check_tasks(cfg)
    return cfg


def load_config(spec: str) -> ml_collections.ConfigDict:
    """Loads `path/to/file.py[:arg]` through its `get_config(arg)`, completes and validates it."""
    path, _, arg = spec.partition(":")
    module = import_config_file(path)
    cfg = module.get_config(arg) if arg else module.get_config()
    return validate_config(cfg)


__all__ = [
    "SOURCES",
    "SPLITS",
    "TASKS",
    "Batch",
    "ByteDataset",
    "MqarDataset",
    "TaskDataset",
    "TokenDataset",
    "Tokenizer",
    "load_config",
    "load_corpus",
    "load_tokenizer",
    "make_dataset",
    "make_task",
    "mqar_batch",
    "validate_config",
]
