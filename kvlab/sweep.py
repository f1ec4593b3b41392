"""Sweeps: perplexity against cache bytes per token over models x caches.

A sweep config file (configs/sweeps/*.py) has `get_config(arg)`, a full kvlab
config plus a `sweep` section (name; seeds, below), and `get_grid(cfg)`, which returns

    {"models": {name: {"model.num_kv_heads": 2, "train.steps": 500, ...}, ...},
     "caches": {name: {"cache.k_bits": 8, "cache.v_bits": 4, ...}, ...}}

Every key is a dotted config field ("sweep axis"). Model entries may change any
section; cache entries only `cache.*`, so every cache reuses the one checkpoint
trained per model. A model entry {"hf": DIR, ...} is a local Hugging Face
checkpoint evaluated as it is, without training: its model section and weights
come from DIR (kvlab.hf.config_from_hf), so its other axes may not name
`model.*` or `train.init_from`. A model entry {"gguf": FILE, ...} is a llama.cpp
GGUF file (kvlab.load_gguf, extra `real`), converted once into
workdir/converted/gguf/<file stem>/ (config.json, float32 model.safetensors and
its tokenizer.json, reused when present) and then evaluated as an hf entry.
Either may add {"convert": "gqa:N" | "mla:R[,rope=P][,select=S][,factor=F]"}: the
checkpoint's attention converted (kvlab.convert.convert, calibrated on the
sweep's training text) once into workdir/converted/<model>/, a kvlab run
holding it at step 0, evaluated as it is (no uptraining). A
cache entry applies to the models that cache the tensors it names (`k_*`/`v_*`
for grouped-query models, `latent_*`/`rope_*` for latent attention; an entry
naming neither applies to all). The grid's units are the applicable (model,
cache) pairs in model-major order.

The sweep section may add `seeds` (default 1): each trained model entry is
then trained that many times, with train.seed its own + 0, 1, ... (its data
order and initialisation), and its units repeat per seed (model-major, then
seed, then cache); every row carries its `seed`. Evaluation windows are
`eval_seq_len` tokens (eval.seq_len, 0: train.seq_len).

Each model's full cache (kvlab.eval.full_cache: 16 bits, every token kept) is
evaluated once, its logits kept (kvlab.eval.evaluate_reference), and every
cache of the model is scored against them as well as on the text: a row
carries kl_mean and kl_p99 (KL of the full cache's next-token distribution to
this cache's), top1_agreement and delta_ppl beside ppl and
delta_vs_16bit_pct; the full cache's own row reads exactly 0, 0, 1, 0.

A unit whose config sets eval.tasks is also scored on the long-context tasks
(kvlab.eval_tasks.evaluate_tasks through its cache, on the sweep's mesh): one
column per task and length, `task_<task>_<length>` (task_columns; the needle
task's accuracy averages eval.depths), after COLUMNS in the order of
eval.tasks and then eval.task_lengths; summary.csv gives their mean over
seeds. A unit without tasks leaves them empty, and a CSV without them (a
sweep without tasks, or one written before) reads and merges as before.

    run_sweep(cfg, grid, workdir, sweep_index=i, sweep_count=n)

runs slice i of n (a contiguous run of units, so most slices train one or two
models) on the mesh of the config's mesh section (kvlab.sharding.make_mesh:
training through train(), evaluation through evaluate(mesh=); on several
hosts a mesh spanning them, process 0 alone writing) and writes
workdir/slices/<i>-of-<n>.csv, printing a line per model's full cache and
per unit (model 2/5, cache 3/12, units done and the time left: time_left,
each model's training and full cache apart from each unit's evaluation);
`merge(workdir)` joins the slices, checks each unit appears exactly once, and
writes workdir/results.csv, workdir/summary.csv, workdir/pareto.png and a
wandb run holding them. With one slice, run_sweep merges by itself. Files are
replaced atomically (kvlab/files.py). The CSVs' cells are typed by their
column (read_csv): names stay text, so a cache named "16" or a model named
"nan" is a name; an empty name is refused (expand).

A unit is written to workdir/units/<u>.json as it finishes (u: its place in
sweep.json's units; its row, its per-window sums and its model's full
cache's, under its key), so a slice killed halfway loses only the unit it
was evaluating: a rerun skips the finished units (a model all of whose units
are done is neither trained nor evaluated, one with some done evaluates its
full cache and the rest) and writes the same slice, byte for byte. A rerun
reuses them whatever changed since: delete workdir/units/ (or one unit's
file) to recompute. A result whose loss or KL is not a finite number
(kvlab.eval.check_finite) stops the slice with an error naming the model and
cache; the units finished before it stay in units/.

summary.csv holds one row per (model, cache) over its seeds: the mean of the
metric (ppl or MQAR accuracy) with a 95% interval over seeds (every point is
scored on the same held-out windows, so it measures the spread between
trainings: zero width with one seed), and its difference to the same model's
full cache (delta, in the metric's units, and delta_pct) with a 95% interval
and whether that interval excludes 0 (significant). `bootstrap` resamples
the seeds and, for the difference, the evaluation windows within each
(kvlab.eval's per-window sums, saved in workdir/windows/), the cache and its
full cache on the same draws (paired); BOOTSTRAP_RESAMPLES draws from a
fixed numpy seed, so a merge always gives the same intervals. The full
cache's own delta is exactly 0 with a zero-width interval.

pareto.png plots summary.csv: each (model, cache) at its mean with its
interval as a bar (the title says what the bars are; with one seed there is
no interval over seeds), a colour per cache entry and a marker per model
entry (legends, no labels over the points), against the evaluation window's
bytes per token or (long_bytes, scripts/sweep.py --long_bytes) the bytes a
token adds to a long cache; points at equal bytes that would cover each
other (K8V4 and K4V8) are drawn side by side (`dodge`, noted in the x
label). The frontier it draws passes through the points no cheaper point
beats beyond both intervals (`interval_front`, on the true bytes). `replot`
redraws it from summary.csv. Working directory:

    workdir/sweep.json              the grid's units and the base config
    workdir/models/<model>/         one training run per model (kvlab/train.py)
    workdir/models/<model>/seed<s>/ ... one per model and seed, with sweep.seeds > 1
    workdir/converted/gguf/<stem>/  a gguf file as a Hugging Face folder (not trained)
    workdir/converted/<model>/      a convert entry's model, a kvlab run at step 0
    workdir/units/<u>.json          each finished unit (u: its place in sweep.json's units);
                                    a rerun skips them: delete the folder to recompute
    workdir/slices/<i>-of-<n>.csv   each slice's rows
    workdir/windows/<i>-of-<n>.json each slice's per-window sums (and its models' full caches')
    workdir/results.csv             all rows, grid order
    workdir/summary.csv             per (model, cache): mean and intervals over seeds
    workdir/pareto.png              the metric against cache bytes per token
    workdir/wandb/                  the sweep's wandb run (table and plot)
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import io
import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

import ml_collections
import numpy as np

from kvlab.cache import bits_label
from kvlab.config import (
    CACHED_PREFIXES,
    cached_prefixes,
    check_count,
    complete_config,
    eval_seq_len,
)
from kvlab.convert import convert, parse_target
from kvlab.data import make_dataset, validate_config
from kvlab.data.tasks import task_lengths
from kvlab.eval import check_finite, evaluate, evaluate_reference, full_cache, full_precision
from kvlab.eval_tasks import evaluate_tasks
from kvlab.files import read_json, store_json, write_atomic
from kvlab.gguf import load_gguf
from kvlab.hf import config_from_hf, save_hf
from kvlab.logging import Run
from kvlab.sharding import axis_rules, describe_mesh, is_primary, make_mesh
from kvlab.train import initial_params, load_run_config, start_workdir, train

# results.csv columns, in order. `bits` labels each cached tensor by the bits it
# is stored in (K8V4; K32V32 for an unquantized float32 cache); k_bits etc. are
# the config fields (16 = cache.dtype, whatever its width).
COLUMNS = (
    "sweep",
    "model",
    "family",
    "cache",
    "seed",
    "bits",
    "k_bits",
    "v_bits",
    "latent_bits",
    "rope_bits",
    "cache_dtype",
    "k_axis",
    "v_axis",
    "group_size",
    "residual",
    "evict_method",
    "evict_ratio",
    "evict_budget",
    "num_kv_heads",
    "kv_rank",
    "metric",
    "ppl",
    "bits_per_byte",
    "accuracy",
    "delta_vs_16bit_pct",
    "kl_mean",
    "kl_p99",
    "top1_agreement",
    "delta_ppl",
    "cache_bytes_per_token",
    "cache_bytes_per_token_measured",
    "cache_bytes_per_token_long",
    "eval_tokens",
    "train_steps",
)

# The CSVs' text and bool columns (results.csv's and summary.csv's); every
# other column, the task columns included, holds numbers. read_csv types a
# cell by its column, so a cache named "16" or a model named "nan" stays a name.
TEXT_COLUMNS = frozenset(
    ("sweep", "model", "family", "cache", "bits", "metric", "cache_dtype")
    + ("k_axis", "v_axis", "evict_method")
)
BOOL_COLUMNS = frozenset(("significant",))

# The columns `kvlab.eval.evaluate` reports; the sweep scores every cache
# against its model's full cache (kvlab.eval.full_cache), which scores exactly
# kl 0, agreement 1 and delta_ppl 0.
RESULT_COLUMNS = (
    "ppl",
    "bits_per_byte",
    "accuracy",
    "kl_mean",
    "kl_p99",
    "top1_agreement",
    "delta_ppl",
    "cache_bytes_per_token",
    "cache_bytes_per_token_measured",
    "cache_bytes_per_token_long",
)
# A unit's long-context task accuracies (eval.tasks) follow COLUMNS, one
# column per task and length: 'task_needle_256' (task_column).
TASK_PREFIX = "task_"
# summary.csv columns: per (model, cache), over its seeds (module docstring);
# then each task column of results.csv, its mean over the seeds.
SUMMARY_COLUMNS = (
    "sweep",
    "model",
    "family",
    "cache",
    "bits",
    "metric",
    "seeds",
    "windows",
    "cache_bytes_per_token",
    "cache_bytes_per_token_long",
    "mean",
    "ci_low",
    "ci_high",
    "delta",
    "delta_ci_low",
    "delta_ci_high",
    "delta_pct",
    "significant",
)
# The bootstrap of summary.csv: how many resamples, the numpy seed that draws
# them (the same draws on every merge) and the interval's coverage.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
# The plot: a marker per model entry (in grid order), a colour per cache entry.
MODEL_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">", "p")
BYTES_COLUMNS = {False: "cache_bytes_per_token", True: "cache_bytes_per_token_long"}
# Points at equal bytes that would cover each other are drawn side by side
# (dodge), DODGE of the x axis's decades apart: about a marker's width; a
# marker covers about MARKER_HEIGHT of the y axis on either side of its point.
DODGE = 0.015
MARKER_HEIGHT = 0.02
# The fields of a finished unit's record, workdir/units/<index>.json (evaluate_model).
RECORD = frozenset(("key", "row", "window", "reference"))


@dataclasses.dataclass(frozen=True)
class Unit:
    """One cell of the grid: a model entry (trained with one seed) evaluated
    under a cache entry. seed: None in a sweep of one seed (models/<model>/,
    units [model, cache]), else the model's train.seed (models/<model>/seed<s>/,
    units [model, seed, cache])."""

    model: str
    cache: str
    cfg: ml_collections.ConfigDict = dataclasses.field(compare=False, repr=False)
    hf: str = dataclasses.field(default="", compare=False)  # a checkpoint, not trained
    seed: int | None = None

    @property
    def key(self) -> tuple:
        """Its entry in sweep.json's units and its rows' key in the merge."""
        return (
            (self.model, self.cache) if self.seed is None else (self.model, self.seed, self.cache)
        )


# ---------------------------------------------------------------------------
# The grid


def split_sweep_config(cfg: ml_collections.ConfigDict) -> tuple:
    """(base kvlab config, sweep section) of a sweep config, completed in place
    (fields it omits take base_config()'s defaults; sweep.seeds 1). The sweep
    section may hold fields of the config file's own (read by its get_grid)."""
    if "sweep" not in cfg or "name" not in cfg.sweep:
        raise ValueError(
            "the sweep config has no sweep.name: add cfg.sweep = ConfigDict(dict(name=...)) "
            "in get_config (see configs/sweeps/cache_pareto.py)"
        )
    if not isinstance(cfg.sweep.name, str) or not cfg.sweep.name:
        raise ValueError(
            f"sweep.name={cfg.sweep.name!r} must be non-empty text: it names the sweep's rows "
            "and wandb runs, e.g. cfg.sweep.name = 'cache_pareto'"
        )
    with cfg.unlocked():  # a config from --config flags comes locked
        cfg.sweep.seeds = check_count("sweep.seeds", cfg.sweep.get("seeds", 1))
    complete_config(cfg)
    base = ml_collections.ConfigDict({k: v for k, v in cfg.items() if k != "sweep"})
    return validate_config(base), cfg.sweep


def _apply(cfg: ml_collections.ConfigDict, where: str, overrides: Mapping) -> None:
    for axis, value in overrides.items():
        *path, field = axis.split(".")
        section = cfg
        for part in path:
            section = section.get(part) if isinstance(section, ml_collections.ConfigDict) else None
        if not path or not isinstance(section, ml_collections.ConfigDict) or field not in section:
            raise ValueError(
                f"sweep axis {axis!r} in {where} is not a config field: name one as "
                f"'section.field', e.g. 'model.num_kv_heads' or 'cache.k_bits'"
            )
        section[field] = value


def _check_name(where: str, name: object) -> None:
    """An entry's name is non-empty text: it is a text cell of every CSV (where
    an empty cell reads as None) and a key of sweep.json's units."""
    if not isinstance(name, str) or not name:
        shown = str(name) if name != "" else "base"
        raise ValueError(
            f"{where}: an entry's name must be non-empty text (it names results.csv's rows "
            f"and sweep.json's units): name it {shown!r}"
        )


def _tensors_named(overrides: Mapping) -> set:
    fields = {axis.split(".", 1)[1] for axis in overrides}
    return {field.split("_", 1)[0] for field in fields} & set(CACHED_PREFIXES)


def convert_gguf(file: str, folder: str) -> str:
    """`folder` as a Hugging Face checkpoint of the GGUF file (kvlab.load_gguf then
    kvlab.save_hf, float32) with its tokenizer.json and eos in tokenizer_config.json;
    written once: a folder whose source.json names the same file (size, mtime) is reused."""
    file = os.path.abspath(file)
    if not os.path.isfile(file):
        raise ValueError(f"gguf={file!r} is not a file: a gguf model entry names a .gguf file")
    info = os.stat(file)
    source = {"gguf": file, "size": info.st_size, "mtime_ns": info.st_mtime_ns}
    marker = os.path.join(folder, "source.json")
    if os.path.isfile(marker) and read_json(marker) == source:
        return folder
    cfg, params, tokenizer = load_gguf(file)
    save_hf(cfg, params, folder, tokenizer=tokenizer)
    write_atomic(marker, json.dumps(source) + "\n")  # last: the folder is complete
    return folder


def convert_checkpoint(cfg: ml_collections.ConfigDict, target: str, folder: str) -> str:
    """`folder` as a kvlab run holding the checkpoint `cfg` starts from
    (train.init_from) converted as `target` says (kvlab.convert.convert), at
    step 0; written once: a folder whose source.json names the same source,
    target and calibration text is reused, another one replaced."""
    source = {
        "source": os.path.abspath(cfg.train.init_from),
        "convert": target,
        "calibration": {"data": json.loads(cfg.data.to_json()), "seq_len": cfg.train.seq_len},
    }
    marker = os.path.join(folder, "source.json")
    if os.path.isfile(marker) and read_json(marker) == source:
        return folder
    parse_target(target)  # a bad target is refused before anything loads
    if os.path.isdir(folder):
        shutil.rmtree(folder)  # an earlier conversion, or one cut short
    converted, params = convert(cfg, initial_params(cfg), target)
    start_workdir(converted, params, folder)
    write_atomic(marker, json.dumps(source) + "\n")  # last: the run is complete
    return folder


def expand(
    cfg: ml_collections.ConfigDict, grid: Mapping, workdir: str | None = None, seeds: int = 1
) -> list[Unit]:
    """The grid's units with their full, validated configs (before anything runs).
    gguf model entries are converted into `workdir` (required when there are any).

    With `seeds` > 1 each trained model entry is trained `seeds` times, with
    train.seed its own train.seed + 0, 1, ...: its units repeat per seed
    (model-major, then seed, then cache) and carry the seed; a checkpoint entry
    (hf, gguf, convert: nothing random) stays one set of units."""
    seeds = check_count("sweep.seeds", seeds)
    unknown = set(grid) - {"models", "caches"}
    if unknown or not grid.get("models") or not grid.get("caches"):
        raise ValueError(
            f"the grid has keys {sorted(grid)}: get_grid must return a dict with non-empty "
            "'models' and 'caches' entries (and nothing else)"
        )
    units = []
    for model_name, model_overrides in grid["models"].items():
        model_cfg = ml_collections.ConfigDict(cfg.to_dict())
        model_overrides = dict(model_overrides)
        hf = model_overrides.pop("hf", "")
        gguf = model_overrides.pop("gguf", "")
        target = model_overrides.pop("convert", "")
        entry = f"models[{model_name!r}]"
        _check_name(entry, model_name)
        if os.sep in model_name or model_name in (".", ".."):
            suggestion = model_name.replace(os.sep, "-").strip(".") or "base"
            raise ValueError(
                f"{entry}: a model's name names its folders (models/<model>, converted/<model>): "
                f"use one without {os.sep!r}, e.g. {suggestion!r}"
            )
        if (gguf or target) and workdir is None:
            raise ValueError(
                f"{entry} is converted (gguf or convert): expand(cfg, grid, workdir) "
                "converts it into workdir/converted/; pass the sweep's workdir"
            )
        if gguf:
            if hf:
                raise ValueError(f"{entry} names both hf and gguf: keep one checkpoint")
            stem = os.path.splitext(os.path.basename(gguf))[0]
            hf = convert_gguf(gguf, os.path.join(workdir, "converted", "gguf", stem))
        if target and model_name == "gguf":
            raise ValueError(
                f"{entry} converts into workdir/converted/<model>, where converted/gguf holds "
                "the gguf files: rename the model"
            )
        if target and not hf:
            raise ValueError(
                f"{entry} has convert={target!r} but no checkpoint: add hf or gguf (a trained "
                "model is converted and uptrained by experiments/uptrain.py)"
            )
        if hf:
            fixed = [a for a in model_overrides if a.startswith("model.") or a == "train.init_from"]
            if fixed:
                raise ValueError(
                    f"sweep axis {fixed[0]!r} in {entry} is decided by its "
                    f"checkpoint hf={hf!r}: drop it (or convert the checkpoint, scripts/convert.py)"
                )
            model_cfg = config_from_hf(model_cfg, hf)
        if target:
            folder = os.path.join(workdir, "converted", model_name)
            hf = convert_checkpoint(model_cfg, target, folder)
            model_cfg.model = load_run_config(hf).model
            model_cfg.train.init_from = hf
        _apply(model_cfg, entry, model_overrides)
        validate_config(model_cfg)
        cached = set(cached_prefixes(model_cfg.model))
        trained = [model_cfg]
        if not hf and seeds > 1:
            trained = []
            for k in range(seeds):
                seeded = ml_collections.ConfigDict(model_cfg.to_dict())
                seeded.train.seed = model_cfg.train.seed + k
                try:
                    trained.append(validate_config(seeded))
                except ValueError as error:
                    raise ValueError(
                        f"{entry}, seed {k + 1} of sweep.seeds={seeds}: {error}"
                    ) from None
        for seeded in trained:
            seed = seeded.train.seed if seeds > 1 else None
            units += _cache_units(grid, model_name, seeded, cached, hf, seed)
    return units


def _cache_units(grid, model_name, model_cfg, cached, hf, seed) -> list[Unit]:
    """The units of one model entry (with one seed): the cache entries that apply."""
    units = []
    for cache_name, cache_overrides in grid["caches"].items():
        where = f"caches[{cache_name!r}]"
        _check_name(where, cache_name)
        outside = [axis for axis in cache_overrides if not axis.startswith("cache.")]
        if outside:
            raise ValueError(
                f"sweep axis {outside[0]!r} in {where} is not a cache field: cache entries "
                "reuse each model's checkpoint, so they may only change cache.* "
                "(put it in a models entry)"
            )
        named = _tensors_named(cache_overrides)
        if named and not named <= cached:
            continue  # this entry stores tensors the model does not cache
        unit_cfg = ml_collections.ConfigDict(model_cfg.to_dict())
        _apply(unit_cfg, where, cache_overrides)
        try:
            validate_config(unit_cfg)
        except ValueError as error:
            raise ValueError(f"{where} on models[{model_name!r}]: {error}") from None
        units.append(Unit(model_name, cache_name, unit_cfg, hf, seed))
    return units


def slice_range(total: int, index: int, count: int) -> range:
    """The places, among the grid's `total` units, of slice `index` of `count`:
    contiguous, sizes differing by at most one."""
    count = check_count("--sweep_count", count)
    index = check_count("--sweep_index", index, minimum=0)
    if index >= count:
        raise ValueError(
            f"--sweep_index={index!r} must be in [0, {count - 1}] for --sweep_count={count}"
        )
    return range(index * total // count, (index + 1) * total // count)


def slice_units(units: list[Unit], index: int, count: int) -> list[Unit]:
    """Slice `index` of `count` (slice_range): contiguous, sizes differing by at most one."""
    span = slice_range(len(units), index, count)
    return units[span.start : span.stop]


# ---------------------------------------------------------------------------
# Running


def family(model_cfg: Mapping) -> str:
    if model_cfg.attention == "mla":
        return "mla"
    if model_cfg.num_kv_heads == model_cfg.num_heads:
        return "mha"
    return "mqa" if model_cfg.num_kv_heads == 1 else "gqa"


def _row(sweep_name: str, unit: Unit, result: Mapping, baseline: Mapping, metric: str) -> dict:
    cfg = unit.cfg
    cached = cached_prefixes(cfg.model)
    row = {
        "sweep": sweep_name,
        "model": unit.model,
        "family": family(cfg.model),
        "cache": unit.cache,
        "seed": cfg.train.seed,
        "bits": bits_label(cfg.model, cfg.cache),
        "cache_dtype": cfg.cache.dtype,
        "group_size": cfg.cache.group_size,
        "residual": cfg.cache.residual,
        "evict_method": cfg.cache.evict.method,
        "evict_ratio": cfg.cache.evict.ratio,
        "evict_budget": cfg.cache.evict.budget,
        "num_kv_heads": cfg.model.num_kv_heads,
        "kv_rank": cfg.model.mla.kv_rank if cfg.model.attention == "mla" else None,
        "metric": metric,
        "train_steps": 0 if unit.hf else cfg.train.steps,
        "eval_tokens": result["targets"],
    }
    for prefix in ("k", "v", "latent", "rope"):
        row[f"{prefix}_bits"] = cfg.cache[f"{prefix}_bits"] if prefix in cached else None
    for prefix in ("k", "v"):
        row[f"{prefix}_axis"] = cfg.cache[f"{prefix}_axis"] if prefix in cached else None
    row.update({key: result[key] for key in RESULT_COLUMNS})
    # None when the baseline scores 0 (an MQAR model that recalls nothing)
    change = result[metric] / baseline[metric] - 1 if baseline[metric] else None
    row["delta_vs_16bit_pct"] = None if change is None else 100 * change
    return row


def task_column(task: str, seq_len: int) -> str:
    """results.csv's column of a task's accuracy at a length: 'task_needle_256'."""
    return f"{TASK_PREFIX}{task}_{seq_len}"


def task_columns(rows: list[Mapping]) -> tuple:
    """The task columns the rows hold (keys starting with TASK_PREFIX), in the
    order they first appear: each unit's eval.tasks, then eval.task_lengths."""
    found = (key for row in rows for key in row if key.startswith(TASK_PREFIX))
    return tuple(dict.fromkeys(found))


def _task_results(unit: Unit, params, on_mesh: Mapping) -> dict:
    """{task_column: accuracy} of the unit's eval.tasks through its cache ({} without)."""
    cfg = unit.cfg
    if not cfg.eval.tasks:
        return {}
    rows = evaluate_tasks(cfg, cfg.cache, params, cfg.eval.tasks, task_lengths(cfg), **on_mesh)
    return {task_column(r["task"], r["seq_len"]): r["accuracy"] for r in rows}


def write_csv(path: str, rows: list[dict], columns: tuple = COLUMNS) -> None:
    """`rows` as a CSV of `columns` then their task columns (task_columns), written
    atomically (read_csv reads it back)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=(*columns, *task_columns(rows)))
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, text.getvalue())


def read_csv(path: str, columns: tuple = COLUMNS) -> list[dict]:
    """The rows of a slice's or the merged results' CSV (or summary.csv, with
    SUMMARY_COLUMNS), each cell typed by its column: TEXT_COLUMNS as text,
    BOOL_COLUMNS as True/False, every other column as the int or float it
    spells (ValueError naming the cell when it spells none); an empty cell is
    None. A column it lacks (a file written before the column joined
    `columns`) is None, and columns beyond `columns` (the task columns) are kept."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [
        {**dict.fromkeys(columns), **{k: _cell(path, n, k, v) for k, v in r.items()}}
        for n, r in enumerate(rows, start=1)
    ]


def _cell(path: str, row: int, column: str, text: str):
    """A CSV cell as its column's type (read_csv); None when empty."""
    if text == "":
        return None
    if column in TEXT_COLUMNS:
        return text
    if column in BOOL_COLUMNS and text in ("True", "False"):
        return text == "True"
    if column not in BOOL_COLUMNS:
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
    kind = "True or False" if column in BOOL_COLUMNS else "a number"
    raise ValueError(
        f"{path}, row {row}, column {column!r}: {text!r} is not {kind}, which the column "
        "holds: the file was changed by hand or by another program; restore it or rerun "
        "the slice that wrote it"
    )


def model_dir(workdir: str, unit: Unit) -> str:
    """Where the unit's model trains: workdir/models/<model>, or .../seed<s> in a
    sweep of several seeds."""
    folder = os.path.join(workdir, "models", unit.model)
    return folder if unit.seed is None else os.path.join(folder, f"seed{unit.seed}")


def _model_params(unit: Unit, workdir: str, group: str, progress: bool):
    """Trains (or resumes, or reuses) the unit's model in model_dir(workdir, unit);
    a checkpoint's (unit.hf) weights are read as they are."""
    if unit.hf:
        return initial_params(unit.cfg)
    cfg = ml_collections.ConfigDict(unit.cfg.to_dict())
    cfg.cache = full_precision(cfg.cache)  # training never reads a cache
    name = unit.model if unit.seed is None else f"{unit.model}-seed{unit.seed}"
    state, _ = train(cfg, model_dir(workdir, unit), name=name, group=group, progress=progress)
    return state.params


def _write_plan(workdir: str, sweep_cfg: ml_collections.ConfigDict, units: list[Unit]) -> None:
    """Records the grid in workdir/sweep.json; refuses a workdir of another sweep."""
    plan = {
        "units": [list(u.key) for u in units],
        "config": json.loads(sweep_cfg.to_json()),
    }

    def completed(stored: dict) -> dict:  # a plan written before a field joined the schema
        config = complete_config(ml_collections.ConfigDict(stored.get("config", {})))
        if "sweep" in config and "seeds" not in config.sweep:
            config.sweep.seeds = 1  # written before sweeps had seeds
        return {**stored, "config": json.loads(config.to_json())}

    path = os.path.join(workdir, "sweep.json")
    store_json(
        path,
        plan,
        fixed=("units", "config"),
        owner="a sweep",
        normalize=completed,
        write=is_primary(),  # the other hosts of a multi-host run only check it
    )


def _duration(seconds: float) -> str:
    """'42s', '3m05s' or '2h07m'."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def time_left(
    model_seconds: Sequence[float],
    unit_seconds: Sequence[float],
    models_left: int,
    units_left: int,
    reference_seconds: Sequence[float] = (),
) -> float | None:
    """The seconds a slice has left (its progress lines' eta), from what it has
    measured so far: the mean fixed cost of a model x `models_left` (models not
    started that have units to evaluate) + the mean time of a unit x
    `units_left` (units still to evaluate through a cache of their own).

    model_seconds: each started model's fixed cost (training or loading, its
    full cache's evaluation, and its units whose cache is that full cache, as
    they reuse its result); unit_seconds: each evaluated unit's own time (its
    cache's evaluation and its tasks). Units finished by an earlier run count
    in neither. Until a unit is measured one is taken to cost what a full
    cache's evaluation did (reference_seconds: the same windows through the
    same model). None when something left has nothing to go by."""

    def mean(values: Sequence[float]) -> float | None:
        return sum(values) / len(values) if len(values) else None

    per_model = mean(model_seconds)
    per_unit = mean(unit_seconds) if len(unit_seconds) else mean(reference_seconds)
    if (models_left and per_model is None) or (units_left and per_unit is None):
        return None
    return models_left * (per_model or 0.0) + units_left * (per_unit or 0.0)


def _reuses_reference(unit: Unit, first: Unit) -> bool:
    """Whether the unit's cache is its model's full cache (full_cache of the
    first unit of the model in the slice), so its result is the reference's."""
    return unit.cfg.cache.to_dict() == full_cache(first.cfg.cache).to_dict()


