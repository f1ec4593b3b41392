"""The scripts on a local Hugging Face checkpoint: --hf, scripts/convert.py, refusals."""

import csv
import json
import shutil

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

import kvlab
from kvlab.checkpoints.convert import to_gqa, to_mla
from kvlab.checkpoints.hf import config_from_hf
from kvlab.config import base_config
from kvlab.data import make_dataset
from kvlab.eval import evaluate, full_precision
from kvlab.train import load_params
from tests.helpers import ROOT
from tests.test_scripts import run_script, user_error

LLAMA = ROOT / "tests" / "fixtures" / "hf" / "llama"  # 4 query heads, 2 KV heads, vocab 256
SHORT = [  # one small batch: the runs take seconds
    "--config.train.batch_size=2",
    "--config.train.seq_len=32",
    "--config.eval.batch_size=2",
    "--config.eval.num_batches=1",
    "--config.wandb.mode=disabled",
]
WORDS = "<unk> the cat sat on a mat key value cache".split()


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory):
    """The llama fixture plus a word-level tokenizer.json whose ids fit its 256."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    shutil.copytree(LLAMA, folder)
    backend = tokenizers.Tokenizer(
        models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(folder / "tokenizer.json"))
    return folder


def test_config_from_hf_takes_model_weights_source_and_tokenizer(llama_with_tokenizer):
    source, _ = kvlab.load_hf(LLAMA)
    cfg = base_config()
    cfg.model.num_layers = 5  # replaced whole by the checkpoint's
    cfg = config_from_hf(cfg, LLAMA)
    assert cfg.model.to_dict() == source.model.to_dict()
    assert cfg.train.init_from == str(LLAMA) and cfg.data.tokenizer == ""
    with_tokenizer = config_from_hf(base_config(), llama_with_tokenizer)
    assert with_tokenizer.data.tokenizer == str(llama_with_tokenizer)


def test_eval_hf_reports_perplexity_through_a_kivi_cache():
    # Windows of 64 tokens (--seq_len): past KIVI tiny's 32-token full-precision
    # window; RoPE positions halved for the evaluation (--rope_scaling).
    overrides = [arg.replace("--config.", "--cache.") for arg in SHORT if "seq_len" not in arg]
    result = run_script(
        "scripts/eval.py",
        f"--hf={LLAMA}",
        "--cache=configs/kv_kivi2.py:tiny",
        "--cache.eval.chunk=16",
        "--seq_len=64",
        "--rope_scaling=type=linear,factor=2",
        *overrides,
        "--json",
    )
    report = json.loads(result.stdout)
    assert report["hf"] == str(LLAMA) and report["targets"] == 2 * 64
    assert report["seq_len"] == 64 and report["rope_scaling"]["type"] == "linear"
    assert report["cache_bytes_per_token"] < report["baseline"]["cache_bytes_per_token"]
    # The baseline is the checkpoint's own perplexity through its full cache, same windows.
    cfg, params = kvlab.load_hf(LLAMA)
    cfg.model.rope_scaling = kvlab.config.parse_rope_scaling("type=linear,factor=2", 128)
    data = make_dataset(cfg.data, "validation", 64)
    cache = full_precision(kvlab.load_config(f"{ROOT}/configs/kv_kivi2.py:tiny").cache)
    expected = evaluate(cfg.model, cache, params, data.eval_batches(2, 1), chunk=16)
    assert report["baseline"]["ppl"] == pytest.approx(expected["ppl"], rel=1e-5)


def test_scripts_refuse_a_checkpoint_whose_tokenizer_is_missing(tmp_path):
    # A vocabulary other than the 256 bytes is never fed bytes: refused before anything runs.
    folder = tmp_path / "llama"
    shutil.copytree(LLAMA, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    for script in ("scripts/eval.py", "scripts/generate.py"):
        message = user_error(run_script(script, f"--hf={folder}", check=False))
        assert message.startswith(f"{str(folder)!r} holds no tokenizer.json, and its model's")


def test_generate_hf_uses_the_checkpoint_and_its_tokenizer(llama_with_tokenizer):
    result = run_script(
        "scripts/generate.py",
        f"--hf={llama_with_tokenizer}",
        "--max_new_tokens=3",
        "--end_token=-1",
        "--prompt=the cat sat",
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("GQA: 2 KV heads shared by 4 query heads; 2 layers")
    assert lines[0].endswith(f"weights of {llama_with_tokenizer}")
    # Words in, words out: every generated id decodes to a word of the tokenizer.
    prompt, _, tail = lines[1].partition(" -> ")
    assert prompt == "  [0] 'the cat sat'"
    assert all(word in WORDS for word in tail.strip("'").split()), tail


def test_quant_probe_hf_measures_the_checkpoint():
    args = ["--bits=16,4", "--seq_len=64", "--chunk=32", "--json"]
    result = run_script("scripts/quant_probe.py", f"--hf={LLAMA}", *args)
    report = json.loads(result.stdout)
    cfg, _ = kvlab.load_hf(LLAMA)
    assert report["config"]["model"] == json.loads(cfg.model.to_json())
    rows = {(row["k_bits"], row["v_bits"]): row for row in report["rows"]}
    assert rows[16, 16]["logit_max_abs_error"] == 0 and rows[4, 4]["kl_from_reference"] > 0


def test_convert_to_mqa_then_uptrain_from_it(tmp_path):
    out = tmp_path / "mqa"
    converted = run_script("scripts/convert.py", f"--hf={LLAMA}", "--to=gqa:1", f"--out={out}")
    assert "MQA: 1 KV head shared by 4 query heads" in converted.stdout
    cfg, params = kvlab.load_hf(out)
    assert cfg.model.num_kv_heads == 1
    (out / "generation_config.json").read_text()  # the source's other files come along
    expected_cfg, expected = to_gqa(*kvlab.load_hf(LLAMA), num_kv_heads=1)
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) * 7 % 256
    logits, _ = kvlab.Transformer(cfg.model).apply({"params": params}, tokens)
    reference, _ = kvlab.Transformer(expected_cfg.model).apply({"params": expected}, tokens)
    np.testing.assert_allclose(logits, reference, atol=1e-6)
    # train.py --hf OUT: one update at a vanishing learning rate keeps its weights.
    run_cfg = train_one_vanishing_step(f"--hf={out}", tmp_path / "run", params)
    assert run_cfg.train.init_from == str(out) and run_cfg.model.num_kv_heads == 1


def train_one_vanishing_step(start: str, workdir, params):
    """scripts/train.py from `start` (--hf=... or --init_from=...) for one update
    at lr 1e-9; checks the run kept `params` and returns its config."""
    run_script(
        "scripts/train.py",
        start,
        f"--workdir={workdir}",
        "--config.train.steps=1",
        "--config.train.lr=1e-9",
        "--config.train.warmup=0",
        "--config.train.checkpoint_every=1",
        *SHORT,
    )
    run_cfg, trained = load_params(str(workdir))
    same = jax.tree.map(lambda a, b: np.allclose(a, b, atol=1e-6), trained, params)
    assert jax.tree.all(same)
    return run_cfg


def test_convert_to_latent_attention_then_uptrain_from_it(tmp_path):
    out = tmp_path / "mla"
    converted = run_script(
        "scripts/convert.py",
        f"--hf={LLAMA}",
        "--to=mla:16,rope=2",
        f"--out={out}",
        "--calibration=2",
    )
    assert "MLA: a latent (kv_rank 16) shared by 4 query heads, 2 RoPE keys" in converted.stdout
    # A kvlab run whose step-0 checkpoint is to_mla's result on the same calibration windows.
    cfg, params = load_params(str(out))
    source_cfg = config_from_hf(base_config(), LLAMA)
    windows = make_dataset(source_cfg.data, "train", source_cfg.train.seq_len)
    tokens = windows.batch(0, 2, source_cfg.train.seed)["inputs"]
    expected_cfg, expected = to_mla(
        source_cfg, kvlab.load_hf(LLAMA)[1], 16, rope_pairs=2, tokens=tokens
    )
    assert cfg.model.to_dict() == expected_cfg.model.to_dict()
    assert jax.tree.all(jax.tree.map(np.array_equal, params, expected))
    # train.py --init_from OUT: the model from the conversion, one update at a vanishing rate.
    run_cfg = train_one_vanishing_step(f"--init_from={out}", tmp_path / "run", params)
    assert run_cfg.train.init_from == str(out) and run_cfg.model.mla.rope_heads == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["scripts/eval.py", f"--hf={LLAMA}", "--workdir=runs/x"],
            f"--workdir=runs/x and --hf={LLAMA} both name the weights to use: pass one of them",
        ),
        (
            ["scripts/eval.py"],
            "--workdir is not set: pass a training run's directory, or --hf",
        ),
        (
            [
                "scripts/train.py",
                f"--hf={LLAMA}",
                "--workdir=runs/x",
                "--config.model.num_layers=3",
            ],
            f"--config.model.num_layers=3: with --hf={LLAMA} the model section",
        ),
        (
            ["scripts/convert.py", f"--hf={LLAMA}", "--to=mla:32,rope=two", "--out=runs/x"],
            "'mla:32,rope=two': 'rope=two' is not an option of mla",
        ),
        (
            ["scripts/convert.py", f"--hf={LLAMA}", "--to=mla:999,select=high", "--out=runs/x"],
            "kv_rank=999 exceeds the full rank",
        ),
        (
            ["scripts/convert.py", f"--hf={LLAMA}", "--to=gqa:3", "--out=runs/x"],
            "num_kv_heads=3 does not divide the source's model.num_kv_heads=2",
        ),
    ],
)
def test_conflicting_or_invalid_flags_are_one_line(args, message):
    assert user_error(run_script(*args, check=False)).startswith(message)


def test_eval_says_when_the_text_holds_fewer_windows_than_asked(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("The KV cache holds keys and values. " * 60)  # 2,160 bytes: 108 held out
    result = run_script(
        "scripts/eval.py",
        f"--hf={LLAMA}",
        "--cache=configs/gqa.py:tiny",
        "--cache.data.source=text",
        f"--cache.data.path={text}",
        "--cache.train.seq_len=32",
        "--cache.eval.num_batches=8",
        "--json",
    )
    assert result.stderr.splitlines() == [
        "warning: eval.num_batches=8 x eval.batch_size=16 asks for 128 windows of 32 bytes, "
        f"but the validation split of {str(text)!r} holds 3: evaluating 1 batch of 3 windows"
    ]
    report = json.loads(result.stdout)
    assert report["windows"] == 3 and report["batches"] == 1 and report["targets"] == 3 * 32


def test_the_formats_experiment_compares_formats_at_their_bytes(llama_with_tokenizer, tmp_path):
    """experiments/formats.py on a small checkpoint: a row per format, the codebooks it
    calibrated kept beside the results, equal bytes but for the zero point's; with
    scales calibrated per head (no zero point there), the codes' bytes alone; an
    outlier a token costs the same bytes in every format; keys coded before RoPE."""
    out = tmp_path / "formats"
    args = ["--windows=2", "--length=32", "--bits=2", "--rotations=none", "--group_size=8"]
    args += ["--scales=group,head", "--outliers=0,1", "--keys_before_rope", f"--workdir={out}"]
    run_script("experiments/formats.py", f"--model=hf:{llama_with_tokenizer}", *args)
    report = json.loads((out / "results.json").read_text())
    assert report["keys_before_rope"] and report["key_groups"] == "token"
    apart = {(r["format"], r["scales"]): r for r in report["rows"] if r["outliers"] == 1}
    rows = {(r["format"], r["scales"]): r for r in report["rows"] if r["outliers"] == 0}
    assert set(apart) == set(rows)
    assert len({apart[f]["bytes_per_token"] - rows[f]["bytes_per_token"] for f in rows}) == 1
    grouped = {"int (symmetric)", "nf", "codebook"}
    assert set(rows) == {(f, "group") for f in grouped | {"int (zero point)"}} | {
        (f, "head") for f in grouped
    }
    same = {rows[f, "group"]["bytes_per_token"] for f in grouped}
    assert len(same) == 1 and rows["int (zero point)", "group"]["bytes_per_token"] > min(same)
    codes = {rows[f, "head"]["bytes_per_token"] for f in grouped}
    assert len(codes) == 1 and codes.pop() < same.pop()
    assert all(np.isfinite(r["kl_mean"]) and r["kl_mean"] >= 0 for r in rows.values())
    assert np.load(out / "codebooks_2bit_none.npz")["k"].shape[1] == 4
    assert np.load(out / "codebooks_2bit_none_head.npz")["k"].shape[1] == 4
    assert (np.load(out / "scales_none_head.npz")["k"] > 0).all()
    table = (out / "table.md").read_text()
    assert table.count("\n| 2 | none | group | 0 |") == 4
    assert table.count("\n| 2 | none | head | 0 |") == 3
    assert table.count("\n| 2 | none | head | 1 |") == 3
    assert (out / "formats.png").stat().st_size > 0


def test_the_storage_experiment_runs_every_recipe_at_its_bytes(llama_with_tokenizer, tmp_path):
    """experiments/storage.py on a small checkpoint: a row per recipe with what it
    calibrated kept beside the results; per-head scales store less than scales per
    group, a key sketch adds its bits and norm per key, and RULER scores the
    rows asked for and the bfloat16 cache; a recipe at matched bytes evicts to its
    share."""
    out = tmp_path / "storage"
    recipes = "fp8 per group,fp8 per head,KIVI-2,rotated codebook 2,rotated codebook 2 + sketch"
    args = ["--windows=2", "--length=96", "--group_size=8", "--ruler=KIVI-2"]
    recipes += ",codebook 2 per 8 channel groups,KVQuant-2,KVQuant-2 + first token"
    recipes += ",KIVI-4 + snapkv 50%"
    args += [f"--recipes={recipes},fp8 per head + snapkv at 0.125"]
    args += ["--ruler_tasks=niah_single_1"]
    args += ["--ruler_samples=1", f"--workdir={out}"]
    run_script("experiments/storage.py", f"--model=hf:{llama_with_tokenizer}", *args)
    report = json.loads((out / "results.json").read_text())
    rows = {r["recipe"]: r for r in report["rows"]}
    assert len(rows) == 10 and {"fp8 per head", "KIVI-2", "KVQuant-2"} <= set(rows)
    size = {name: r["bytes_per_token"] for name, r in rows.items()}
    assert size["fp8 per head"] < size["fp8 per group"]
    assert size["KIVI-4 + snapkv 50%"] < size["fp8 per head"]
    # at matched bytes: the most tokens that cost at most 12.5% of the bfloat16 cache
    full = report["reference"]["bytes_per_token"]
    assert 0.11 * full < size["fp8 per head + snapkv at 0.125"] <= 0.125 * full
    model = json.loads((llama_with_tokenizer / "config.json").read_text())
    keys = model["num_hidden_layers"] * model["num_key_value_heads"]
    assert size["rotated codebook 2 + sketch"] - size["rotated codebook 2"] == keys * (8 + 2)
    # the first token's key and value in bfloat16 per layer and KV head, over 96 tokens
    first = keys * model["hidden_size"] // model["num_attention_heads"] * 2 * 2
    added = size["KVQuant-2 + first token"] - size["KVQuant-2"]
    assert first // 96 <= added <= -(-first // 96) and added > 0
    assert all(np.isfinite(r["kl_mean"]) and r["kl_mean"] >= 0 for r in rows.values())
    assert [name for name, r in rows.items() if r["ruler"] is not None] == ["KIVI-2"]
    assert report["reference"]["ruler"] is not None
    assert (out / "scales_KVQuant-2.npz").exists() and (out / "codebooks_KVQuant-2.npz").exists()
    # levels per run of 8 channels: as many bytes as levels per layer (constants, not cache)
    with np.load(out / "codebooks_codebook_2_per_8_channel_groups.npz") as books:
        assert books["k"].shape == (model["num_hidden_layers"], 8, 4)
    assert size["codebook 2 per 8 channel groups"] == size["rotated codebook 2"]
    assert (out / "table.md").read_text().count("\n| ") == len(rows) + 1
    assert (out / "storage.png").stat().st_size > 0


def test_the_hybrid_experiment_trades_bytes_for_loss(llama_with_tokenizer, tmp_path):
    """experiments/hybrid.py on a small checkpoint: a row per pattern and window,
    the bytes of each as its cache counts them (a sliding layer's ring of 8 in
    place of every position), the loss change against every layer full."""
    out = tmp_path / "hybrid"
    args = ["--windows=2", "--length=96", "--sliding=8", "--patterns=1:1,all", "--long=192"]
    args += ["--sinks=0", "--quantized=1:1@8@2", "--group_size=8", f"--workdir={out}"]
    args += ["--ruler=all W8", "--ruler_tasks=niah_single_1", "--ruler_samples=1"]
    run_script("experiments/hybrid.py", f"--model=hf:{llama_with_tokenizer}", *args)
    report = json.loads((out / "results.json").read_text())
    rows = {r["label"]: r for r in report["rows"]}
    assert set(rows) == {"1:1 W8", "all W8", "1:1 W8 S2 4-bit"}
    full = report["reference"]["long_bytes_per_token"]
    assert rows["all W8"]["long_bytes_per_token"] < rows["1:1 W8"]["long_bytes_per_token"] < full
    assert rows["1:1 W8 S2 4-bit"]["bytes_per_token"] < rows["1:1 W8"]["bytes_per_token"]
    assert rows["1:1 W8"]["full_layers"] >= 1 and rows["all W8"]["full_layers"] == 0
    assert all(np.isfinite(r["loss_change"]) and r["ppl"] > 1 for r in rows.values())
    assert all(r["kl_mean"] > 0 for r in rows.values())  # against every layer full
    scored = {label: r["ruler"] for label, r in rows.items() if r["ruler"] is not None}
    assert list(scored) == ["all W8"] and 0 <= scored["all W8"] <= 100
    assert 0 <= report["reference"]["ruler"] <= 100
    assert (out / "table.md").read_text().count("\n| ") == 4
    assert (out / "hybrid.png").stat().st_size > 0


def test_benchmark_writes_the_leaderboard_and_resumes(llama_with_tokenizer, tmp_path):
    out = tmp_path / "benchmark"
    args = [
        "scripts/benchmark.py",
        f"--model=hf:{llama_with_tokenizer}",
        "--methods=knorm,qfilter,duo_attention,kvzip_head",
        "--ratios=0.5",
        "--tasks=niah_single_1,cwe",
        "--length=96",
        "--samples=1",
        f"--out={out}",
    ]
    run_script(*args)
    with open(out / "leaderboard.csv") as file:
        board = list(csv.DictReader(file))
    assert [(r["method"], r["ratio"]) for r in board] == [
        ("none", "0.0"),
        ("knorm", "0.5"),
        ("qfilter", "0.5"),
        ("duo_attention", "0.5"),
        ("kvzip_head", "0.5"),
    ]
    assert float(board[1]["bytes_per_token"]) < float(board[0]["bytes_per_token"])
    assert np.load(out / "qfilters.npz")["filters"].ndim == 3  # calibrated, kept with the run
    assert np.load(out / "duo_patterns.npz")["patterns"].ndim == 2
    assert np.load(out / "kvzip_heads.npz")["patterns"].ndim == 2
    assert set(board[0]) >= {"score", "niah_single_1", "cwe"}
    assert (out / "leaderboard.png").stat().st_size > 0
    results = (out / "results.csv").read_text()
    # Started again, it finds every cache done; other settings are refused.
    again = run_script(*args)
    assert "{" not in again.stdout and (out / "results.csv").read_text() == results
    other = run_script(*args[:-2], "--samples=2", f"--out={out}", check=False)
    assert "holds a benchmark run with other settings" in user_error(other)
