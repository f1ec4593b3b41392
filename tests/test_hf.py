"""kvlab.load_hf and kvlab.save_hf against checkpoints transformers wrote (no torch here).

The fixtures in tests/fixtures/hf were written by scripts/make_hf_fixtures.py
with transformers' own save_pretrained; each holds the logits transformers
computed on a token batch and its greedy continuation (reference.npz).
"""

import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
from flax import traverse_util

import kvlab
import kvlab.kernels.native as native
from kvlab.convert import to_mla
from kvlab.hf import config_from_hf
from kvlab.kernels.native import ffi
from tests.helpers import TOLERANCE, run_in_chunks

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
GROUPED = ["llama", "qwen2", "qwen3", "mistral"]
WINDOWED = ["mistral_window"]  # sliding window 4 over 24 tokens
LATENT = ["deepseek_v2_q_lora", "deepseek_v2", "deepseek_v3"]
ALL = GROUPED + WINDOWED + LATENT


def reference(name):
    return np.load(FIXTURES / name / "reference.npz")


@pytest.fixture(scope="module")
def loaded():
    """load_hf of each fixture, once per module (lazily)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = kvlab.load_hf(FIXTURES / name)
        return cache[name]

    return get


def flat(params):
    return traverse_util.flatten_dict(params)


def read_tensors(folder) -> dict:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(safetensors.numpy.load_file(os.path.join(folder, name)))
    return tensors


# ---------------------------------------------------------------------------
# Logits and tokens against transformers'


@pytest.mark.parametrize("name", ALL)
def test_forward_matches_transformers(name, loaded):
    cfg, params = loaded(name)
    ref = reference(name)
    logits, _ = jax.jit(kvlab.Transformer(cfg.model).apply)({"params": params}, ref["tokens"])
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=TOLERANCE, rtol=0)


# Each latent fixture goes through the cache once, both MLA paths covered; every
# test here compiles its own programs, so the cases are chosen to stay fast.
THROUGH_CACHE = [(name, None) for name in GROUPED] + [
    ("deepseek_v2_q_lora", True),
    ("deepseek_v2", False),
    ("deepseek_v3", True),
]
# Greedy generation (absorbed MLA in its loop): a GQA family with and without
# norms and biases, and both DeepSeek routings.
# mistral_window generates through its ring of 4 slots.
GREEDY = ["llama", "qwen2", "qwen3", "mistral_window", "deepseek_v2_q_lora", "deepseek_v3"]


@pytest.mark.parametrize("name, absorb", THROUGH_CACHE)
def test_cache_token_by_token_matches_transformers(name, absorb, loaded):
    cfg, params = loaded(name)
    model_cfg = cfg.model.copy_and_resolve_references()
    if absorb is not None:
        model_cfg.mla.absorb = absorb
    ref = reference(name)
    tokens = ref["tokens"]
    logits = token_by_token(model_cfg, cfg.cache, params, tokens, max_len=16)
    np.testing.assert_allclose(logits, ref["logits"], atol=TOLERANCE, rtol=0)


def token_by_token(model_cfg, cache_cfg, params, tokens, max_len):
    """Logits [B, T, V] of decode steps over `tokens`, one at a time."""
    model = kvlab.Transformer(model_cfg)
    cache = kvlab.init_cache(model_cfg, cache_cfg, batch_size=tokens.shape[0], max_len=max_len)
    steps = []
    for t in range(tokens.shape[1]):
        logits, cache = kvlab.decode_step(model, params, cache, tokens[:, t])
        steps.append(np.asarray(logits))
    cache.check()
    return np.stack(steps, 1)


@pytest.mark.parametrize("name", GREEDY)
def test_native_kernels_decode_transformers_logits_and_tokens(name, loaded, monkeypatch):
    """What the scripts decode with on one CPU (kvlab.cli.decode_params: fused
    projections in 32-column panels, attention_impl='native', its kernels here
    for any cache size): token by token transformers' logits, and its greedy
    tokens."""
    monkeypatch.setattr(ffi, "ATTENTION_MIN_BYTES", 0)
    cfg, params = loaded(name)
    model_cfg = cfg.model.copy_and_resolve_references()
    model_cfg.attention_impl = "native"
    params = native.panel_projections(kvlab.fuse_projections(params))
    ref = reference(name)
    tokens = ref["tokens"]
    logits = token_by_token(model_cfg, cfg.cache, params, tokens, max_len=tokens.shape[1])
    np.testing.assert_allclose(logits, ref["logits"], atol=TOLERANCE, rtol=0)
    new_tokens = ref["generated"].shape[1] - tokens.shape[1]
    model = kvlab.Transformer(model_cfg)
    out = kvlab.generate(model, params, tokens, cache_cfg=cfg.cache, max_new_tokens=new_tokens)
    np.testing.assert_array_equal(np.asarray(out), ref["generated"])


@pytest.mark.parametrize("chunks", [[5, 1, 7, 11], [1] * 24])
def test_sliding_window_cache_in_chunks_matches_transformers(chunks, loaded):
    """Mistral's window through the default cache, a dense ring of 4 slots per
    layer: any chunks give transformers' logits. The window matters: without it
    the logits move from position 4 on (the script checked transformers alike)."""
    cfg, params = loaded("mistral_window")
    ref = reference("mistral_window")
    tokens, window = ref["tokens"], cfg.model.sliding_window
    model = kvlab.Transformer(cfg.model)
    cache = kvlab.init_cache(cfg.model, cfg.cache, tokens.shape[0], max_len=tokens.shape[1])
    logits, cache = run_in_chunks(jax.jit(model.apply), params, cache, tokens, chunks)
    cache.check()
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-5, rtol=0)
    full = cfg.model.copy_and_resolve_references()
    full.sliding_window = 0
    unwindowed, _ = jax.jit(kvlab.Transformer(full).apply)({"params": params}, tokens)
    moved = np.abs(np.asarray(unwindowed) - ref["logits"]).max(-1)  # [B, T]
    assert moved[:, :window].max() < 1e-5 and moved[:, window:].min() > 1e-2


@pytest.mark.parametrize("name", GREEDY)
def test_greedy_tokens_match_transformers(name, loaded):
    cfg, params = loaded(name)
    ref = reference(name)
    new_tokens = ref["generated"].shape[1] - ref["tokens"].shape[1]
    out = kvlab.generate(
        kvlab.Transformer(cfg.model),
        params,
        ref["tokens"],
        cache_cfg=cfg.cache,
        max_new_tokens=new_tokens,
        sampler=kvlab.Greedy(),
    )
    np.testing.assert_array_equal(np.asarray(out), ref["generated"])


# ---------------------------------------------------------------------------
# What the import maps


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


def test_params_are_laid_out_as_init_params(loaded):
    for name in ("qwen2", "deepseek_v3"):
        cfg, params = loaded(name)
        expected = jax.eval_shape(lambda c=cfg: kvlab.init_params(c.model, jax.random.key(0)))
        assert jax.tree.structure(params) == jax.tree.structure(expected)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
            lambda x: (x.shape, x.dtype), expected
        )


def test_interleaved_rope_channels_are_reordered_to_halves(loaded):
    """DeepSeek's rope key rows [latent; rope] come back with channels 0,2,4,.. then 1,3,5,.."""
    cfg, params = loaded("deepseek_v2")
    stored = read_tensors(FIXTURES / "deepseek_v2")[
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    ]
    rank, rope = cfg.model.mla.kv_rank, cfg.model.mla.rope_dim
    key_rope = np.asarray(params["block_0"]["attention"]["key_rope"]["kernel"])[:, 0]  # [D, Hr]
    np.testing.assert_array_equal(key_rope[:, : rope // 2], stored[rank::2].T)
    np.testing.assert_array_equal(key_rope[:, rope // 2 :], stored[rank + 1 :: 2].T)


def test_dtype_argument_and_checkpoint_dtype():
    cfg, params = kvlab.load_hf(FIXTURES / "qwen2", dtype="bfloat16")
    assert cfg.model.dtype == cfg.model.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("bfloat16")}
    cfg, _ = kvlab.load_hf(FIXTURES / "qwen2")
    assert cfg.model.param_dtype == "float32"  # config.json's dtype
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported.*'bfloat16'"):
        kvlab.load_hf(FIXTURES / "qwen2", dtype="int8")


# ---------------------------------------------------------------------------
# Export


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
    # What a conversion to latent attention makes (kvlab.convert.to_mla)
    cfg, params = loaded("llama")
    converted, converted_params = to_mla(cfg, params, 8, rope_pairs=1, select="high")
    with pytest.raises(ValueError, match=r"model.mla.latent_norm=False cannot be exported"):
        kvlab.save_hf(converted, converted_params, tmp_path / "converted")
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
    back to the same model section (transformers' own logits: tests/test_hf_live.py)."""
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


# ---------------------------------------------------------------------------
# Refusals on import


def copy_fixture(name, tmp_path, config_changes=None, tensors=None):
    """A copy of fixture `name` with config.json fields changed (None deletes) and
    model.safetensors replaced by `tensors(old) -> new`."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        for key, value in config_changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    if tensors:
        new = tensors(read_tensors(folder))
        safetensors.numpy.save_file(new, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


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
    "qwen some layers sliding": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 4,
            "layer_types": ["full_attention", "sliding_attention"],
        },
        r"layer_types=.*slides 1 of the 2 layers \(sliding_window=4\).*one model.sliding_window",
    ),
    "qwen layers from max_window_layers sliding": (
        "qwen3",
        {
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
            "layer_types": None,
        },
        r"max_window_layers=1 slides 1 of the 2 layers",
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


@pytest.mark.parametrize("case", sorted(CONFIG_REFUSALS))
def test_import_refuses_config(case, tmp_path):
    name, changes, message = CONFIG_REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        kvlab.load_hf(copy_fixture(name, tmp_path, changes))


def test_import_refuses_missing_tensor(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    folder = copy_fixture(
        "llama", tmp_path, tensors=lambda t: {k: v for k, v in t.items() if k != name}
    )
    with pytest.raises(ValueError, match=rf"has no tensor '{name}'.*block_1/attention/key/kernel"):
        kvlab.load_hf(folder)


def test_import_refuses_wrong_shape(tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    folder = copy_fixture("llama", tmp_path, tensors=lambda t: dict(t, **{name: t[name][:32]}))
    with pytest.raises(
        ValueError, match=rf"'{name}'.*has shape \(32, 64\) but config.json makes it \(64, 64\)"
    ):
        kvlab.load_hf(folder)


def test_import_refuses_leftover_tensors(tmp_path):
    extra = {"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}
    folder = copy_fixture("llama", tmp_path, tensors=lambda t: dict(t, **extra))
    with pytest.raises(ValueError, match=r"no place for: 'model.layers.0.self_attn.o_proj.bias'"):
        kvlab.load_hf(folder)


def test_import_refuses_untied_head_under_tied_config(tmp_path):
    def add_head(t):
        return dict(t, **{"lm_head.weight": t["model.embed_tokens.weight"] + 1})

    with pytest.raises(ValueError, match=r"'lm_head.weight'.*differs.*tie_word_embeddings=true"):
        kvlab.load_hf(copy_fixture("qwen2", tmp_path, tensors=add_head))
    # An identical copy of the tied matrix is the same model.
    same = lambda t: dict(t, **{"lm_head.weight": t["model.embed_tokens.weight"]})  # noqa: E731
    kvlab.load_hf(copy_fixture("qwen2", tmp_path / "same", tensors=same))


def test_import_refuses_quantized_tensors(tmp_path):
    name = "model.norm.weight"
    folder = copy_fixture(
        "llama", tmp_path, tensors=lambda t: dict(t, **{name: t[name].astype(np.int8)})
    )
    with pytest.raises(ValueError, match=rf"'{name}'.*stored as I8: kvlab reads F32, BF16, F16"):
        kvlab.load_hf(folder)


def test_import_refuses_folders_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"is not a folder"):
        kvlab.load_hf(tmp_path / "absent")
    with pytest.raises(ValueError, match=r"has no config.json"):
        kvlab.load_hf(tmp_path)
    folder = copy_fixture("llama", tmp_path)
    os.rename(folder / "model.safetensors", folder / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match=r"neither model.safetensors nor .*pytorch_model.bin.*safe_serialization"
    ):
        kvlab.load_hf(folder)
    sharded = copy_fixture("mistral", tmp_path)
    os.remove(sharded / "model-00002-of-00004.safetensors")
    with pytest.raises(ValueError, match=r"names model-00002-of-00004.safetensors, which"):
        kvlab.load_hf(sharded)


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_import_refuses_a_damaged_safetensors_file_naming_it(damage, tmp_path):
    folder = copy_fixture("llama", tmp_path)
    file = folder / "model.safetensors"
    data = bytearray(file.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[10:30] = b"#" * 20  # inside the JSON header
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError) as error:
        kvlab.load_hf(folder)
    message = str(error.value)
    assert message.startswith(f"{file} is not a safetensors file") and "\n" not in message
    assert message.endswith("it is damaged or was cut short; write or download it again")


def test_import_refuses_non_finite_weights_unless_asked(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"

    def poison(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name].flat[[3, 7, 11, 40, 41]] = [np.nan, np.nan, np.inf, -np.inf, np.nan]
        return tensors

    folder = copy_fixture("llama", tmp_path, tensors=poison)
    with pytest.raises(ValueError) as error:
        kvlab.load_hf(folder)
    message = str(error.value)
    assert message.startswith(f"tensor {name!r} in {str(folder)!r} holds 5 non-finite value(s)")
    assert "(nan at index (0, 3) first)" in message and "allow_nonfinite=True" in message
    _, params = kvlab.load_hf(folder, allow_nonfinite=True)  # for those who study them
    kernel = np.asarray(params["block_1"]["mlp"]["up"]["kernel"])
    assert np.isnan(kernel).sum() == 3 and np.isinf(kernel).sum() == 2


def test_import_refuses_a_cast_that_overflows(tmp_path):
    name = "model.norm.weight"
    large = lambda t: dict(t, **{name: t[name] * 0 + 1e5})  # noqa: E731 (beyond float16)
    folder = copy_fixture("llama", tmp_path, tensors=large)
    with pytest.raises(ValueError, match=r"^parameter final_norm/scale in float16 holds 64 non"):
        kvlab.load_hf(folder, dtype="float16")
    cfg, params = kvlab.load_hf(folder, dtype="bfloat16")  # within bfloat16's range
    assert float(params["final_norm"]["scale"][0]) == pytest.approx(1e5, rel=1e-2)


def smaller_vocabulary(tmp_path, vocab_size):
    """The llama fixture with its vocabulary cut to the first `vocab_size` ids."""

    def cut(tensors):
        cut = ("model.embed_tokens.weight", "lm_head.weight")
        return {k: v[:vocab_size] if k in cut else v for k, v in tensors.items()}

    return copy_fixture("llama", tmp_path, {"vocab_size": vocab_size}, tensors=cut)


def word_tokenizer(words):
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0])
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return backend


def test_imported_data_section_follows_the_tokenizer(tmp_path):
    # Vocabulary 131: below the 256 byte values, so only its tokenizer can feed it.
    folder = smaller_vocabulary(tmp_path, 131)
    with pytest.raises(ValueError) as error:
        kvlab.load_hf(folder)
    assert str(error.value).startswith(
        f"{str(folder)!r} holds no tokenizer.json, and its model's vocabulary of 131 token ids "
        "is not the 256 byte values kvlab reads text as without one: put the model's "
        "tokenizer.json in the folder (kvlab.save_hf(cfg, params, folder, tokenizer=tokenizer)"
    )
    word_tokenizer([f"w{i}" for i in range(131)]).save(str(folder / "tokenizer.json"))
    cfg, params = kvlab.load_hf(folder)
    assert cfg.model.vocab_size == 131 and cfg.data.tokenizer == str(folder)
    assert params["embed"]["embedding"].shape == (131, 64)
    # The byte vocabulary reads bytes; a tokenizer the config names is kept.
    assert kvlab.load_hf(FIXTURES / "llama")[0].data.tokenizer == ""
    named = kvlab.base_config()
    named.data.tokenizer = str(folder)
    assert config_from_hf(named, smaller_vocabulary(tmp_path / "other", 300)).data.tokenizer == (
        str(folder)
    )
    mqar = kvlab.base_config()
    mqar.data.source = "mqar"
    assert config_from_hf(mqar, smaller_vocabulary(tmp_path / "mqar", 300)).data.tokenizer == ""


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
