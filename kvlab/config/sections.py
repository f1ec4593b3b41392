"""Completing a config from the schema's defaults and checking it whole: every section,
alone and against the others (`validate_sections`), the `train`, `data`, `eval` and
`mesh` sections here, the model and cache sections through kvlab.config.model and
kvlab.config.cache; the mesh rules' axes and the sizes they split."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import ml_collections

from kvlab.config.cache import validate_cache_config
from kvlab.config.fields import check_choice, check_int, check_known_fields, check_number, fail
from kvlab.config.model import validate_model_config
from kvlab.config.schema import (
    BYTE_VOCAB_SIZE,
    DATA_SOURCES,
    EVAL_SPLITS,
    EVAL_TASKS,
    MESH_AXES,
    SEED_LIMIT,
    WANDB_MODES,
    base_config,
    frozen_schema,
)


def complete_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Fills the fields `cfg` omits with base_config()'s defaults, in place; returns `cfg`.

    A config may leave out what does not apply to it (the model.mla section of a
    grouped-query model, cache fields it keeps at their defaults), and a run saved
    before a field joined the schema loads with that field at its default. Given
    fields are never changed; unknown ones stay, for validate_sections to refuse.
    Defaults are the tiny variant's: a config sized for an accelerator sets its sizes.
    """
    if isinstance(cfg, ml_collections.FrozenConfigDict):
        return cfg  # immutable: validate_sections names what it lacks
    with cfg.unlocked():  # a config from --config flags comes locked
        _fill(cfg, base_config())
    return cfg


def _fill(given, defaults: ml_collections.ConfigDict) -> None:
    for key, default in defaults.items():
        is_section = isinstance(default, ml_collections.ConfigDict)
        if key not in given:
            given[key] = ml_collections.ConfigDict(default.to_dict()) if is_section else default
        elif is_section and isinstance(given[key], (ml_collections.ConfigDict, Mapping)):
            _fill(given[key], default)


