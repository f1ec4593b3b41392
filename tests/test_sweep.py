"""Sweeps: the grid expands and slices exactly, bad axes are refused, and a
sliced sweep merges into the table, the plot and a wandb run."""

import csv
import json
import shutil

import ml_collections
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.config import import_config_file, validate_config
from kvlab.logging import read_offline_run
from kvlab.sweep import (
    COLUMNS,
    Unit,
    bits_label,
    expand,
    full_cache,
    merge,
    pareto_front,
    run_sweep,
    slice_units,
    split_sweep_config,
)
from tests.helpers import ROOT, run_config, write_corpus

DISTANCE = ("kl_mean", "kl_p99", "top1_agreement", "delta_ppl")  # to the full cache
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


@pytest.mark.parametrize(
    "attention, dtype, bits, label",
    [
        ("gqa", "float32", {}, "K32V32"),
        ("gqa", "bfloat16", {}, "K16V16"),
        ("gqa", "float16", {"k_bits": 8}, "K8V16"),
        ("gqa", "float32", {"k_bits": 4, "v_bits": 2}, "K4V2"),
        ("mla", "float32", {"latent_bits": 4}, "L4R32"),
        ("mla", "bfloat16", {"rope_bits": 8}, "L16R8"),
    ],
)
def test_the_bits_label_counts_the_bits_really_stored(attention, dtype, bits, label):
    cfg = ml_collections.ConfigDict({"model": {"attention": attention}, "cache": {"dtype": dtype}})
    if attention == "mla":
        cfg.model.update(num_kv_heads=4, head_dim=24)
    cfg.cache.update(bits)
    assert bits_label(validate_config(cfg)) == label


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
    ],
)
def test_unknown_or_misplaced_sweep_axes_are_refused(tmp_path, grid, match):
    cfg, _ = split_sweep_config(sweep_config(tmp_path))
    with pytest.raises(ValueError, match=match):
        expand(cfg, grid)


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


def test_sliced_sweep_merges_into_table_plot_and_wandb(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = sweep_config(corpus)
    cfg.wandb.mode = "offline"
    workdir = tmp_path / "sweep"
    first = run_sweep(cfg, GRID, str(workdir), sweep_index=0, sweep_count=2, progress=True)
    assert [r["model"] for r in first] == ["mqa", "mqa"]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model")]
    assert [line.split(":")[0] for line in printed] == [
        "model 1/1 (mqa), cache 1/2 (16bit)",
        "model 1/1 (mqa), cache 2/2 (K8V4)",
    ]
    assert "; 1/2 units, eta " in printed[0] and printed[1].endswith("; 2/2 units, eta 0s")
    with pytest.raises(ValueError, match="2 of 4 units have no results"):
        merge(str(workdir))
    second = run_sweep(cfg, GRID, str(workdir), sweep_index=1, sweep_count=2, progress=False)
    rows = merge(str(workdir))

    with open(workdir / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == COLUMNS
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
    assert logged["columns"] == list(COLUMNS)
    assert [row[1:4:2] for row in logged["data"]] == [[r["model"], r["cache"]] for r in table]

    # A slice written before the distance columns existed merges, their cells empty.
    with open(workdir / "slices" / "1-of-2.csv") as f:
        older = [{k: v for k, v in r.items() if k not in DISTANCE} for r in csv.DictReader(f)]
    with open(workdir / "slices" / "1-of-2.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c for c in COLUMNS if c not in DISTANCE])
        writer.writeheader()
        writer.writerows(older)
    merged = merge(str(workdir))
    assert [r["kl_mean"] is None for r in merged] == [False, False, True, True]
    with open(workdir / "results.csv") as f:
        assert [r["kl_p99"] == "" for r in csv.DictReader(f)] == [False, False, True, True]

    # A slice of another slicing of the grid makes units appear twice.
    shutil.copy(workdir / "slices" / "0-of-2.csv", workdir / "slices" / "0-of-3.csv")
    with pytest.raises(ValueError, match="appears in 2 slices"):
        merge(str(workdir))
    assert len(rows) == 4

    # The folder holds this sweep: another grid is refused before anything runs.
    smaller = {"models": {"mqa": GRID["models"]["mqa"]}, "caches": GRID["caches"]}
    with pytest.raises(ValueError, match=r"holds a sweep with another units section"):
        run_sweep(cfg, smaller, str(workdir), progress=False)


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
    assert sweep.name == "cache_pareto_tiny"


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
