"""Sweeps: the grid expands and slices exactly, bad axes are refused, and a
sliced sweep merges into the table, the plot and a wandb run."""

import csv
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import jax
import matplotlib.collections
import ml_collections
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache import bits_label
from kvlab.config import import_config_file
from kvlab.eval_tasks import evaluate_tasks
from kvlab.logging import read_offline_run
from kvlab.sweep import (
    COLUMNS,
    SUMMARY_COLUMNS,
    Unit,
    bootstrap,
    evaluate_model,
    expand,
    family,
    full_cache,
    interval_front,
    merge,
    pareto_front,
    pareto_plot,
    read_csv,
    replot,
    run_sweep,
    slice_units,
    split_sweep_config,
    time_left,
    write_csv,
)
from kvlab.train import load_params
from tests.helpers import ROOT, run_config, write_corpus

DISTANCE = ("kl_mean", "kl_p99", "top1_agreement", "delta_ppl")  # to the full cache
SUMS = ("nll", "correct", "weight")
GRID = {
    "models": {
        "mqa": {"model.num_kv_heads": 1},
        "mla": {
            "model.attention": "mla",
            "model.num_kv_heads": 4,
            "model.head_dim": 24,
            "model.mla.kv_rank": 32,
        },
    },
    "caches": {
        "16bit": {},
        "K8V4": {"cache.k_bits": 8, "cache.v_bits": 4},
        "L4R16": {"cache.latent_bits": 4},
    },
}


def sweep_config(corpus):
    cfg = run_config(corpus, steps=2, checkpoint_every=2, eval_every=2)
    cfg.eval.update(batch_size=2, num_batches=1, chunk=32, split="test")
    cfg.sweep = {"name": "test_sweep"}
    return cfg


@given(units=st.integers(0, 40), count=st.integers(1, 12))
def test_slices_cover_the_grid_exactly_once_and_in_order(units, count):
    grid = [Unit(f"m{i // 5}", f"c{i % 5}", None) for i in range(units)]
    slices = [slice_units(grid, i, count) for i in range(count)]
    assert [u for part in slices for u in part] == grid
    assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_bad_slices_are_refused():
    with pytest.raises(ValueError, match="--sweep_index=3"):
        slice_units([], 3, 3)
    with pytest.raises(ValueError, match="--sweep_count=0 is below 1"):
        slice_units([], 0, 0)
    with pytest.raises(ValueError, match="--sweep_index=-1 is below 0"):
        slice_units([], -1, 2)
    with pytest.raises(ValueError, match="--sweep_count=True is not an integer"):
        slice_units([], 0, True)
    assert slice_units(list("abcd"), np.int64(1), np.int32(2)) == ["c", "d"]


def test_cache_entries_apply_to_the_models_that_cache_their_tensors(tmp_path):
    cfg, _ = split_sweep_config(sweep_config(tmp_path))
    units = expand(cfg, GRID)
    assert [(u.model, u.cache) for u in units] == [
        ("mqa", "16bit"),
        ("mqa", "K8V4"),
        ("mla", "16bit"),
        ("mla", "L4R16"),
    ]
    assert units[1].cfg.cache.v_bits == 4 and units[1].cfg.model.num_kv_heads == 1
    assert units[3].cfg.cache.latent_bits == 4 and units[3].cfg.model.attention == "mla"


def test_cache_entries_reach_nested_fields_and_the_baseline_keeps_every_token(tmp_path):
    cfg, _ = split_sweep_config(sweep_config(tmp_path))
    snapkv = {"cache.evict.method": "snapkv", "cache.evict.ratio": 0.5}
    quantized = {"cache.k_bits": 8, "cache.v_bits": 8, "cache.k_axis": "token"}
    grid = {
        "models": {"mqa": {"model.num_kv_heads": 1}},
        "caches": {"snapkv50+K8V8": {**snapkv, **quantized}},
    }
    (unit,) = expand(cfg, grid)
    evicted = unit.cfg.cache
    assert (evicted.evict.method, evicted.evict.ratio, evicted.k_bits) == ("snapkv", 0.5, 8)
    baseline = full_cache(evicted)  # what delta_vs_16bit_pct compares with
    assert (baseline.evict.method, baseline.k_bits, baseline.v_bits) == ("none", 16, 16)
    assert (evicted.evict.method, evicted.k_bits) == ("snapkv", 8)  # a copy
    assert COLUMNS.index("evict_method") < COLUMNS.index("evict_ratio")
    with pytest.raises(ValueError, match="'cache.evict.metod' in caches"):
        expand(cfg, {"models": {"a": {}}, "caches": {"c": {"cache.evict.metod": "h2o"}}})


