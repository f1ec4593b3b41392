"""Long-context tasks through a cache: the rows, the needle grid and its plot, the script."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

import kvlab
from kvlab.eval.tasks import evaluate_tasks, needle_matrix, plot_needle_grid
from tests.helpers import ROOT

PARAMS = dict(value_digits=5, num_keys=3, num_values=3, num_chains=2, num_hops=3)


def config(**eval_fields):
    cfg = kvlab.base_config("tiny")
    cfg.eval.task_params.update(PARAMS)
    cfg.eval.update(eval_fields)
    return kvlab.validate_config(cfg)


def test_needle_grid_through_dense_and_paged_caches_and_its_plot(tmp_path):
    """A random-weight model on two tasks through two 16-bit caches: exact, so equal."""
    cfg = config(batch_size=2, num_batches=1, chunk=96, depths=(0.0, 1.0))
    cfg.model.num_layers = 1  # compiles faster
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    paged = cfg.cache.copy_and_resolve_references()
    paged.kind = "paged"
    kwargs = dict(tasks=("needle", "vartrack"), lengths=(192,))
    dense_rows = evaluate_tasks(cfg, cfg.cache, params, **kwargs)
    paged_rows = evaluate_tasks(cfg, paged, params, **kwargs)
    assert [(r["task"], r["seq_len"]) for r in dense_rows] == [("needle", 192), ("vartrack", 192)]
    for dense, page in zip(dense_rows, paged_rows, strict=True):
        assert 0 <= dense["accuracy"] <= 1 and dense["accuracy"] == page["accuracy"]
        assert dense["targets"] == (2 if dense["task"] == "needle" else 1) * 2 * 5
    matrix, depths, lengths = needle_matrix(dense_rows)
    assert matrix.shape == (2, 1) and depths == [0.0, 1.0] and lengths == [192]
    assert np.mean(matrix) == pytest.approx(dense_rows[0]["accuracy"])
    plot_needle_grid(str(tmp_path / "needle.png"), matrix, depths, lengths, title="K32V32")
    assert (tmp_path / "needle.png").read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["needle.png"]  # no temporary file left
    with pytest.raises(ValueError, match=r"shape \(1, 2\)"):
        plot_needle_grid(str(tmp_path / "x.png"), matrix.T, depths, lengths)


def test_eval_tasks_script_sweeps_lengths_with_rope_scaling(tmp_path):
    """scripts/eval_tasks.py on a random-weight checkpoint (--hf): the JSON report and the map."""
    plot = tmp_path / "needle.png"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/eval_tasks.py",
            f"--hf={ROOT}/tests/fixtures/hf/llama",
            "--tasks=needle,mqar",
            "--lengths=128,160",
            "--depths=0,1",
            "--batch_size=1",
            "--num_batches=1",
            "--chunk=160",
            "--rope_scaling=type=yarn,factor=2",
            f"--plot={plot}",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    scaling = report["rope_scaling"]
    assert (scaling["type"], scaling["factor"]) == ("yarn", 2.0)
    assert scaling["original_max_len"] == kvlab.base_config().train.seq_len  # --hf: its default
    assert [r["seq_len"] for r in report["perplexity"]] == [128, 160]
    assert all(r["ppl"] > 1 for r in report["perplexity"])
    assert [(r["task"], r["seq_len"]) for r in report["tasks"]] == [
        ("needle", 128),
        ("needle", 160),
        ("mqar", 128),
        ("mqar", 160),
    ]
    assert all(0 <= r["accuracy"] <= 1 and r["targets"] > 0 for r in report["tasks"])
    assert report["needle_plot"] == str(plot) and plot.read_bytes().startswith(b"\x89PNG")
