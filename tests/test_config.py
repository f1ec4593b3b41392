import math
import re

import ml_collections
import pytest

import kvlab
from kvlab.config import VARIANTS, complete_config, eval_seq_len, parse_rope_scaling
from tests.helpers import ROOT

GQA_KV_HEADS = {"tiny": 2, "small": 2, "base": 4}


@pytest.mark.parametrize("name", ["base", "mha", "gqa", "mqa", "mla"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_config_files_load_and_select_the_attention(name, variant):
    cfg = kvlab.load_config(f"{ROOT}/configs/{name}.py:{variant}")
    expected = {
        "base": cfg.model.num_heads,
        "mha": cfg.model.num_heads,
        "gqa": GQA_KV_HEADS[variant],
        "mqa": 1,
        "mla": cfg.model.num_heads,
    }[name]
    assert cfg.model.num_kv_heads == expected
    assert cfg.model.attention == ("mla" if name == "mla" else "gqa")
    assert set(cfg) == {"model", "cache", "train", "data", "eval", "wandb", "mesh"}


def test_mla_base_has_deepseek_v2_attention_widths():
    mla = kvlab.load_config(f"{ROOT}/configs/mla.py:base").model.mla
    assert (mla.kv_rank, mla.rope_dim, mla.nope_dim, mla.v_head_dim) == (512, 64, 128, 128)


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
    ("model", "rope_theta", 0.0, "not a finite number > 0"),
    ("model", "rope_theta", math.inf, "not a finite number > 0"),
    ("model", "norm_eps", -1e-6, "not a finite number > 0"),
    ("model", "attention", "linear", "'gqa', 'mla'"),
    ("model", "dtype", "float8", "'float32'"),
    ("model", "param_dtype", "fp32", "'bfloat16'"),
    ("model", "tie_embeddings", "yes", "not a bool"),
    ("cache", "kind", "ring", "'dense'"),
    ("cache", "dtype", "int8", "'float32'"),
    ("cache", "k_bits", 5, "16"),
    ("cache", "v_bits", 16.0, "16"),
    ("train", "steps", 0, "below 1"),
    ("train", "lr", -1.0, "not a finite number > 0"),
    ("train", "lr", math.inf, "not a finite number > 0"),
    ("train", "lr", math.nan, "not a finite number > 0"),
    ("train", "weight_decay", -0.1, "not a finite number >= 0"),
    ("train", "weight_decay", math.nan, "not a finite number >= 0"),
    ("train", "weight_decay", math.inf, "not a finite number >= 0"),
    ("train", "clip", math.inf, "not a finite number > 0"),
    ("train", "clip", 0.0, "not a finite number > 0"),
    ("train", "warmup", math.inf, "not an integer"),
    ("train", "warmup", -1, "below 0"),
    ("train", "seed", 2**32, "set train.seed in 0..4294967295"),
    ("train", "seed", 2**32 + 7, "it would act as 7"),
    ("train", "seed", -1, "below 0"),
    ("model", "vocab_size", 100, "below the 256 byte values data.source='stdlib'"),
    ("data", "source", "web", "'stdlib'"),
    ("wandb", "mode", "cloud", "'offline'"),
    ("eval", "seq_len", -1, "below 0"),
    ("eval", "seq_len", 1.5, "not an integer"),
    ("eval", "tasks", "needle", "not a tuple"),
    ("eval", "tasks", ("needle", "haystack"), "holds 'haystack', not a task"),
    ("eval", "tasks", ("needle", "needle"), "names a task twice"),
    ("eval", "task_lengths", (256, 0), "holds 0"),
    ("eval", "task_lengths", (256.0,), "holds 256.0"),
    ("eval", "depths", (0.0, 1.5), "holds 1.5, not a number in [0, 1]"),
    ("eval", "depths", (math.nan,), "holds nan"),
    ("eval", "depths", (True,), "holds True"),
]


BAD_MLA = [
    # (field of model.mla, value, words); the config is configs/mla.py:tiny
    ("kv_rank", 0, "below 1"),
    ("q_rank", -1, "below 0"),
    ("rope_dim", 0, "below 1"),
    ("rope_dim", 7, "odd"),
    ("nope_dim", -1, "below 0"),
    ("v_head_dim", -4, "below 1"),
    ("absorb", 1, "not a bool"),
    ("latent_norm", "no", "not a bool"),
    ("rope_heads", 0, "below 1"),
    ("rope_heads", 3, "does not divide model.num_heads=4"),
    # configs/mla.py:tiny: 2 layers, one RoPE key of 4 pairs, head_dim 24 (12 pairs)
    ("rope_pairs", ((0, 1, 2, 3),), "wrong shape"),
    ("rope_pairs", (((0, 1, 2),), ((0, 1, 2, 3),)), "wrong shape"),
    ("rope_pairs", (((0, 1, 2, 12),), ((0, 1, 2, 3),)), "holds [0, 1, 2, 12]"),
    ("rope_pairs", (((0, 1, 2, 3),), ((5, 5, 2, 3),)), "holds [5, 5, 2, 3]"),
    ("rope_pairs", (((0, 1, 2, 3.0),), ((0, 1, 2, 3),)), "holds [0, 1, 2, 3.0]"),
]


@pytest.mark.parametrize("field,value,words", BAD_MLA)
def test_bad_mla_field_is_named(field, value, words):
    cfg = kvlab.load_config(f"{ROOT}/configs/mla.py:tiny")
    fields = cfg.model.mla.to_dict()
    fields[field] = value
    cfg.model.mla = ml_collections.ConfigDict(fields)
    with pytest.raises(ValueError) as error:
        kvlab.validate_config(cfg)
    assert str(error.value).startswith(f"model.mla.{field}={value!r}")
    assert words in str(error.value)


def test_mla_head_widths_must_agree():
    cfg = kvlab.load_config(f"{ROOT}/configs/mla.py:tiny")
    cfg.model.mla.rope_dim = 4
    with pytest.raises(
        ValueError, match=r"model.head_dim=24 does not match .*nope_dim \+ model.mla.rope_dim = 20"
    ):
        kvlab.validate_config(cfg)
    cfg = kvlab.load_config(f"{ROOT}/configs/mla.py:tiny")
    cfg.model.num_kv_heads = 2
    with pytest.raises(ValueError, match=r"model.num_kv_heads=2 must equal model.num_heads=4"):
        kvlab.validate_config(cfg)


@pytest.mark.parametrize("section,field,value,words", BAD_CONFIGS)
def test_bad_field_raises_naming_field_value_and_fix(section, field, value, words):
    cfg = _bad(section, field, value)
    with pytest.raises(ValueError) as error:
        kvlab.validate_config(cfg)
    message = str(error.value)
    assert message.startswith(f"{section}.{field}={value!r}")
    assert words in message


def test_seed_and_numbers_at_their_limits_pass():
    cfg = kvlab.base_config("tiny")
    cfg.train.update(seed=2**32 - 1, weight_decay=0.0, lr=1e-8)
    assert kvlab.validate_config(cfg).train.seed == 2**32 - 1


def test_the_model_vocabulary_must_hold_the_data_vocabulary():
    cfg = kvlab.base_config("tiny")
    cfg.data.source = "text"
    cfg.data.path = "corpus.txt"
    cfg.model.vocab_size = 255
    with pytest.raises(ValueError) as error:
        kvlab.validate_config(cfg)
    message = str(error.value)
    assert message.startswith("model.vocab_size=255") and "256" in message
    assert "set model.vocab_size >= 256" in message
    # MQAR uses only its own ids: a small model vocabulary fits a small MQAR one.
    cfg.data.source = "mqar"
    cfg.data.mqar.vocab_size = 64
    cfg.model.vocab_size = 64
    kvlab.validate_config(cfg)
    cfg.model.vocab_size = 63
    with pytest.raises(ValueError, match=r"data.mqar.vocab_size=64 exceeds model.vocab_size=63"):
        kvlab.validate_config(cfg)


def test_text_source_needs_a_path():
    cfg = _bad("data", "source", "text")
    with pytest.raises(ValueError, match=r"data.path=''"):
        kvlab.validate_config(cfg)


def test_unknown_fields_are_named_and_omitted_ones_take_their_defaults():
    cfg = kvlab.base_config("tiny")
    cfg.model.num_kv_head = 2  # a typo of num_kv_heads
    with pytest.raises(ValueError, match=r"model.num_kv_head is not a kvlab config field"):
        kvlab.validate_config(cfg)
    cfg = kvlab.base_config("tiny")
    cfg.cache.dtype = "bfloat16"
    del cfg.cache["residual"]
    del cfg.model["mla"]  # a grouped-query model has no use for it
    assert kvlab.validate_config(cfg) is cfg
    assert cfg.cache.residual == 0 and cfg.cache.dtype == "bfloat16"
    assert cfg.model.mla.to_dict() == kvlab.base_config("tiny").model.mla.to_dict()


def test_a_partial_config_is_completed_then_validated():
    """Sections a config file builds by hand, with only the fields it cares about."""
    cfg = ml_collections.ConfigDict(
        {
            "model": {"num_layers": 1, "num_kv_heads": 2, "attention": "gqa"},
            "cache": {"k_bits": 8, "v_bits": 4},
            "train": {"steps": 3},
        }
    )
    cfg.lock()  # as a --config flag delivers it
    kvlab.validate_config(cfg)
    full = kvlab.base_config("tiny")
    assert set(cfg) == set(full) and set(cfg.model) == set(full.model)
    assert (cfg.model.num_layers, cfg.model.embed_dim, cfg.cache.v_bits) == (1, 64, 4)
    assert cfg.train.lr == full.train.lr and cfg.wandb.mode == full.wandb.mode

    # Completion never hides a bad or unknown field, and never changes a given one.
    bad = ml_collections.ConfigDict({"model": {"num_kv_heads": 3}})
    with pytest.raises(ValueError, match=r"model.num_kv_heads=3 must divide"):
        kvlab.validate_config(bad)
    unknown = ml_collections.ConfigDict({"model": {"kv_heads": 2}, "optimizer": {}})
    complete_config(unknown)
    assert unknown.model.kv_heads == 2 and "optimizer" in unknown
    with pytest.raises(ValueError, match=r"config.optimizer is not a kvlab config field"):
        kvlab.validate_config(unknown)


def test_a_config_file_may_omit_what_does_not_apply(tmp_path):
    path = tmp_path / "partial.py"
    path.write_text(
        "import ml_collections\n\n\n"
        "def get_config(arg='tiny'):\n"
        "    return ml_collections.ConfigDict(\n"
        "        {'model': {'attention': 'mla', 'head_dim': 24, 'mla': {'kv_rank': 32}}}\n"
        "    )\n"
    )
    cfg = kvlab.load_config(f"{path}:tiny")
    assert cfg.model.attention == "mla" and cfg.model.mla.kv_rank == 32
    assert cfg.model.mla.rope_dim == 8 and cfg.cache.latent_bits == 16


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


def test_the_evaluation_window_is_checked_against_the_data():
    cfg = kvlab.validate_config(kvlab.base_config("tiny"))
    assert cfg.eval.seq_len == 0 and eval_seq_len(cfg) == cfg.train.seq_len == 128
    cfg.eval.seq_len = 512
    assert eval_seq_len(kvlab.validate_config(cfg)) == 512
    # The tasks' lengths against their samples: tests/data/test_tasks.py.
    mqar = kvlab.base_config("tiny")
    mqar.data.source = "mqar"
    mqar.data.mqar.vocab_size = mqar.model.vocab_size = 64
    mqar.eval.tasks = ("mqar",)
    mqar.eval.seq_len = 16  # 8 pairs need 31 tokens
    with pytest.raises(ValueError, match=r"^eval.seq_len=16 gives windows of 16 .* >= 31"):
        kvlab.validate_config(mqar)


def test_eval_lists_from_config_json_become_tuples():
    fields = kvlab.base_config("tiny").to_dict()
    fields["eval"].update(tasks=["needle"], task_lengths=[256, 512], depths=[0, 1])
    cfg = kvlab.validate_config(ml_collections.ConfigDict(fields))
    assert (cfg.eval.tasks, cfg.eval.task_lengths, cfg.eval.depths) == (
        ("needle",),
        (256, 512),
        (0, 1),
    )


def test_rope_scaling_from_a_flag():
    yarn = parse_rope_scaling("type=yarn,factor=4", original_max_len=128)
    assert (yarn.type, yarn.factor, yarn.original_max_len, yarn.beta_fast) == ("yarn", 4, 128, 32)
    assert parse_rope_scaling("llama3, factor=8, original_max_len=64", 128).original_max_len == 64
    assert parse_rope_scaling("linear,factor=2", 128).original_max_len == 0
    plain = kvlab.base_config().model.rope_scaling.to_dict()
    assert parse_rope_scaling("none", 128).to_dict() == plain
    for spec, words in [
        ("type=yarn,factor=0", "model.rope_scaling.factor=0.0 is not a finite number > 0"),
        ("factor=2", "does nothing with model.rope_scaling.type='none'"),
        ("type=ntk", "model.rope_scaling.type='ntk' is not supported"),
        ("type=yarn,alpha=2", "holds 'alpha=2', not field=value"),
        ("type=yarn,factor=x", "model.rope_scaling.factor='x' is not a number"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_rope_scaling(spec, 128)
