"""config.json -> kvlab's model section (kvlab/checkpoints/hf/config.py): the fields
mapped, the dtype, Qwen's windows, and every config kvlab does not compute refused.

The fixtures in tests/fixtures/hf were written by scripts/make_hf_fixtures.py
with transformers' own save_pretrained; each holds the logits transformers
computed on a token batch and its greedy continuation (reference.npz).
"""

import json

import jax
import numpy as np
import pytest

import kvlab
from tests.checkpoints.hf.helpers import (
    FIXTURES,
    copy_fixture,
)


def test_config_fields_are_mapped(loaded):
    llama = loaded("llama")[0].model
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 16)
    assert not llama.tie_embeddings and llama.attention == "gqa"
    assert dict(llama.rope_scaling) == dict(
        kvlab.base_config().model.rope_scaling,
        type="llama3",
        factor=8.0,
        original_max_len=64,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )
    qwen2 = loaded("qwen2")[0].model
    assert qwen2.qkv_bias and qwen2.tie_embeddings and qwen2.rope_theta == 1e6
    qwen3 = loaded("qwen3")[0].model
    assert qwen3.qk_norm and qwen3.head_dim == 24 and qwen3.norm_eps == 1e-5
    assert (qwen3.rope_scaling.type, qwen3.rope_scaling.factor) == ("linear", 2.0)
    deepseek = loaded("deepseek_v2_q_lora")[0].model
    assert deepseek.attention == "mla" and deepseek.head_dim == 16
    assert deepseek.mla.q_rank == 12 and deepseek.mla.norm_eps == 1e-6 and deepseek.norm_eps == 1e-5
    assert deepseek.moe.first_dense_layers == 1 and deepseek.moe.routing == "softmax"
    assert (deepseek.rope_scaling.type, deepseek.rope_scaling.mscale_all_dim) == ("yarn", 0.707)
    assert loaded("deepseek_v2")[0].model.mla.q_rank == 0
    assert loaded("mistral_window")[0].model.sliding_window == 4
    assert loaded("mistral")[0].model.sliding_window == 0  # sliding_window null
    v3 = loaded("deepseek_v3")[0].model.moe
    assert (v3.routing, v3.num_groups, v3.groups_per_token, v3.normalize_weights) == (
        "sigmoid",
        2,
        1,
        True,
    )


def test_dtype_argument_and_checkpoint_dtype():
    cfg, params = kvlab.load_hf(FIXTURES / "qwen2", dtype="bfloat16")
    assert cfg.model.dtype == cfg.model.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("bfloat16")}
    cfg, _ = kvlab.load_hf(FIXTURES / "qwen2")
    assert cfg.model.param_dtype == "float32"  # config.json's dtype
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported.*'bfloat16'"):
        kvlab.load_hf(FIXTURES / "qwen2", dtype="int8")


CONFIG_REFUSALS = {
    "unknown family": (
        "llama",
        {"model_type": "gpt2"},
        r"model_type='gpt2' is not a family kvlab reads: kvlab reads llama, mistral, qwen2, "
        r"qwen3, deepseek_v2, deepseek_v3",
    ),
    "empty window": ("mistral_window", {"sliding_window": 0}, r"sliding_window=0 is not a count"),
    "qwen sliding layers without a window": (
        "qwen2",
        {"layer_types": ["full_attention", "sliding_attention"]},
        r"layer_types=.*has sliding-attention layers but config.json gives them no window",
    ),
    "dynamic rope": (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        r"rope_parameters.rope_type='dynamic' is not supported: kvlab computes RoPE types "
        r"'default', 'linear', 'llama3', 'yarn'",
    ),
    "legacy rope_scaling": (
        "llama",
        {"rope_scaling": {"type": "longrope", "factor": 2.0}},
        r"rope_scaling.rope_type='longrope' is not supported",
    ),
    "partial rotary": (
        "qwen3",
        {"partial_rotary_factor": 0.5},
        r"partial_rotary_factor=0.5 rotates only part of each head",
    ),
    "o_proj bias": (
        "llama",
        {"attention_bias": True},
        r"attention_bias=True puts biases on q/k/v and o_proj",
    ),
    "activation": ("qwen3", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not SwiGLU"),
    "quantized": (
        "qwen2",
        {"quantization_config": {"quant_method": "fp8"}},
        r"quantization_config=.*dequantize first",
    ),
    "missing field": ("llama", {"hidden_size": None}, r"config.json has no hidden_size"),
    "v2 routing": (
        "deepseek_v2",
        {"topk_method": "noaux_tc"},
        r"topk_method='noaux_tc' is not a DeepSeek-V2 routing",
    ),
    "yarn attention factor": (
        "deepseek_v2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "attention_factor": 2.0,
            }
        },
        r"attention_factor=2.0 differs from the 1.13",
    ),
}


@pytest.mark.parametrize(
    "changes, window",
    [
        ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}, 4),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention"] * 2,
            },
            8,
        ),
        ({"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0}, 0),
        ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}, 0),
    ],
)
def test_qwen_window_loads_when_every_layer_slides(changes, window, tmp_path):
    """As transformers reads Qwen2's config: a window only with use_sliding_window, on
    the layers layer_types names or, without layer_types, from max_window_layers on."""
    folder = copy_fixture("qwen2", tmp_path, {"layer_types": None, **changes})
    assert kvlab.load_hf(folder)[0].model.sliding_window == window


@pytest.mark.parametrize(
    "family, changes",
    [
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}),
        ("qwen3", {"max_window_layers": 1, "layer_types": None}),
    ],
)
def test_qwen_window_on_some_layers_is_a_hybrid_model(family, changes, tmp_path):
    """Qwen's window on some layers (layer_types, or max_window_layers without them)
    loads as model.layer_types, and save_hf writes the same layer kinds back."""
    changes = {"use_sliding_window": True, "sliding_window": 4, **changes}
    cfg, params = kvlab.load_hf(copy_fixture(family, tmp_path / "in", changes))
    assert (cfg.model.sliding_window, cfg.model.layer_types) == (4, ("full", "sliding"))
    kvlab.save_hf(cfg, params, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["layer_types"] == ["full_attention", "sliding_attention"]
    assert kvlab.load_hf(tmp_path / "out")[0].model.to_dict() == cfg.model.to_dict()


@pytest.mark.parametrize("case", sorted(CONFIG_REFUSALS))
def test_import_refuses_config(case, tmp_path):
    name, changes, message = CONFIG_REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        kvlab.load_hf(copy_fixture(name, tmp_path, changes))
