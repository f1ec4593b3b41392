"""Token eviction against quantization at equal cache bytes: perplexity and recall.

    python experiments/eviction.py --workdir runs/eviction
    python experiments/eviction.py --workdir runs/eviction --wandb
    python experiments/eviction.py --config configs/sweeps/eviction.py:small --workdir DIR
    python experiments/eviction.py --workdir DIR --models=mha,mqar-mha --caches=16bit,snapkv50
    python experiments/eviction.py --workdir runs/eviction --replot   # redraw from results.csv

Runs the sweep of `--config` (configs/sweeps/eviction.py: trained MHA, GQA,
MQA and MLA byte models and an MQAR-trained MHA, each evaluated through the
16-bit cache, quantized caches, every eviction policy of kvlab/cache/evict/
at four kept ratios, and eviction with quantization) through
kvlab.sweep.run_sweep in --workdir, then writes under --results:

    results.csv      the sweep's table (kvlab/sweep/tables.py's columns; one row per unit)
    perplexity.png   perplexity against cache bytes per token, a panel per byte model
    recall.png       MQAR accuracy against cache bytes per token
    summary.md       per model and byte budget (a share of its 16-bit cache), the
                     best eviction, quantization and combined cache, and the winner

A cache's family is 'eviction' (cache.evict.method set, 16-bit), 'quantization'
(fewer bits, every token kept), 'combination' (both) or '16bit'. Bytes are
kvlab.cache_bytes of one window over its tokens: an evicting cache counts its
budget's slots, the positions a score-based method keeps per slot and h2o's
scores, so a policy keeping half the tokens costs a little over half.
`--models` and `--caches` run a part of the grid (in a workdir of its own:
a sweep's workdir holds one grid).

`--wandb` logs the training runs, the sweep's table and one run holding the
plots and the summary (offline unless --config.wandb.mode says otherwise); a
workdir keeps the wandb setting it was first run with. Rerunning in the same
workdir reuses the trained models (kvlab/train/ resumes) and the slices of
the grid already evaluated (workdir/slices/; delete them to evaluate again);
`--replot` only redraws the plots and summary from its results.csv.
"""

import io
import math
import os
import shutil
import time
from collections.abc import Mapping, Sequence

import jax
from absl import flags
from ml_collections import config_flags

from kvlab import cli
from kvlab.config import import_config_file
from kvlab.files import read_json, write_atomic
from kvlab.logging import Run
from kvlab.sweep import merge, read_csv, run_sweep

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/sweeps/eviction.py:tiny", "The sweep config (get_config, get_grid)."
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/eviction", "The sweep's directory.")
_RESULTS = flags.DEFINE_string(
    "results", "experiments/results/eviction", "Where results.csv, the plots and summary go."
)
_WANDB = flags.DEFINE_bool("wandb", False, "Log the runs and the results to wandb.")
_MODELS = flags.DEFINE_list("models", [], "Only these model entries of the grid (default: all).")
_SLICES = flags.DEFINE_integer(
    "slices",
    8,
    "Slices the grid runs in, one after another; each frees its compiled programs (one "
    "process compiling ~150 cache layouts exhausts XLA:CPU's memory maps).",
)
_REPLOT = flags.DEFINE_bool(
    "replot", False, "Only redraw the plots and summary from --workdir's results.csv."
)
_CACHES = flags.DEFINE_list(
    "caches", [], "Only these cache entries of the grid and its 16-bit baseline (default: all)."
)

FAMILIES = ("eviction", "quantization", "combination")
# Byte budgets of the summary, as shares of each model's 16-bit cache: the
# eviction ratios and the quantized widths (K8V8 62.5%, K4V4 37.5%, K2V2 25%)
# and between them. A cache fits with up to SLACK more, for the per-row length
# and flags every cache carries (8 bytes a row: K2V2 is 25.01% of the 16-bit).
BUDGETS = (0.75, 0.625, 0.5, 0.375, 0.25, 0.1875, 0.125)
SLACK = 0.001
RATIO_MARKERS = {0.75: "o", 0.5: "s", 0.25: "^", 0.125: "v"}
CLIP = 0.1  # perplexity plots: the y axis ends 10% above the 16-bit cache's


