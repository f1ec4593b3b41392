"""kvlab/cli.py: which errors reach the user as one line, and the words for a model's heads.

The scripts' behaviour through it (exit status, quiet logs, a shadowing clone)
is tested by running them, in tests/test_scripts.py; a script on a full disk here.
"""

import os

import numpy as np
import pytest

import kvlab
from kvlab import cli
from kvlab.files import WriteError, write_atomic
from tests.full_disk import run_python
from tests.helpers import ROOT, tiny_config


def caught(fn) -> BaseException:
    with pytest.raises(ValueError) as info:
        fn()
    return info.value


def test_a_value_error_kvlab_raises_is_the_users():
    cfg = tiny_config()
    cfg.model.num_kv_heads = 3
    assert cli.raised_by_kvlab(caught(lambda: kvlab.validate_config(cfg)))


def test_a_write_the_os_refuses_is_the_users(tmp_path):
    with pytest.raises(WriteError) as caught:
        write_atomic(tmp_path / "missing" / "results.csv", "a,b\n")
    assert cli.raised_by_kvlab(caught.value)


def test_a_script_on_a_full_disk_prints_one_line_naming_the_file(tmp_path):
    """scripts/train.py's first write, the run's config.json, past a 1 KiB file-size limit."""
    workdir = tmp_path / "run"
    result = run_python(1024, "scripts/train.py", f"--workdir={workdir}")
    assert result.returncode == cli.WRITE_ERROR_STATUS == 74, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"{workdir / 'config.json'} was not written (File too large): free space on the disk "
        f"holding {workdir} or raise the file-size limit (ulimit -f), then run again; the file "
        "is as it was and finished work is kept"
    ]
    assert os.listdir(workdir) == []  # no config.json, no temporary file


def test_a_value_error_from_below_kvlab_is_a_bug():
    # Raised inside NumPy, or by code outside the package and the running script.
    assert not cli.raised_by_kvlab(caught(lambda: np.ones(3).reshape(2, 2)))
    assert not cli.raised_by_kvlab(caught(lambda: np.concatenate([np.ones(2), np.ones((2, 2))])))
    assert not cli.raised_by_kvlab(ValueError("never raised"))


@pytest.mark.parametrize(
    "config, label",
    [
        ("mha", "MHA: 4 query heads, 4 KV heads"),
        ("gqa", "GQA: 2 KV heads shared by 4 query heads"),
        ("mqa", "MQA: 1 KV head shared by 4 query heads"),
        ("mla", "MLA: a latent (kv_rank 64) and a RoPE key (rope_dim 8) shared by 4 query heads"),
    ],
)
def test_attention_label(config, label):
    cfg = kvlab.load_config(f"{ROOT}/configs/{config}.py:tiny")
    assert cli.attention_label(cfg.model) == label


def test_attention_label_names_layers_sharing_a_cache():
    assert cli.attention_label(tiny_config(num_layers=5, topology="cla:2").model) == (
        "MHA: 4 query heads, 4 KV heads; cla:2, 5 layers cache 3"
    )


def test_one_head_is_singular():
    assert cli.attention_label(tiny_config(num_heads=1, num_kv_heads=1).model) == (
        "MHA: 1 query head, 1 KV head"
    )
    assert cli.count(1, "row") == "1 row" and cli.count(0, "row") == "0 rows"
