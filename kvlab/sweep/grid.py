"""The sweep's grid: model entries x cache entries, expanded into units, and slices of them.

A sweep config file (configs/sweeps/*.py) has `get_config(arg)`, a full kvlab
config plus a `sweep` section (name; seeds, below), and `get_grid(cfg)`, which returns

    {"models": {name: {"model.num_kv_heads": 2, "train.steps": 500, ...}, ...},
     "caches": {name: {"cache.k_bits": 8, "cache.v_bits": 4, ...}, ...}}

Every key is a dotted config field ("sweep axis"). Model entries may change any
section; cache entries only `cache.*`, so every cache reuses the one checkpoint
trained per model. A model entry {"hf": DIR, ...} is a local Hugging Face
checkpoint evaluated as it is, without training: its model section and weights
come from DIR (kvlab.checkpoints.config_from_hf), so its other axes may not name
`model.*` or `train.init_from`. A model entry {"gguf": FILE, ...} is a llama.cpp
GGUF file (kvlab.load_gguf, extra `real`), converted once into
workdir/converted/gguf/<file stem>/ (config.json, float32 model.safetensors and
its tokenizer.json, reused when present) and then evaluated as an hf entry.
Either may add {"convert": "gqa:N" | "mla:R[,rope=P][,select=S][,factor=F]"}: the
checkpoint's attention converted (kvlab.checkpoints.convert.convert, calibrated on
the sweep's training text) once into workdir/converted/<model>/, a kvlab run
holding it at step 0, evaluated as it is (no uptraining). A
cache entry applies to the models that cache the tensors it names (`k_*`/`v_*`
for grouped-query models, `latent_*`/`rope_*` for latent attention; an entry
naming neither applies to all), and whose eviction method scores the model's
attention kind (expected_attention and qfilter score grouped-query caches
alone). The grid's units are the applicable (model, cache) pairs in
model-major order; an empty name is refused.

The sweep section may add `seeds` (default 1): each trained model entry is
then trained that many times, with train.seed its own + 0, 1, ... (its data
order and initialisation), and its units repeat per seed (model-major, then
seed, then cache). A slice (slice_range) is a contiguous run of units, so most
slices train one or two models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping

import ml_collections

from kvlab.cache.evict import scorer_of
from kvlab.checkpoints.convert import convert, parse_target
from kvlab.checkpoints.gguf import load_gguf
from kvlab.checkpoints.hf import config_from_hf, save_hf
from kvlab.config import (
    CACHED_PREFIXES,
    UNSCORED_METHODS,
    cached_prefixes,
    check_count,
    complete_config,
)
from kvlab.data import validate_config
from kvlab.files import read_json, write_atomic
from kvlab.train import initial_params, load_run_config, start_workdir


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


def _scores(cfg) -> bool:
    """Whether cfg's eviction method (if any) scores cfg.model's attention kind."""
    method = cfg.cache.evict.method
    if method in UNSCORED_METHODS or not isinstance(method, str):
        return True
    kinds = scorer_of(method).attention_kinds
    return cfg.model.attention in kinds


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
    (train.init_from) converted as `target` says (kvlab.checkpoints.convert.convert), at
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
        entry = f"models[{model_name!r}]"
        _check_name(entry, model_name)
        if os.sep in model_name or model_name in (".", ".."):
            suggestion = model_name.replace(os.sep, "-").strip(".") or "base"
            raise ValueError(
                f"{entry}: a model's name names its folders (models/<model>, converted/<model>): "
                f"use one without {os.sep!r}, e.g. {suggestion!r}"
            )
        overrides = dict(model_overrides)
        model_cfg, hf = _model_source(cfg, entry, model_name, overrides, workdir)
        _apply(model_cfg, entry, overrides)
        validate_config(model_cfg)
        cached = set(cached_prefixes(model_cfg.model))
        trained = [model_cfg] if hf else _seeded(model_cfg, entry, seeds)
        for seeded in trained:
            seed = seeded.train.seed if seeds > 1 else None
            units += _cache_units(grid, model_name, seeded, cached, hf, seed)
    return units


def _model_source(
    cfg: ml_collections.ConfigDict,
    entry: str,
    model_name: str,
    overrides: dict,
    workdir: str | None,
) -> tuple[ml_collections.ConfigDict, str]:
    """(config, checkpoint folder) of a model entry: `cfg` to train (folder ''),
    or the config of the entry's hf/gguf checkpoint, converted when it says so.
    Takes its hf, gguf and convert keys out of `overrides`."""
    model_cfg = ml_collections.ConfigDict(cfg.to_dict())
    hf = overrides.pop("hf", "")
    gguf = overrides.pop("gguf", "")
    target = overrides.pop("convert", "")
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
        fixed = [a for a in overrides if a.startswith("model.") or a == "train.init_from"]
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
    return model_cfg, hf


def _seeded(
    model_cfg: ml_collections.ConfigDict, entry: str, seeds: int
) -> list[ml_collections.ConfigDict]:
    """A trained model entry's configs, one per seed: train.seed its own + 0, 1, ..."""
    if seeds == 1:
        return [model_cfg]
    trained = []
    for k in range(seeds):
        seeded = ml_collections.ConfigDict(model_cfg.to_dict())
        seeded.train.seed = model_cfg.train.seed + k
        try:
            trained.append(validate_config(seeded))
        except ValueError as error:
            raise ValueError(f"{entry}, seed {k + 1} of sweep.seeds={seeds}: {error}") from None
    return trained


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
        if not _scores(unit_cfg):
            continue  # its eviction method does not score this attention kind
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
