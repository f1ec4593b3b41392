"""Training (kvlab/train/loop.py, through its workdir, kvlab/train/workdir.py): the
loss falls, checkpoints round-trip, a resumed run is the same run (even when its
latest checkpoint is damaged), a non-finite loss or update stops the run without
touching the last good state, and so does a full disk, in one line naming the
file. One file: its tests share one trained run (`finished_run`)."""

import errno
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kvlab.config import base_config
from kvlab.files import WriteError
from kvlab.logging import read_offline_run
from kvlab.train import (
    DamagedCheckpoint,
    NonFiniteLoss,
    checkpoint_manager,
    load_params,
    load_run_config,
    restore,
    save,
    train,
)
from kvlab.train.workdir import _os_reason as workdir_reasons
from tests.full_disk import file_size_limit, run_python
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

    # Lose the checkpoint after step 2, as if the run had been killed before
    # saving it: the resumed run drops the metrics of steps 3-4 and logs them again.
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    resumed_state, history = train(cfg, tmp_path, progress=False)
    assert history[0]["step"] == 3 and history[0]["train/tokens_per_s"] > 0
    assert read_metrics(tmp_path) == uninterrupted
    assert_trees_equal(resumed_state, state)

    # A finished run is reused as it is, its config.json not even rewritten.
    stored = os.stat(tmp_path / "config.json")
    again, history = train(cfg, tmp_path, progress=False)
    assert history == []
    assert_trees_equal(again, state)
    unchanged = os.stat(tmp_path / "config.json")
    assert (unchanged.st_ino, unchanged.st_mtime_ns) == (stored.st_ino, stored.st_mtime_ns)
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


# ---------------------------------------------------------------------------
# Damaged checkpoints


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):
    """An uninterrupted run of 6 steps (checkpoints 2, 4, 6): its config, folder,
    final state and metrics."""
    workdir = tmp_path_factory.mktemp("finished")
    cfg = run_config(corpus, steps=6, checkpoint_every=2, log_every=1, eval_every=2)
    state, _ = train(cfg, workdir, progress=False)
    return cfg, workdir, state, read_metrics(workdir)


def largest_file(folder):
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def truncate(step_dir):
    data = largest_file(step_dir)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def delete(step_dir):
    largest_file(step_dir).unlink()


def other_arrays(step_dir):
    """Arrays that still restore, into other numbers (another step's, the step's own
    metadata kept): only the checksum sees it."""
    other = step_dir.parent / ("2" if step_dir.name != "2" else "4")
    shutil.rmtree(step_dir / "default")
    shutil.copytree(other / "default", step_dir / "default")


def empty_folder(step_dir):
    shutil.rmtree(step_dir)
    step_dir.mkdir()


@pytest.mark.parametrize(
    "damage, reason",
    [
        (truncate, "does not restore"),
        (delete, "does not restore"),
        (other_arrays, "does not match the checksum"),
        (empty_folder, "does not restore"),
    ],
)
def test_a_damaged_latest_checkpoint_resumes_from_the_one_before(
    finished_run, tmp_path, damage, reason
):
    cfg, finished, state, metrics = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    damage(workdir / "checkpoints" / "6")
    with pytest.warns(UserWarning, match=rf"checkpoint step 6 .* {reason}.*skipped it for step 4"):
        resumed, history = train(cfg, workdir, progress=False)
    assert history[0]["step"] == 5
    assert read_metrics(workdir) == metrics  # steps 5-6 replaced, not duplicated
    assert_trees_equal(resumed, state)
    assert (workdir / "damaged_checkpoints" / "6").is_dir()
    _, params = load_params(workdir, step=6)  # saved again, whole
    assert_trees_equal(params, state.params)


def test_load_params_names_the_steps_there_are_and_refuses_a_damaged_one(finished_run, tmp_path):
    cfg, finished, state, _ = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    with pytest.raises(ValueError, match=r"step=5 has no checkpoint .* holds steps \[2, 4, 6\]"):
        load_params(workdir, step=5)
    other_arrays(workdir / "checkpoints" / "4")
    with pytest.raises(DamagedCheckpoint, match="step 4 .* does not match the checksum") as error:
        load_params(workdir, step=4)
    assert str(error.value).endswith(": pass another step, or none for the newest that restores")
    # The reason is tensorstore's, under orbax's wrapper ('Encountered error while reading').
    truncated = tmp_path / "truncated"
    shutil.copytree(finished, truncated)
    truncate(truncated / "checkpoints" / "2")
    with pytest.raises(DamagedCheckpoint, match=r"step 2 .* does not restore \(ValueError: "):
        load_params(truncated, step=2)
    _, params = load_params(workdir, step=6)
    assert_trees_equal(params, state.params)

    # Without a step: the newest that restores, left where it is.
    other_arrays(workdir / "checkpoints" / "6")
    with pytest.warns(UserWarning) as warned:
        _, params = load_params(workdir)
    assert [str(w.message).split()[2] for w in warned] == ["6", "4"]
    assert all(str(w.message).endswith("skipped it for step 2") for w in warned)
    assert_trees_equal(params, load_params(workdir, step=2)[1])
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4", "6"]

    # When nothing restores, the run does not start over silently.
    for step in ("2", "4", "6"):
        empty_folder(workdir / "checkpoints" / step)
    with pytest.raises(ValueError, match=r"no checkpoint restores .* to start the run over"):
        train(cfg, workdir, progress=False)


