"""Real offline wandb runs, read back with wandb's reader; disabled runs stay silent.

Each wandb.init costs ~0.2-0.6 s (Run.finish shuts wandb-core down, so each
Run starts it), so the file makes few runs: one module-wide run that logs every
kind of value, and a few short ones.
"""

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import matplotlib
import pytest

import kvlab
from kvlab.logging import Run, read_offline_run
from tests.helpers import ROOT

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STEPS = range(0, 600, 10)  # 60 history rows
# A value longer than two of the .wandb file's 32 KiB blocks, so it is split
# across blocks in the file.
LONG_NOTE = "kv" * 40_000
COLUMNS = ["bits", "ppl", "kind"]
ROWS = [[16, 12.3, "dense"], [4, 12.875, "int"], [2, None, "int"]]


def wandb_section(tags=("tiny", "test"), group=""):
    cfg = kvlab.base_config("tiny")
    cfg.wandb.tags = tags
    cfg.wandb.group = group
    return cfg


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """One offline run logging config, history, summary, a table and an image."""
    tmp = tmp_path_factory.mktemp("logging")
    png = tmp / "pareto.png"
    figure, axes = plt.subplots(figsize=(2, 2))
    axes.plot([1, 2, 3], [3, 1, 2])
    figure.savefig(png)
    plt.close(figure)

    cfg = wandb_section()
    with pytest.MonkeyPatch.context() as patch:
        # wandb stages a copy of each logged table under its data dir (default
        # ~/.local/share/wandb) for a later sync; keep the test's copies in tmp.
        patch.setenv("WANDB_DATA_DIR", str(tmp / "wandb-data"))
        with Run(cfg.wandb, "mha", cfg.to_dict(), tmp / "work", "train", group="sweep-a") as run:
            for step in STEPS:
                run.log({"train/loss": 5.0 - step / 100, "train/lr": {"peak": 3e-3}}, step=step)
            run.log({"train/grad_norm": math.nan}, step=STEPS[-1])
            run.summary({"eval/ppl": 12.3, "eval/notes": LONG_NOTE})
            run.summary({"eval/worst_ppl": math.inf, "eval/probe": math.nan})
            run.table("results", columns=COLUMNS, rows=ROWS)
            run.image("pareto", png)
    # The bytes on disk the moment the `with` block ends: finish has returned.
    at_finish = next(Path(run.dir).glob("run-*.wandb")).read_bytes()
    return dict(
        run=run,
        cfg=cfg,
        png=png,
        workdir=tmp / "work",
        at_finish=at_finish,
        read=read_offline_run(run.dir),
    )


def run_copy(logged, tmp_path, data: bytes) -> Path:
    """A run folder holding `data` as its .wandb file, beside the logged run's media."""
    run_dir = tmp_path / "wandb" / "offline-run-copy"
    run_dir.mkdir(parents=True)
    (run_dir / "run-copy.wandb").write_bytes(data)
    (run_dir / "files").symlink_to(Path(logged["run"].dir) / "files")
    return run_dir


def test_run_dir_is_under_workdir(logged):
    run_dir = Path(logged["run"].dir)
    assert run_dir.parent == logged["workdir"] / "wandb"
    assert run_dir.name.startswith("offline-run-")
    assert run_dir.name.endswith(logged["run"].id)
    wandb_file = next(run_dir.glob("run-*.wandb"))
    assert wandb_file.stat().st_size > 2 * 32 * 1024


def test_finish_returns_once_the_run_is_written(logged, tmp_path):
    # wandb-core writes a run's tail after wandb's finish returns; Run.finish
    # waits for it, so a copy taken right after finish holds the whole run.
    read = read_offline_run(run_copy(logged, tmp_path, logged["at_finish"]))
    assert read["exit_code"] == 0
    assert read["history"] == logged["read"]["history"]
    assert read["summary"]["eval/notes"] == LONG_NOTE


def test_reads_back_run_fields_and_config(logged):
    read, cfg = logged["read"], logged["cfg"]
    assert read["id"] == logged["run"].id
    assert read["name"] == "mha"
    assert read["group"] == "sweep-a"  # the argument overrides cfg.wandb.group
    assert read["job_type"] == "train"
    assert read["tags"] == ["tiny", "test"]
    assert read["project"] == cfg.wandb.project
    assert read["exit_code"] == 0
    assert read["resume"] is False
    assert read["config"] == json.loads(json.dumps(cfg.to_dict()))  # tuples come back as lists