@pytest.mark.parametrize(
    "grid, match",
    [
        ({"models": {"a": {"model.num_kv_head": 2}}, "caches": {"c": {}}}, "'model.num_kv_head'"),
        ({"models": {"a": {}}, "caches": {"c": {"cache.kbits": 8}}}, "'cache.kbits'"),
        ({"models": {"a": {}}, "caches": {"c": {"k_bits": 8}}}, "'k_bits'"),
        ({"models": {"a": {}}, "caches": {"c": {"train.steps": 8}}}, "only change cache"),
        ({"models": {"a": {}}, "caches": {"c": {"cache.k_bits": 3}}}, "cache.k_bits=3"),
        ({"models": {"a": {}}, "caches": {}, "seeds": [1]}, "'seeds'"),
        ({"models": {"mla-1/2": {}}, "caches": {"c": {}}}, "use one without '/', e.g. 'mla-1-2'"),
        ({"models": {"..": {}}, "caches": {"c": {}}}, r"models\['..'\]: a model's name"),
        # An empty cell reads as None, and sweep.json's units are keyed by text.
        ({"models": {"a": {}}, "caches": {"": {}}}, r"caches\[''\]: an entry's name must be"),
        ({"models": {"": {}}, "caches": {"c": {}}}, r"models\[''\]: .* name it 'base'"),
        ({"models": {16: {}}, "caches": {"c": {}}}, r"models\[16\]: .* name it '16'"),
        ({"models": {"a": {}}, "caches": {4: {}}}, r"caches\[4\]: .* name it '4'"),
    ],
)
def test_unknown_or_misplaced_sweep_axes_are_refused(tmp_path, grid, match):
    cfg, _ = split_sweep_config(sweep_config(tmp_path))
    with pytest.raises(ValueError, match=match):
        expand(cfg, grid)


NAMES = st.text(min_size=1)  # any entry name: digits, "nan", "True", "1e5", quotes, newlines
NUMBERS = st.none() | st.integers() | st.floats(allow_nan=False)


def typed(rows):
    """Rows with each value beside its type: 16 and 16.0 and "16" differ."""
    return [{k: (type(v).__name__, v) for k, v in row.items()} for row in rows]


@settings(max_examples=50, deadline=None)
@given(
    names=st.lists(st.tuples(NAMES, NAMES, NAMES), min_size=1, max_size=4),
    numbers=st.lists(st.tuples(NUMBERS, NUMBERS, st.booleans()), min_size=4, max_size=4),
)
@example(
    names=[
        ("1", "nan", "16"),
        ("True", "1e5", "4"),
        ('a,"b"', "x\ny\r", "K4V4 ü 量"),
        ("-0", " ", "inf"),
    ],
    numbers=[(0, 1.0, True), (None, math.inf, False), (2**70, -0.0, True), (-3, 1e-300, False)],
)
def test_names_stay_text_and_numbers_numbers_through_the_csvs(names, numbers):
    """read_csv types a cell by its column: a name that spells a number, a
    bool or NaN reads back as the text it is; numbers and bools as they were."""
    rows, summary = [], []
    for (sweep, model, cache), (seed, ppl, significant) in zip(
        names, numbers[: len(names)], strict=True
    ):
        text = dict(sweep=sweep, model=model, cache=cache, bits=cache, metric="ppl")
        rows.append(
            dict.fromkeys(COLUMNS)
            | text
            | dict(seed=seed, ppl=ppl, cache_dtype=model, evict_method=cache, task_mqar_32=ppl)
        )
        summary.append(
            dict.fromkeys(SUMMARY_COLUMNS) | text | dict(mean=ppl, significant=significant)
        )
    with tempfile.TemporaryDirectory() as folder:
        write_csv(os.path.join(folder, "results.csv"), rows)
        write_csv(os.path.join(folder, "summary.csv"), summary, SUMMARY_COLUMNS)
        assert typed(read_csv(os.path.join(folder, "results.csv"))) == typed(rows)
        assert typed(read_csv(os.path.join(folder, "summary.csv"), SUMMARY_COLUMNS)) == typed(
            summary
        )


