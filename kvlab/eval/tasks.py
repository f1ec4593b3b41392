"""Long-context recall tasks through a cache, at several lengths: the accuracy
rows, the needle's depth x length grid and its heat map.

    rows = evaluate_tasks(cfg, cache_cfg, params, ("needle", "vartrack"), (256, 512))
    matrix, depths, lengths = needle_matrix(rows)  # accuracy float[D, L]: depths x lengths
    plot_needle_grid("needle.png", matrix, depths, lengths, title="K4V4")

The tasks' sequences are kvlab/data/tasks.py's (needle in a haystack, RULER's
multi-key, multi-value and variable tracking, MQAR; eval.tasks and
eval.task_params); each is scored as kvlab/eval/perplexity.py scores a held-out window
through a cache, its accuracy being the share of the asked values' tokens the
model predicts. scripts/eval_tasks.py and kvlab.sweep run them.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np

from kvlab.data.tasks import TASKS, make_task, task_lengths
from kvlab.eval.perplexity import evaluate
from kvlab.files import write_atomic


def evaluate_tasks(
    cfg: Mapping,
    cache_cfg: Mapping,
    params,
    tasks: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
    *,
    depths: Sequence[float] | None = None,
    split: str | None = None,
    chunk: int | None = None,
    mesh=None,
    rules=None,
) -> list[dict]:
    """One row per (task, length): the task's accuracy through `cache_cfg`.

    Defaults from `cfg`: tasks eval.tasks, lengths task_lengths(cfg), depths
    eval.depths, split eval.split, chunk eval.chunk; eval.batch_size x
    eval.num_batches sequences per task, length and depth. A row holds task,
    seq_len, accuracy, targets and the cache's bytes per token (kvlab.eval.evaluate);
    a needle row averages its depths (each equally weighted) and keeps them in
    `depths` and `depth_accuracy`. Every dataset is built (and every bad length
    refused) before anything compiles.
    """
    ev = cfg["eval"]
    tasks = tuple(ev["tasks"] if tasks is None else tasks)
    lengths = tuple(task_lengths(cfg) if lengths is None else lengths)
    depths = tuple(ev["depths"] if depths is None else depths)
    split = split or ev["split"]
    on_mesh = dict(chunk=chunk or ev["chunk"], mesh=mesh, rules=rules)
    for task in tasks:
        if task not in TASKS:
            raise ValueError(
                f"eval.tasks holds {task!r}, which is not a task: use any of "
                f"{', '.join(map(repr, TASKS))}"
            )
    plan = []  # (task, length, [(depth, batches)])
    for task in tasks:
        for length in lengths:
            at = depths if task == "needle" else (None,)
            made = [
                (d, make_task(task, cfg, split, length, d).eval_batches(
                    ev["batch_size"], ev["num_batches"]
                ))
                for d in at
            ]  # fmt: skip
            plan.append((task, length, made))
    rows = []
    for task, length, made in plan:
        results = [(d, evaluate(cfg["model"], cache_cfg, params, b, **on_mesh)) for d, b in made]
        first = results[0][1]
        row = dict(
            task=task,
            seq_len=length,
            accuracy=float(np.mean([r["accuracy"] for _, r in results])),
            targets=sum(r["targets"] for _, r in results),
            cache_bytes_per_token=first["cache_bytes_per_token"],
            cache_bytes_per_token_long=first["cache_bytes_per_token_long"],
        )
        if task == "needle":
            row.update(depths=list(depths), depth_accuracy=[r["accuracy"] for _, r in results])
        rows.append(row)
    return rows


def needle_matrix(rows: Sequence[Mapping]) -> tuple[np.ndarray, list[float], list[int]]:
    """(accuracy float[D, L], depths, lengths) from evaluate_tasks' needle rows."""
    needle = sorted((r for r in rows if r["task"] == "needle"), key=lambda r: r["seq_len"])
    if not needle:
        raise ValueError("no needle rows: add 'needle' to eval.tasks (or --tasks)")
    depths = list(needle[0]["depths"])
    matrix = np.array([r["depth_accuracy"] for r in needle], np.float64).T  # [D, L]
    return matrix, depths, [r["seq_len"] for r in needle]


def plot_needle_grid(
    path: str,
    accuracy: np.ndarray,
    depths: Sequence[float],
    lengths: Sequence[int],
    title: str = "",
) -> None:
    """A depth x length heat map of needle accuracy (red 0 to green 1), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracy = np.asarray(accuracy, np.float64)
    if accuracy.shape != (len(depths), len(lengths)):
        raise ValueError(
            f"accuracy has shape {accuracy.shape}, not (depths, lengths) = "
            f"({len(depths)}, {len(lengths)}): pass needle_matrix's outputs"
        )
    fig, ax = plt.subplots(figsize=(2.8 + 0.8 * len(lengths), 1.6 + 0.4 * len(depths)), dpi=120)
    image = ax.imshow(accuracy, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for (i, j), value in np.ndenumerate(accuracy):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=8)
    ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths], fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
