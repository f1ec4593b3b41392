"""kvlab.save_hf (kvlab/checkpoints/hf/write.py): the tensors and config.json
transformers reads, round trips, the tokenizer, and what cannot be exported.

The fixtures in tests/fixtures/hf were written by scripts/make_hf_fixtures.py
with transformers' own save_pretrained; each holds the logits transformers
computed on a token batch and its greedy continuation (reference.npz).
"""

import json
import os

import jax
import numpy as np
import pytest

import kvlab
from kvlab.checkpoints.convert import to_mla
from tests.checkpoints.hf.helpers import (
    ALL,
    FIXTURES,
    flat,
    read_tensors,
    smaller_vocabulary,
    word_tokenizer,
)


@pytest.mark.parametrize("name", ALL)
def test_export_writes_transformers_tensors_and_round_trips(name, loaded, tmp_path):
    cfg, params = loaded(name)
    kvlab.save_hf(cfg, params, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    # The tensors transformers itself saved, bit for bit (a sharded fixture in one file).
    written, original = read_tensors(tmp_path), read_tensors(FIXTURES / name)
    assert sorted(written) == sorted(original)
    for key, value in original.items():
        assert written[key].dtype == value.dtype and np.array_equal(written[key], value), key
    kvlab.save_hf(cfg, kvlab.fuse_projections(params), tmp_path / "fused")  # unfused on the way
    fused = read_tensors(tmp_path / "fused")
    assert fused.keys() == written.keys()
    assert all(np.array_equal(fused[key], written[key]) for key in written)
    again_cfg, again = kvlab.load_hf(tmp_path)
    assert again_cfg.model.to_dict() == cfg.model.to_dict()
    first, second = flat(params), flat(again)
    assert first.keys() == second.keys()
    for path in first:
        assert np.array_equal(np.asarray(first[path]), np.asarray(second[path])), path


# config.json fields transformers reads, which an export must give as transformers wrote them.
COMMON_FIELDS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_act",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
]


EXPORTED_FIELDS = {
    "llama": ["num_key_value_heads", "head_dim", "attention_bias", "mlp_bias"],
    "mistral_window": ["architectures", "num_key_value_heads", "head_dim", "sliding_window"],
    "deepseek_v3": [
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_shared_experts",
        "first_k_dense_replace",
        "routed_scaling_factor",
        "norm_topk_prob",
        "n_group",
        "topk_group",
        "rope_interleave",
    ],
}