def test_a_cell_that_is_not_its_columns_type_is_refused_naming_it(tmp_path):
    nan = dict.fromkeys(COLUMNS) | dict(model="nan", cache="16", ppl=math.nan, seed=0)
    write_csv(str(tmp_path / "results.csv"), [nan])
    (row,) = read_csv(str(tmp_path / "results.csv"))
    assert (row["model"], row["cache"], row["seed"]) == ("nan", "16", 0)
    assert math.isnan(row["ppl"])  # a number column's NaN is a number
    text = (tmp_path / "results.csv").read_text().replace(",0,", ",zero,")
    (tmp_path / "results.csv").write_text(text)
    with pytest.raises(ValueError, match="row 1, column 'seed': 'zero' is not a number"):
        read_csv(str(tmp_path / "results.csv"))


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


@settings(max_examples=25, deadline=None)
@given(
    seeds=st.integers(1, 3),
    windows=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    metric=st.sampled_from(["ppl", "accuracy"]),
)
def test_the_bootstrap_is_deterministic_paired_and_exact_where_nothing_varies(
    seeds, windows, seed, metric
):
    rng = np.random.default_rng(seed)
    weight = rng.integers(1, 40, (seeds, windows)).astype(np.float64)
    sums = {
        "nll": weight * rng.uniform(1, 3, weight.shape),
        "correct": weight * rng.uniform(0, 1, weight.shape),
        "weight": weight,
    }
    other = {**sums, "nll": sums["nll"] * 1.1, "correct": sums["correct"] * 0.9}
    result = bootstrap(metric, other, sums)
    assert result == bootstrap(metric, other, sums)  # a fixed numpy seed: the same draws
    assert (
        result["ci_low"] <= result["ci_high"] and result["delta_ci_low"] <= result["delta_ci_high"]
    )
    # worse everywhere (10% more nll, 10% fewer hits): the whole interval says so
    worse = result["delta_ci_low"] > 0 if metric == "ppl" else result["delta_ci_high"] <= 0
    assert worse
    # paired with itself: exactly 0, and no width
    same = bootstrap(metric, sums, sums)
    assert (same["delta"], same["delta_ci_low"], same["delta_ci_high"]) == (0.0, 0.0, 0.0)
    # every seed and window alike: the interval is the mean itself
    alike = {k: np.full((seeds, windows), v[0, 0]) for k, v in sums.items()}
    flat = bootstrap(metric, alike)
    assert flat["ci_low"] == flat["mean"] == flat["ci_high"]
    with pytest.raises(ValueError, match=r"\[seeds, windows\]"):
        bootstrap(metric, sums, {k: np.tile(v, 2) for k, v in sums.items()})


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


# The MLA entry also scores MQAR recall at the evaluation window (eval.tasks);
# the MQA entry has no tasks, so its rows leave the task column empty.
TASK = "task_mqar_32"
TASK_GRID = {
    "models": {
        "mqa": GRID["models"]["mqa"],
        "mla": {**GRID["models"]["mla"], "eval.tasks": ("mqar",), "data.mqar.num_pairs": 4},
    },
    "caches": GRID["caches"],
}


