import ml_collections
import pytest

import kvlab
from kvlab.config import VARIANTS
from tests.helpers import ROOT

HEAD_SHARING = {"mha": None, "gqa": {"tiny": 2, "small": 2, "base": 4}, "mqa": 1}


@pytest.mark.parametrize("name", ["base", "mha", "gqa", "mqa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_config_files_load_and_select_head_sharing(name, variant):
    cfg = kvlab.load_config(f"{ROOT}/configs/{name}.py:{variant}")
    expected = {
        "base": cfg.model.num_heads,
        "mha": cfg.model.num_heads,
        "gqa": HEAD_SHARING["gqa"][variant],
        "mqa": 1,
    }[name]
    assert cfg.model.num_kv_heads == expected
    assert set(cfg) == {"model", "cache", "train", "data", "wandb"}


def test_overrides_are_revalidated():
    cfg = kvlab.load_config(f"{ROOT}/configs/gqa.py:tiny")
    cfg.model.num_kv_heads = 1
    assert kvlab.validate_config(cfg).model.num_kv_heads == 1
    cfg.model.num_kv_heads = 3
    with pytest.raises(ValueError, match=r"model.num_kv_heads=3 must divide model.num_heads=4"):
        kvlab.validate_config(cfg)


def _bad(section, field, value):
    """A tiny config with one field replaced, whatever its type (as a config file could)."""
    cfg = kvlab.base_config("tiny")
    fields = cfg[section].to_dict()
    fields[field] = value
    cfg[section] = ml_collections.ConfigDict(fields)
    return cfg


BAD_CONFIGS = [
    # (section, field, value, words the message must contain)
    ("model", "num_kv_heads", 3, "must divide model.num_heads=4"),
    ("model", "head_dim", 15, "odd"),
    ("model", "num_heads", 0, "below 1"),
    ("model", "num_layers", -2, "below 1"),
    ("model", "embed_dim", 0, "below 1"),
    ("model", "mlp_dim", 0, "below 1"),
    ("model", "vocab_size", 0, "below 1"),
    ("model", "num_kv_heads", 0, "below 1"),
    ("model", "head_dim", 2.5, "not an integer"),
    ("model", "rope_theta", 0.0, "not a positive number"),
    ("model", "norm_eps", -1e-6, "not a positive number"),
    ("model", "attention", "linear", "'gqa'"),
    ("model", "dtype", "float8", "'float32'"),
    ("model", "param_dtype", "fp32", "'bfloat16'"),
    ("model", "tie_embeddings", "yes", "not a bool"),
    ("cache", "kind", "ring", "'dense'"),
    ("cache", "dtype", "int8", "'float32'"),
    ("cache", "k_bits", 3, "16"),
    ("cache", "v_bits", 16.0, "16"),
    ("train", "steps", 0, "below 1"),
    ("train", "lr", -1.0, "not a positive number"),
    ("train", "weight_decay", -0.1, ">= 0"),
    ("data", "source", "web", "'stdlib'"),
    ("wandb", "mode", "cloud", "'offline'"),
]


@pytest.mark.parametrize("section,field,value,words", BAD_CONFIGS)
def test_bad_field_raises_naming_field_value_and_fix(section, field, value, words):
    cfg = _bad(section, field, value)
    with pytest.raises(ValueError) as error:
        kvlab.validate_config(cfg)
    message = str(error.value)
    assert message.startswith(f"{section}.{field}={value!r}")
    assert words in message


def test_text_source_needs_a_path():
    cfg = _bad("data", "source", "text")
    with pytest.raises(ValueError, match=r"data.path=''"):
        kvlab.validate_config(cfg)


def test_unknown_and_missing_fields_are_named():
    cfg = kvlab.base_config("tiny")
    cfg.model.num_kv_head = 2  # a typo of num_kv_heads
    with pytest.raises(ValueError, match=r"model.num_kv_head is not a kvlab config field"):
        kvlab.validate_config(cfg)
    cfg = kvlab.base_config("tiny")
    del cfg.cache["dtype"]
    with pytest.raises(ValueError, match=r"cache.dtype is missing"):
        kvlab.validate_config(cfg)


def test_bad_config_is_refused_by_the_model_and_cache_before_compiling():
    cfg = _bad("model", "num_kv_heads", 3)
    with pytest.raises(ValueError, match="model.num_kv_heads=3"):
        kvlab.Transformer(cfg.model)
    with pytest.raises(ValueError, match="model.num_kv_heads=3"):
        kvlab.init_cache(cfg.model, kvlab.base_config("tiny").cache, batch_size=1, max_len=8)


@pytest.mark.parametrize(
    "spec,words",
    [
        ("configs/nope.py:tiny", "does not exist"),
        ("configs/gqa.py:huge", "variant 'huge' is unknown"),
    ],
)
def test_bad_config_spec(spec, words):
    with pytest.raises(ValueError, match=words):
        kvlab.load_config(f"{ROOT}/{spec}")
