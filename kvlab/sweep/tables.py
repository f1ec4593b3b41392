"""The sweep's CSVs: results.csv's and summary.csv's columns, written and read back typed.

    write_csv(path, rows)                      # COLUMNS, then the rows' task columns
    rows = read_csv(path)                      # each cell typed by its column
    summary = read_csv(path, SUMMARY_COLUMNS)

Files are replaced atomically (kvlab/files.py). The CSVs' cells are typed by
their column (read_csv): names stay text, so a cache named "16" or a model
named "nan" is a name. A unit whose config sets eval.tasks adds one column per
task and length, `task_<task>_<length>` (task_column), after COLUMNS; a CSV
without them reads as before.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping

from kvlab.files import write_atomic

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
# The coverage of summary.csv's intervals (ci_low..ci_high, delta_ci_low..delta_ci_high).
CONFIDENCE = 0.95


def family(model_cfg: Mapping) -> str:
    if model_cfg.attention == "mla":
        return "mla"
    if model_cfg.num_kv_heads == model_cfg.num_heads:
        return "mha"
    return "mqa" if model_cfg.num_kv_heads == 1 else "gqa"


def task_column(task: str, seq_len: int) -> str:
    """results.csv's column of a task's accuracy at a length: 'task_needle_256'."""
    return f"{TASK_PREFIX}{task}_{seq_len}"


def task_columns(rows: list[Mapping]) -> tuple:
    """The task columns the rows hold (keys starting with TASK_PREFIX), in the
    order they first appear: each unit's eval.tasks, then eval.task_lengths."""
    found = (key for row in rows for key in row if key.startswith(TASK_PREFIX))
    return tuple(dict.fromkeys(found))


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
