"""The entry points run, read configs and overrides, and print honest numbers."""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

import kvlab
import kvlab.kernels.native as native
from kvlab.train import start_workdir
from tests.helpers import ROOT

# absl's log line format, used by absl, orbax and (through absl's handler) JAX.
INFO_LINE = re.compile(r"^I\d{4} ", re.M)


def run_script(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    kwargs = {"cwd": ROOT, **kwargs}
    result = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, **kwargs
    )
    if check and result.returncode:
        pytest.fail(f"{args} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def user_error(result: subprocess.CompletedProcess) -> str:
    """The one line a script printed for a mistake in its input (kvlab/cli.py)."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_readme_example_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"## The API\n.*?```python\n(.*?)```", readme, re.S).group(1)
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


@pytest.mark.parametrize("config", ["gqa", "mla"])
def test_attention_comparison_reproduces_deepseek_v2_table_1(config):
    result = run_script(
        "scripts/cache_size.py",
        "--config",
        f"configs/{config}.py:base",
        "--compare",
        "--lengths=8",
        "--batch_sizes=1",
        "--json",
    )
    comparison = json.loads(result.stdout)["attention_comparison"]
    width, rows = comparison["head_dim"], comparison["rows"]
    assert width == (64 if config == "gqa" else 128)
    by_name = {row["attention"].split(",")[0]: row for row in rows}
    assert by_name["MHA"]["elements_per_token_and_layer"] == 2 * 12 * width
    assert by_name["MQA"]["elements_per_token_and_layer"] == 2 * width
    mla = by_name["MLA"]
    # d_c = 4 d_h and d_R = d_h / 2 cache 4.5 d_h per layer: GQA with 2.25 groups.
    assert mla["elements_per_token_and_layer"] == 4 * width + width // 2
    assert mla["equivalent_gqa_groups"] == 2.25
    assert mla["bytes_per_token"] == 12 * (4 * width + width // 2) * 2  # 12 layers, bfloat16
    groups = sorted(
        row["equivalent_gqa_groups"] for row in rows if row["attention"] != mla["attention"]
    )
    assert groups == [1, 2, 3, 4, 6, 12]


@pytest.mark.parametrize("script", ["cache_size", "generate"])
def test_bad_override_prints_one_line_naming_the_field(script):
    result = run_script(
        f"scripts/{script}.py",
        "--config",
        "configs/gqa.py:tiny",
        "--config.model.num_kv_heads=3",
        check=False,
    )
    assert user_error(result).startswith("model.num_kv_heads=3 must divide model.num_heads=4")


def test_a_workdir_without_a_run_is_one_line(tmp_path):
    result = run_script("scripts/eval.py", f"--workdir={tmp_path}", check=False)
    assert user_error(result).startswith(f"workdir={str(tmp_path)!r} has no config.json")


def test_a_clone_named_kvlab_shadowing_the_package_is_named(tmp_path):
    clone = tmp_path / "kvlab"  # a checkout of the repository, seen from the folder above
    clone.mkdir()
    for name in ("kvlab", "configs", "scripts"):
        (clone / name).symlink_to(ROOT / name)
    args = ["kvlab/scripts/cache_size.py", "--config=kvlab/configs/gqa.py:tiny", "--json"]
    # Run by path, a script's own folder leads sys.path and the package is found.
    report = json.loads(run_script(*args, cwd=tmp_path).stdout)
    assert report["config"]["num_kv_heads"] == 2
    # With the folder above the clone on the path, `import kvlab` finds the clone.
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    message = user_error(run_script(*args, cwd=tmp_path, env=env, check=False))
    assert f"imported the folder {clone}, which has no __init__.py" in message
    assert "run from the repository root" in message


def test_bench_decode_reports_speedup_roofline_and_latent_paths():
    result = run_script(
        "scripts/bench_decode.py",
        "--config",
        "configs/mla.py:tiny",
        "--lengths=64",
        "--mla_lengths=32",
        "--steps=2",
        "--mla_steps=2",
        "--repeats=1",
        "--probe_mib=16",
        "--bits=16,4",
        "--evict=window:0.5",
        "--json",
    )
    report = json.loads(result.stdout)
    assert not INFO_LINE.search(result.stderr)
    cfg = kvlab.load_config(f"{ROOT}/configs/mla.py:tiny")
    params = kvlab.init_params(cfg.model, jax.random.key(0))
    assert report["weight_bytes"] == kvlab.tree_bytes(params)
    # Fused, then in 32-column panels for the native kernel where this machine builds it.
    assert report["weight_layout"] == ("panels" if native.available() else "fused")
    assert report["native_kernels"] == (native.unavailable_reason() or "available")
    assert set(report["bandwidth_bytes_per_s"]) == {"sum_16MiB", "matvec_8MiB"}
    bandwidth = max(report["bandwidth_bytes_per_s"].values())
    assert [row["seq_len"] for row in report["rows"]] == [64]
    for row in report["rows"]:
        # Two decode steps after the prompt, one row.
        assert row["cache_bytes"] == kvlab.cache_bytes(cfg.model, cfg.cache, 1, row["seq_len"] + 2)
        assert row["bytes_per_step"] == report["weight_bytes"] + row["cache_bytes"]
        assert row["cached_tokens_per_s"] == pytest.approx(1 / row["decode_step_s"])
        assert row["speedup"] == pytest.approx(
            row["cached_tokens_per_s"] / row["recompute_tokens_per_s"]
        )
        assert row["roofline_step_s"] == pytest.approx(row["bytes_per_step"] / bandwidth)
        assert row["roofline_fraction"] == pytest.approx(
            row["roofline_step_s"] / row["decode_step_s"]
        )
    (paths,) = report["mla_paths"]
    assert paths["seq_len"] == 32
    ratio = paths["absorbed_tokens_per_s"] / paths["expanded_tokens_per_s"]
    assert paths["absorbed_speedup"] == pytest.approx(ratio)
    widths = {(row["bits"], row["seq_len"]): row for row in report["bit_widths"]}
    assert set(widths) == {(16, 64), (4, 64)}
    for (bits, length), row in widths.items():
        first = widths[16, length]
        cache = cfg.cache.copy_and_resolve_references()
        cache.update(latent_bits=bits, rope_bits=bits)
        assert row["cache_bytes"] == kvlab.cache_bytes(cfg.model, cache, 1, length + 2)
        assert row["bytes_vs_first"] == pytest.approx(row["cache_bytes"] / first["cache_bytes"])
        assert row["speed_vs_first"] == pytest.approx(row["tokens_per_s"] / first["tokens_per_s"])
    assert widths[4, 64]["bytes_vs_first"] < 0.5
    evictions = {(row["evict"], row["seq_len"]): row for row in report["evictions"]}
    assert set(evictions) == {("full", 64), ("window:0.5", 64)}
    for (policy, length), row in evictions.items():
        cache = cfg.cache.copy_and_resolve_references()
        if policy != "full":
            cache.evict.update(method="window", ratio=0.5)
        assert row["cache_bytes"] == kvlab.cache_bytes(cfg.model, cache, 1, length + 2)
    # a ring of half the slots: half the latent bytes, plus the fixed per-row ints
    assert evictions["window:0.5", 64]["bytes_vs_first"] == pytest.approx(0.5, abs=0.01)


def test_bench_decode_times_calibrated_methods_on_its_own_artefacts(tmp_path):
    """qfilter, duo_attention and fast_kvzip read artefacts calibrated on the
    benchmark's own weights, in a temporary folder that is gone when it ends."""
    result = run_script(
        "scripts/bench_decode.py",
        "--lengths=32",
        "--steps=2",
        "--repeats=1",
        "--probe_mib=16",
        "--evict=qfilter:0.5,duo_attention:0.5,fast_kvzip:0.5",
        "--json",
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    rows = {row["evict"]: row for row in json.loads(result.stdout)["evictions"]}
    assert list(rows) == ["full", "qfilter:0.5", "duo_attention:0.5", "fast_kvzip:0.5"]
    for policy in ("qfilter:0.5", "duo_attention:0.5", "fast_kvzip:0.5"):
        assert rows[policy]["tokens_per_s"] > 0
        assert 0.4 < rows[policy]["bytes_vs_first"] < 0.7
    assert not list(tmp_path.glob("kvlab-bench-*"))


PROBE = ["--config", "configs/kv_kivi2.py:tiny", "--seq_len=128", "--chunk=32"]


@pytest.fixture(scope="module")
def random_probe() -> dict:
    """quant_probe.py's JSON for random weights of seed 3."""
    return json.loads(
        run_script("scripts/quant_probe.py", *PROBE, "--bits=16,4", "--seed=3", "--json").stdout
    )


def test_quant_probe_compares_every_key_and_value_width(random_probe):
    assert random_probe["weights"] == {"source": "random", "seed": 3}
    rows = {(row["k_bits"], row["v_bits"]): row for row in random_probe["rows"]}
    assert set(rows) == {(16, 16), (16, 4), (4, 16), (4, 4)}
    exact = rows[16, 16]
    assert exact["logit_max_abs_error"] == 0 and exact["top1_agreement"] == 1
    assert exact["attention_relative_error"] == 0 and exact["kl_from_reference"] == 0
    for pair in [(16, 4), (4, 16), (4, 4)]:
        assert rows[pair]["attention_relative_error"] > 0 and rows[pair]["kl_from_reference"] > 0
        assert rows[pair]["cache_bytes"] < exact["cache_bytes"]
    assert rows[4, 16]["logit_mean_abs_error"] != rows[16, 4]["logit_mean_abs_error"]


def test_quant_probe_measures_a_run_and_says_so(tmp_path, random_probe):
    """A run holding seed 3's weights measures as seed 3 does (one pair: K4V4),
    under a header naming the run and its step; contradicting inputs are
    one-line refusals."""
    cfg = kvlab.load_config(f"{ROOT}/configs/kv_kivi2.py:tiny")
    run = tmp_path / "run"
    fused = kvlab.fuse_projections(kvlab.init_params(cfg.model, jax.random.key(3)))
    start_workdir(cfg, fused, str(run))  # a fused tree is stored as the unfused one
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((run / "config.json").read_text())
    refused = {  # concurrently: a refusal is mostly interpreter start-up
        f"--workdir={run} and --hf=": [f"--workdir={run}", "--hf=tests/fixtures/hf/llama"],
        f"--seed=0 and --workdir={run} both name": [f"--workdir={run}", "--seed=0"],
        f"--config.model.num_layers=1: with --workdir={run}": [
            f"--workdir={run}",
            "--config.model.num_layers=1",
        ],
        f"--workdir={empty} holds no checkpoint": [f"--workdir={empty}"],
        "--step=4 picks a checkpoint: pass the run's --workdir": ["--step=4"],
    }
    pending = {
        start: subprocess.Popen(
            [sys.executable, "scripts/quant_probe.py", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for start, args in refused.items()
    }
    probe = run_script("scripts/quant_probe.py", *PROBE, "--bits=4", f"--workdir={run}")
    for start, process in pending.items():
        _, stderr = process.communicate(timeout=300)
        result = subprocess.CompletedProcess(process.args, process.returncode, "", stderr)
        assert user_error(result).startswith(start), stderr[-3000:]
    assert not (empty / "checkpoints").exists()  # nothing written into a run
    header, _, line = probe.stdout.splitlines()
    assert header == f"MHA: 4 query heads, 4 KV heads; weights trained in {run}, step 0"
    fields, row = line.split(), random_probe["rows"][-1]
    assert [int(f) for f in fields[:2]] == [row["k_bits"], row["v_bits"]] == [4, 4]
    for field, key, decimals in [
        (2, "attention_relative_error", 5),
        (3, "logit_mean_abs_error", 5),
        (5, "top1_agreement", 4),
        (6, "loss_change", 5),
    ]:
        assert float(fields[field]) == pytest.approx(row[key], abs=0.6 * 10**-decimals), key
    assert float(fields[4]) == pytest.approx(row["kl_from_reference"], rel=0.01)


def test_generate_demo_runs_quietly():
    result = run_script(
        "scripts/generate.py",
        "--config",
        "configs/mqa.py:tiny",
        "--max_new_tokens=5",
        "--sampler=top_k",
        "--prompt=ab",
        "--prompt=c",
    )
    assert result.stdout.startswith("MQA: 1 KV head shared by 4 query heads; 2 layers")
    assert re.search(
        r"cache K32V32 \(k and v in float32\), dense, every token kept: 2 rows x 7 tokens, "
        r"([\d,]+) bytes analytic, \1 measured",
        result.stdout,
    )
    assert not INFO_LINE.search(result.stderr), result.stderr


def test_train_then_eval_through_another_cache(tmp_path):
    short = [
        "--config.train.steps=4",
        "--config.train.batch_size=2",
        "--config.train.seq_len=32",
        "--config.train.checkpoint_every=4",
        "--config.eval.batch_size=2",
        "--config.eval.num_batches=1",
        "--config.wandb.mode=disabled",
    ]
    trained = run_script(
        "scripts/train.py", "--config", "configs/gqa.py:tiny", f"--workdir={tmp_path}", *short
    )
    assert (tmp_path / "checkpoints" / "4").is_dir()
    assert not INFO_LINE.search(trained.stderr)
    result = run_script(
        "scripts/eval.py",
        f"--workdir={tmp_path}",
        "--cache=configs/kv_k8v4.py:tiny",
        "--cache.cache.k_bits=4",
        "--json",
    )
    report = json.loads(result.stdout)
    assert report["targets"] == 2 * 32 and report["metric"] == "ppl"
    assert report["baseline"]["cache_bytes_per_token"] > report["cache_bytes_per_token"]
    assert report["delta_vs_full_pct"] == pytest.approx(
        100 * (report["ppl"] / report["baseline"]["ppl"] - 1)
    )
    assert report["cache"].startswith("K4V4 (k int per token, v int per token; groups of 16")
    assert report["baseline_cache"] == "K32V32 (k and v in float32), dense, every token kept"
    assert report["kl_mean"] > 0 and report["windows"] == 2 and report["batches"] == 1
    assert not INFO_LINE.search(result.stderr)
    # An evicting cache is compared with the full cache, not with itself at 16 bits.
    evicting = run_script(
        "scripts/eval.py",
        f"--workdir={tmp_path}",
        "--cache=configs/gqa.py:tiny",
        "--cache.cache.evict.method=window",
        "--cache.cache.evict.ratio=0.25",
    )
    lines = evicting.stdout.splitlines()
    assert lines[0] == (
        f"{tmp_path}: validation split, 2 windows of 32 tokens in 1 batch, 64 targets, chunks of 32"
    )
    assert lines[1] == (
        "        this cache K32V32 (k and v in float32), dense, window keeping 25% of the "
        "tokens per KV head"
    )
    assert lines[2] == "        full cache K32V32 (k and v in float32), dense, every token kept"
    change = re.search(r"^ppl change against the full cache: ([-+][\d.]+)%$", evicting.stdout, re.M)
    assert float(change.group(1)) != 0, evicting.stdout
    missing = run_script("scripts/eval.py", f"--workdir={tmp_path}", "--step=3", check=False)
    assert "step=3" in user_error(missing) and "[4]" in user_error(missing)
    # The trained model through generate.py: orbax's restore logs stay quiet too.
    generated = run_script(
        "scripts/generate.py", f"--workdir={tmp_path}", "--max_new_tokens=2", "--prompt=a"
    )
    assert f"trained in {tmp_path}" in generated.stdout
    assert not INFO_LINE.search(generated.stderr), generated.stderr


SWEEP_CONFIG = """
import ml_collections

from kvlab.config import base_config


def get_config(arg="tiny"):
    cfg = base_config(arg)
    cfg.sweep = ml_collections.ConfigDict(dict(name="two_units"))
    return cfg


def get_grid(cfg):
    caches = {"16bit": {}, "K8V4": {"cache.k_bits": 8, "cache.v_bits": 4}}
    return {"models": {"mqa": {"model.num_kv_heads": 1}}, "caches": caches}
"""


def test_sweep_slices_then_merge(tmp_path):
    config = tmp_path / "two_units.py"
    config.write_text(SWEEP_CONFIG)
    workdir = tmp_path / "sweep"
    short = [
        "--config.train.steps=2",
        "--config.train.batch_size=2",
        "--config.train.seq_len=32",
        "--config.eval.batch_size=2",
        "--config.eval.num_batches=1",
        "--config.wandb.mode=disabled",
    ]

    def sweep(*args, check=True):
        return run_script(
            "scripts/sweep.py",
            f"--config={config}",
            f"--workdir={workdir}",
            *short,
            *args,
            check=check,
        )

    first = sweep("--sweep_index=0", "--sweep_count=2")
    assert first.stdout.splitlines()[-1] == "slice 0 of 2: 1 row; merge with --merge"
    assert "1 of 2 units have no results yet" in user_error(sweep("--merge", check=False))
    sweep("--sweep_index=1", "--sweep_count=2")
    merged = sweep("--merge")
    # With wandb disabled there are no wandb runs to point to.
    assert merged.stdout.splitlines() == [
        f"2 results: {workdir / 'results.csv'}",
        f"plot: {workdir / 'pareto.png'}",
    ]
    assert not INFO_LINE.search(merged.stderr)


def test_serve_bench_matches_one_at_a_time(tmp_path):
    result = run_script(
        "scripts/serve_bench.py",
        "--requests=4",
        "--max_new_tokens=4",
        "--max_slots=2",
        "--json",
    )
    report = json.loads(result.stdout)
    assert report["outputs_equal"] and report["requests_equal"] == 4
    assert report["dtype"] == "float32"  # tiny: a difference would have failed the script
    assert report["weight_layout"] == ("panels" if native.available() else "fused")
    assert (report["requests"], report["max_new_tokens"], report["max_slots"]) == (4, 4, 2)
    # 16 tokens, at most one per slot and step.
    assert report["engine_steps"] >= 4 * 4 // 2
    assert report["speedup"] == pytest.approx(
        report["engine_tokens_per_s"] / report["one_at_a_time_tokens_per_s"]
    )


def test_paged_memory_experiment(tmp_path):
    run_script(
        "experiments/paged_memory.py", f"--workdir={tmp_path}", "--sequences=300", "--budget_gib=1"
    )
    report = json.loads((tmp_path / "results.json").read_text())
    contiguous, *paged = report["rows"]
    assert contiguous["waste"] > 0.5
    for row in paged:
        assert row["waste"] < contiguous["waste"]
        assert row["sequences_in_budget"] > contiguous["sequences_in_budget"]
        assert row["reserved_tokens"] >= report["used_tokens"]
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_prefix_sharing_experiment(tmp_path):
    run_script(
        "experiments/prefix_sharing.py",
        f"--workdir={tmp_path}",
        "--requests=6",
        "--system_len=40",
        "--user_len=4",
        "--max_new_tokens=3",
        "--max_slots=2",
        "--prefill_chunk=16",
    )
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["outputs_equal"]
    assert report["on"]["prefill_tokens_computed"] < report["off"]["prefill_tokens_computed"]
    assert report["off"]["prefill_tokens_computed"] == report["off"]["prompt_tokens"]


def test_device_check_runs_on_the_cpu_in_interpret_mode():
    """scripts/device_check.py as on an accelerator, on this CPU: each checked
    storage's kernel (interpreted) gives the XLA path's logits, and each timed
    cache's decode rows hold the roofline fraction of the bytes a step reads; a
    storage it does not know is one line naming the known ones."""
    result = run_script(
        "scripts/device_check.py",
        "--json",
        "--checked=MLA 4-bit",
        "--timed=paged",
        "--lengths=32",
        "--check_tokens=24",
    )
    report = json.loads(result.stdout)
    assert report["platform"] == "cpu" and report["interpreted"]
    assert [row["cache"] for row in report["kernels"]] == ["MLA 4-bit"]
    for row in report["kernels"]:
        assert row["max_abs_diff"] < 1e-4 and row["kernel_in_program"] is None
    bandwidth = max(report["bandwidth_bytes_per_s"].values())
    rows = report["decode"]
    assert [(r["attention_impl"], r["seq_len"]) for r in rows] == [("xla", 32), ("pallas", 32)]
    for row in rows:
        assert row["roofline_fraction"] == pytest.approx(
            row["bytes_per_step"] / bandwidth / row["decode_step_s"]
        )
    refused = run_script("scripts/device_check.py", "--timed=K5V5", check=False)
    assert user_error(refused).startswith("--timed=K5V5: not one of ['bf16'")