def _named(unit: Unit) -> str:
    """'model 'gqa'' or 'model 'gqa' (seed 1)': which trained model, in errors."""
    return f"model {unit.model!r}" + ("" if unit.seed is None else f" (seed {unit.seed})")


def _measured(row: Mapping) -> str:
    """A row's numbers in its progress line: 'ppl=5.1234 kl=0.0012 bytes/token=96.0'
    and its tasks' accuracies."""
    metric = row["metric"]
    tasks = (
        f" {k[len(TASK_PREFIX) :]}={v:.4f}" for k, v in row.items() if k.startswith(TASK_PREFIX)
    )
    return (
        f"{metric}={row[metric]:.4f} kl={row['kl_mean']:.4f} "
        f"bytes/token={row['cache_bytes_per_token']:.1f}" + "".join(tasks)
    )


def _stored(value: dict) -> dict:
    """`value` as JSON reads it back: what a rerun finds in workdir/units/, so
    a resumed slice writes the same bytes as an uninterrupted one."""
    return json.loads(json.dumps(value))


def evaluate_model(
    sweep_name: str,
    units: Sequence[tuple[int, Unit]],
    params,
    skip: Collection[int] = (),
) -> Iterator[tuple[int | None, dict]]:
    """Evaluates one model's units of a slice with `params`, yielding each
    result as it completes.

    units: (its place in sweep.json's units, the unit) for the units of one
    model entry and seed, in grid order; the first decides the evaluation
    windows, the mesh and the full cache. Yields first (None, the full cache's
    windows record), evaluated once (evaluate_reference), then (index, record)
    for each unit whose index is not in `skip`. A record is what
    workdir/units/<index>.json holds, as JSON reads it back: {"key": the unit's
    key, "row": its results.csv row, "window": its windows record,
    "reference": the full cache's}. A result whose loss or KL is not finite
    (kvlab.eval.check_finite) raises ValueError naming the model and the cache
    before anything of it is yielded."""
    first = units[0][1]
    cfg = first.cfg
    data = make_dataset(cfg.data, cfg.eval.split, eval_seq_len(cfg))
    batches = data.eval_batches(cfg.eval.batch_size, cfg.eval.num_batches)
    mesh = make_mesh(cfg)  # a model entry may change the mesh or the heads it splits
    on_mesh = dict(chunk=cfg.eval.chunk, mesh=mesh, rules=axis_rules(cfg.mesh))
    # once per model: its logits are what every cache's KL is measured against
    reference = evaluate_reference(
        cfg.model, full_cache(cfg.cache), params, batches, **on_mesh, windows=True
    )
    baseline = check_finite(reference.result, f"{_named(first)}, its full cache")
    full = _stored(_windows_record(first.model, cfg.train.seed, None, baseline))
    yield None, full
    for index, unit in units:
        if index in skip:
            continue
        if _reuses_reference(unit, first):
            result = baseline  # the full-precision entry: already evaluated
        else:
            result = evaluate(
                unit.cfg.model,
                unit.cfg.cache,
                params,
                batches,
                **on_mesh,
                reference=reference,
                windows=True,
            )
            check_finite(result, f"{_named(unit)}, cache {unit.cache!r}")
        tasks = _task_results(unit, params, on_mesh)
        record = {
            "key": list(unit.key),
            "row": {**_row(sweep_name, unit, result, baseline, data.metric), **tasks},
            "window": _windows_record(unit.model, cfg.train.seed, unit.cache, result),
            "reference": full,
        }
        yield index, _stored(record)