def main(argv):
    del argv
    start = time.perf_counter()
    cfg = _CONFIG.value
    if not _WANDB.value:
        cfg.wandb.mode = "disabled"
    workdir = _WORKDIR.value
    if _REPLOT.value:
        rows, seconds = read_results(os.path.join(workdir, "results.csv")), None
    else:
        check_wandb_mode(workdir, cfg.wandb.mode)
        path = config_flags.get_config_filename(flags.FLAGS["config"]).partition(":")[0]
        grid = subset(import_config_file(path).get_grid(cfg), _MODELS.value, _CACHES.value)
        rows = sweep(cfg, grid, workdir, _SLICES.value)
        seconds = time.perf_counter() - start
    rows = [with_family(row) for row in rows]

    results = _RESULTS.value
    os.makedirs(results, exist_ok=True)
    shutil.copyfile(os.path.join(workdir, "results.csv"), os.path.join(results, "results.csv"))
    text = [r for r in rows if r["metric"] == "ppl"]
    recall = [r for r in rows if r["metric"] == "accuracy"]
    figures = {}
    if text:
        figures["perplexity"] = plot(text, "ppl", "perplexity (lower is better)")
    if recall:
        figures["recall"] = plot(recall, "accuracy", "MQAR accuracy (higher is better)")
    for name, png in figures.items():
        write_atomic(os.path.join(results, f"{name}.png"), png)
    report = summary(rows, seconds, cfg.sweep.name)
    write_atomic(os.path.join(results, "summary.md"), report)
    if _WANDB.value:
        log_results(cfg, rows, results, figures, workdir)
    print(report)
    print(f"{cli.count(len(rows), 'unit')}; results in {results}/")


def read_results(path: str) -> list[dict]:
    """The rows of a sweep's results.csv, numbers as numbers and empty cells as None."""
    if not os.path.isfile(path):
        raise ValueError(f"--replot reads {path}, which is not there: run the sweep first")
    return read_csv(path)


def sweep(cfg, grid: Mapping, workdir: str, count: int) -> list[dict]:
    """Runs the grid in `count` slices (kvlab.sweep.run_sweep), skipping those already
    in workdir/slices, clearing JAX's compiled programs after each; then merges."""
    ran = False
    for index in range(count):
        if os.path.isfile(os.path.join(workdir, "slices", f"{index}-of-{count}.csv")):
            print(f"slice {index + 1}/{count}: already in {workdir}/slices, kept")
            continue
        run_sweep(cfg, grid, workdir, sweep_index=index, sweep_count=count)
        jax.clear_caches()
        ran = True
    if count == 1 and ran:  # run_sweep merged it
        return read_results(os.path.join(workdir, "results.csv"))
    return merge(workdir)


def subset(grid: Mapping, models: Sequence[str], caches: Sequence[str]) -> dict:
    """The grid with only the named model and cache entries (all of a kind when none
    named); the grid's first cache, the 16-bit baseline the summary compares with,
    is always kept."""
    if caches:
        caches = list(dict.fromkeys([next(iter(grid["caches"])), *caches]))
    chosen = {}
    for kind, names, flag in (("models", models, "--models"), ("caches", caches, "--caches")):
        unknown = [name for name in names if name not in grid[kind]]
        if unknown:
            raise ValueError(
                f"{flag} names {unknown[0]!r}, which the grid does not hold: pick from "
                + ", ".join(grid[kind])
            )
        chosen[kind] = {name: grid[kind][name] for name in names or grid[kind]}
    return chosen


def check_wandb_mode(workdir: str, mode: str) -> None:
    """A workdir's sweep.json records its config, wandb section included: refuse a
    rerun with another --wandb before anything runs, naming the flag."""
    path = os.path.join(workdir, "sweep.json")
    if not os.path.isfile(path):
        return
    stored = read_json(path).get("config", {}).get("wandb", {}).get("mode")
    if stored is not None and stored != mode:
        flag = "--wandb" if stored != "disabled" else "--nowandb"
        raise ValueError(
            f"--workdir={workdir!r} was swept with wandb.mode={stored!r}, this run asks for "
            f"{mode!r}: pass {flag} as before, or a fresh --workdir"
        )


# ---------------------------------------------------------------------------
# Families and the summary


def quantized(row: Mapping) -> bool:
    """Whether any tensor the row's model caches is stored in fewer than 16 bits."""
    bits = (row[f"{p}_bits"] for p in ("k", "v", "latent", "rope"))
    return any(b is not None and b < 16 for b in bits)


def with_family(row: Mapping) -> dict:
    """The row with `cache_family`: '16bit', 'eviction', 'quantization' or 'combination'."""
    evicts = row["evict_method"] != "none"
    family = {
        (False, False): "16bit",
        (True, False): "eviction",
        (False, True): "quantization",
        (True, True): "combination",
    }[evicts, quantized(row)]
    return {**row, "cache_family": family}


