"""kvlab.load_gguf against tiny Llama GGUF files written here with the gguf package's
GGUFWriter, laid out as llama.cpp's converter lays them out (Q/K rows permuted)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import tokenizers
from flax import traverse_util

import kvlab
from kvlab.checkpoints.gguf import permute_rope_rows, unpermute_rope_rows
from kvlab.checkpoints.hf import config_from_hf, tensor_links
from tests.helpers import TOLERANCE, build, tiny_config

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

TEXT = "The KV cache holds keys and values; 12345 tokens later, the cache is 3.5 GB. Ünïcödé ✓\n"
SAMPLES = ["The cache", "keys and values 2024", "<|endoftext|>new text", "Ünï ✓  two  spaces\n"]


def _model_cfg(tied: bool):
    # embed_dim, head_dim and mlp_dim are multiples of 32, the Q8_0 / Q4_1 block size
    return tiny_config(
        num_kv_heads=2, mlp_dim=128, head_dim=16, tie_embeddings=tied, vocab_size=300
    )


def _source_tokenizer(pre: str) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on TEXT (GPT-2 split, or digits one by one first)."""
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":
        digits = tokenizers.pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([digits, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([TEXT] * 4, trainer)
    return backend


def write_gguf(
    path,
    model,
    params,
    *,
    types=None,
    pre="gpt-2",
    architecture="llama",
    tokenizer_model="gpt2",
    drop=(),
    extra=(),
    permute=True,
):
    """Writes params of `model` as llama.cpp would: HF tensors through the gguf name map,
    attn_q / attn_k rows permuted; `types` maps GGUF names to a quantization type."""
    types = types or {}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.num_layers)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(model.num_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(model.embed_dim)
    writer.add_feed_forward_length(model.mlp_dim)
    writer.add_head_count(model.num_heads)
    writer.add_head_count_kv(model.num_kv_heads)
    writer.add_key_length(model.head_dim)
    writer.add_value_length(model.head_dim)
    writer.add_rope_dimension_count(model.head_dim)
    writer.add_rope_freq_base(model.rope_theta)
    writer.add_layer_norm_rms_eps(model.norm_eps)
    source = _source_tokenizer(pre)
    vocabulary = source.get_vocab(with_added_tokens=True)
    tokens = sorted(vocabulary, key=vocabulary.get)
    assert len(tokens) == model.vocab_size
    merges = [" ".join(pair) for pair in json.loads(source.to_str())["model"]["merges"]]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    writer.add_eos_token_id(vocabulary["<|endoftext|>"])
    flat = traverse_util.flatten_dict(params)
    heads = {"attn_q": model.num_heads, "attn_k": model.num_kv_heads}
    for link in tensor_links(model):
        arrays = link.to_hf(*[np.asarray(flat[p], np.float32) for p in link.params])
        for (hf_name, _), array in zip(link.tensors, arrays, strict=True):
            name = names.get_name(hf_name, try_suffixes=(".weight",))
            if name in drop:
                continue
            role = name.split(".")[-2]
            if permute and role in heads:
                array = permute_rope_rows(array, heads[role])
            kind = types.get(name, Q.F32)
            data = gguf.quants.quantize(np.ascontiguousarray(array), kind)
            writer.add_tensor(name, data, raw_dtype=kind)
    for name, array in extra:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return source


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def source(request):
    cfg = _model_cfg(request.param)
    model, params, apply = build(cfg, seed=1)
    return cfg, params, apply


def test_config_fields_are_mapped(source, tmp_path):
    cfg, params, _ = source
    write_gguf(tmp_path / "m.gguf", cfg.model, params)
    loaded, _, tokenizer = kvlab.load_gguf(tmp_path / "m.gguf")
    for field in (
        "num_layers",
        "embed_dim",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
        "vocab_size",
        "tie_embeddings",
        "rope_theta",
        "norm_eps",
    ):
        assert loaded.model[field] == cfg.model[field], field
    assert loaded.model.attention == "gqa" and loaded.model.param_dtype == "float32"
    assert tokenizer.vocab_size == cfg.model.vocab_size


def test_float32_params_round_trip_exactly_and_logits_match(source, tmp_path):
    cfg, params, apply = source
    write_gguf(tmp_path / "m.gguf", cfg.model, params)
    loaded_cfg, loaded, _ = kvlab.load_gguf(tmp_path / "m.gguf")
    want, got = traverse_util.flatten_dict(params), traverse_util.flatten_dict(loaded)
    assert set(want) == set(got)
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]), str(path))
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.model.vocab_size)
    logits, _ = apply({"params": params}, tokens)
    again, _ = kvlab.Transformer(loaded_cfg.model).apply({"params": loaded}, tokens)
    np.testing.assert_allclose(np.asarray(again), np.asarray(logits), atol=TOLERANCE, rtol=0)