# ---------------------------------------------------------------------------
# Resuming: metrics, wandb, the stored config, weights that overflow


def test_metrics_after_the_restored_step_and_torn_lines_are_dropped(finished_run, tmp_path):
    cfg, finished, state, metrics = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    shutil.rmtree(workdir / "checkpoints" / "6")  # killed after logging step 6, before saving
    with open(workdir / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "train/lo')  # and mid-line in a later start
    resumed, history = train(cfg, workdir, progress=False)
    assert [line["step"] for line in history] == [5, 6, 6]  # train 5, train 6, eval 6
    assert read_metrics(workdir) == metrics
    assert_trees_equal(resumed, state)


def test_a_restarted_run_logs_to_the_same_wandb_run(finished_run, tmp_path):
    cfg, finished, _, _ = finished_run
    cfg = ml_collections.ConfigDict(cfg.to_dict())  # the fixture's stays as it is
    cfg.wandb.mode = "offline"
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    ids = []
    for _ in range(2):  # two restarts, each from step 4
        shutil.rmtree(workdir / "checkpoints" / "6")
        train(cfg, workdir, progress=False)
        ids.append((workdir / "wandb_run_id").read_text().strip())
    runs = [read_offline_run(path) for path in sorted(workdir.glob("wandb/offline-run-*"))]
    assert len(runs) == 2 and {run["id"] for run in runs} == {ids[0]} == {ids[1]}
    assert [row["_step"] for row in runs[1]["history"]] == [5, 6]


def test_an_old_runs_config_loads_with_the_fields_added_since(finished_run, tmp_path):
    cfg, finished, state, _ = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    stored = json.loads(cfg.to_json())
    del stored["model"]["mla"], stored["cache"]["residual"], stored["eval"]
    (workdir / "config.json").write_text(json.dumps(stored))
    loaded = load_run_config(workdir)
    assert loaded.model.to_dict() == cfg.model.to_dict()
    assert loaded.cache.to_dict() == cfg.cache.to_dict()
    assert loaded.eval.to_dict() == base_config("tiny").eval.to_dict()
    # Resuming compares the completed sections: the same model is not "another" one.
    again, history = train(loaded, workdir, progress=False)
    assert history == [] and int(again.step) == 6


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the lr
def test_an_update_that_overflows_the_weights_is_not_kept(finished_run, tmp_path):
    """A learning rate beyond float32 turns the weights into inf/NaN in one update
    while that step's loss and gradient are finite: the step must not be kept,
    nor saved as the last good state."""
    cfg, finished, _, _ = finished_run
    cfg = ml_collections.ConfigDict(cfg.to_dict())  # the fixture's stays as it is
    cfg.train.update(steps=8, checkpoint_every=1, lr=1e39)  # finite in Python, inf in float32
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    with pytest.raises(NonFiniteLoss) as error:
        train(cfg, workdir, progress=False)
    message = str(error.value)
    assert message.startswith("step 7: params") and "latest checkpoint (step 6)" in message
    assert "loss=nan" not in message and "grad_norm=nan" not in message
    manager = checkpoint_manager(workdir, cfg.train)
    assert manager.all_steps() == [2, 4, 6]
    manager.close()
    _, params = load_params(workdir)
    assert all(bool(np.isfinite(p).all()) for p in jax.tree.leaves(params))


# ---------------------------------------------------------------------------
# A full disk


RUN_CONFIG = """
from kvlab.train import load_run_config


def get_config(workdir):
    return load_run_config(workdir)
"""


def test_a_checkpoint_the_disk_refuses_is_one_line_and_the_run_resumes(finished_run, tmp_path):
    """scripts/train.py resumes at step 2 past a 128 KiB file-size limit: the
    config and metrics fit, the arrays of checkpoint 4 do not."""
    cfg, finished, state, metrics = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    for step in ("4", "6"):  # as if killed after saving step 2
        shutil.rmtree(workdir / "checkpoints" / step)
    config = tmp_path / "run_config.py"
    config.write_text(RUN_CONFIG)
    # keep=1: orbax would delete step 2 once step 4 is saved, and must not before.
    args = [f"--config={config}:{workdir}", f"--workdir={workdir}", "--config.train.keep=1"]
    result = run_python(128 * 1024, "scripts/train.py", *args)
    assert result.returncode == 74, result.stderr[-3000:]
    # The lines besides the progress bar's (tqdm's, redrawn after each \r).
    lines = [line for line in result.stderr.splitlines() if line and not line.startswith("run:")]
    checkpoints = workdir / "checkpoints"
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(
        f"checkpoint step 4 was not saved in {checkpoints} (File too large, writing "
        "4.orbax-checkpoint-tmp/"
    ), lines[0]  # the whole line: which file orbax was writing when the limit hit
    assert lines[0].endswith(
        f"): free space on the disk holding {checkpoints} or raise the file-size limit "
        "(ulimit -f), then run again: training resumes from the last complete checkpoint, step 2"
    )
    assert os.listdir(checkpoints) == ["2"]  # the partial step 4 removed, step 2 whole

    resumed, history = train(cfg, workdir, progress=False)
    assert history[0]["step"] == 3
    assert read_metrics(workdir) == metrics
    assert_trees_equal(resumed, state)


def test_a_save_the_os_refuses_keeps_the_checkpoints_before(finished_run, tmp_path):
    _, finished, state, _ = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    checkpoints = workdir / "checkpoints"
    manager = checkpoint_manager(workdir, finished_run[0].train)
    try:
        # No file may grow at all: orbax's own first write fails, in Python or tensorstore.
        with file_size_limit(0), pytest.raises(WriteError) as caught:
            save(manager, state.replace(step=jnp.asarray(8, jnp.int32)))
        error = caught.value
        assert (error.errno, error.filename) == (errno.EFBIG, str(checkpoints / "8"))
        assert str(error).startswith(
            f"checkpoint step 8 was not saved in {checkpoints} (File too large"
        )
        assert str(error).endswith("training resumes from the last complete checkpoint, step 6")
    finally:
        manager.close()
    assert sorted(os.listdir(checkpoints)) == ["2", "4", "6"]
    _, params = load_params(workdir)
    assert_trees_equal(params, state.params)


# tensorstore's words for a write the OS refused, as orbax raises them: the file it
# was writing, alone or followed by the spec it was opening (escaped quotes inside).
_DATA = "/c/4.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/ocdbt.process_0/d/f7f0"
_REFUSED = (
    'OUT_OF_RANGE: Error writing "w0/0.0" in OCDBT database at local file "/c/4/": '
    f'Failed writing: "{_DATA}": Failed to write 111520 bytes to file 4: File too large '
    "[os_error_code='27']",
    'OUT_OF_RANGE: Error opening "zarr" driver: Error writing "w8/.zarray" in OCDBT '
    f'database at local file "/c/4/": Failed writing: "{_DATA}": Failed to write 111521 '
    'bytes to file 15: File too large [tensorstore_spec=\'{\\"create\\":true,'
    '\\"dtype\\":\\"float32\\",\\"store_data_equal_to_fill_value\\":true}\'] '
    "[os_error_code='27']",
)


@pytest.mark.parametrize("message", _REFUSED)
def test_the_file_tensorstore_was_writing_is_the_one_named(message):
    """The file is the one after 'Failed writing:', never a quoted word of the spec
    that may follow it; without one, no file is named."""
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = ValueError(message)
    assert workdir_reasons(wrapped) == (errno.EFBIG, "File too large", _DATA)
    unnamed = ValueError(message.replace(f'Failed writing: "{_DATA}": ', ""))
    assert workdir_reasons(unnamed) == (errno.EFBIG, "File too large", None)
    assert workdir_reasons(ValueError(message.replace("os_error_code", "code"))) is None


def test_a_metrics_line_the_disk_refuses_names_the_file(finished_run, tmp_path):
    cfg, finished, state, metrics = finished_run
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    shutil.rmtree(workdir / "checkpoints" / "6")
    # metrics.jsonl as the resume from step 4 leaves it, then not one byte more:
    # the line of step 5 does not fit.
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    kept = "".join(line for line in lines if json.loads(line)["step"] <= 4)
    with file_size_limit(len(kept.encode())), pytest.raises(WriteError) as caught:
        train(cfg, workdir, progress=False)
    assert str(caught.value) == (
        f"{path} was not written (File too large): free space on the disk holding {workdir} "
        "or raise the file-size limit (ulimit -f), then run again; training resumes from its "
        "last complete checkpoint"
    )
    assert path.read_text() == kept
    resumed, _ = train(cfg, workdir, progress=False)
    assert read_metrics(workdir) == metrics
    assert_trees_equal(resumed, state)


# ---------------------------------------------------------------------------
# Starting from given weights


def test_init_from_a_workdir_starts_from_its_weights(finished_run, tmp_path):
    cfg, workdir, state, _ = finished_run
    start = cfg.copy_and_resolve_references()
    start.train.update(init_from=str(workdir), steps=1, lr=1e-9, warmup=0, checkpoint_every=1)
    started, _ = train(start, tmp_path, progress=False)
    # One update at a vanishing learning rate: the weights are the source's.
    same = jax.tree.map(
        lambda a, b: np.allclose(np.asarray(a), np.asarray(b), atol=1e-6),
        started.params,
        state.params,
    )
    assert jax.tree.all(same)


def test_init_from_a_different_model_or_a_missing_folder_is_refused(finished_run, tmp_path):
    cfg, workdir, _, _ = finished_run
    other = cfg.copy_and_resolve_references()
    other.train.init_from = str(workdir)
    other.model.num_kv_heads = 1
    with pytest.raises(ValueError, match="model.num_kv_heads=4 but the config has 1"):
        train(other, tmp_path, progress=False)
    other.train.init_from = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="train.init_from=.* is not a directory"):
        train(other, tmp_path, progress=False)