def test_sliced_sweep_merges_into_table_plot_and_wandb(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = sweep_config(corpus)
    cfg.wandb.mode = "offline"
    workdir = tmp_path / "sweep"
    first = run_sweep(cfg, TASK_GRID, str(workdir), sweep_index=0, sweep_count=2, progress=True)
    assert [r["model"] for r in first] == ["mqa", "mqa"]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model")]
    assert [line.split(":")[0] for line in printed] == [
        "model 1/1 (mqa), cache 1/2 (16bit)",
        "model 1/1 (mqa), cache 2/2 (K8V4)",
    ]
    assert "; 1/2 units, eta " in printed[0] and printed[1].endswith("; 2/2 units, eta 0s")
    with pytest.raises(ValueError, match="2 of 4 units have no results"):
        merge(str(workdir))
    second = run_sweep(cfg, TASK_GRID, str(workdir), sweep_index=1, sweep_count=2, progress=False)
    rows = merge(str(workdir))

    with open(workdir / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == (*COLUMNS, TASK)  # the slices' task columns, after COLUMNS
    assert [(r["model"], r["cache"]) for r in table] == [
        ("mqa", "16bit"),
        ("mqa", "K8V4"),
        ("mla", "16bit"),
        ("mla", "L4R16"),
    ]
    for row, ran in zip(table, first + second, strict=True):
        assert float(row["ppl"]) == pytest.approx(ran["ppl"])
        assert float(row["cache_bytes_per_token"]) == float(row["cache_bytes_per_token_measured"])
    baseline = {r["model"]: float(r["ppl"]) for r in table if r["cache"] == "16bit"}
    for row in table:
        assert float(row["delta_vs_16bit_pct"]) == pytest.approx(
            100 * (float(row["ppl"]) / baseline[row["model"]] - 1), abs=1e-6
        )
        # Against the model's full cache: exactly nothing for the 16-bit entry itself.
        kl_mean, kl_p99, agreement, delta = (float(row[c]) for c in DISTANCE)
        if row["cache"] == "16bit":
            assert (kl_mean, kl_p99, agreement, delta) == (0.0, 0.0, 1.0, 0.0)
        else:
            assert kl_p99 >= kl_mean > 0 and 0 < agreement <= 1
            assert delta == pytest.approx(float(row["ppl"]) - baseline[row["model"]], abs=1e-9)
    # Labelled by the bits stored: the unquantized float32 cache is 32-bit.
    assert [r["bits"] for r in table] == ["K32V32", "K8V4", "L32R32", "L4R32"]
    assert table[3]["k_bits"] == "" and table[3]["latent_bits"] == "4"
    assert float(table[1]["cache_bytes_per_token"]) < float(table[0]["cache_bytes_per_token"])
    assert (workdir / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (workdir / "models").iterdir()) == ["mla", "mqa"]
    assert [r["seed"] for r in table] == ["0"] * 4  # one seed: train.seed, models/<model>/
    # Task accuracy through each unit's own cache: what evaluate_tasks gives it.
    assert [r[TASK] == "" for r in table] == [True, True, False, False]
    mla_cfg, params = load_params(str(workdir / "models" / "mla"))
    for row, unit in zip(table[2:], second, strict=True):
        cache_cfg = ml_collections.ConfigDict(mla_cfg.cache.to_dict())
        cache_cfg.latent_bits = unit["latent_bits"]
        (direct,) = evaluate_tasks(mla_cfg, cache_cfg, params, chunk=32)
        assert (direct["task"], direct["seq_len"]) == ("mqar", 32)
        assert float(row[TASK]) == unit[TASK] == direct["accuracy"]
        assert 0 <= direct["accuracy"] <= 1 and direct["targets"] == 2 * 4  # 2 rows, 4 queries

    # summary.csv: per (model, cache) the mean over seeds with its interval over
    # windows (one seed here), the difference to the model's full cache paired.
    summary = read_csv(str(workdir / "summary.csv"), SUMMARY_COLUMNS)
    assert [(r["model"], r["cache"], r["seeds"], r["windows"]) for r in summary] == [
        (model, cache, 1, 2) for model, cache in [(r["model"], r["cache"]) for r in table]
    ]
    for line, row in zip(summary, table, strict=True):
        assert line[TASK] == (float(row[TASK]) if row[TASK] else None)  # one seed: its value
        assert line["ci_low"] == line["mean"] == line["ci_high"]  # one seed: no spread
        assert line["mean"] == pytest.approx(float(row["ppl"]), rel=1e-6)
        assert line["delta_ci_low"] <= line["delta"] <= line["delta_ci_high"]
        if line["cache"] == "16bit":  # the full cache against itself: exactly nothing
            assert (line["delta"], line["delta_ci_low"], line["delta_ci_high"]) == (0, 0, 0)
            assert line["significant"] is False
    # --replot redraws from summary.csv alone, here against the long-cache bytes.
    (workdir / "pareto.png").unlink()
    assert replot(str(workdir), long_bytes=True) == str(workdir / "pareto.png")
    assert (workdir / "pareto.png").is_file()

    # wandb: one offline run per trained model and one for the sweep's results.
    runs = [read_offline_run(path) for path in sorted(workdir.glob("**/offline-run-*"))]
    assert sorted(r["job_type"] for r in runs) == ["sweep", "train", "train"]
    assert {r["group"] for r in runs} == {"test_sweep"}
    trained = next(r for r in runs if r["job_type"] == "train" and r["name"] == "mla")
    assert trained["config"]["model"]["attention"] == "mla"
    assert trained["config"]["train"]["steps"] == 2
    logged_steps = {row["_step"]: row for row in trained["history"]}
    assert "train/loss" in logged_steps[2] and "eval/ppl" in trained["summary"]
    lines = (workdir / "models" / "mla" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert trained["summary"]["eval/ppl"] == pytest.approx(metrics[-1]["eval/ppl"])
    sweep_run = next(r for r in runs if r["job_type"] == "sweep")
    logged = sweep_run["tables"]["results"]
    assert logged["columns"] == [*COLUMNS, TASK]
    assert [row[1:4:2] for row in logged["data"]] == [[r["model"], r["cache"]] for r in table]

    # A slice written before the distance, seed and task columns and the
    # per-window sums existed merges: its cells empty, its seed the one its
    # model trained with, its summary a mean without an interval.
    old = (*DISTANCE, "seed", TASK)
    with open(workdir / "slices" / "1-of-2.csv") as f:
        older = [{k: v for k, v in r.items() if k not in old} for r in csv.DictReader(f)]
    with open(workdir / "slices" / "1-of-2.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c for c in COLUMNS if c not in old])
        writer.writeheader()
        writer.writerows(older)
    (workdir / "windows" / "1-of-2.json").unlink()
    merged = merge(str(workdir))
    assert [r["kl_mean"] is None for r in merged] == [False, False, True, True]
    assert [r["seed"] for r in merged] == [0] * 4
    with open(workdir / "results.csv") as f:
        merged_table = list(csv.DictReader(f))
    assert [r["kl_p99"] == "" for r in merged_table] == [False, False, True, True]
    assert tuple(merged_table[0]) == COLUMNS  # no slice holds tasks now
    summary = read_csv(str(workdir / "summary.csv"), SUMMARY_COLUMNS)
    assert [r["windows"] for r in summary] == [2, 2, 0, 0]
    assert summary[3]["ci_low"] is None and summary[3]["mean"] == merged[3]["ppl"]

    # A slice of another slicing of the grid makes units appear twice.
    shutil.copy(workdir / "slices" / "0-of-2.csv", workdir / "slices" / "0-of-3.csv")
    with pytest.raises(ValueError, match="appears in 2 slices"):
        merge(str(workdir))
    assert len(rows) == 4

    # The folder holds this sweep: another grid is refused before anything runs.
    smaller = {"models": {"mqa": GRID["models"]["mqa"]}, "caches": GRID["caches"]}
    with pytest.raises(ValueError, match=r"holds a sweep with another units section"):
        run_sweep(cfg, smaller, str(workdir), progress=False)


def test_seeds_train_each_model_once_per_seed_and_the_summary_pairs_them(tmp_path):
    """sweep.seeds=2: every model entry trained with train.seed 0 and 1 in
    models/<model>/seed<s>/, a row per seed, evaluated over eval.seq_len
    windows; a rerun reuses the trained models."""
    cfg = sweep_config(write_corpus(tmp_path / "corpus"))
    cfg.sweep.seeds = 2
    cfg.eval.seq_len = 16  # the evaluation windows: not train.seq_len (32)
    grid = {"models": {"mqa": GRID["models"]["mqa"]}, "caches": GRID["caches"]}
    workdir = tmp_path / "sweep"
    rows = run_sweep(cfg, grid, str(workdir), progress=False)
    assert [(r["model"], r["seed"], r["cache"]) for r in rows] == [
        ("mqa", 0, "16bit"),
        ("mqa", 0, "K8V4"),
        ("mqa", 1, "16bit"),
        ("mqa", 1, "K8V4"),
    ]
    assert {r["eval_tokens"] for r in rows} == {2 * 16}  # 2 windows of 16 tokens
    assert rows[0]["ppl"] != rows[2]["ppl"]  # two trainings
    for seed in (0, 1):
        trained = json.loads(
            (workdir / "models" / "mqa" / f"seed{seed}" / "config.json").read_text()
        )
        assert trained["train"]["seed"] == seed
    plan = json.loads((workdir / "sweep.json").read_text())
    assert plan["units"][1] == ["mqa", 0, "K8V4"] and plan["config"]["sweep"]["seeds"] == 2

    summary = read_csv(str(workdir / "summary.csv"), SUMMARY_COLUMNS)
    assert [(r["cache"], r["seeds"], r["windows"]) for r in summary] == [
        ("16bit", 2, 2),
        ("K8V4", 2, 2),
    ]
    full, quantized = summary
    assert full["mean"] == pytest.approx((rows[0]["ppl"] + rows[2]["ppl"]) / 2, rel=1e-6)
    for line in summary:
        assert (
            line["ci_low"] <= line["mean"] <= line["ci_high"] and line["ci_low"] < line["ci_high"]
        )
    assert (full["delta"], full["delta_ci_low"], full["delta_ci_high"]) == (0, 0, 0)
    change = np.mean([rows[1]["ppl"] - rows[0]["ppl"], rows[3]["ppl"] - rows[2]["ppl"]])
    # (per-window sums in float32 add up in another order than the rows' totals)
    assert quantized["delta"] == pytest.approx(change, abs=1e-6 * rows[0]["ppl"])
    assert quantized["delta_ci_low"] <= quantized["delta"] <= quantized["delta_ci_high"]
    assert quantized["significant"] == (
        quantized["delta_ci_low"] > 0 or quantized["delta_ci_high"] < 0
    )

    # Rerun: the trained models are reused, the rows the same.
    steps = (workdir / "models" / "mqa" / "seed1" / "metrics.jsonl").read_text()
    assert run_sweep(cfg, grid, str(workdir), progress=False) == rows
    assert (workdir / "models" / "mqa" / "seed1" / "metrics.jsonl").read_text() == steps


@pytest.mark.parametrize(
    "sweep, match",
    [
        ({"name": "s", "seeds": 0}, "sweep.seeds=0 is below 1"),
        ({"name": "s", "seeds": 1.5}, "sweep.seeds=1.5 is not an integer"),
        ({"name": ""}, "sweep.name='' must be non-empty text"),
    ],
)
def test_bad_sweep_sections_are_refused(tmp_path, sweep, match):
    cfg = sweep_config(tmp_path)
    cfg.sweep = sweep
    with pytest.raises(ValueError, match=match):
        split_sweep_config(cfg)


def test_the_default_sweep_config_spans_every_lever():
    module = import_config_file(f"{ROOT}/configs/sweeps/cache_pareto.py")
    sweep_cfg = module.get_config("tiny")
    cfg, sweep = split_sweep_config(sweep_cfg)
    units = expand(cfg, module.get_grid(sweep_cfg))
    families = {(u.cfg.model.attention, u.cfg.model.num_kv_heads) for u in units}
    assert len({u.model for u in units}) >= 4 and len(families) >= 4
    bits = {(u.cfg.cache.k_bits, u.cfg.cache.v_bits) for u in units}
    assert {(16, 16), (8, 8), (8, 4), (4, 8), (2, 2)} <= bits
    assert any(u.cfg.cache.latent_bits < 16 for u in units)
    assert sweep.name == "cache_pareto_tiny" and sweep.seeds == 1
    three = module.get_config("tiny3")
    _, sweep = split_sweep_config(three)
    assert (sweep.name, sweep.seeds, three.train.steps) == ("cache_pareto_tiny3", 3, 500)
    with pytest.raises(ValueError, match="'tiny-3'"):
        module.get_config("tiny-3")


def test_the_recall_sweep_trains_four_designs_at_one_parameter_budget():
    """configs/sweeps/recall.py: MHA, GQA, MQA and MLA on MQAR with 3 seeds, their
    parameter counts (kvlab.init_params) within 2% of each other, each through
    its 16-bit cache and quantized caches of 8, 4 and 2 bits."""
    module = import_config_file(f"{ROOT}/configs/sweeps/recall.py")
    sweep_cfg = module.get_config("tiny")
    cfg, sweep = split_sweep_config(sweep_cfg)
    units = expand(cfg, module.get_grid(sweep_cfg), seeds=sweep.seeds)
    assert (sweep.name, sweep.seeds) == ("recall_tiny", 3)
    assert {u.cfg.data.source for u in units} == {"mqar"}
    assert {u.cfg.train.seed for u in units} == {0, 1, 2}
    counts = {}
    for unit in units:
        if unit.model not in counts:
            init = functools.partial(kvlab.init_params, unit.cfg.model, jax.random.key(0))
            shapes = jax.eval_shape(init)  # the parameters' shapes, nothing compiled
            counts[unit.model] = sum(leaf.size for leaf in jax.tree.leaves(shapes))
    print("parameters:", counts)
    assert {family(u.cfg.model) for u in units} == {"mha", "gqa", "mqa", "mla"}
    assert max(counts.values()) <= 1.02 * min(counts.values())
    for model in counts:
        bits = [
            bits_label(u.cfg.model, u.cfg.cache)
            for u in units
            if u.model == model and u.cfg.train.seed == 0
        ]
        assert len(bits) == 4 and bits[0] in ("K16V16", "L16R16")
        assert {b[1] for b in bits[1:]} == {"8", "4", "2"}


def test_a_hugging_face_model_entry_is_evaluated_without_training(tmp_path):
    llama = ROOT / "tests" / "fixtures" / "hf" / "llama"
    cfg = sweep_config(write_corpus(tmp_path / "corpus", files=4))
    caches = {"16bit": {}, "K8V4": {"cache.k_bits": 8, "cache.v_bits": 4}}
    grid = {"models": {"llama": {"hf": str(llama)}}, "caches": caches}
    rows = run_sweep(cfg, grid, str(tmp_path / "sweep"), progress=False)
    assert [(row["model"], row["cache"]) for row in rows] == [("llama", "16bit"), ("llama", "K8V4")]
    assert all(row["train_steps"] == 0 and row["num_kv_heads"] == 2 for row in rows)
    assert not (tmp_path / "sweep" / "models").exists()  # nothing trained
    assert rows[1]["cache_bytes_per_token"] < rows[0]["cache_bytes_per_token"]
    base, _ = split_sweep_config(sweep_config(tmp_path))
    refused = {"models": {"llama": {"hf": str(llama), "model.num_kv_heads": 1}}, "caches": caches}
    with pytest.raises(ValueError, match="'model.num_kv_heads' in models\\['llama'\\] is decided"):
        expand(base, refused)


def test_entries_named_like_numbers_sweep_and_merge(tmp_path):
    """A model named "nan" and caches named "16" and "4" are names: the merge
    finds their rows and writes results.csv."""
    llama = str(ROOT / "tests" / "fixtures" / "hf" / "llama")
    cfg = sweep_config(write_corpus(tmp_path / "corpus", files=4))
    grid = {
        "models": {"nan": {"hf": llama}},
        "caches": {"16": {}, "4": {"cache.k_bits": 4, "cache.v_bits": 4}},
    }
    workdir = tmp_path / "sweep"
    rows = run_sweep(cfg, grid, str(workdir), progress=False)
    assert [(r["model"], r["cache"]) for r in rows] == [("nan", "16"), ("nan", "4")]
    merged = read_csv(str(workdir / "results.csv"))
    assert [(r["model"], r["cache"], r["bits"]) for r in merged] == [
        ("nan", "16", "K32V32"),
        ("nan", "4", "K4V4"),
    ]
    summary = read_csv(str(workdir / "summary.csv"), SUMMARY_COLUMNS)
    assert [(r["model"], r["cache"]) for r in summary] == [("nan", "16"), ("nan", "4")]


def test_the_eta_counts_each_model_once_and_each_unit_at_its_own_pace():
    """A first model trained for 10 minutes and a unit evaluated in 30 s: the
    time left is one more model's training and nine units, not ten minutes
    per unit (what elapsed / units done * units left said)."""
    assert time_left([600.0], [30.0], models_left=1, units_left=9) == 600 + 9 * 30
    assert time_left([600.0, 300.0], [30.0, 50.0], models_left=2, units_left=4) == 900 + 160
    # No unit measured yet: a full cache's evaluation (the same windows) stands in for one.
    assert time_left([620.0], [], models_left=0, units_left=5, reference_seconds=[20.0]) == 100
    assert time_left([620.0], [40.0], 0, 5, reference_seconds=[20.0]) == 200  # refined
    assert time_left([620.0], [], 0, 0) == 0  # nothing left
    assert time_left([], [], models_left=1, units_left=0) is None  # nothing to go by
    assert time_left([600.0], [], models_left=0, units_left=1) is None


# A trained model and a checkpoint, each through its full cache and an 8/4-bit
# one: units 0-1 train `mqa`, units 2-3 read `llama`.
RESUMED_GRID = {
    "models": {
        "mqa": {"model.num_kv_heads": 1},
        "llama": {"hf": str(ROOT / "tests" / "fixtures" / "hf" / "llama")},
    },
    "caches": {"16bit": {}, "K8V4": {"cache.k_bits": 8, "cache.v_bits": 4}},
}
# A slice killed (SIGKILL, as a crash or a preempted job does) right after
# workdir/units/2.json is written: mqa's units and llama's first are finished.
KILLED = """
import os, signal, sys
from kvlab import sweep
from tests.test_sweep import RESUMED_GRID, sweep_config

corpus, workdir = sys.argv[1:]
write = sweep.write_atomic
def write_then_die(path, data):
    write(path, data)
    if path == os.path.join(workdir, "units", "2.json"):
        os.kill(os.getpid(), signal.SIGKILL)
sweep.write_atomic = write_then_die
sweep.run_sweep(sweep_config(corpus), RESUMED_GRID, workdir)
"""


def test_a_killed_slice_resumes_from_its_finished_units_and_writes_the_same_files(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    workdir = tmp_path / "killed"
    child = subprocess.run(
        [sys.executable, "-c", KILLED, str(corpus), str(workdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    units = workdir / "units"
    assert sorted(p.name for p in units.glob("*.json")) == ["0.json", "1.json", "2.json"]
    assert not (workdir / "slices").exists()
    written = {p.name: p.stat().st_mtime_ns for p in units.glob("*.json")}
    stored = json.loads((units / "2.json").read_text())
    assert stored["key"] == ["llama", "16bit"] and stored["row"]["cache"] == "16bit"

    # The rerun: mqa is neither trained nor evaluated, llama's full cache is
    # evaluated again for K8V4's KL, and K8V4 alone is computed.
    rows = run_sweep(sweep_config(corpus), RESUMED_GRID, str(workdir), progress=True)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("slice 0-of-1: 3 of 4 units finished before")
    progress = [line.split(":")[0] for line in printed if line.startswith(("model", "full"))]
    assert progress == ["full cache of model 2/2 (llama)", "model 2/2 (llama), cache 2/2 (K8V4)"]
    assert printed[-1].endswith("; 4/4 units, eta 0s")
    assert {p.name: p.stat().st_mtime_ns for p in units.glob("*.json") if p.name != "3.json"} == (
        written
    )
    assert json.loads((units / "3.json").read_text())["row"] == rows[3]

    # The same bytes as a slice never interrupted.
    again = tmp_path / "uninterrupted"
    assert run_sweep(sweep_config(corpus), RESUMED_GRID, str(again), progress=False) == rows
    for name in ("slices/0-of-1.csv", "windows/0-of-1.json", "results.csv", "summary.csv"):
        assert (workdir / name).read_bytes() == (again / name).read_bytes(), name

    # A rerun of a finished slice evaluates nothing; a unit file of another grid is refused.
    run_sweep(sweep_config(corpus), RESUMED_GRID, str(workdir), progress=True)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        f"slice 0-of-1: 4 of 4 units finished before ({units}, delete it to recompute "
        "them), skipped"
    ]
    shutil.copy(units / "0.json", units / "1.json")
    with pytest.raises(ValueError, match=r"units/1.json holds unit \['mqa', '16bit'\], but unit 1"):
        run_sweep(sweep_config(corpus), RESUMED_GRID, str(workdir), progress=False)


def huge_values_checkpoint(folder):
    """The llama fixture with its last layer's value projection scaled by 1e7:
    finite in float32, past float16's range (65504) in a float16 cache."""
    cfg, params = kvlab.load_hf(ROOT / "tests" / "fixtures" / "hf" / "llama")
    value = params["block_1"]["attention"]["value"]
    value["kernel"] = value["kernel"] * 1e7
    kvlab.save_hf(cfg, params, folder)
    return str(folder)


def test_a_result_that_is_not_a_number_is_refused_and_the_units_before_it_kept(tmp_path):
    cfg = sweep_config(write_corpus(tmp_path / "corpus", files=4))
    grid = {
        "models": {"huge": {"hf": huge_values_checkpoint(tmp_path / "huge")}},
        "caches": {"16bit": {}, "F16": {"cache.dtype": "float16"}},
    }
    workdir = tmp_path / "sweep"
    with pytest.raises(
        ValueError, match=r"model 'huge', cache 'F16': the evaluation gave loss=nan"
    ):
        run_sweep(cfg, grid, str(workdir), progress=False)
    assert [p.name for p in (workdir / "units").glob("*.json")] == ["0.json"]
    assert not (workdir / "slices").exists() and not (workdir / "results.csv").exists()

    # Weights holding a NaN: the model's full cache is refused, before any unit.
    base, _ = split_sweep_config(sweep_config(tmp_path))
    llama = {"hf": str(ROOT / "tests" / "fixtures" / "hf" / "llama")}
    units = expand(base, {"models": {"llama": llama}, "caches": {"16bit": {}}})
    _, params = kvlab.load_hf(llama["hf"])
    query = params["block_0"]["attention"]["query"]
    query["kernel"] = query["kernel"].at[0, 0, 0].set(np.nan)
    results = evaluate_model("s", list(enumerate(units)), params)
    with pytest.raises(ValueError, match=r"model 'llama', its full cache: the evaluation gave"):
        next(results)
