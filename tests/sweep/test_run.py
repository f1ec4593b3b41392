"""Running sweeps (kvlab/sweep/run.py, then the merge): a sliced sweep merges into
the table, the plot and a wandb run; seeds, checkpoint entries, the eta, a killed
slice that resumes, a result that is not a number."""

import csv
import json
import shutil
import signal
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

import kvlab
from kvlab.eval.tasks import evaluate_tasks
from kvlab.logging import read_offline_run
from kvlab.sweep import (
    COLUMNS,
    SUMMARY_COLUMNS,
    evaluate_model,
    expand,
    merge,
    read_csv,
    replot,
    run_sweep,
    split_sweep_config,
    time_left,
)
from kvlab.train import load_params
from tests.helpers import ROOT, write_corpus
from tests.sweep.helpers import GRID, sweep_config

DISTANCE = ("kl_mean", "kl_p99", "top1_agreement", "delta_ppl")  # to the full cache


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
from kvlab.sweep import run
from tests.sweep.helpers import sweep_config
from tests.sweep.test_run import RESUMED_GRID

corpus, workdir = sys.argv[1:]
write = run.write_atomic  # what writes workdir/units/<u>.json
def write_then_die(path, data):
    write(path, data)
    if path == os.path.join(workdir, "units", "2.json"):
        os.kill(os.getpid(), signal.SIGKILL)
run.write_atomic = write_then_die
run.run_sweep(sweep_config(corpus), RESUMED_GRID, workdir)
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