@pytest.mark.parametrize("name", sorted(EXPORTED_FIELDS))
def test_export_config_gives_the_fields_transformers_reads(name, loaded, tmp_path):
    cfg, params = loaded(name)
    kvlab.save_hf(cfg, params, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((FIXTURES / name / "config.json").read_text())
    for key in COMMON_FIELDS + EXPORTED_FIELDS[name]:
        assert written[key] == original[key], key


def test_export_refuses_what_transformers_cannot_compute(loaded, tmp_path):
    cfg, params = loaded("qwen3")
    both = cfg.copy_and_resolve_references()
    both.model.qkv_bias = True
    with pytest.raises(ValueError, match=r"model.qkv_bias=True with model.qk_norm=True"):
        kvlab.save_hf(both, params, tmp_path / "both")
    cfg, params = loaded("deepseek_v2")
    eps = cfg.copy_and_resolve_references()
    eps.model.mla.norm_eps = 1e-5
    with pytest.raises(ValueError, match=r"model.mla.norm_eps=1e-05.*set model.mla.norm_eps=1e-06"):
        kvlab.save_hf(eps, params, tmp_path / "eps")
    normalized = cfg.copy_and_resolve_references()
    normalized.model.moe.normalize_weights = True
    with pytest.raises(ValueError, match=r"normalize_weights=True.*ignores norm_topk_prob"):
        kvlab.save_hf(normalized, params, tmp_path / "normalized")
    # What a conversion to latent attention makes (kvlab.checkpoints.to_mla)
    cfg, params = loaded("llama")
    converted, converted_params = to_mla(cfg, params, 8, rope_pairs=1, select="high")
    with pytest.raises(ValueError, match=r"model.mla.latent_norm=False cannot be exported"):
        kvlab.save_hf(converted, converted_params, tmp_path / "converted")
    shared = cfg.copy_and_resolve_references()
    shared.model.topology = "cla:2"
    shared_params = kvlab.init_params(shared.model, jax.random.key(0))
    with pytest.raises(ValueError, match=r"model.topology='cla:2' cannot be exported"):
        kvlab.save_hf(shared, shared_params, tmp_path / "shared")
    cfg, params = loaded("deepseek_v3")
    windowed = cfg.copy_and_resolve_references()
    windowed.model.sliding_window = 4
    with pytest.raises(
        ValueError, match=r"model.sliding_window=4 with model.attention='mla' cannot be exported"
    ):
        kvlab.save_hf(windowed, params, tmp_path / "windowed")


@pytest.mark.parametrize(
    "changes, family",
    [
        (dict(qkv_bias=True), "qwen2"),
        (dict(qk_norm=True), "qwen3"),
    ],
)
def test_export_gives_qwen_a_window_on_every_layer(changes, family, loaded, tmp_path):
    """A windowed model with Qwen's biases or norms: every layer slides, and it imports
    back to the same model section (transformers' own logits: tests/checkpoints/hf/test_live.py)."""
    cfg, params = loaded("mistral_window")
    windowed = cfg.copy_and_resolve_references()
    windowed.model.update(changes)
    params = kvlab.init_params(windowed.model, jax.random.key(0))
    kvlab.save_hf(windowed, params, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == family
    assert (written["use_sliding_window"], written["sliding_window"]) == (True, 4)
    assert written["max_window_layers"] == 0
    assert written["layer_types"] == ["sliding_attention"] * 2
    assert kvlab.load_hf(tmp_path)[0].model.to_dict() == windowed.model.to_dict()


def test_export_refuses_params_of_another_model(loaded, tmp_path):
    cfg, params = loaded("llama")
    missing = {k: v for k, v in params.items() if k != "final_norm"}
    with pytest.raises(ValueError, match=r"params has no parameter final_norm/scale"):
        kvlab.save_hf(cfg, missing, tmp_path)
    extra = dict(params, spare={"kernel": np.zeros(3)})
    with pytest.raises(ValueError, match=r"parameters the model does not use: spare/kernel"):
        kvlab.save_hf(cfg, extra, tmp_path)
    reshaped = dict(params, final_norm={"scale": np.ones(65, np.float32)})
    with pytest.raises(ValueError, match=r"final_norm/scale of params has shape \(65,\)"):
        kvlab.save_hf(cfg, reshaped, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds a sharded checkpoint"):
        kvlab.save_hf(cfg, params, tmp_path)


def test_save_hf_writes_the_tokenizer_it_is_given(tmp_path):
    source = smaller_vocabulary(tmp_path / "source", 131)
    word_tokenizer(["<unk>", "</s>", *[f"w{i}" for i in range(129)]]).save(
        str(source / "tokenizer.json")
    )
    cfg, params = kvlab.load_hf(source)
    tokenizer = kvlab.data.load_tokenizer(str(source))
    kvlab.save_hf(cfg, params, tmp_path / "out", tokenizer=tokenizer)
    loaded, _ = kvlab.load_hf(tmp_path / "out")
    assert loaded.data.tokenizer == str(tmp_path / "out")
    copy = kvlab.data.load_tokenizer(loaded.data.tokenizer)
    assert copy.encode("w5 w7 </s>") == tokenizer.encode("w5 w7 </s>") == [7, 9, 1]
    assert copy.end_token == tokenizer.end_token == 1  # eos named in tokenizer_config.json
    kvlab.save_hf(cfg, params, tmp_path / "bare")  # no tokenizer given: none written
    assert not (tmp_path / "bare" / "tokenizer.json").exists()
    word_tokenizer([f"w{i}" for i in range(300)]).save(str(tmp_path / "large.json"))
    larger = kvlab.data.load_tokenizer(str(tmp_path / "large.json"))
    with pytest.raises(ValueError, match=r"makes 300 token ids but model.vocab_size=131"):
        kvlab.save_hf(cfg, params, tmp_path / "x", tokenizer=larger)
    with pytest.raises(ValueError, match=r"tokenizer='tokenizer.json' is not a kvlab"):
        kvlab.save_hf(cfg, params, tmp_path / "y", tokenizer="tokenizer.json")