def best(rows: Sequence[Mapping], metric: str) -> Mapping | None:
    """The row with the best metric (lowest ppl, highest accuracy), or None."""
    if not rows:
        return None
    sign = -1 if metric == "accuracy" else 1
    return min(rows, key=lambda r: sign * r[metric])


def winners(rows: Sequence[Mapping]) -> list[dict]:
    """Per model and byte budget: the best row of each family within the budget
    (bytes per token at most budget x the model's 16-bit cache) and the winner."""
    table = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        full = next(r for r in mine if r["cache_family"] == "16bit")
        metric = full["metric"]
        for budget in BUDGETS:
            limit = budget * full["cache_bytes_per_token"] * (1 + SLACK)
            fits = [r for r in mine if r["cache_bytes_per_token"] <= limit]
            entry = {"model": model, "metric": metric, "budget": budget, "full": full}
            for family in FAMILIES:
                entry[family] = best([r for r in fits if r["cache_family"] == family], metric)
            present = [entry[f] for f in FAMILIES if entry[f] is not None]
            top = best(present, metric)
            entry["winner"] = top["cache_family"] if top else None
            others = [r for r in present if r is not top]
            entry["runner_up"] = best(others, metric)
            table.append(entry)
    return table


def _value(row: Mapping, metric: str) -> str:
    return f"{100 * row[metric]:.1f}%" if metric == "accuracy" else f"{row[metric]:.3f}"


def _cell(row: Mapping | None, metric: str, full: Mapping) -> str:
    """'snapkv50 5.432 (53%)': the cache, its metric, its bytes as a share of the 16-bit's."""
    if row is None:
        return "-"
    share = row["cache_bytes_per_token"] / full["cache_bytes_per_token"]
    return f"{row['cache']} {_value(row, metric)} ({100 * share:.0f}%)"


def summary(rows: Sequence[Mapping], seconds: float | None, name: str) -> str:
    """summary.md: who wins each byte budget, on recall and on perplexity."""
    table = winners(rows)
    lines = [
        f"# {name}: eviction vs quantization vs both, at equal cache bytes",
        "",
        "Each cell: the best cache of the family whose bytes per token are at most the budget "
        "(a share of the model's 16-bit cache), its metric and (its bytes as a share of the "
        "16-bit cache). '-': no cache of the family fits. The winner's margin is over the "
        "best other family that fits (perplexity: relative; accuracy: percentage points).",
        "",
    ]
    for metric, title in (("accuracy", "Recall (MQAR accuracy)"), ("ppl", "Perplexity")):
        part = [e for e in table if e["metric"] == metric]
        if not part:
            continue
        lines += [
            f"## {title}",
            "",
            "| model | 16-bit | budget | eviction | quantization | combination | winner |",
            "|---|---|---:|---|---|---|---|",
        ]
        for e in part:
            full = e["full"]
            cells = [_cell(e[f], metric, full) for f in FAMILIES]
            lines.append(
                f"| {e['model']} | {_value(full, metric)} | {100 * e['budget']:g}% | "
                + " | ".join(cells)
                + f" | {_winner(e, metric)} |"
            )
        lines.append("")
        lines.append("Wins per budget, over the models: " + _tally(part) + ".")
        lines.append("")
    if seconds is not None:
        lines.append(
            f"{len(rows)} units; wall time {seconds / 60:.1f} min (models already trained in "
            "the workdir are reused, not counted)."
        )
    return "\n".join(lines) + "\n"


def _winner(entry: Mapping, metric: str) -> str:
    """'eviction', or 'eviction by 1.2%' (perplexity) / 'by 3.1 points' (accuracy)
    over the next best family that fits."""
    winner, second = entry["winner"], entry["runner_up"]
    if winner is None:
        return "-"
    if second is None:
        return f"{winner} (alone)"
    top = entry[winner]
    if metric == "accuracy":
        return f"{winner} by {100 * (top[metric] - second[metric]):.1f} points"
    return f"{winner} by {100 * (second[metric] / top[metric] - 1):.2f}%"


