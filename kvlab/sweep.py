"""Sweeps: perplexity against cache bytes per token over models x caches.

A sweep config file (configs/sweeps/*.py) has `get_config(arg)`, a full kvlab
config plus a `sweep` section (name), and `get_grid(cfg)`, which returns

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

Each model's full cache (kvlab.eval.full_cache: 16 bits, every token kept) is
evaluated once, its logits kept (kvlab.eval.evaluate_reference), and every
cache of the model is scored against them as well as on the text: a row
carries kl_mean and kl_p99 (KL of the full cache's next-token distribution to
this cache's), top1_agreement and delta_ppl beside ppl and
delta_vs_16bit_pct; the full cache's own row reads exactly 0, 0, 1, 0.

    run_sweep(cfg, grid, workdir, sweep_index=i, sweep_count=n)

runs slice i of n (a contiguous run of units, so most slices train one or two
models) on the mesh of the config's mesh section (kvlab.sharding.make_mesh:
training through train(), evaluation through evaluate(mesh=); on several
hosts a mesh spanning them, process 0 alone writing) and writes
workdir/slices/<i>-of-<n>.csv, printing a line per unit (model 2/5, cache
3/12, units done and the time left at the pace so far);
`merge(workdir)` joins the slices, checks each unit appears exactly once, and
writes workdir/results.csv, workdir/pareto.png and a wandb run holding both.
With one slice, run_sweep merges by itself. Files are replaced atomically
(kvlab/files.py). Working directory:

    workdir/sweep.json              the grid's units and the base config
    workdir/models/<model>/         one training run per model (kvlab/train.py)
    workdir/converted/gguf/<stem>/  a gguf file as a Hugging Face folder (not trained)
    workdir/converted/<model>/      a convert entry's model, a kvlab run at step 0
    workdir/slices/<i>-of-<n>.csv   each slice's rows
    workdir/results.csv             all rows, grid order
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
from collections.abc import Mapping

import ml_collections

from kvlab.config import (
    CACHED_PREFIXES,
    cached_prefixes,
    check_count,
    complete_config,
    dtype_of,
    validate_config,
)
from kvlab.convert import convert, parse_target
from kvlab.data import make_dataset
from kvlab.eval import evaluate, evaluate_reference, full_cache, full_precision
from kvlab.files import read_json, store_json, write_atomic
from kvlab.hf import config_from_hf, save_hf
from kvlab.logging import Run
from kvlab.sharding import axis_rules, is_primary, make_mesh
from kvlab.train import initial_params, load_run_config, start_workdir, train

# results.csv columns, in order. `bits` labels each cached tensor by the bits it
# is stored in (K8V4; K32V32 for an unquantized float32 cache); k_bits etc. are
# the config fields (16 = cache.dtype, whatever its width).
COLUMNS = (
    "sweep",
    "model",
    "family",
    "cache",
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
FAMILY_MARKERS = {"mha": "o", "gqa": "s", "mqa": "^", "mla": "D"}


@dataclasses.dataclass(frozen=True)
class Unit:
    """One cell of the grid: a model entry evaluated under a cache entry."""

    model: str
    cache: str
    cfg: ml_collections.ConfigDict = dataclasses.field(compare=False, repr=False)
    hf: str = dataclasses.field(default="", compare=False)  # a checkpoint, not trained


# ---------------------------------------------------------------------------
# The grid


def split_sweep_config(cfg: ml_collections.ConfigDict) -> tuple:
    """(base kvlab config, sweep section) of a sweep config, completed in place
    (fields it omits take base_config()'s defaults)."""
    if "sweep" not in cfg or "name" not in cfg.sweep:
        raise ValueError(
            "the sweep config has no sweep.name: add cfg.sweep = ConfigDict(dict(name=...)) "
            "in get_config (see configs/sweeps/cache_pareto.py)"
        )
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


def _tensors_named(overrides: Mapping) -> set:
    fields = {axis.split(".", 1)[1] for axis in overrides}
    return {field.split("_", 1)[0] for field in fields} & set(CACHED_PREFIXES)


def convert_gguf(file: str, folder: str) -> str:
    """`folder` as a Hugging Face checkpoint of the GGUF file (kvlab.load_gguf then
    kvlab.save_hf, float32) with its tokenizer.json and eos in tokenizer_config.json;
    written once: a folder whose source.json names the same file (size, mtime) is reused."""
    from kvlab.gguf import load_gguf

    file = os.path.abspath(file)
    if not os.path.isfile(file):
        raise ValueError(f"gguf={file!r} is not a file: a gguf model entry names a .gguf file")
    info = os.stat(file)
    source = {"gguf": file, "size": info.st_size, "mtime_ns": info.st_mtime_ns}
    marker = os.path.join(folder, "source.json")
    if os.path.isfile(marker) and read_json(marker) == source:
        return folder
    cfg, params, tokenizer = load_gguf(file)
    save_hf(cfg, params, folder)
    write_atomic(os.path.join(folder, "tokenizer.json"), tokenizer.backend.to_str())
    eos = tokenizer.end_token
    config = {} if eos is None else {"eos_token": tokenizer.backend.id_to_token(eos)}
    write_atomic(os.path.join(folder, "tokenizer_config.json"), json.dumps(config) + "\n")
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


def expand(cfg: ml_collections.ConfigDict, grid: Mapping, workdir: str | None = None) -> list[Unit]:
    """The grid's units with their full, validated configs (before anything runs).
    gguf model entries are converted into `workdir` (required when there are any)."""
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
        if not model_name or os.sep in model_name or model_name in (".", ".."):
            raise ValueError(
                f"{entry}: a model's name names its folders (models/<model>, converted/<model>): "
                f"use one without {os.sep!r}, e.g. {model_name.replace(os.sep, '-') or 'base'!r}"
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
        for cache_name, cache_overrides in grid["caches"].items():
            where = f"caches[{cache_name!r}]"
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
            units.append(Unit(model_name, cache_name, unit_cfg, hf))
    return units


def slice_units(units: list[Unit], index: int, count: int) -> list[Unit]:
    """Slice `index` of `count`: contiguous, sizes differing by at most one."""
    count = check_count("--sweep_count", count)
    index = check_count("--sweep_index", index, minimum=0)
    if index >= count:
        raise ValueError(
            f"--sweep_index={index!r} must be in [0, {count - 1}] for --sweep_count={count}"
        )
    return units[index * len(units) // count : (index + 1) * len(units) // count]


# ---------------------------------------------------------------------------
# Running


def family(model_cfg: Mapping) -> str:
    if model_cfg.attention == "mla":
        return "mla"
    if model_cfg.num_kv_heads == model_cfg.num_heads:
        return "mha"
    return "mqa" if model_cfg.num_kv_heads == 1 else "gqa"


def stored_bits(cache_cfg: Mapping, prefix: str) -> int:
    """The bits each number of cached tensor `prefix` is stored in: cache.<prefix>_bits
    when quantized, else the width of cache.dtype (32 for float32, 16 for bfloat16)."""
    bits = cache_cfg[f"{prefix}_bits"]
    return bits if bits < 16 else dtype_of(cache_cfg["dtype"]).itemsize * 8


def bits_label(cfg: ml_collections.ConfigDict) -> str:
    """'K8V4' for grouped-query models, 'L8R16' (latent, RoPE key) for MLA, by
    the bits really stored: an unquantized float32 cache is 'K32V32'."""
    k, v = cached_prefixes(cfg.model)
    return f"{k[0].upper()}{stored_bits(cfg.cache, k)}{v[0].upper()}{stored_bits(cfg.cache, v)}"


def _row(sweep_name: str, unit: Unit, result: Mapping, baseline: Mapping, metric: str) -> dict:
    cfg = unit.cfg
    cached = cached_prefixes(cfg.model)
    row = {
        "sweep": sweep_name,
        "model": unit.model,
        "family": family(cfg.model),
        "cache": unit.cache,
        "bits": bits_label(cfg),
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


def _write_csv(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, text.getvalue())


def read_csv(path: str) -> list[dict]:
    """The rows of a slice's or the merged results' CSV, numbers as numbers; a
    column it lacks (a file written before the column joined COLUMNS) is None."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{**dict.fromkeys(COLUMNS), **{k: _number(v) for k, v in r.items()}} for r in rows]


def _number(text: str):
    """A CSV cell as the int or float it spells, None when empty, else the text."""
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _model_params(unit: Unit, workdir: str, group: str, progress: bool):
    """Trains (or resumes, or reuses) the unit's model in workdir/models/<model>;
    a checkpoint's (unit.hf) weights are read as they are."""
    if unit.hf:
        return initial_params(unit.cfg)
    cfg = ml_collections.ConfigDict(unit.cfg.to_dict())
    cfg.cache = full_precision(cfg.cache)  # training never reads a cache
    model_dir = os.path.join(workdir, "models", unit.model)
    state, _ = train(cfg, model_dir, name=unit.model, group=group, progress=progress)
    return state.params


def _write_plan(workdir: str, sweep_cfg: ml_collections.ConfigDict, units: list[Unit]) -> None:
    """Records the grid in workdir/sweep.json; refuses a workdir of another sweep."""
    plan = {
        "units": [[u.model, u.cache] for u in units],
        "config": json.loads(sweep_cfg.to_json()),
    }

    def completed(stored: dict) -> dict:  # a plan written before a field joined the schema
        config = complete_config(ml_collections.ConfigDict(stored.get("config", {})))
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


def run_sweep(
    sweep_cfg: ml_collections.ConfigDict,
    grid: Mapping,
    workdir: str,
    *,
    sweep_index: int = 0,
    sweep_count: int = 1,
    progress: bool = True,
) -> list[dict]:
    """Runs one slice of the sweep; returns its rows (and merges when it is the only one).

    On several hosts (kvlab.sharding.initialize_distributed) every process runs
    the slice together, on meshes spanning them, and returns the same rows;
    process 0 alone prints and writes sweep.json, the slice and the merge."""
    cfg, sweep = split_sweep_config(sweep_cfg)
    units = expand(cfg, grid, workdir)
    mine = slice_units(units, sweep_index, sweep_count)
    primary = is_primary()
    if primary:
        os.makedirs(workdir, exist_ok=True)
    _write_plan(workdir, sweep_cfg, units)

    rows = []
    by_model = [(name, list(group)) for name, group in itertools.groupby(mine, lambda u: u.model)]
    started = time.perf_counter()
    for model_index, (model_name, model_units) in enumerate(by_model, start=1):
        first = model_units[0].cfg
        params = _model_params(model_units[0], workdir, sweep.name, progress)
        data = make_dataset(first.data, first.eval.split, first.train.seq_len)
        batches = data.eval_batches(first.eval.batch_size, first.eval.num_batches)
        baseline_cache = full_cache(first.cache)
        mesh = make_mesh(first)  # a model entry may change the mesh or the heads it splits
        on_mesh = dict(chunk=first.eval.chunk, mesh=mesh, rules=axis_rules(first.mesh))
        # once per model: its logits are what every cache's KL is measured against
        reference = evaluate_reference(first.model, baseline_cache, params, batches, **on_mesh)
        baseline = reference.result
        for cache_index, unit in enumerate(model_units, start=1):
            if unit.cfg.cache.to_dict() == baseline_cache.to_dict():
                result = baseline  # the full-precision entry: already evaluated
            else:
                result = evaluate(
                    unit.cfg.model, unit.cfg.cache, params, batches, **on_mesh, reference=reference
                )
            rows.append(_row(sweep.name, unit, result, baseline, data.metric))
            if progress and primary:
                elapsed = time.perf_counter() - started
                left = elapsed / len(rows) * (len(mine) - len(rows))
                print(
                    f"model {model_index}/{len(by_model)} ({model_name}), cache "
                    f"{cache_index}/{len(model_units)} ({unit.cache}): "
                    f"{data.metric}={result[data.metric]:.4f} "
                    f"kl={result['kl_mean']:.4f} "
                    f"bytes/token={result['cache_bytes_per_token']:.1f}; "
                    f"{len(rows)}/{len(mine)} units, eta {_duration(left)}",
                    flush=True,
                )
    if primary:
        _write_csv(os.path.join(workdir, "slices", f"{sweep_index}-of-{sweep_count}.csv"), rows)
        if sweep_count == 1:
            merge(workdir)
    return rows


# ---------------------------------------------------------------------------
# Merging, the table and the plot


def merge(workdir: str) -> list[dict]:
    """Joins workdir/slices/*.csv into results.csv and pareto.png and logs them to wandb.

    Every unit of the grid must appear in exactly one slice. On several hosts
    each reads the slices (a shared directory) and process 0 alone writes.
    """
    path = os.path.join(workdir, "sweep.json")
    if not os.path.isfile(path):
        raise ValueError(f"workdir={workdir!r} has no sweep.json: run a sweep slice there first")
    plan = read_json(path)
    sweep_cfg = ml_collections.ConfigDict(plan["config"])
    cfg, sweep = split_sweep_config(sweep_cfg)
    found: dict[tuple, list] = {}
    for slice_path in sorted(glob.glob(os.path.join(workdir, "slices", "*.csv"))):
        for row in read_csv(slice_path):
            found.setdefault((row["model"], row["cache"]), []).append((slice_path, row))
    twice = {unit: [p for p, _ in hits] for unit, hits in found.items() if len(hits) > 1}
    if twice:
        unit, paths = next(iter(twice.items()))
        raise ValueError(
            f"unit {unit} appears in {len(paths)} slices ({', '.join(paths)}): remove the slices "
            "of other --sweep_count runs from workdir/slices"
        )
    units = [tuple(u) for u in plan["units"]]
    missing = [u for u in units if u not in found]
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(units)} units have no results yet (first: {missing[0]}): "
            "run the remaining --sweep_index slices before merging"
        )
    rows = [found[u][0][1] for u in units]
    if not is_primary():
        return rows
    _write_csv(os.path.join(workdir, "results.csv"), rows)
    plot = os.path.join(workdir, "pareto.png")
    pareto_plot(rows, plot, title=sweep.name)
    with Run(
        cfg.wandb,
        name=f"{sweep.name}-results",
        config=sweep_cfg.to_dict(),
        workdir=workdir,
        job_type="sweep",
        group=sweep.name,
    ) as run:
        run.table("results", columns=list(COLUMNS), rows=[[r[c] for c in COLUMNS] for r in rows])
        run.image("pareto", plot)
    return rows


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


def pareto_plot(rows: list[Mapping], path: str, title: str = "") -> None:
    """The metric against cache bytes per token (log x; log y too when the metric
    spans more than a factor of 3): marker per model family, colour per
    bit-width, the Pareto frontier drawn and ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    from matplotlib.lines import Line2D

    metric = rows[0]["metric"]
    higher_is_better = metric == "accuracy"
    x = [float(r["cache_bytes_per_token"]) for r in rows]
    y = [float(r[metric]) for r in rows]
    labels = sorted({r["bits"] for r in rows}, key=lambda b: (b[0], -sum(map(int, _numbers(b)))))
    colours = {b: plt.get_cmap("tab20")(i % 20) for i, b in enumerate(labels)}

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for r, xi, yi in zip(rows, x, y, strict=True):
        marker, colour = FAMILY_MARKERS[r["family"]], colours[r["bits"]]
        ax.scatter(xi, yi, marker=marker, color=colour, s=46, zorder=3)
    front = pareto_front(list(zip(x, y, strict=True)), higher_is_better)
    ax.plot([x[i] for i in front], [y[i] for i in front], color="black", lw=1, ls="--", zorder=2)
    ax.scatter(
        [x[i] for i in front],
        [y[i] for i in front],
        s=140,
        facecolors="none",
        edgecolors="black",
        zorder=4,
    )
    for n, i in enumerate(front):  # labels alternate above and below the line
        ax.annotate(
            f"{rows[i]['model']} {rows[i]['cache']}",
            (x[i], y[i]),
            textcoords="offset points",
            xytext=(6, 7 if n % 2 == 0 else -12),
            fontsize=7,
        )
    ax.set_xscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(_minor_labels(ax.get_xlim))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    if min(y) > 0 and max(y) > 3 * min(y):  # a collapsed cache would flatten the rest
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(_minor_labels(ax.get_ylim))
        ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xlabel("cache bytes per token (all layers)")
    ax.set_ylabel(metric + (" (higher is better)" if higher_is_better else " (lower is better)"))
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    families = [
        Line2D([], [], marker=m, ls="", color="grey", label=f)
        for f, m in FAMILY_MARKERS.items()
        if any(r["family"] == f for r in rows)
    ]
    bits = [Line2D([], [], marker="o", ls="", color=colours[b], label=b) for b in labels]
    frontier = [
        Line2D([], [], color="black", ls="--", marker="o", mfc="none", label="Pareto frontier")
    ]
    first = ax.legend(handles=families + frontier, loc="upper right", fontsize=8, title="model")
    ax.add_artist(first)
    ax.legend(handles=bits, loc="upper center", fontsize=7, title="bits", ncol=2)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png")
    plt.close(fig)
    write_atomic(path, image.getvalue())


def _numbers(label: str) -> list[str]:
    return [part for part in "".join(c if c.isdigit() else " " for c in label).split()]
