"""experiments/uptrain.py end to end at toy sizes: convert, uptrain, report, log."""

import json
import math

import jax
import numpy as np

import kvlab
from kvlab.logging import read_offline_run
from tests.helpers import run_experiment

STEPS, EVAL_EVERY = 2, 1
# name -> fraction of the source's cache
MODELS = {"gqa2": 1 / 2, "mla-1of4": 1 / 4}


def save_source(folder: str) -> None:
    """A random 1-layer MHA model (embed_dim 16, 4 heads of 16) in a Hugging Face
    folder, which its GQA-2 and 1/4-cache MLA conversions compute exactly: its KV
    heads are equal, so pooling them changes nothing, and its keys are zero on
    RoPE pairs 2..7, so the 2 pairs per head MLA keeps at 1/4 of the cache (0 and
    1) are all that matter, beside a latent of full rank (kv_rank 32 - 2 x 4 x 2
    = 16 = embed_dim)."""
    cfg = kvlab.load_config("configs/mha.py:tiny")
    cfg.model.update(num_layers=1, embed_dim=16, mlp_dim=32)
    # Drawn with numpy on init_params' shapes: compiling the init would take longer.
    shapes = jax.eval_shape(lambda: kvlab.init_params(cfg.model, jax.random.key(0)))
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        if path[-1].key == "scale":  # RMSNorm
            return np.ones(leaf.shape, np.float32)
        return rng.normal(0.0, 0.2, leaf.shape).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(draw, shapes)
    attention = params["block_0"]["attention"]
    for name in ("key", "value"):
        attention[name]["kernel"][:] = attention[name]["kernel"][:, :1]  # [D, K, H]
    attention["key"]["kernel"][..., [*range(2, 8), *range(10, 16)]] = 0  # pair p turns p, p + H/2
    kvlab.save_hf(cfg, params, folder)


def test_uptrain_experiment(tmp_path):
    source, out = str(tmp_path / "source"), tmp_path / "out"
    save_source(source)
    flags = [
        f"--workdir={out}",
        f"--source_hf={source}",
        f"--uptrain_steps={STEPS}",
        f"--eval_every={EVAL_EVERY}",
        "--gqa_kv_heads=2",
        "--mla_fractions=4",
        # MHA2MLA's choice of the highest-frequency pairs: 'norm' would pick the
        # same (the others are zero here) after an uncompiled forward pass.
        "--select=high",
        "--wandb",
        "--config.train.batch_size=4",
        "--config.train.seq_len=32",
        "--config.eval.batch_size=4",
        "--config.eval.num_batches=1",
        "--config.wandb.mode=offline",
    ]
    run_experiment("uptrain.py", flags)
    report = json.loads((out / "results.json").read_text())
    models = {m["name"]: m for m in report["models"]}
    assert list(models) == list(MODELS)
    source_ppl = report["source"]["ppl"]
    assert math.isfinite(source_ppl)
    for name, fraction in MODELS.items():
        m = models[name]
        assert m["cache_fraction"] == fraction, name
        steps, ppl = zip(*m["curve"], strict=True)
        assert steps == tuple(range(0, STEPS + 1, EVAL_EVERY))
        assert ppl[0] == m["ppl_before"] and ppl[-1] == m["ppl_after"]
        assert all(map(math.isfinite, ppl))
        # The first step's learning rate is 0 (warm-up from 0): uptraining starts
        # from exactly the converted model, as the folder init_from read holds it.
        np.testing.assert_allclose(ppl[1], ppl[0], rtol=1e-5)
        assert ppl[2] < ppl[0]  # a random model learns in one step
        # Both conversions compute the source (save_source).
        np.testing.assert_allclose(m["ppl_before"], source_ppl, rtol=1e-4)
    assert models["mla-1of4"]["attention"].startswith("MLA: a latent (kv_rank 16)")
    assert "| mla-1of4 |" in (out / "results.md").read_text()
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"

    for name in MODELS:  # each uptraining run logs itself, as train() does
        assert list((out / "models" / name / "uptrain" / "wandb").glob("offline-run-*"))
    (results_run,) = (out / "wandb").glob("offline-run-*")
    logged = read_offline_run(results_run)
    assert [row[0] for row in logged["tables"]["results"]["data"]] == ["source", *MODELS]
    curve = [row["val_ppl/mla-1of4"] for row in logged["history"] if "val_ppl/mla-1of4" in row]
    assert curve == [ppl for _, ppl in models["mla-1of4"]["curve"]]