def read_units(workdir: str, units: Sequence[Unit], indices: Iterable[int]) -> dict[int, dict]:
    """{index: record} of the units among `indices` (places in sweep.json's
    units) that an earlier run finished: workdir/units/<index>.json, records
    of evaluate_model. A file holding another unit (a folder of another grid)
    is refused."""
    finished = {}
    for index in indices:
        path = os.path.join(workdir, "units", f"{index}.json")
        if not os.path.isfile(path):
            continue
        record = read_json(path)
        key = list(units[index].key)
        if not isinstance(record, dict) or record.get("key") != key or set(record) != RECORD:
            held = record.get("key") if isinstance(record, dict) else record
            raise ValueError(
                f"{path} holds unit {held!r}, but unit {index} of sweep.json is {key!r}: "
                "it was written for another grid; delete workdir/units/ (its units are then "
                "evaluated again)"
            )
        finished[index] = record
    return finished


def _save_unit(workdir: str, index: int, record: dict) -> None:
    folder = os.path.join(workdir, "units")
    os.makedirs(folder, exist_ok=True)
    write_atomic(os.path.join(folder, f"{index}.json"), json.dumps(record) + "\n")


def run_sweep(
    sweep_cfg: ml_collections.ConfigDict,
    grid: Mapping,
    workdir: str,
    *,
    sweep_index: int = 0,
    sweep_count: int = 1,
    progress: bool = True,
    long_bytes: bool = False,
) -> list[dict]:
    """Runs one slice of the sweep; returns its rows (and merges when it is the only one).

    Each unit's record is written to workdir/units/ as it completes, and a
    rerun skips the units found there (read_units): a model all of whose
    units are done is neither trained nor evaluated, one with some done
    evaluates its full cache and the rest. On several hosts
    (kvlab.sharding.initialize_distributed) every process reads units/, runs
    the slice together, on meshes spanning them, and returns the same rows;
    process 0 alone prints and writes sweep.json, units/, the slice and the
    merge. long_bytes: the merge's plot puts cache_bytes_per_token_long on x."""
    cfg, sweep = split_sweep_config(sweep_cfg)
    units = expand(cfg, grid, workdir, seeds=sweep.seeds)
    span = slice_range(len(units), sweep_index, sweep_count)
    primary = is_primary()
    if primary:
        os.makedirs(workdir, exist_ok=True)
    _write_plan(workdir, sweep_cfg, units)
    name = f"{sweep_index}-of-{sweep_count}"
    show = progress and primary

    mine = [(index, units[index]) for index in span]
    finished = read_units(workdir, units, span)
    by_model = [list(g) for _, g in itertools.groupby(mine, lambda pair: pair[1].key[:-1])]
    if show and finished:
        print(
            f"slice {name}: {len(finished)} of {len(mine)} units finished before "
            f"({os.path.join(workdir, 'units')}, delete it to recompute them), skipped",
            flush=True,
        )
    # What is left, for the eta (time_left): models to start, units to evaluate.
    models_left = sum(any(i not in finished for i, _ in model) for model in by_model)
    units_left = sum(
        i not in finished and not _reuses_reference(unit, model[0][1])
        for model in by_model
        for i, unit in model
    )
    spent = {"model": [], "unit": [], "reference": []}
    records, references, meshes = dict(finished), [], set()
    for model_index, model in enumerate(by_model, start=1):
        first = model[0][1]
        if all(i in finished for i, _ in model):
            references.append(finished[model[0][0]]["reference"])
            continue
        entry = first.model if first.seed is None else f"{first.model} seed {first.seed}"
        shown = f"model {model_index}/{len(by_model)} ({entry})"
        started = time.perf_counter()
        mesh = make_mesh(first.cfg)  # as evaluate_model makes it; said once per mesh
        if show and mesh.size > 1 and describe_mesh(mesh) not in meshes:
            print(f"{shown} runs on the {describe_mesh(mesh)}", flush=True)
            meshes.add(describe_mesh(mesh))
        params = _model_params(first, workdir, sweep.name, progress)
        models_left -= 1
        loaded = last = time.perf_counter()
        for index, record in evaluate_model(sweep.name, model, params, skip=finished):
            if index is None:  # the full cache: the model's fixed cost so far
                references.append(record)
                now = time.perf_counter()
                spent["reference"].append(now - loaded)
                spent["model"].append(now - started)
                line = (
                    f"full cache of {shown}: {_duration(now - started)} to train or load "
                    "the model and evaluate it"
                )
            else:
                if primary:
                    _save_unit(workdir, index, record)
                records[index] = record
                now = time.perf_counter()
                unit, row = units[index], record["row"]
                if _reuses_reference(unit, first):  # its result is the full cache's
                    spent["model"][-1] += now - last
                else:
                    spent["unit"].append(now - last)
                    units_left -= 1
                line = (
                    f"{shown}, cache {index - model[0][0] + 1}/{len(model)} ({unit.cache}): "
                    f"{_measured(row)}; {len(records)}/{len(mine)} units"
                )
            last = now
            if show:
                left = time_left(
                    spent["model"], spent["unit"], models_left, units_left, spent["reference"]
                )
                print(f"{line}, eta {'?' if left is None else _duration(left)}", flush=True)
    rows = [records[index]["row"] for index, _ in mine]
    if primary:
        windows = []
        for model, reference in zip(by_model, references, strict=True):
            windows += [reference, *(records[index]["window"] for index, _ in model)]
        # the windows first: a slice whose CSV is there is complete
        text = json.dumps({"windows": windows}) + "\n"
        os.makedirs(os.path.join(workdir, "windows"), exist_ok=True)
        write_atomic(os.path.join(workdir, "windows", f"{name}.json"), text)
        write_csv(os.path.join(workdir, "slices", f"{name}.csv"), rows)
        if sweep_count == 1:
            merge(workdir, long_bytes=long_bytes)
    return rows


