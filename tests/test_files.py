"""Atomic writes: a file is replaced whole or not at all, and one the OS refuses
is named in one line with what to do; a working directory's stored JSON
refuses a different run and is not rewritten when unchanged."""

import errno
import os
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.files import WriteError, read_json, store_json, write_atomic
from tests.full_disk import file_size_limit


@given(data=st.one_of(st.binary(max_size=2000), st.text(max_size=500)))
def test_write_atomic_replaces_the_file_and_leaves_nothing_else(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("atomic")
    path = folder / "out"
    path.write_bytes(b"old contents")
    write_atomic(path, data)
    assert path.read_bytes() == (data.encode("utf-8") if isinstance(data, str) else data)
    assert os.listdir(folder) == ["out"]


def test_a_write_that_fails_midway_leaves_the_old_file_and_names_it(tmp_path):
    """A full disk, made real: the process may not grow a file past 1 KiB."""
    path = tmp_path / "results.csv"
    path.write_text("the old table\n")
    with file_size_limit(1024), pytest.raises(OSError) as caught:
        write_atomic(path, "x" * 100_000)
    error = caught.value
    assert isinstance(error, WriteError)  # an OSError still, as callers catch
    assert (error.errno, error.strerror, error.filename) == (
        errno.EFBIG,
        "File too large",
        str(path),
    )
    assert str(error) == (
        f"{path} was not written (File too large): free space on the disk holding {tmp_path} "
        "or raise the file-size limit (ulimit -f), then run again; the file is as it was "
        "and finished work is kept"
    )
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.EFBIG
    assert path.read_text() == "the old table\n"
    assert os.listdir(tmp_path) == ["results.csv"]  # no temporary file left
    copied = pickle.loads(pickle.dumps(error))  # as multiprocessing sends it
    assert (type(copied), str(copied), copied.errno) == (WriteError, str(error), errno.EFBIG)


def test_a_missing_folder_or_a_folder_in_the_way_is_named(tmp_path):
    # Creating the temporary file fails: there is no folder to hold it.
    missing = tmp_path / "never_made" / "sweep.json"
    with pytest.raises(WriteError) as caught:
        write_atomic(missing, "{}")
    assert caught.value.errno == errno.ENOENT and caught.value.filename == str(missing)
    assert str(caught.value).startswith(
        f"{missing} was not written (No such file or directory): create the folder "
        f"{missing.parent}, then run again"
    )
    # Renaming fails: the target is a folder, which stays as it was.
    in_the_way = tmp_path / "results.csv"
    (in_the_way / "inside").mkdir(parents=True)
    with pytest.raises(WriteError) as caught:
        write_atomic(in_the_way, "a,b\n")
    assert caught.value.errno == errno.EISDIR
    assert str(caught.value).startswith(f"{in_the_way} was not written (Is a directory): ")
    assert os.listdir(tmp_path) == ["results.csv"]
    assert os.listdir(in_the_way) == ["inside"]


def test_store_json_refuses_another_run_and_rewrites_only_changes(tmp_path):
    path = tmp_path / "config.json"
    run = {"model": {"num_kv_heads": 2}, "train": {"steps": 10, "tags": ()}}
    assert store_json(path, run, fixed=("model",), owner="a run")
    assert read_json(path) == {"model": {"num_kv_heads": 2}, "train": {"steps": 10, "tags": []}}

    before = os.stat(path)
    assert not store_json(path, run, fixed=("model",), owner="a run")
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    other = {"model": {"num_kv_heads": 1}, "train": {"steps": 10}}
    with pytest.raises(ValueError) as error:
        store_json(path, other, fixed=("model",), owner="a run")
    assert str(tmp_path) in str(error.value) and "another model section" in str(error.value)
    assert "use a fresh directory" in str(error.value)

    longer = {"model": {"num_kv_heads": 2}, "train": {"steps": 20}}  # a section free to change
    assert store_json(path, longer, fixed=("model",), owner="a run")
    assert read_json(path)["train"] == {"steps": 20}

    # A value that cannot be serialised fails before the file is touched.
    with pytest.raises(TypeError):
        store_json(path, {"model": {"num_kv_heads": 2}, "train": object()}, fixed=(), owner="")
    assert read_json(path)["train"] == {"steps": 20}
    assert os.listdir(tmp_path) == ["config.json"]


def test_damaged_json_is_named(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text('{"units": [["mha", "16bit"]')  # a write cut short
    with pytest.raises(ValueError, match=r"sweep.json' is not valid JSON"):
        store_json(path, {"units": []}, fixed=("units",), owner="a sweep")
    assert path.read_text() == '{"units": [["mha", "16bit"]'
