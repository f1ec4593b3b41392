"""The sweep's plot (kvlab/sweep/plot.py): the Pareto and interval frontiers, and
what the figure shows, read off it."""

import matplotlib.collections
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.sweep import (
    SUMMARY_COLUMNS,
    interval_front,
    pareto_front,
    pareto_plot,
)


@given(points=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=12))
def test_the_pareto_front_holds_exactly_the_undominated_points(points):
    def dominates(a, b):
        return a[0] <= b[0] and a[1] <= b[1] and a != b

    front = set(pareto_front(points))
    for i, p in enumerate(points):
        beaten = any(dominates(q, p) for q in points)
        if i in front:
            assert not beaten
        elif not beaten:
            assert points.index(p) in front  # an exact duplicate of a frontier point
    # A metric where higher is better (MQAR accuracy) is the same front, mirrored.
    mirrored = [(x, -y) for x, y in points]
    assert pareto_front(mirrored, higher_is_better=True) == pareto_front(points)


def spans_beat(a, b, higher_is_better=False):
    """Point a = (x, estimate, low, high) beats b beyond both intervals."""
    if higher_is_better:
        return a[0] <= b[0] and a[2] >= b[3]
    return a[0] <= b[0] and a[3] <= b[2]


@given(
    points=st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 8), st.integers(0, 3), st.integers(0, 3)),
        min_size=1,
        max_size=10,
    ),
    higher_is_better=st.booleans(),
)
def test_the_interval_frontier_keeps_what_no_cheaper_point_beats_beyond_the_intervals(
    points, higher_is_better
):
    spans = [(x, y, y - below, y + above) for x, y, below, above in points]
    front = interval_front(spans, higher_is_better)
    assert front == sorted(
        front, key=lambda i: spans[i][:2] if not higher_is_better else (spans[i][0], -spans[i][1])
    )
    for i, point in enumerate(spans):
        beaten = [
            j
            for j, other in enumerate(spans)
            if j != i and spans_beat(other, point, higher_is_better)
        ]
        strictly = [j for j in beaten if spans[j] != point]
        if strictly:  # dominated beyond the intervals: never on the frontier
            assert i not in front
        elif not beaten:
            assert i in front
        else:  # beaten only by exact copies: the first of them stands for all
            assert (i in front) == (min(beaten) > i)
    # Zero-width intervals: the plain Pareto front, exactly.
    flat = [(x, y, y, y) for x, y, _, _ in spans]
    plain = pareto_front([(x, y) for x, y, _, _ in spans], higher_is_better)
    assert interval_front(flat, higher_is_better) == plain


def test_the_plot_has_a_colour_per_cache_a_marker_per_model_and_one_font(tmp_path):
    """Read off the figure: legends (not labels) name each cache entry and model
    entry once; K4V4 per channel and per token are two colours; --long_bytes
    moves the points to the long-cache bytes."""
    summary = []
    for m, (model, scale) in enumerate([("mqa", 1), ("mla64", 2), ("mla32", 1.5)]):
        for c, cache in enumerate(["16bit", "K4V4", "K4V4-token", "L4R16"]):
            mean = 6 + 0.1 * c + m
            summary.append(
                dict.fromkeys(SUMMARY_COLUMNS)
                | dict(model=model, cache=cache, metric="ppl", seeds=3, mean=mean)
                | dict(ci_low=mean - 0.05, ci_high=mean + 0.05)
                | dict(
                    cache_bytes_per_token=100 * scale / (c + 1),
                    cache_bytes_per_token_long=50 * scale / (c + 1),
                )
            )
    fig = pareto_plot(summary, str(tmp_path / "p.png"), title="t")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    models, caches = fig.legends
    assert [t.get_text() for t in models.get_texts()][:-1] == ["mqa", "mla64", "mla32"]
    assert "beyond the intervals" in models.get_texts()[-1].get_text()
    assert len({h.get_marker() for h in models.legend_handles[:-1]}) == 3
    assert [t.get_text() for t in caches.get_texts()] == ["16bit", "K4V4", "K4V4-token", "L4R16"]
    assert len({tuple(h.get_color()) for h in caches.legend_handles}) == 4
    (ax,) = fig.axes
    assert not ax.texts  # no labels over the points
    ticks = ax.get_xticklabels(which="both") + ax.get_yticklabels(which="both")
    assert len({t.get_fontsize() for t in ticks}) == 1
    xs = [c.lines[0].get_xdata()[0] for c in ax.containers]
    assert xs == [r["cache_bytes_per_token"] for r in summary]
    bars = [c.lines[2][0].get_segments()[0][:, 1].tolist() for c in ax.containers]
    assert bars == [[r["ci_low"], r["ci_high"]] for r in summary]
    long = pareto_plot(summary, str(tmp_path / "p.png"), long_bytes=True).axes[0]
    assert [c.lines[0].get_xdata()[0] for c in long.containers] == [
        r["cache_bytes_per_token_long"] for r in summary
    ]
    assert "long cache" in long.get_xlabel()
    assert "side by side" not in long.get_xlabel()  # no two points cover each other


