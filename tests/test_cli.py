"""kvlab/cli.py: which errors reach the user as one line, and the words for a model's heads.

The scripts' behaviour through it (exit status, quiet logs, a shadowing clone)
is tested by running them, in tests/test_scripts.py.
"""

import numpy as np
import pytest

import kvlab
from kvlab import cli
from tests.helpers import ROOT, tiny_config


def caught(fn) -> BaseException:
    with pytest.raises(ValueError) as info:
        fn()
    return info.value


def test_a_value_error_kvlab_raises_is_the_users():
    cfg = tiny_config()
    cfg.model.num_kv_heads = 3
    assert cli.raised_by_kvlab(caught(lambda: kvlab.validate_config(cfg)))


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


def test_one_head_is_singular():
    assert cli.attention_label(tiny_config(num_heads=1, num_kv_heads=1).model) == (
        "MHA: 1 query head, 1 KV head"
    )
    assert cli.count(1, "row") == "1 row" and cli.count(0, "row") == "0 rows"
