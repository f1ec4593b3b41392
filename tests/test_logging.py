"""Real offline wandb runs, read back from their .wandb files; disabled runs stay silent.

Each wandb.init costs up to a second (the first starts wandb-core), so the file
makes three runs: one module-wide run that logs every kind of value, and two
short ones in a row.
"""

import json
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

import kvlab
from kvlab.logging import Run, read_offline_run
from tests.helpers import ROOT

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STEPS = range(0, 600, 10)  # 60 history rows: the .wandb file spans several 32 KiB blocks
# A value longer than two blocks, so the reader must join FIRST, MIDDLE and LAST chunks.
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
            run.summary({"eval/ppl": 12.3, "eval/notes": LONG_NOTE})
            run.table("results", columns=COLUMNS, rows=ROWS)
            run.image("pareto", png)
    return dict(run=run, cfg=cfg, png=png, workdir=tmp / "work", read=read_offline_run(run.dir))


def test_run_dir_is_under_workdir(logged):
    run_dir = Path(logged["run"].dir)
    assert run_dir.parent == logged["workdir"] / "wandb"
    assert run_dir.name.startswith("offline-run-")
    wandb_file = next(run_dir.glob("run-*.wandb"))
    assert wandb_file.stat().st_size > 2 * 32 * 1024


def test_reads_back_run_fields_and_config(logged):
    read, cfg = logged["read"], logged["cfg"]
    assert read["name"] == "mha"
    assert read["group"] == "sweep-a"  # the argument overrides cfg.wandb.group
    assert read["job_type"] == "train"
    assert read["tags"] == ["tiny", "test"]
    assert read["project"] == cfg.wandb.project
    assert read["exit_code"] == 0
    assert read["config"] == json.loads(json.dumps(cfg.to_dict()))  # tuples come back as lists


def test_reads_back_history(logged):
    history = logged["read"]["history"]
    assert [row["_step"] for row in history] == [*STEPS, STEPS[-1] + 1]
    for row, step in zip(history[: len(STEPS)], STEPS, strict=True):
        assert row["train/loss"] == pytest.approx(5.0 - step / 100)
        assert row["train/lr"] == {"peak": 3e-3}  # nested keys come back nested
    # Without a step, the table joins the open row of the last step and the
    # image, logged after that row is written, starts the next one.
    assert history[-2]["results"]["_type"] == "table-file"
    assert history[-1]["pareto"]["_type"] == "image-file"
    assert "train/loss" not in history[-1]


def test_reads_back_summary(logged):
    summary = logged["read"]["summary"]
    assert summary["eval/ppl"] == 12.3
    assert summary["eval/notes"] == LONG_NOTE
    assert summary["train/loss"] == pytest.approx(5.0 - STEPS[-1] / 100)
    assert summary["results"]["_type"] == "table-file"
    assert "_wandb" not in summary


def test_reads_back_table_and_image(logged):
    read = logged["read"]
    assert read["tables"] == {"results": {"columns": COLUMNS, "data": ROWS}}
    [image] = read["images"]
    assert image["key"] == "pareto"
    assert image["step"] == STEPS[-1] + 1
    assert Path(image["path"]).read_bytes() == logged["png"].read_bytes()


def test_reader_rejects_a_corrupt_file(logged, tmp_path):
    wandb_file = next(Path(logged["run"].dir).glob("run-*.wandb"))
    data = bytearray(wandb_file.read_bytes())
    data[40_000] ^= 0xFF
    corrupt = tmp_path / wandb_file.name
    corrupt.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        read_offline_run(corrupt)


def test_reader_stops_at_a_truncated_tail(logged, tmp_path):
    # A run killed mid-write leaves a partial last chunk: read what is complete.
    wandb_file = next(Path(logged["run"].dir).glob("run-*.wandb"))
    cut = tmp_path / wandb_file.name
    cut.write_bytes(wandb_file.read_bytes()[:10_000])
    read = read_offline_run(cut)
    assert read["name"] == "mha" and read["exit_code"] is None
    assert 0 < len(read["history"]) < len(STEPS)


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

    assert first.dir != second.dir
    a, b = read_offline_run(first.dir), read_offline_run(second.dir)
    assert (a["name"], a["job_type"], a["config"]) == ("first", "train", {"seed": 1})
    assert (b["name"], b["job_type"], b["config"]) == ("second", "eval", {"seed": 2})
    assert a["exit_code"] == 0
    assert b["exit_code"] == 1  # the exception marks the run failed
    assert a["group"] == b["group"] == "from-config"
    assert a["tags"] == b["tags"] == []
    assert [row["loss"] for row in a["history"]] == [1.0]
    assert [row["loss"] for row in b["history"]] == [2.0]


def test_disabled_run_writes_nothing_and_never_imports_wandb(tmp_path):
    workdir = tmp_path / "work"
    script = f"""
import sys
import kvlab
from kvlab.logging import Run

cfg = kvlab.base_config("tiny")
cfg.wandb.mode = "disabled"
with Run(cfg.wandb, "mha", cfg.to_dict(), {str(workdir)!r}) as run:
    run.log({{"train/loss": 1.0}}, step=0)
    run.summary({{"eval/ppl": 1.0}})
    run.table("results", columns=["a"], rows=[[1]])
    run.image("pareto", "no-such.png")
assert run.dir is None
print("wandb imported:", "wandb" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "wandb imported: False"
    assert not workdir.exists()


def test_unknown_mode_names_the_field(tmp_path):
    cfg = kvlab.base_config("tiny")
    cfg.wandb.mode = "dryrun"
    with pytest.raises(ValueError, match=r"wandb.mode='dryrun'.*offline, online, disabled"):
        Run(cfg.wandb, "mha", {}, tmp_path)