def test_rope_row_permutation_is_inverted():
    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)  # 3 heads of 8 rows
    permuted = permute_rope_rows(weight, 3)
    # each head's rows [0..3; 4..7] become pairs (0, 4), (1, 5), ...
    np.testing.assert_array_equal(permuted[:8, 0], weight[[0, 4, 1, 5, 2, 6, 3, 7], 0])
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, 3), weight)


def test_unpermuted_file_gives_other_logits(tmp_path):
    # Without llama.cpp's permutation the import's unpermute scrambles q and k: it matters.
    cfg = _model_cfg(True)
    _, params, apply = build(cfg, seed=1)
    write_gguf(tmp_path / "m.gguf", cfg.model, params, permute=False)
    loaded_cfg, loaded, _ = kvlab.load_gguf(tmp_path / "m.gguf")
    tokens = jax.random.randint(jax.random.key(0), (1, 12), 0, cfg.model.vocab_size)
    logits, _ = apply({"params": params}, tokens)
    again, _ = kvlab.Transformer(loaded_cfg.model).apply({"params": loaded}, tokens)
    assert np.abs(np.asarray(again) - np.asarray(logits)).max() > 1e-3


def _block_error(weight: np.ndarray, kind) -> np.ndarray:
    """The largest error the format allows per element: half a step of its block, plus
    float16 rounding of the block's scale (and minimum)."""
    blocks = weight.reshape(-1, 32)
    if kind == Q.Q8_0:
        step = np.abs(blocks).max(-1, keepdims=True) / 127
        bound = step * (0.5 + 128 * 2**-11)
    else:  # Q4_1: min + step * [0, 15]
        low, high = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
        step = (high - low) / 15
        bound = step * (0.5 + 16 * 2**-11) + np.abs(low) * 2**-11
    return np.broadcast_to(bound, blocks.shape).reshape(weight.shape) + 1e-7


def test_quantized_and_half_tensors_within_their_format(tmp_path):
    cfg = _model_cfg(False)
    _, params, _ = build(cfg, seed=1)
    types = {
        "token_embd.weight": Q.Q8_0,
        "blk.0.attn_q.weight": Q.Q4_1,
        "blk.0.attn_k.weight": Q.Q8_0,
        "blk.1.ffn_gate.weight": Q.Q4_1,
        "blk.1.ffn_down.weight": Q.F16,
        "output.weight": Q.Q4_1,
    }
    write_gguf(tmp_path / "m.gguf", cfg.model, params, types=types)
    _, loaded, _ = kvlab.load_gguf(tmp_path / "m.gguf")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.model.num_layers)
    flat_params, flat_loaded = (traverse_util.flatten_dict(p) for p in (params, loaded))
    checked = set()
    for link in tensor_links(cfg.model):
        name = names.get_name(link.tensors[0][0], try_suffixes=(".weight",))
        if name not in types:
            continue
        (want,) = link.to_hf(*[np.asarray(flat_params[p]) for p in link.params])
        (got,) = link.to_hf(*[np.asarray(flat_loaded[p]) for p in link.params])
        error = np.abs(got - want)
        if types[name] == Q.F16:
            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))
        else:
            assert (error <= _block_error(want, types[name])).all(), name
        assert error.max() > 0, name  # it really was stored quantized
        checked.add(name)
    assert checked == set(types)


@pytest.mark.parametrize("pre", ["gpt-2", "smollm"])
def test_tokenizer_encodes_and_decodes_like_the_original(pre, tmp_path):
    cfg = _model_cfg(True)
    _, params, _ = build(cfg, seed=1)
    original = write_gguf(tmp_path / "m.gguf", cfg.model, params, pre=pre)
    _, _, tokenizer = kvlab.load_gguf(tmp_path / "m.gguf")
    assert tokenizer.end_token == original.token_to_id("<|endoftext|>")
    assert tokenizer.path == str(tmp_path / "m.gguf")
    for text in [*SAMPLES, TEXT]:
        ids = original.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids) == original.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.encode("<|endoftext|>") == [tokenizer.end_token]
    assert (len(tokenizer.encode("12345")) == 5) == (pre == "smollm")  # digits one by one