def test_reads_back_history(logged):
    history = logged["read"]["history"]
    assert [row["_step"] for row in history] == [*STEPS, STEPS[-1] + 1]
    for row, step in zip(history[: len(STEPS)], STEPS, strict=True):
        assert row["train/loss"] == pytest.approx(5.0 - step / 100)
        assert row["train/lr"] == {"peak": 3e-3}  # nested keys come back nested
    assert math.isnan(history[len(STEPS) - 1]["train/grad_norm"])
    # Without a step, the table joins the open row of the last step and the
    # image, logged after that row is written, starts the next one.
    assert history[-2]["results"]["_type"] == "table-file"
    assert history[-1]["pareto"]["_type"] == "image-file"
    assert "train/loss" not in history[-1]


def test_reads_back_summary(logged):
    summary = logged["read"]["summary"]
    assert summary["eval/ppl"] == 12.3
    assert summary["eval/notes"] == LONG_NOTE
    assert summary["eval/worst_ppl"] == math.inf
    assert summary["eval/probe"] is None  # wandb stores a NaN summary value as null
    assert summary["train/loss"] == pytest.approx(5.0 - STEPS[-1] / 100)
    assert summary["train/lr"] == {"peak": 3e-3}
    assert summary["results"]["_type"] == "table-file"
    assert "_wandb" not in summary


def test_reads_back_table_and_image(logged):
    read = logged["read"]
    assert read["tables"] == {"results": {"columns": COLUMNS, "data": ROWS}}
    [image] = read["images"]
    assert image["key"] == "pareto"
    assert image["step"] == STEPS[-1] + 1
    assert Path(image["path"]).read_bytes() == logged["png"].read_bytes()


def test_reader_warns_of_corrupt_data_and_reads_the_rest(logged, tmp_path):
    wandb_file = next(Path(logged["run"].dir).glob("run-*.wandb"))
    data = bytearray(wandb_file.read_bytes())
    data[data.index(LONG_NOTE[:1000].encode()) + 500] ^= 0xFF  # inside the long note's record
    with pytest.warns(UserWarning, match="corrupt"):
        read = read_offline_run(run_copy(logged, tmp_path, bytes(data)))
    assert "eval/notes" not in read["summary"]  # the damaged record is skipped
    assert read["history"] == logged["read"]["history"]
    assert read["exit_code"] == 0


