"""The entry points run, read configs and overrides, and print honest numbers."""

import json
import re
import subprocess
import sys

import pytest

import kvlab
from tests.helpers import ROOT


def run_script(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if check and result.returncode:
        pytest.fail(f"{args} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def test_readme_example_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"## The API\n\n```python\n(.*?)```", readme, re.S).group(1)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["out"].shape == (2, 35)


def test_cache_size_json_matches_the_library_and_takes_overrides():
    result = run_script(
        "scripts/cache_size.py",
        "--config",
        "configs/gqa.py:tiny",
        "--config.model.num_kv_heads=1",
        "--lengths=16,4096",
        "--batch_sizes=1,3",
        "--json",
    )
    report = json.loads(result.stdout)
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:tiny")
    cfg.model.num_kv_heads = 1
    assert report["config"]["num_kv_heads"] == 1
    assert len(report["rows"]) == 4
    for row in report["rows"]:
        expected = kvlab.cache_bytes(cfg.model, cfg.cache, row["batch_size"], row["seq_len"])
        assert row["cache_bytes"] == row["measured_bytes"] == expected
    # Past this many cached tokens the cache is larger than the weights.
    crossover = report["tokens_where_cache_exceeds_weights"]
    assert (crossover - 1) * report["cache_bytes_per_token"] < report["weights_bytes"]
    assert crossover * report["cache_bytes_per_token"] >= report["weights_bytes"]


def test_bad_override_fails_with_the_field_named():
    result = run_script(
        "scripts/cache_size.py",
        "--config",
        "configs/gqa.py:tiny",
        "--config.model.num_kv_heads=3",
        check=False,
    )
    assert result.returncode != 0
    assert "model.num_kv_heads=3 must divide model.num_heads=4" in result.stderr


def test_bench_decode_reports_speedup_and_roofline():
    result = run_script(
        "scripts/bench_decode.py",
        "--config",
        "configs/mqa.py:tiny",
        "--lengths=32,64",
        "--steps=4",
        "--repeats=1",
        "--probe_mib=16",
        "--json",
    )
    report = json.loads(result.stdout)
    assert [row["seq_len"] for row in report["rows"]] == [32, 64]
    for row in report["rows"]:
        assert row["cached_tokens_per_s"] > 0 and row["recompute_tokens_per_s"] > 0
        assert row["roofline_fraction"] > 0
        assert row["bytes_per_step"] == report["weight_bytes"] + row["cache_bytes"]


def test_generate_demo_runs():
    result = run_script(
        "scripts/generate.py",
        "--config",
        "configs/mqa.py:tiny",
        "--max_new_tokens=5",
        "--sampler=top_k",
        "--prompt=ab",
        "--prompt=c",
    )
    assert "sharing 1 KV heads" in result.stdout
    assert re.search(
        r"cache: 2 rows x 7 tokens in float32: ([\d,]+) bytes analytic, \1 measured", result.stdout
    )