def _windows_record(model: str, seed: int, cache: str | None, result: Mapping) -> dict:
    """One entry of workdir/windows/<slice>.json: a unit's per-window sums
    (kvlab.eval's `windows`) as lists; cache None: the model's full cache."""
    keys = ("nll", "correct", "weight")
    return {
        "model": model,
        "seed": seed,
        "cache": cache,
        **{k: [w[k] for w in result["windows"]] for k in keys},
    }


# ---------------------------------------------------------------------------
# Merging, the table and the plot


def merge(workdir: str, long_bytes: bool = False) -> list[dict]:
    """Joins workdir/slices/*.csv into results.csv, summary.csv and pareto.png
    and logs them to wandb; returns results.csv's rows.

    Every unit of the grid must appear in exactly one slice. A slice written
    before rows carried their seed reads the seed its model trained with
    (models/<model>/config.json, else the sweep's train.seed); a unit without
    per-window sums (workdir/windows/, written since) has a mean and no
    interval in summary.csv. long_bytes: the plot's x is
    cache_bytes_per_token_long. On several hosts each reads the slices (a
    shared directory) and process 0 alone writes.
    """
    path = os.path.join(workdir, "sweep.json")
    if not os.path.isfile(path):
        raise ValueError(f"workdir={workdir!r} has no sweep.json: run a sweep slice there first")
    plan = read_json(path)
    sweep_cfg = ml_collections.ConfigDict(plan["config"])
    cfg, sweep = split_sweep_config(sweep_cfg)
    units = [tuple(u) for u in plan["units"]]
    found: dict[tuple, list] = {}
    for slice_path in sorted(glob.glob(os.path.join(workdir, "slices", "*.csv"))):
        for row in read_csv(slice_path):
            if row["seed"] is None:  # a slice of a one-seed sweep written before seeds
                row["seed"] = _trained_seed(workdir, row["model"], cfg.train.seed)
            key = (row["model"], row["cache"]) if len(units[0]) == 2 else _key(row)
            found.setdefault(key, []).append((slice_path, row))
    twice = {unit: [p for p, _ in hits] for unit, hits in found.items() if len(hits) > 1}
    if twice:
        unit, paths = next(iter(twice.items()))
        raise ValueError(
            f"unit {unit} appears in {len(paths)} slices ({', '.join(paths)}): remove the slices "
            "of other --sweep_count runs from workdir/slices"
        )
    missing = [u for u in units if u not in found]
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(units)} units have no results yet (first: {missing[0]}): "
            "run the remaining --sweep_index slices before merging"
        )
    rows = [found[u][0][1] for u in units]
    if not is_primary():
        return rows
    summary = summarize(rows, read_windows(workdir))
    write_csv(os.path.join(workdir, "results.csv"), rows)
    write_csv(os.path.join(workdir, "summary.csv"), summary, SUMMARY_COLUMNS)
    plot = os.path.join(workdir, "pareto.png")
    pareto_plot(summary, plot, title=sweep.name, long_bytes=long_bytes)
    with Run(
        cfg.wandb,
        name=f"{sweep.name}-results",
        config=sweep_cfg.to_dict(),
        workdir=workdir,
        job_type="sweep",
        group=sweep.name,
    ) as run:
        for name, table_rows, fixed in (
            ("results", rows, COLUMNS),
            ("summary", summary, SUMMARY_COLUMNS),
        ):
            columns = (*fixed, *task_columns(table_rows))
            cells = [[r.get(c) for c in columns] for r in table_rows]
            run.table(name, columns=list(columns), rows=cells)
        run.image("pareto", plot)
    return rows