def test_dtype_argument(tmp_path):
    cfg = _model_cfg(True)
    _, params, _ = build(cfg, seed=1)
    write_gguf(tmp_path / "m.gguf", cfg.model, params)
    loaded_cfg, loaded, _ = kvlab.load_gguf(tmp_path / "m.gguf", dtype="bfloat16")
    assert loaded_cfg.model.param_dtype == loaded_cfg.model.dtype == "bfloat16"
    assert loaded["embed"]["embedding"].dtype == jax.numpy.bfloat16
    with pytest.raises(ValueError, match="dtype='int8' is not supported"):
        kvlab.load_gguf(tmp_path / "m.gguf", dtype="int8")


REFUSALS = {
    "architecture": (
        dict(architecture="qwen2"),
        "general.architecture='qwen2' is not an architecture kvlab reads",
    ),
    "tensor type": (
        dict(types={"blk.1.attn_v.weight": Q.Q4_0}),
        "tensor 'blk.1.attn_v.weight' .* is stored as Q4_0: kvlab dequantizes F32, F16, Q8_0, Q4_1",
    ),
    "missing tensor": (
        dict(drop=("blk.1.ffn_up.weight",)),
        "has no tensor 'blk.1.ffn_up.weight'.*block_1/mlp/up/kernel",
    ),
    "leftover tensor": (
        dict(extra=[("blk.2.attn_norm.weight", np.ones(64, np.float32))]),
        "has no place for: 'blk.2.attn_norm.weight'",
    ),
    "rope_freqs": (
        dict(extra=[("rope_freqs.weight", np.ones(8, np.float32))]),
        "rope_freqs.weight",
    ),
    "tokenizer model": (
        dict(tokenizer_model="llama"),
        "tokenizer.ggml.model='llama' is not a tokenizer kvlab builds",
    ),
    "pre-tokenizer": (
        dict(pre="qwen2"),
        "tokenizer.ggml.pre='qwen2' is a pre-tokenizer kvlab does not rebuild",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_key_or_tensor(case, tmp_path):
    cfg = _model_cfg(True)
    _, params, _ = build(cfg, seed=1)
    changes, message = REFUSALS[case]
    write_gguf(tmp_path / "m.gguf", cfg.model, params, **changes)
    with pytest.raises(ValueError, match=message):
        kvlab.load_gguf(tmp_path / "m.gguf")


def test_refuses_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        kvlab.load_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="is not a file"):
        kvlab.load_gguf(tmp_path / "absent.gguf")


def test_refuses_weights_that_decode_to_non_finite_values(tmp_path):
    cfg = _model_cfg(True)
    _, params, _ = build(cfg, seed=1)
    flat = traverse_util.flatten_dict(params)
    kernel = np.array(flat["block_0", "mlp", "up", "kernel"])
    kernel[:2, :3] = 7e4  # beyond float16: stored as F16, these bytes decode to infinity
    flat["block_0", "mlp", "up", "kernel"] = kernel
    poisoned = traverse_util.unflatten_dict(flat)
    with np.errstate(over="ignore"):  # the cast to float16 is the point
        write_gguf(tmp_path / "m.gguf", cfg.model, poisoned, types={"blk.0.ffn_up.weight": Q.F16})
    with pytest.raises(ValueError) as error:
        kvlab.load_gguf(tmp_path / "m.gguf")
    assert str(error.value).startswith(
        f"tensor 'blk.0.ffn_up.weight' in {tmp_path / 'm.gguf'} (dequantized) holds 6 non-finite"
    )
    _, loaded, _ = kvlab.load_gguf(tmp_path / "m.gguf", allow_nonfinite=True)
    assert np.isinf(np.asarray(loaded["block_0"]["mlp"]["up"]["kernel"])).sum() == 6


def test_the_readme_recipe_keeps_the_tokenizer(tmp_path):
    # load_gguf, then save_hf with its tokenizer: --hf (config_from_hf) reads text through it.
    cfg = _model_cfg(True)
    _, params, _ = build(cfg, seed=1)
    write_gguf(tmp_path / "m.gguf", cfg.model, params)
    loaded_cfg, loaded, tokenizer = kvlab.load_gguf(tmp_path / "m.gguf")
    kvlab.save_hf(loaded_cfg, loaded, tmp_path / "without")
    with pytest.raises(ValueError, match=r"holds no tokenizer.json, and its model's vocabulary"):
        config_from_hf(kvlab.base_config(), tmp_path / "without")
    kvlab.save_hf(loaded_cfg, loaded, tmp_path / "hf", tokenizer=tokenizer)
    run_cfg = config_from_hf(kvlab.base_config(), tmp_path / "hf")
    assert run_cfg.data.tokenizer == str(tmp_path / "hf")
    again = kvlab.data.load_tokenizer(run_cfg.data.tokenizer)
    assert again.encode(TEXT) == tokenizer.encode(TEXT) and again.end_token == tokenizer.end_token