def test_reader_reads_the_complete_part_of_a_truncated_file(logged, tmp_path):
    # A run killed mid-write leaves a partial last record: read what is complete. A
    # record is at least its 7-byte header, so of two cuts 3 bytes apart at most one
    # falls between records (where the reader sees a clean end and says nothing).
    data = next(Path(logged["run"].dir).glob("run-*.wandb")).read_bytes()
    said = []
    for cut in (10_000, 10_003):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            read = read_offline_run(run_copy(logged, tmp_path / str(cut), data[:cut]))
        said += [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        assert read["name"] == "mha" and read["exit_code"] is None
        assert 0 < len(read["history"]) < len(STEPS)
    assert any("incomplete" in message for message in said), said


def test_reader_names_a_folder_without_one_run_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds 0 run-.*wandb files"):
        read_offline_run(tmp_path)


def test_runs_in_one_process_are_separate(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    cfg = wandb_section(tags=(), group="from-config")
    first = Run(cfg.wandb, "first", {"seed": 1}, tmp_path, "train")
    first.log({"loss": 1.0}, step=0)
    first.finish()
    first.finish()  # a second finish does nothing
    with pytest.raises(RuntimeError, match="diverged"):
        with Run(cfg.wandb, "second", {"seed": 2}, tmp_path, "eval") as second:
            second.log({"loss": 2.0}, step=0)
            raise RuntimeError("loss diverged")

    assert first.dir != second.dir and first.id != second.id
    a, b = read_offline_run(first.dir), read_offline_run(second.dir)
    assert (a["name"], a["job_type"], a["config"]) == ("first", "train", {"seed": 1})
    assert (b["name"], b["job_type"], b["config"]) == ("second", "eval", {"seed": 2})
    assert a["exit_code"] == 0
    assert b["exit_code"] == 1  # the exception marks the run failed
    assert a["group"] == b["group"] == "from-config"
    assert a["tags"] == b["tags"] == []
    assert [row["loss"] for row in a["history"]] == [1.0]
    assert [row["loss"] for row in b["history"]] == [2.0]


def test_finishing_a_run_leaves_an_open_one_logging(tmp_path, monkeypatch):
    # finish shuts wandb-core down only once no Run is open.
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    cfg = wandb_section(tags=())
    with Run(cfg.wandb, "outer", {}, tmp_path, "sweep") as outer:
        outer.log({"loss": 1.0}, step=0)
        with Run(cfg.wandb, "inner", {}, tmp_path, "train") as inner:
            inner.log({"loss": 2.0}, step=0)
        outer.log({"loss": 3.0}, step=1)
    a, b = read_offline_run(outer.dir), read_offline_run(inner.dir)
    assert [row["loss"] for row in a["history"]] == [1.0, 3.0]
    assert [row["loss"] for row in b["history"]] == [2.0]
    assert a["exit_code"] == b["exit_code"] == 0


def test_resumed_offline_run_keeps_its_id_in_a_second_folder(tmp_path, monkeypatch):
    # Offline, each Run writes its own folder; the second is marked as resuming
    # the run id, and `wandb sync` uploads both, in order, into that one run.
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    cfg = wandb_section(tags=())
    with Run(cfg.wandb, "mha", {"seed": 1}, tmp_path, "train") as first:
        for step in range(3):
            first.log({"train/loss": 5.0 - step}, step=step)
    with Run(cfg.wandb, "mha", {"seed": 1}, tmp_path, "train", run_id=first.id) as second:
        assert second.id == first.id
        for step in range(3, 6):
            second.log({"train/loss": 5.0 - step}, step=step)

    folders = sorted(str(path) for path in (tmp_path / "wandb").glob("offline-run-*"))
    assert folders == sorted([first.dir, second.dir]) and first.dir != second.dir
    a, b = read_offline_run(first.dir), read_offline_run(second.dir)
    assert a["id"] == b["id"] == first.id
    assert (a["resume"], b["resume"]) == (False, True)
    assert [row["_step"] for row in a["history"] + b["history"]] == list(range(6))
    assert [row["train/loss"] for row in b["history"]] == [2.0, 1.0, 0.0]
    assert a["exit_code"] == b["exit_code"] == 0


def test_run_id_names_a_new_run(tmp_path, monkeypatch):
    # A run_id that no run has yet starts a run with that id ("allow").
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    with Run(wandb_section().wandb, "mha", {}, tmp_path, run_id="kvlab-test-7") as run:
        run.log({"train/loss": 1.0}, step=0)
    assert run.id == "kvlab-test-7"
    assert Path(run.dir).name.endswith("-kvlab-test-7")
    read = read_offline_run(run.dir)
    assert (read["id"], read["resume"]) == ("kvlab-test-7", True)


def test_disabled_run_prints_and_writes_nothing_and_never_imports_wandb(tmp_path):
    script = """
import sys
import kvlab
from kvlab.logging import Run

cfg = kvlab.base_config("tiny")
cfg.wandb.mode = "disabled"
with Run(cfg.wandb, "mha", cfg.to_dict(), "work", run_id="abc123") as run:
    run.log({"train/loss": 1.0}, step=0)
    run.summary({"eval/ppl": 1.0})
    run.table("results", columns=["a"], rows=[[1]])
    run.image("pareto", "no-such.png")
assert run.dir is None and run.id is None
print("wandb imported:", "wandb" in sys.modules)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "wandb imported: False\n"
    assert "wandb" not in result.stderr.lower()
    assert list(tmp_path.iterdir()) == []  # no workdir, no wandb/ folder


def test_unknown_mode_names_the_field(tmp_path):
    cfg = kvlab.base_config("tiny")
    cfg.wandb.mode = "dryrun"
    with pytest.raises(ValueError, match=r"wandb.mode='dryrun'.*offline, online, disabled"):
        Run(cfg.wandb, "mha", {}, tmp_path)
