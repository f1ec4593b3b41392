"""Sweeps: perplexity against cache bytes per token over models x caches.

    rows = kvlab.sweep.run_sweep(cfg, grid, workdir, sweep_index=i, sweep_count=n)
    rows = kvlab.sweep.merge(workdir)      # results.csv, summary.csv, pareto.png, wandb

A sweep config file (configs/sweeps/*.py) gives a kvlab config with a `sweep`
section and `get_grid(cfg)`: model entries (trained, or a Hugging Face / GGUF
checkpoint, optionally converted) x cache entries. The top layer of kvlab,
beside kvlab.cli: it trains through kvlab.train, loads and converts through
kvlab.checkpoints and evaluates through kvlab.eval; nothing below imports it.

    grid.py      the grid: entries expanded into units (validated configs), seeds,
                 slices; hf/gguf/convert model entries (expand, slice_range)
    run.py       one slice: train or load each model, evaluate its full cache and
                 its caches, resume from finished units (run_sweep, evaluate_model)
    summary.py   the merge: results.csv, summary.csv with paired bootstrap
                 intervals over seeds and windows, the wandb run (merge, bootstrap)
    plot.py      pareto.png: the metric against bytes per token, intervals, the
                 frontier beyond them (pareto_plot, interval_front, dodge)
    tables.py    the CSVs' columns, written and read back typed (write_csv, read_csv)

Files are replaced atomically (kvlab/files.py). Working directory:

    workdir/sweep.json              the grid's units and the base config
    workdir/models/<model>/         one training run per model (kvlab/train/)
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

from kvlab.sweep.grid import (
    Unit,
    convert_checkpoint,
    convert_gguf,
    expand,
    slice_range,
    slice_units,
    split_sweep_config,
)
from kvlab.sweep.plot import dodge, interval_front, pareto_front, pareto_plot
from kvlab.sweep.run import RECORD, evaluate_model, model_dir, read_units, run_sweep, time_left
from kvlab.sweep.summary import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    bootstrap,
    merge,
    metric_of,
    read_windows,
    replot,
    summarize,
)
from kvlab.sweep.tables import (
    BOOL_COLUMNS,
    COLUMNS,
    CONFIDENCE,
    RESULT_COLUMNS,
    SUMMARY_COLUMNS,
    TASK_PREFIX,
    TEXT_COLUMNS,
    family,
    read_csv,
    task_column,
    task_columns,
    write_csv,
)

__all__ = [
    "BOOL_COLUMNS",
    "BOOTSTRAP_RESAMPLES",
    "BOOTSTRAP_SEED",
    "COLUMNS",
    "CONFIDENCE",
    "RECORD",
    "RESULT_COLUMNS",
    "SUMMARY_COLUMNS",
    "TASK_PREFIX",
    "TEXT_COLUMNS",
    "Unit",
    "bootstrap",
    "convert_checkpoint",
    "convert_gguf",
    "dodge",
    "evaluate_model",
    "expand",
    "family",
    "interval_front",
    "merge",
    "metric_of",
    "model_dir",
    "pareto_front",
    "pareto_plot",
    "read_csv",
    "read_units",
    "read_windows",
    "replot",
    "run_sweep",
    "slice_range",
    "slice_units",
    "split_sweep_config",
    "summarize",
    "task_column",
    "task_columns",
    "time_left",
    "write_csv",
]