def replot(workdir: str, long_bytes: bool = False) -> str:
    """Redraws workdir/pareto.png from its summary.csv (no merge, no wandb run);
    returns the plot's path."""
    path = os.path.join(workdir, "summary.csv")
    if not os.path.isfile(path):
        raise ValueError(
            f"workdir={workdir!r} has no summary.csv to replot: merge the sweep first (--merge)"
        )
    summary = read_csv(path, SUMMARY_COLUMNS)
    if not summary:
        raise ValueError(f"{path} has no rows: merge the sweep again (--merge)")
    plot = os.path.join(workdir, "pareto.png")
    pareto_plot(summary, plot, title=summary[0]["sweep"], long_bytes=long_bytes)
    return plot


def _key(row: Mapping) -> tuple:
    return (row["model"], row["seed"], row["cache"])


def _trained_seed(workdir: str, model: str, default: int) -> int:
    config = os.path.join(workdir, "models", model, "config.json")
    return read_json(config)["train"]["seed"] if os.path.isfile(config) else default


def read_windows(workdir: str) -> dict:
    """{(model, seed, cache): {"nll", "correct", "weight": float64[W]}} from
    workdir/windows/*.json; cache None is the model's full cache."""
    windows = {}
    for path in sorted(glob.glob(os.path.join(workdir, "windows", "*.json"))):
        for record in read_json(path)["windows"]:
            sums = {k: np.asarray(record[k], np.float64) for k in ("nll", "correct", "weight")}
            windows.setdefault(_key(record), sums)  # a model split over slices: equal twice
    return windows


