"""kvlab.load_hf (kvlab/checkpoints/hf/read.py) against checkpoints transformers wrote
(no torch here): logits and tokens as transformers computes them, and the
tensors refused.

The fixtures in tests/fixtures/hf were written by scripts/make_hf_fixtures.py
with transformers' own save_pretrained; each holds the logits transformers
computed on a token batch and its greedy continuation (reference.npz).
"""

import os

import jax
import numpy as np
import pytest

import kvlab
import kvlab.kernels.native as native
from kvlab.checkpoints.hf import config_from_hf
from tests.checkpoints.hf.helpers import (
    ALL,
    FIXTURES,
    GROUPED,
    copy_fixture,
    reference,
    smaller_vocabulary,
    word_tokenizer,
)
from tests.helpers import TOLERANCE, native_attention_at_any_size, run_in_chunks


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
    native_attention_at_any_size(monkeypatch)
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
