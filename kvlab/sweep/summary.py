"""Merging a sweep's slices: results.csv, summary.csv with bootstrap intervals, the plot.

    rows = merge(workdir)             # results.csv, summary.csv, pareto.png, a wandb run
    replot(workdir, long_bytes=True)  # pareto.png again from summary.csv

`merge(workdir)` joins workdir/slices/*.csv, checks each unit appears exactly
once, and writes workdir/results.csv, workdir/summary.csv, workdir/pareto.png
(plot.py) and a wandb run holding them.

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
cache's own delta is exactly 0 with a zero-width interval. Task columns
(tables.task_columns) give their mean over seeds.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

import ml_collections
import numpy as np

from kvlab.files import read_json
from kvlab.logging import Run
from kvlab.sharding import is_primary
from kvlab.sweep.grid import split_sweep_config
from kvlab.sweep.plot import pareto_plot
from kvlab.sweep.tables import (
    COLUMNS,
    CONFIDENCE,
    SUMMARY_COLUMNS,
    read_csv,
    task_columns,
    write_csv,
)

# The bootstrap of summary.csv: how many resamples and the numpy seed that draws
# them (the same draws on every merge); the coverage is tables.CONFIDENCE.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


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
    paired = {} if baseline is None else {k: np.asarray(baseline[k], np.float64) for k in keys}
    shape = arrays["weight"].shape
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
    per_seed = _per_seed(metric, arrays)
    means, deltas = _draws(metric, arrays, paired, per_seed, resamples, seed)
    tails = [100 * (1 - CONFIDENCE) / 2, 100 * (1 + CONFIDENCE) / 2]
    low, high = np.percentile(means, tails)
    result = {"mean": float(per_seed.mean()), "ci_low": float(low), "ci_high": float(high)}
    if baseline is not None:
        reference = _per_seed(metric, paired)
        low, high = np.percentile(deltas, tails)
        result.update(
            baseline=float(reference.mean()),
            delta=float((per_seed - reference).mean()),
            delta_ci_low=float(low),
            delta_ci_high=float(high),
        )
    return result


def _per_seed(metric: str, sums: Mapping) -> np.ndarray:
    """[S]: each seed's metric over all its windows."""
    return metric_of(metric, {k: v.sum(-1) for k, v in sums.items()})


def _draws(
    metric: str, sums: Mapping, paired: Mapping, per_seed: np.ndarray, resamples: int, seed: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """The bootstrap's `resamples` draws (default_rng(seed), in blocks of bounded
    memory): the mean over the drawn seeds, and with a baseline (`paired`) the
    mean over the drawn seeds of the cache's metric minus the baseline's on the
    drawn windows."""
    num_seeds, num_windows = per_seed.shape[0], sums["weight"].shape[1]

    def drawn(values, seed_draws, window_draws) -> np.ndarray:  # [n, S]
        picked = {k: v[seed_draws[..., None], window_draws].sum(-1) for k, v in values.items()}
        return metric_of(metric, picked)

    rng = np.random.default_rng(seed)
    block = max(1, (1 << 22) // (num_seeds * num_windows))  # bounded memory per draw
    means, deltas = [], []
    for start in range(0, resamples, block):
        n = min(block, resamples - start)
        seed_draws = rng.integers(num_seeds, size=(n, num_seeds))
        window_draws = rng.integers(num_windows, size=(n, num_seeds, num_windows))
        means.append(per_seed[seed_draws].mean(-1))
        if paired:
            change = drawn(sums, seed_draws, window_draws) - drawn(paired, seed_draws, window_draws)
            deltas.append(change.mean(-1))
    return np.concatenate(means), np.concatenate(deltas) if paired else None


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