def validate_sections(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Completes `cfg` (complete_config) and checks every section, alone and against
    the others; returns it when valid. What the files it names hold (data.tokenizer,
    eval.tasks' samples) kvlab.data.validate_config checks after this."""
    schema = frozen_schema()
    if isinstance(cfg, ml_collections.ConfigDict):
        complete_config(cfg)
    check_known_fields("config", cfg, schema)
    validate_model_config(cfg.model)
    _canonical_tuples(cfg)
    validate_cache_config(cfg.cache, cfg.model)
    _validate_train(cfg.train, schema.train)
    _validate_data(cfg, schema.data)
    validate_eval_config(cfg)
    check_known_fields("wandb", cfg.wandb, schema.wandb)
    check_choice("wandb", cfg.wandb, "mode", WANDB_MODES)
    validate_mesh_config(cfg)
    return cfg


def _canonical_tuples(cfg: ml_collections.ConfigDict) -> None:
    """Turns the lists of model.mla.rope_pairs and model.layer_types into tuples, in place."""
    pairs = cfg.model.mla.rope_pairs
    _set_canonical(cfg.model.mla, "rope_pairs", tuple(tuple(map(tuple, p)) for p in pairs))
    _set_canonical(cfg.model, "layer_types", tuple(cfg.model.layer_types))


def _set_canonical(section: ml_collections.ConfigDict, name: str, canonical: tuple) -> None:
    if section[name] != canonical:
        # One form for equal configs: a config.json gives lists where Python gave
        # tuples (and a field read as a list keeps converting tuples to lists).
        with section.unlocked():
            del section[name]
            section[name] = canonical


def _validate_train(train: ml_collections.ConfigDict, schema: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad field of the `train` section."""
    check_known_fields("train", train, schema)
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep",
    ):
        check_int("train", train, name)
    check_int("train", train, "warmup", minimum=0)
    check_int("train", train, "seed", minimum=0)
    if train.seed >= SEED_LIMIT:
        fail(
            "train.seed",
            train.seed,
            f"does not fit a 32-bit PRNG seed (it would act as {train.seed % SEED_LIMIT})",
            f"set train.seed in 0..{SEED_LIMIT - 1}",
        )
    check_number("train", train, "lr")
    check_number("train", train, "clip")
    check_number("train", train, "weight_decay", zero_allowed=True)
    init_from = train.init_from
    if not isinstance(init_from, str) or (init_from and not os.path.isdir(init_from)):
        fail(
            "train.init_from",
            init_from,
            "is not a directory",
            "give a kvlab training workdir or a Hugging Face model directory, or '' for "
            "random weights",
        )


def _validate_data(cfg: ml_collections.ConfigDict, schema: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad field of the `data` section, against the
    model's vocabulary and (MQAR) train.seq_len."""
    check_known_fields("data", cfg.data, schema)
    check_choice("data", cfg.data, "source", DATA_SOURCES)
    if cfg.data.source == "text" and not cfg.data.path:
        fail(
            "data.path",
            cfg.data.path,
            "is empty but data.source='text' reads a local file",
            "set data.path to a text file or a folder of text files",
        )

    check_known_fields("data.mqar", cfg.data.mqar, schema.mqar)
    tokenizer = cfg.data.tokenizer
    if not isinstance(tokenizer, str):
        fail(
            "data.tokenizer",
            tokenizer,
            "is not a string",
            "set '' (bytes) or a folder holding tokenizer.json (or the file)",
        )
    if tokenizer and cfg.data.source == "mqar":
        fail(
            "data.tokenizer",
            tokenizer,
            "applies to text, but data.source='mqar' makes its own token ids",
            "set data.tokenizer='' or data.source='text' / 'stdlib'",
        )
    if cfg.data.source == "mqar":
        _validate_mqar(cfg)
    elif not tokenizer and cfg.model.vocab_size < BYTE_VOCAB_SIZE:  # tokens: kvlab.data
        fail(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"is below the {BYTE_VOCAB_SIZE} byte values data.source={cfg.data.source!r} "
            "feeds the model",
            f"set model.vocab_size >= {BYTE_VOCAB_SIZE}",
        )


def eval_seq_len(cfg: Mapping) -> int:
    """The evaluation window of a validated config: eval.seq_len, or train.seq_len when 0."""
    return cfg["eval"]["seq_len"] or cfg["train"]["seq_len"]


def validate_eval_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad field of the `eval` section: sizes, the
    window, the tasks' names. Turns the tuple fields given as lists (config.json)
    into tuples. Whether the tasks' samples fit their lengths, the model and the
    data section is kvlab.data.tasks.check_tasks' to say."""
    schema = frozen_schema().eval
    ev = cfg.eval
    check_known_fields("eval", ev, schema)
    check_known_fields("eval.task_params", ev.task_params, schema.task_params)
    check_choice("eval", ev, "split", EVAL_SPLITS)
    for name in ("batch_size", "num_batches", "chunk"):
        check_int("eval", ev, name)
    check_int("eval", ev, "seq_len", minimum=0)
    for name in schema.task_params:
        check_int("eval.task_params", ev.task_params, name)
    for name in ("tasks", "task_lengths", "depths"):
        if not isinstance(ev[name], (tuple, list)):
            fail(f"eval.{name}", ev[name], "is not a tuple", f"give a tuple, e.g. {schema[name]}")
    for task in ev.tasks:
        if not isinstance(task, str) or task not in EVAL_TASKS:
            listed = ", ".join(map(repr, EVAL_TASKS))
            fail("eval.tasks", tuple(ev.tasks), f"holds {task!r}, not a task", f"use {listed}")
    if len(set(ev.tasks)) != len(ev.tasks):
        fail("eval.tasks", tuple(ev.tasks), "names a task twice", "name each task once")
    for length in ev.task_lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            fail(
                "eval.task_lengths",
                tuple(ev.task_lengths),
                f"holds {length!r}",
                "give integer lengths >= 1, e.g. (256, 512, 1024)",
            )
    for depth in ev.depths:
        number = not isinstance(depth, bool) and isinstance(depth, (int, float))
        if not number or not 0 <= depth <= 1:  # NaN fails too
            fail(
                "eval.depths",
                tuple(ev.depths),
                f"holds {depth!r}, not a number in [0, 1]",
                "give depths from 0 (the start) to 1 (the end), e.g. (0.0, 0.5, 1.0)",
            )
    if not ev.depths and "needle" in ev.tasks:
        fail("eval.depths", (), "is empty but eval.tasks holds 'needle'", "give depths in [0, 1]")
    # One form for equal configs (config.json gives lists where Python gave tuples).
    for name in ("tasks", "task_lengths", "depths"):
        if not isinstance(ev[name], tuple):
            value = tuple(ev[name])
            with ev.unlocked():
                del ev[name]
                ev[name] = value
    window = eval_seq_len(cfg)
    if cfg.data.source == "mqar" and 4 * cfg.data.mqar.num_pairs > window + 1:
        fail(
            "eval.seq_len",
            ev.seq_len,
            f"gives windows of {window} tokens, but data.mqar.num_pairs={cfg.data.mqar.num_pairs} "
            f"needs {4 * cfg.data.mqar.num_pairs - 1}",
            f"set eval.seq_len >= {4 * cfg.data.mqar.num_pairs - 1} (or 0: train.seq_len)",
        )


def validate_mesh_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad field of the `mesh` section.

    What does not depend on the devices: sizes >= 1 or -1 (one at most), the
    rules, and that the sizes given split what they split evenly
    (`check_mesh_shape`). kvlab.sharding.mesh_shape checks the rest (the
    product against the device count) when a run builds its mesh.
    """
    schema = frozen_schema().mesh
    mesh = cfg.mesh
    check_known_fields("mesh", mesh, schema)
    for axis in MESH_AXES:
        size = mesh[axis]
        if size != -1:
            check_int("mesh", mesh, axis)
    rest = [axis for axis in MESH_AXES if mesh[axis] == -1]
    if len(rest) > 1:
        fail(
            f"mesh.{rest[1]}",
            -1,
            f"is the second -1 (mesh.{rest[0]}=-1 already takes the devices the others leave)",
            f"give mesh.{rest[1]} a size >= 1",
        )
    if not isinstance(mesh["distributed"], bool):
        fail("mesh.distributed", mesh["distributed"], "is not a bool", "set True or False")
    check_known_fields("mesh.rules", mesh["rules"], schema.rules)
    for name in schema.rules:
        mesh_axes(mesh["rules"], name)  # refuses a malformed rule
    check_mesh_shape(cfg, {axis: mesh[axis] for axis in MESH_AXES})


def mesh_axes(rules: Mapping, name: str) -> tuple[str, ...]:
    """The mesh axes rule `mesh.rules.<name>` splits a logical axis over, in order."""
    value = rules[name]
    if not isinstance(value, str):
        fail(
            f"mesh.rules.{name}",
            value,
            "is not a string",
            f"give mesh axes separated by commas from {', '.join(MESH_AXES)}, or '' (replicated)",
        )
    axes = tuple(axis.strip() for axis in value.split(",") if axis.strip())
    for axis in axes:
        if axis not in MESH_AXES:
            fail(
                f"mesh.rules.{name}",
                value,
                f"names {axis!r}, which is not a mesh axis",
                f"use mesh axes from {', '.join(MESH_AXES)} separated by commas, or ''",
            )
    if len(set(axes)) != len(axes):
        fail(f"mesh.rules.{name}", value, "names a mesh axis twice", "name each axis once")
    return axes


def check_mesh_shape(cfg: Mapping, shape: Mapping[str, int]) -> None:
    """Raises ValueError when the mesh sizes `shape` (-1: not known yet, skipped)
    do not split evenly what the rules split over them: the query heads, the
    feed-forward widths and the training batch. (Key/value heads, the
    vocabulary and the model width are replicated where they do not divide:
    kvlab/sharding.py.)"""
    rules = cfg["mesh"]["rules"]
    model = cfg["model"]
    widths = [("heads", "model.num_heads", model["num_heads"])]
    widths.append(("mlp", "model.mlp_dim", model["mlp_dim"]))
    if model["moe"]["num_experts"]:
        widths.append(("mlp", "model.moe.expert_dim", model["moe"]["expert_dim"]))
    widths.append(("batch", "train.batch_size", cfg["train"]["batch_size"]))
    for logical, field, value in widths:
        axes = mesh_axes(rules, logical)
        if not axes or any(shape[axis] == -1 for axis in axes):
            continue
        split = math.prod(shape[axis] for axis in axes)
        if value % split:
            divisors = [d for d in range(1, value + 1) if value % d == 0]
            fail(
                " * ".join(f"mesh.{axis}" for axis in axes),
                split,
                f"does not divide {field}={value}, which mesh.rules.{logical}="
                f"{rules[logical]!r} splits over "
                + ("it" if len(axes) == 1 else f"them ({', '.join(axes)})"),
                f"make it one of {divisors}, or change {field}",
            )


def _validate_mqar(cfg: ml_collections.ConfigDict) -> None:
    mqar = cfg.data.mqar
    check_int("data.mqar", mqar, "num_pairs")
    check_int("data.mqar", mqar, "vocab_size", minimum=4)
    check_number("data.mqar", mqar, "power")
    if mqar.vocab_size > cfg.model.vocab_size:
        fail(
            "data.mqar.vocab_size",
            mqar.vocab_size,
            f"exceeds model.vocab_size={cfg.model.vocab_size}",
            f"set data.mqar.vocab_size <= {cfg.model.vocab_size}",
        )
    keys = mqar.vocab_size // 2 - 1  # ids 1 .. V/2-1 are keys, V/2 .. V-1 values
    if mqar.num_pairs > keys:
        fail(
            "data.mqar.num_pairs",
            mqar.num_pairs,
            f"exceeds the {keys} distinct keys data.mqar.vocab_size={mqar.vocab_size} holds",
            f"set data.mqar.num_pairs <= {keys} or raise data.mqar.vocab_size",
        )
    needed = 4 * mqar.num_pairs  # the pairs, then every key and its value again
    if needed > cfg.train.seq_len + 1:
        fail(
            "data.mqar.num_pairs",
            mqar.num_pairs,
            f"needs {needed} tokens but train.seq_len={cfg.train.seq_len} holds "
            f"{cfg.train.seq_len + 1} per sequence",
            f"set data.mqar.num_pairs <= {(cfg.train.seq_len + 1) // 4} or raise train.seq_len",
        )