def metric_of(metric: str, sums: Mapping) -> np.ndarray:
    """The metric of summed nll/correct/weight (arrays): ppl = exp(nll / weight),
    accuracy = correct / weight (weights below 1 count as 1, as summarize does)."""
    weight = np.maximum(sums["weight"], 1.0)
    if metric == "ppl":
        return np.exp(sums["nll"] / weight)
    if metric == "accuracy":
        return sums["correct"] / weight
    raise ValueError(f"metric={metric!r} has no bootstrap: the summary knows ppl and accuracy")


def bootstrap(
    metric: str,
    sums: Mapping,
    baseline: Mapping | None = None,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> dict:
    """Mean over seeds of the metric with its CONFIDENCE interval over seeds,
    and the difference against `baseline` with its interval by a paired
    hierarchical bootstrap over seeds and windows.

    sums: {"nll", "correct", "weight"}: float[S, W], per seed (trained model)
    and evaluation window; baseline: the same model's full cache, the same
    shape (the same seeds and windows). The estimate is the mean over the S
    seeds of each seed's metric over its W windows (metric_of their sums);
    delta the mean over seeds of (metric - baseline's metric). Each of
    `resamples` draws S seeds with replacement and, within each drawn seed, W
    windows with replacement. The mean's draw averages the drawn seeds'
    metrics over all their windows: every point of a sweep is scored on the
    same held-out windows, so its interval is the spread between trainings
    (zero width with one seed). The delta's draw averages, over the drawn
    seeds, the cache's metric minus its baseline's on the drawn windows
    (paired: the same seeds and windows for both). Intervals are the draws'
    (1 - CONFIDENCE)/2 and (1 + CONFIDENCE)/2 percentiles. The draws come
    from numpy's default_rng(seed): the same shapes always draw the same
    resamples. Equal cache and baseline sums give a delta of exactly 0 with
    a zero-width interval, and seeds that agree a zero-width mean interval.

    Returns mean, ci_low, ci_high, and with a baseline: baseline (its mean),
    delta, delta_ci_low, delta_ci_high."""
    keys = ("nll", "correct", "weight")
    arrays = {k: np.asarray(sums[k], np.float64) for k in keys}
    shape = arrays["weight"].shape
    paired = {} if baseline is None else {k: np.asarray(baseline[k], np.float64) for k in keys}
    if (
        len(shape) != 2
        or 0 in shape
        or any(a.shape != shape for a in (*arrays.values(), *paired.values()))
    ):
        raise ValueError(
            f"bootstrap takes sums of shape [seeds, windows], the baseline's the same: got "
            f"{ {k: a.shape for k, a in arrays.items()} } and "
            f"{ {k: a.shape for k, a in paired.items()} }"
        )
    num_seeds, num_windows = shape

    def whole(values) -> np.ndarray:  # [S]: each seed's metric over all its windows
        return metric_of(metric, {k: v.sum(-1) for k, v in values.items()})

    def drawn(values, seed_draws, window_draws) -> np.ndarray:  # [n, S]
        picked = {k: v[seed_draws[..., None], window_draws].sum(-1) for k, v in values.items()}
        return metric_of(metric, picked)

    per_seed = whole(arrays)
    estimate = per_seed.mean()
    if baseline is not None:
        reference = whole(paired).mean()
        delta = (per_seed - whole(paired)).mean()
    rng = np.random.default_rng(seed)
    block = max(1, (1 << 22) // (num_seeds * num_windows))  # bounded memory per draw
    draws = {"mean": [], "delta": []}
    for start in range(0, resamples, block):
        n = min(block, resamples - start)
        seed_draws = rng.integers(num_seeds, size=(n, num_seeds))
        window_draws = rng.integers(num_windows, size=(n, num_seeds, num_windows))
        draws["mean"].append(per_seed[seed_draws].mean(-1))
        if baseline is not None:
            change = drawn(arrays, seed_draws, window_draws) - drawn(
                paired, seed_draws, window_draws
            )
            draws["delta"].append(change.mean(-1))
    tails = [100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2]
    low, high = np.percentile(np.concatenate(draws["mean"]), tails)
    result = {"mean": float(estimate), "ci_low": float(low), "ci_high": float(high)}
    if baseline is not None:
        low, high = np.percentile(np.concatenate(draws["delta"]), tails)
        result.update(
            baseline=float(reference),
            delta=float(delta),
            delta_ci_low=float(low),
            delta_ci_high=float(high),
        )
    return result


def summarize(rows: list[Mapping], windows: Mapping) -> list[dict]:
    """summary.csv's rows: one per (model, cache) in grid order, over its seeds.

    mean, ci_low, ci_high: the metric and its interval over seeds (bootstrap;
    zero width with one seed); delta, delta_ci_low,
    delta_ci_high: the difference against the model's full cache, in the
    metric's units, and delta_pct = 100 delta / the full cache's mean;
    significant: whether the delta's interval excludes 0. seeds: how many;
    windows: evaluation windows per seed (0: no per-window sums, so no
    intervals: only the mean of the rows' metric). Task columns (task_columns):
    the mean over seeds, None where a seed has none."""
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault((row["model"], row["cache"]), []).append(row)
    summary = []
    for (model, cache), group in groups.items():
        first, metric = group[0], group[0]["metric"]
        seeds = sorted(r["seed"] for r in group)
        line = {key: first[key] for key in ("sweep", "model", "family", "cache", "bits", "metric")}
        line.update(
            seeds=len(seeds),
            cache_bytes_per_token=first["cache_bytes_per_token"],
            cache_bytes_per_token_long=first["cache_bytes_per_token_long"],
        )
        for column in task_columns(group):  # the mean over seeds; None if a seed lacks it
            values = [r.get(column) for r in group]
            line[column] = None if None in values else float(np.mean(values))
        own = [windows.get((model, s, cache)) for s in seeds]
        full = [windows.get((model, s, None)) for s in seeds]
        counts = {len(w["weight"]) for w in own + full if w is not None}
        if None in own or None in full or len(counts) != 1:
            line.update(dict.fromkeys(SUMMARY_COLUMNS[-8:]), windows=0)
            line["mean"] = float(np.mean([r[metric] for r in group]))
            summary.append(line)
            continue
        stacked = {k: np.stack([w[k] for w in own]) for k in ("nll", "correct", "weight")}
        paired = {k: np.stack([w[k] for w in full]) for k in ("nll", "correct", "weight")}
        result = bootstrap(metric, stacked, paired)
        reference = result.pop("baseline")
        line.update(result, windows=counts.pop())
        line["delta_pct"] = 100 * line["delta"] / reference if reference else None
        line["significant"] = line["delta_ci_low"] > 0 or line["delta_ci_high"] < 0
        summary.append(line)
    return summary


def pareto_front(points: list[tuple[float, float]], higher_is_better: bool = False) -> list[int]:
    """Indices of the points no other point beats on both cost (x) and metric (y)."""
    sign = -1.0 if higher_is_better else 1.0
    order = sorted(range(len(points)), key=lambda i: (points[i][0], sign * points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if sign * points[i][1] < best:
            front.append(i)
            best = sign * points[i][1]
    return front


def _minor_labels(limits):
    """Labels for a log axis's minor ticks that stay readable: every one when the
    axis (`limits()` at drawing time) spans a decade or less, the 2s and 5s up
    to two decades, none beyond (the decades' own labels suffice)."""
    import matplotlib.ticker

    def label(value: float, _) -> str:
        low, high = sorted(limits())
        decades = math.log10(high / low) if low > 0 else math.inf
        leading = round(value / 10 ** math.floor(math.log10(value)))
        if decades <= 1 or (decades <= 2 and leading in (2, 5)):
            return f"{value:g}"
        return ""

    return matplotlib.ticker.FuncFormatter(label)


def interval_front(
    points: list[tuple[float, float, float, float]], higher_is_better: bool = False
) -> list[int]:
    """Indices of the points that no other point beats beyond their intervals,
    in order of cost: the frontier pareto_plot draws.

    points: (cost x, estimate, interval low, interval high). Point j clearly
    beats point i when it costs no more (x_j <= x_i) and its whole interval is
    no worse than the whole of i's (high_j <= low_i; for a metric where higher
    is better low_j >= high_i), and the two differ (in cost or interval); of
    points equal in all of these, the first stands for them. A point is on
    the frontier when no point clearly beats it: an advantage inside the
    intervals (a cheaper point better on average, the intervals overlapping)
    leaves both on. With zero-width intervals this is pareto_front exactly.
    """
    sign = -1.0 if higher_is_better else 1.0
    # as costs to minimize: (x, best plausible, worst plausible)
    spans = [(x, *sorted((sign * low, sign * high))) for x, _, low, high in points]
    front = []
    for i, (x, best, _) in enumerate(spans):
        beaten = any(
            other[0] <= x and other[2] <= best and (other != spans[i] or j < i)
            for j, other in enumerate(spans)
            if j != i
        )
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], sign * points[i][1]))


def dodge(
    x: Sequence[float], low: Sequence[float], high: Sequence[float], log_y: bool = False
) -> list[float]:
    """Where pareto_plot draws each point on its log x axis so that none hides
    another: points of equal x whose extents on the y axis overlap (interval
    low..high, widened by MARKER_HEIGHT of the y axis's span on either side;
    in log10 with `log_y`) are spread sideways around their x, in grid order,
    DODGE of the x axis's decades apart (an axis of less than half a decade
    taken as half a decade); every other point keeps its x. Only the drawing
    moves: costs are compared on x."""
    scale = math.log10 if log_y else float
    bottom, top = [scale(v) for v in low], [scale(v) for v in high]
    pad = MARKER_HEIGHT * (max(top) - min(bottom))
    decades = math.log10(max(x) / min(x)) if min(x) > 0 else 0.0
    step = DODGE * max(decades, 0.5)
    drawn = [float(v) for v in x]
    for value in dict.fromkeys(x):
        clusters, reach = [], -math.inf  # overlapping extents, from the bottom up
        for i in sorted((i for i, v in enumerate(x) if v == value), key=lambda i: bottom[i]):
            if clusters and bottom[i] - pad <= reach + pad:
                clusters[-1].append(i)
                reach = max(reach, top[i])
            else:
                clusters.append([i])
                reach = top[i]
        for cluster in clusters:
            for k, i in enumerate(sorted(cluster)):
                drawn[i] = float(value) * 10 ** ((k - (len(cluster) - 1) / 2) * step)
    return drawn


def _palette(count: int) -> list:
    """`count` colours, distinct as far as possible: tab10, then tab20's light
    shades, then tab20b and tab20c (60), repeating beyond."""
    import matplotlib

    colours = [
        *matplotlib.colormaps["tab10"].colors,
        *matplotlib.colormaps["tab20"].colors[1::2],
        *matplotlib.colormaps["tab20b"].colors,
        *matplotlib.colormaps["tab20c"].colors,
    ]
    return [colours[i % len(colours)] for i in range(count)]


def pareto_plot(summary: list[Mapping], path: str, title: str = "", long_bytes: bool = False):
    """The metric against cache bytes per token from summary rows (summarize):
    each (model, cache) at its mean over seeds with its 95% interval as a bar,
    a colour per cache entry (its name: K4V4 and K4V4-token differ), a marker
    per model entry, legends instead of labels, and the interval frontier
    (interval_front, on the true bytes) drawn and ringed. Points at equal bytes
    that would cover each other are drawn side by side (dodge), as the x label
    says. Log x; log y too when the metric spans more than a factor of 3.
    long_bytes: x is cache_bytes_per_token_long (what a token adds to a long
    cache) instead of the evaluation window's bytes. The title says what the
    bars are: 95% intervals over seeds, none with one seed. Writes `path`
    (PNG) and returns the figure (closed) for inspection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    from matplotlib.lines import Line2D

    column = BYTES_COLUMNS[bool(long_bytes)]
    metric = summary[0]["metric"]
    higher_is_better = metric == "accuracy"
    x = [float(r[column]) for r in summary]
    y = [float(r["mean"]) for r in summary]
    has_interval = [r["ci_low"] is not None and r["ci_high"] is not None for r in summary]
    low = [
        float(r["ci_low"]) if ok else yi for r, ok, yi in zip(summary, has_interval, y, strict=True)
    ]
    high = [
        float(r["ci_high"]) if ok else yi
        for r, ok, yi in zip(summary, has_interval, y, strict=True)
    ]
    caches = list(dict.fromkeys(r["cache"] for r in summary))
    models = list(dict.fromkeys(r["model"] for r in summary))
    colours = dict(zip(caches, _palette(len(caches)), strict=True))
    markers = {m: MODEL_MARKERS[i % len(MODEL_MARKERS)] for i, m in enumerate(models)}

    log_y = min(low) > 0 and max(high) > 3 * min(low)  # a collapsed cache would flatten the rest
    drawn = dodge(x, low, high, log_y)

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    for r, xi, yi, lo, hi in zip(summary, drawn, y, low, high, strict=True):
        ax.errorbar(
            xi,
            yi,
            yerr=[[yi - lo], [hi - yi]],
            marker=markers[r["model"]],
            color=colours[r["cache"]],
            markeredgecolor="black",
            markeredgewidth=0.4,
            markersize=6,
            elinewidth=1,
            capsize=2,
            ls="",
            zorder=3,
        )
    front = interval_front(list(zip(x, y, low, high, strict=True)), higher_is_better)
    ax.plot(
        [drawn[i] for i in front], [y[i] for i in front], color="black", lw=1, ls="--", zorder=2
    )
    ax.scatter(
        [drawn[i] for i in front],
        [y[i] for i in front],
        s=150,
        facecolors="none",
        edgecolors="black",
        linewidths=0.8,
        zorder=4,
    )
    ax.set_xscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(_minor_labels(ax.get_xlim))
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(_minor_labels(ax.get_ylim))
    ax.tick_params(axis="both", which="both", labelsize=8)  # one size, major and minor
    where = "per token of a long cache" if long_bytes else "per token of the evaluation window"
    side = "; points of equal bytes drawn side by side" if drawn != x else ""
    ax.set_xlabel(f"cache bytes {where} (all layers){side}", fontsize=9)
    better = " (higher is better)" if higher_is_better else " (lower is better)"
    ax.set_ylabel(metric + better, fontsize=9)
    seeds = sorted({r["seeds"] for r in summary})
    if seeds == [1]:  # nothing varies between trainings: no interval to draw
        bars = "one seed: no interval over seeds"
    else:
        counts = "/".join(map(str, seeds))
        bars = f"mean of {counts} seeds; bars: {CONFIDENCE:.0%} intervals over seeds"
        bars += " where a point has several" if 1 in seeds else ""
    ax.set_title(f"{title} ({bars})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    model_handles = [
        Line2D([], [], marker=markers[m], ls="", color="grey", markeredgecolor="black", label=m)
        for m in models
    ]
    frontier = Line2D(
        [], [], color="black", ls="--", marker="o", mfc="none", ms=9,
        label="frontier: no cheaper point\nbetter beyond the intervals",
    )  # fmt: skip
    cache_handles = [Line2D([], [], marker="s", ls="", color=colours[c], label=c) for c in caches]
    # Outside the axes, the caches' legend below the models': nothing covers a point.
    style = dict(loc="upper left", fontsize=8, title_fontsize=8, alignment="left")
    first = fig.legend(
        handles=[*model_handles, frontier], bbox_to_anchor=(0.91, 0.88), title="model", **style
    )
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    fig.canvas.draw()  # the first legend's extent, to put the second below it
    box = first.get_window_extent().transformed(fig.transFigure.inverted())
    fig.legend(
        handles=cache_handles,
        bbox_to_anchor=(box.x0, box.y0 - 0.02),
        title="cache",
        ncol=1 + (len(caches) - 1) // 24,
        **style,
    )
    image = io.BytesIO()
    fig.savefig(image, format="png", bbox_inches="tight")
    plt.close(fig)
    write_atomic(path, image.getvalue())
    return fig
