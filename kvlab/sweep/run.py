"""Running one slice of a sweep: train (or load) each model, evaluate its caches, resume.

    rows = run_sweep(cfg, grid, workdir, sweep_index=i, sweep_count=n)

runs slice i of n (a contiguous run of the grid's units, grid.py) on the mesh
of the config's mesh section (kvlab.sharding.make_mesh: training through
kvlab.train.train, evaluation through kvlab.eval.evaluate(mesh=); on several
hosts a mesh spanning them, process 0 alone writing) and writes
workdir/slices/<i>-of-<n>.csv, printing a line per model's full cache and per
unit (model 2/5, cache 3/12, units done and the time left: time_left, each
model's training and full cache apart from each unit's evaluation). With one
slice, run_sweep merges by itself (summary.merge).

Each model's full cache (kvlab.eval.full_cache: 16 bits, every token kept) is
evaluated once, its logits kept (kvlab.eval.evaluate_reference), and every
cache of the model is scored against them as well as on the text: a row
carries kl_mean and kl_p99 (KL of the full cache's next-token distribution to
this cache's), top1_agreement and delta_ppl beside ppl and
delta_vs_16bit_pct; the full cache's own row reads exactly 0, 0, 1, 0. Every
row carries its `seed`; evaluation windows are `eval_seq_len` tokens
(eval.seq_len, 0: train.seq_len). A unit whose config sets eval.tasks is also
scored on the long-context tasks (kvlab.eval.evaluate_tasks through its cache,
on the sweep's mesh): one column per task and length (tables.task_column).

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
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

import ml_collections

from kvlab.cache import bits_label
from kvlab.config import cached_prefixes, complete_config, eval_seq_len
from kvlab.data import make_dataset
from kvlab.data.tasks import task_lengths
from kvlab.eval import (
    check_finite,
    evaluate,
    evaluate_reference,
    evaluate_tasks,
    full_cache,
    full_precision,
)
from kvlab.files import read_json, store_json, write_atomic
from kvlab.sharding import axis_rules, describe_mesh, is_primary, make_mesh
from kvlab.sweep.grid import Unit, expand, slice_range, split_sweep_config
from kvlab.sweep.summary import merge
from kvlab.sweep.tables import RESULT_COLUMNS, TASK_PREFIX, family, task_column, write_csv
from kvlab.train import initial_params, train

# The fields of a finished unit's record, workdir/units/<index>.json (evaluate_model).
RECORD = frozenset(("key", "row", "window", "reference"))


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


def _task_results(unit: Unit, params, on_mesh: Mapping) -> dict:
    """{task_column: accuracy} of the unit's eval.tasks through its cache ({} without)."""
    cfg = unit.cfg
    if not cfg.eval.tasks:
        return {}
    rows = evaluate_tasks(cfg, cfg.cache, params, cfg.eval.tasks, task_lengths(cfg), **on_mesh)
    return {task_column(r["task"], r["seq_len"]): r["accuracy"] for r in rows}


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

    mine = [(index, units[index]) for index in span]
    finished = read_units(workdir, units, span)
    by_model = [list(g) for _, g in itertools.groupby(mine, lambda pair: pair[1].key[:-1])]
    report = _Progress(by_model, finished, show=progress and primary, training=progress)
    if finished:
        report.say(
            f"slice {name}: {len(finished)} of {len(mine)} units finished before "
            f"({os.path.join(workdir, 'units')}, delete it to recompute them), skipped"
        )
    records, references = dict(finished), []
    for model_index, model in enumerate(by_model, start=1):
        if all(i in finished for i, _ in model):
            references.append(finished[model[0][0]]["reference"])
            continue
        references.append(
            _run_model(
                workdir, sweep.name, model, f"{model_index}/{len(by_model)}", records, report
            )
        )
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


def _run_model(
    workdir: str,
    sweep_name: str,
    model: list[tuple[int, Unit]],
    place: str,
    records: dict,
    report: _Progress,
) -> dict:
    """Trains or loads one model entry (with one seed) of the slice and evaluates
    its units not in `records`, adding each record there (and to workdir/units/
    on the primary host) as it finishes; returns its full cache's windows record.
    `place`: '2/5', its place among the slice's models, for the progress lines."""
    first = model[0][1]
    entry = first.model if first.seed is None else f"{first.model} seed {first.seed}"
    label = f"model {place} ({entry})"
    started = time.perf_counter()
    mesh = make_mesh(first.cfg)  # as evaluate_model makes it; said once per mesh
    if mesh.size > 1 and describe_mesh(mesh) not in report.meshes:
        report.say(f"{label} runs on the {describe_mesh(mesh)}")
        report.meshes.add(describe_mesh(mesh))
    params = _model_params(first, workdir, sweep_name, report.training)
    report.models_left -= 1
    loaded = last = time.perf_counter()
    skip = set(records)
    for index, record in evaluate_model(sweep_name, model, params, skip=skip):
        if index is None:  # the full cache: the model's fixed cost so far
            reference = record
            now = time.perf_counter()
            report.spent["reference"].append(now - loaded)
            report.spent["model"].append(now - started)
            line = (
                f"full cache of {label}: {_duration(now - started)} to train or load "
                "the model and evaluate it"
            )
        else:
            if is_primary():
                _save_unit(workdir, index, record)
            records[index] = record
            now = time.perf_counter()
            unit = dict(model)[index]
            if _reuses_reference(unit, first):  # its result is the full cache's
                report.spent["model"][-1] += now - last
            else:
                report.spent["unit"].append(now - last)
                report.units_left -= 1
            line = (
                f"{label}, cache {index - model[0][0] + 1}/{len(model)} ({unit.cache}): "
                f"{_measured(record['row'])}; {len(records)}/{report.units} units"
            )
        last = now
        report.say(line, eta=True)
    return reference


class _Progress:
    """A slice's progress lines (printed on the primary host when asked) and
    what their eta (time_left) goes by: the seconds spent so far on models,
    units and full caches, and the models and units left."""

    def __init__(self, by_model: list, finished: Collection[int], show: bool, training: bool):
        self.show, self.training = show, training  # training: train()'s own progress bar
        self.units = sum(len(model) for model in by_model)
        # What is left: models to start, units to evaluate through a cache of their own.
        self.models_left = sum(any(i not in finished for i, _ in model) for model in by_model)
        self.units_left = sum(
            i not in finished and not _reuses_reference(unit, model[0][1])
            for model in by_model
            for i, unit in model
        )
        self.spent = {"model": [], "unit": [], "reference": []}
        self.meshes = set()

    def say(self, line: str, eta: bool = False) -> None:
        if not self.show:
            return
        if eta:
            spent = self.spent
            left = time_left(
                spent["model"], spent["unit"], self.models_left, self.units_left, spent["reference"]
            )
            line += f", eta {'?' if left is None else _duration(left)}"
        print(line, flush=True)


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
