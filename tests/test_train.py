"""Training: the loss falls, checkpoints round-trip, a resumed run is the same
run, and a non-finite loss stops the run without touching the last good state."""

import json
import shutil

import jax
import numpy as np
import pytest

from kvlab.train import NonFiniteLoss, checkpoint_manager, load_params, restore, train
from tests.helpers import run_config, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def assert_trees_equal(a, b):
    same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)
    assert jax.tree.all(same)


def read_metrics(workdir):
    """The logged lines without the wall-clock throughput."""
    with open(workdir / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    return [{k: v for k, v in line.items() if k != "train/tokens_per_s"} for line in lines]


def test_training_lowers_the_loss(corpus, tmp_path):
    cfg = run_config(corpus, steps=40, lr=3e-3, log_every=5, eval_every=20, checkpoint_every=40)
    _, history = train(cfg, tmp_path, progress=False)
    losses = [line["train/loss"] for line in history if "train/loss" in line]
    evals = [line["eval/loss"] for line in history if "eval/loss" in line]
    assert len(losses) == 8 and len(evals) == 2
    assert losses[-1] < 0.7 * losses[0]  # from ~ln 256 towards the corpus' entropy
    assert evals[-1] < evals[0]
    assert len(history) == len(read_metrics(tmp_path))


def test_resumed_run_continues_the_same_curve_bitwise(corpus, tmp_path):
    cfg = run_config(corpus, steps=4, checkpoint_every=2, log_every=1, eval_every=2)
    state, _ = train(cfg, tmp_path, progress=False)
    uninterrupted = read_metrics(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4"]

    # Saved and restored state round-trips bitwise.
    manager = checkpoint_manager(tmp_path, cfg.train)
    assert_trees_equal(restore(manager, state), state)
    manager.close()

    # Lose everything after step 2, as if the run had been killed there.
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in uninterrupted if line["step"] <= 2)
    )
    resumed_state, history = train(cfg, tmp_path, progress=False)
    assert history[0]["step"] == 3 and history[0]["train/tokens_per_s"] > 0
    assert read_metrics(tmp_path) == uninterrupted
    assert_trees_equal(resumed_state, state)

    # A finished run is reused as it is.
    again, history = train(cfg, tmp_path, progress=False)
    assert history == []
    assert_trees_equal(again, state)
    _, params = load_params(tmp_path)
    assert_trees_equal(params, state.params)

    # The directory holds this model; another one is refused.
    cfg.model.num_kv_heads = 1
    with pytest.raises(ValueError, match="another model section"):
        train(cfg, tmp_path, progress=False)
    with pytest.raises(ValueError, match="no config.json"):
        load_params(tmp_path / "nowhere")


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    # A learning rate this large overflows the logits within a few steps.
    cfg = run_config(corpus, steps=20, lr=1e30, clip=1e30, checkpoint_every=1, log_every=1)
    with pytest.raises(NonFiniteLoss, match=r"step (\d+).*latest checkpoint") as error:
        train(cfg, tmp_path, progress=False)
    bad_step = int(error.value.args[0].split()[1].rstrip(":"))
    cfg_back, params = load_params(tmp_path)
    manager = checkpoint_manager(tmp_path, cfg.train)
    assert manager.latest_step() == bad_step - 1
    manager.close()
    assert all(bool(np.isfinite(p).all()) for p in jax.tree.leaves(params))
    assert all(np.isfinite(line.get("train/loss", 0.0)) for line in read_metrics(tmp_path))


def test_bfloat16_compute_trains_float32_weights(corpus, tmp_path):
    cfg = run_config(corpus, steps=2, checkpoint_every=2, log_every=1)
    cfg.model.dtype = "bfloat16"
    state, history = train(cfg, tmp_path, progress=False)
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(state.params))
    assert all(np.isfinite(line["train/loss"]) for line in history if "train/loss" in line)
    assert history[-1]["eval/loss"] < np.log(256) + 0.5