def _tally(entries: Sequence[Mapping]) -> str:
    parts = []
    for budget in BUDGETS:
        won = [e["winner"] for e in entries if e["budget"] == budget and e["winner"]]
        counts = ", ".join(f"{f} {won.count(f)}" for f in FAMILIES if won.count(f))
        parts.append(f"{100 * budget:g}%: {counts or 'none fits'}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------
# Plots


def plot(rows: Sequence[Mapping], metric: str, ylabel: str) -> bytes:
    """The metric against cache bytes per token (log x), a panel per model: a line
    per eviction method (colour) through its kept ratios (marker), the quantized
    caches as black diamonds, eviction with quantization as the method's colour
    ringed in black. Perplexities more than CLIP above the 16-bit cache's are
    drawn on the panel's top edge with their value, so they do not flatten the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["evict_method"] for r in rows if r["evict_method"] != "none"))
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    columns = min(2, len(models))
    height = math.ceil(len(models) / columns)
    width = 6.6 * columns if columns > 1 else 8.5  # one panel: room for the legend
    fig, axes = plt.subplots(height, columns, figsize=(width, 4.8 * height), dpi=110, squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        mine = [r for r in rows if r["model"] == model]
        full = next(r for r in mine if r["cache_family"] == "16bit")
        values = [r[metric] for r in mine]
        top = max(values)
        if metric == "ppl":
            top = min(top, full[metric] * (1 + CLIP))

        def y(row, top=top):
            return min(row[metric], top)

        for method in methods:
            line = sorted(
                (r for r in mine if (r["evict_method"], r["cache_family"]) == (method, "eviction")),
                key=lambda r: r["cache_bytes_per_token"],
            )
            ax.plot(
                [r["cache_bytes_per_token"] for r in line],
                [y(r) for r in line],
                color=colours[method],
                lw=1,
                alpha=0.7,
            )
        for r in mine:
            family, x = r["cache_family"], r["cache_bytes_per_token"]
            if family in ("eviction", "combination"):
                ax.scatter(
                    x,
                    y(r),
                    marker=RATIO_MARKERS.get(r["evict_ratio"], "P"),
                    color=colours[r["evict_method"]],
                    edgecolors="black" if family == "combination" else "none",
                    linewidths=1.2,
                    s=64 if family == "combination" else 34,
                    zorder=3,
                )
            else:
                star = family == "16bit"
                marker, size = ("*", 90) if star else ("D", 30)
                ax.scatter(x, y(r), marker=marker, color="black", s=size, zorder=4)
            if family != "eviction" or r[metric] > top:
                clipped = f" {r[metric]:.3g} (off scale)" if r[metric] > top else ""
                ax.annotate(
                    r["cache"] + clipped,
                    (x, y(r)),
                    textcoords="offset points",
                    xytext=(4, -9 if r[metric] > top else 4),
                    fontsize=6,
                )
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 3, 5)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.margins(x=0.1)
        if metric == "accuracy":
            ax.set_ylim(0, 1.05 * top)
        ax.set_title(f"{model} ({mine[0]['family']})")
        ax.set_xlabel("cache bytes per token (all layers)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(models) :]:
        ax.axis("off")
    handles = [Line2D([], [], color=colours[m], marker="o", label=m) for m in methods]
    handles += [
        Line2D([], [], color="grey", marker=marker, ls="", label=f"keeps {100 * ratio:g}%")
        for ratio, marker in RATIO_MARKERS.items()
    ]
    handles += [
        Line2D([], [], color="black", marker="*", ls="", ms=10, label="16-bit"),
        Line2D([], [], color="black", marker="D", ls="", label="quantized"),
        Line2D([], [], color="grey", marker="o", mec="black", ls="", label="evicted + quantized"),
    ]
    ncol = 8 if columns > 1 else 5
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8)
    rows_of_legend = math.ceil(len(handles) / ncol)
    fig.tight_layout(rect=(0, 0.045 * rows_of_legend / height, 1, 1))
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    return png.getvalue()


def log_results(cfg, rows: Sequence[Mapping], results: str, figures: dict, workdir: str) -> None:
    """One wandb run: the table with each cache's family, the plots and the summary."""
    columns = [
        "model",
        "cache",
        "cache_family",
        "evict_method",
        "evict_ratio",
        "bits",
        "metric",
        "ppl",
        "accuracy",
        "cache_bytes_per_token",
    ]
    with Run(
        cfg.wandb,
        name=f"{cfg.sweep.name}-eviction",
        config=cfg.to_dict(),
        workdir=workdir,
        job_type="eviction",
        group=cfg.sweep.name,
    ) as run:
        run.table("results", columns=columns, rows=[[r[c] for c in columns] for r in rows])
        for name in figures:
            run.image(name, os.path.join(results, f"{name}.png"))
        table = winners(rows)
        run.table(
            "winners",
            columns=["model", "metric", "budget", "winner"],
            rows=[[e["model"], e["metric"], e["budget"], e["winner"]] for e in table],
        )


if __name__ == "__main__":
    cli.run(main)
