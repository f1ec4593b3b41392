"""The sweep's plot: the metric against cache bytes per token, with intervals and a frontier.

    pareto_plot(summary_rows, "workdir/pareto.png", title="cache_pareto", long_bytes=False)

pareto.png plots summary.csv: each (model, cache) at its mean with its
interval as a bar (the title says what the bars are; with one seed there is
no interval over seeds), a colour per cache entry and a marker per model
entry (legends, no labels over the points), against the evaluation window's
bytes per token or (long_bytes, scripts/sweep.py --long_bytes) the bytes a
token adds to a long cache; points at equal bytes that would cover each
other (K8V4 and K4V8) are drawn side by side (`dodge`, noted in the x
label). The frontier it draws passes through the points no cheaper point
beats beyond both intervals (`interval_front`, on the true bytes).
matplotlib is imported when a plot is drawn.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

from kvlab.files import write_atomic
from kvlab.sweep.tables import CONFIDENCE

# The plot: a marker per model entry (in grid order), a colour per cache entry.
MODEL_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">", "p")
BYTES_COLUMNS = {False: "cache_bytes_per_token", True: "cache_bytes_per_token_long"}
# Points at equal bytes that would cover each other are drawn side by side
# (dodge), DODGE of the x axis's decades apart: about a marker's width; a
# marker covers about MARKER_HEIGHT of the y axis on either side of its point.
DODGE = 0.015
MARKER_HEIGHT = 0.02


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

    metric = summary[0]["metric"]
    higher_is_better = metric == "accuracy"
    x, y, low, high = _points(summary, BYTES_COLUMNS[bool(long_bytes)])
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
    _draw_frontier(ax, [drawn[i] for i in front], [y[i] for i in front])
    _label_axes(ax, metric, log_y, long_bytes, side_by_side=drawn != x)
    ax.set_title(f"{title} ({_bars(summary)})", fontsize=10)
    _legends(fig, models, markers, caches, colours)
    image = io.BytesIO()
    fig.savefig(image, format="png", bbox_inches="tight")
    plt.close(fig)
    write_atomic(path, image.getvalue())
    return fig


def _points(summary: list[Mapping], column: str) -> tuple[list, list, list, list]:
    """(x, y, low, high) of the summary rows: bytes, mean and interval (the mean
    itself where a row has none)."""
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
    return x, y, low, high


def _draw_frontier(ax, x: list[float], y: list[float]) -> None:
    """The frontier's points joined by a dashed line and ringed."""
    ax.plot(x, y, color="black", lw=1, ls="--", zorder=2)
    ax.scatter(x, y, s=150, facecolors="none", edgecolors="black", linewidths=0.8, zorder=4)


def _label_axes(ax, metric: str, log_y: bool, long_bytes: bool, side_by_side: bool) -> None:
    """Log x (log y when asked), plain tick labels of one size, the axes' labels."""
    import matplotlib.ticker

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
    side = "; points of equal bytes drawn side by side" if side_by_side else ""
    ax.set_xlabel(f"cache bytes {where} (all layers){side}", fontsize=9)
    better = " (higher is better)" if metric == "accuracy" else " (lower is better)"
    ax.set_ylabel(metric + better, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)


def _bars(summary: list[Mapping]) -> str:
    """What the plot's bars are, for its title."""
    seeds = sorted({r["seeds"] for r in summary})
    if seeds == [1]:  # nothing varies between trainings: no interval to draw
        return "one seed: no interval over seeds"
    counts = "/".join(map(str, seeds))
    bars = f"mean of {counts} seeds; bars: {CONFIDENCE:.0%} intervals over seeds"
    return bars + (" where a point has several" if 1 in seeds else "")


def _legends(fig, models: list, markers: dict, caches: list, colours: dict) -> None:
    """The models' legend (with the frontier's) and below it the caches', outside
    the axes: nothing covers a point."""
    from matplotlib.lines import Line2D

    model_handles = [
        Line2D([], [], marker=markers[m], ls="", color="grey", markeredgecolor="black", label=m)
        for m in models
    ]
    frontier = Line2D(
        [], [], color="black", ls="--", marker="o", mfc="none", ms=9,
        label="frontier: no cheaper point\nbetter beyond the intervals",
    )  # fmt: skip
    cache_handles = [Line2D([], [], marker="s", ls="", color=colours[c], label=c) for c in caches]
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