def summary_row(model, cache, mean, spread, bytes_per_token, seeds=1):
    return (
        dict.fromkeys(SUMMARY_COLUMNS)
        | dict(model=model, cache=cache, metric="ppl", seeds=seeds, mean=mean)
        | dict(ci_low=mean - spread, ci_high=mean + spread)
        | dict(cache_bytes_per_token=bytes_per_token, cache_bytes_per_token_long=bytes_per_token)
    )


@pytest.mark.parametrize(
    "seeds, title",
    [
        ((1, 1), "t (one seed: no interval over seeds)"),
        ((3, 3), "t (mean of 3 seeds; bars: 95% intervals over seeds)"),
        ((1, 3), "t (mean of 1/3 seeds; bars: 95% intervals over seeds where a point has several)"),
    ],
)
def test_the_plot_title_says_what_its_bars_are(tmp_path, seeds, title):
    summary = [
        summary_row("m", cache, 6 + i, 0.1 * (n > 1), 100 / (i + 1), seeds=n)
        for i, (cache, n) in enumerate(zip(["16bit", "K4V4"], seeds, strict=True))
    ]
    (ax,) = pareto_plot(summary, str(tmp_path / "p.png"), title="t").axes
    assert ax.get_title() == title


def test_points_at_equal_bytes_are_drawn_side_by_side_in_their_own_colours(tmp_path):
    """K4V8 and K8V4 store the same bytes: drawn at one x, one colour would hide
    the other, so they are drawn apart on the log axis (the x label says so).
    The frontier still compares the true bytes: K8V4, better at the same cost,
    beats K4V8 though K4V8 is drawn to its left."""
    summary = [
        summary_row("m", "16bit", 5.5, 0.0, 200.0),
        summary_row("m", "K4V8", 6.01, 0.0, 100.0),
        summary_row("m", "K8V4", 6.0, 0.0, 100.0),
        summary_row("m", "K2V2", 7.0, 0.0, 25.0),  # alone at its bytes: stays there
    ]
    fig = pareto_plot(summary, str(tmp_path / "p.png"), title="t")
    (ax,) = fig.axes
    xs = [c.lines[0].get_xdata()[0] for c in ax.containers]
    assert xs[0] == 200.0 and xs[3] == 25.0
    assert xs[1] < 100.0 < xs[2] and xs[2] / 100.0 == pytest.approx(100.0 / xs[1])
    assert xs[2] / xs[1] < 1.1  # a small step: still at its bytes to the eye
    colours = [tuple(c.lines[0].get_color()) for c in ax.containers]
    _, caches = fig.legends
    assert [tuple(h.get_color()) for h in caches.legend_handles] == colours
    assert len(set(colours)) == 4
    assert "points of equal bytes drawn side by side" in ax.get_xlabel()
    # The frontier's rings, in order of bytes: K2V2, K8V4 (where it is drawn), 16bit.
    (rings,) = [c for c in ax.collections if isinstance(c, matplotlib.collections.PathCollection)]
    assert rings.get_offsets()[:, 0].tolist() == [25.0, xs[2], 200.0]
