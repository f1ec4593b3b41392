"""Writing a transformers checkpoint folder: save_hf.

    kvlab.save_hf(cfg, params, "out/model", tokenizer=None)    # transformers loads it back

`save_hf` writes config.json and model.safetensors (and tokenizer.json when
given the tokenizer); AutoModelForCausalLM.from_pretrained computes the same
logits. Export picks the family from the model: latent attention ->
deepseek_v3 with sigmoid routing, else deepseek_v2; qk_norm -> qwen3; qkv_bias
-> qwen2 (a hybrid model's layer_types: one of these two); else mistral with a
sliding window, llama without (a window on latent attention is refused:
DeepSeek has none). Import then export then import gives
bit-identical parameters (layouts.py: nothing is rounded).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import ml_collections
import numpy as np
import safetensors.numpy
from flax import traverse_util

from kvlab.checkpoints.hf.config import (
    DEEPSEEK_LATENT_NORM_EPS,
    GROUPED_FAMILIES,
    ROPE_TYPES,
)
from kvlab.checkpoints.hf.layouts import INDEX_FILE, SINGLE_FILE, check_params, tensor_links
from kvlab.config import dtype_of, validate_model_config
from kvlab.data.tokenizer import TOKENIZER_FILE, Tokenizer
from kvlab.files import write_atomic
from kvlab.model import unfuse_projections

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# max_position_embeddings written when the RoPE scaling gives no context length:
# kvlab has no position limit and transformers' plain RoPE does not read it.
EXPORT_CONTEXT = 4096


def save_hf(
    cfg: ml_collections.ConfigDict,
    params: Mapping,
    path: str | os.PathLike,
    tokenizer: Tokenizer | None = None,
) -> None:
    """Writes `params` of the model `cfg.model` as a transformers checkpoint in the
    folder `path` (created if needed): config.json and model.safetensors, and with
    `tokenizer` (a kvlab.data.tokenizer.Tokenizer: load_gguf's, or load_tokenizer's)
    its tokenizer.json and tokenizer_config.json (its class for transformers and, when
    it has an end token, that as eos_token); each replaced atomically.
    AutoModelForCausalLM.from_pretrained(path) computes the same logits; tensors are
    written in model.param_dtype. `params` may be fused (kvlab.model.fuse_projections).
    A model whose vocabulary is not the 256 byte values needs its tokenizer in the
    folder for kvlab to read text (load_hf)."""
    model = cfg.model
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise ValueError(
            f"tokenizer={tokenizer!r} is not a kvlab.data.tokenizer.Tokenizer: pass the one "
            "kvlab.load_gguf returns, or kvlab.data.load_tokenizer(path)"
        )
    if tokenizer is not None and tokenizer.vocab_size > model.vocab_size:
        raise ValueError(
            f"the tokenizer ({tokenizer.path}) makes {tokenizer.vocab_size} token ids but "
            f"model.vocab_size={model.vocab_size}: pass the model's own tokenizer"
        )
    validate_model_config(model)
    family = _export_family(model)
    flat = traverse_util.flatten_dict(unfuse_projections(params))
    check_params({p: np.shape(v) for p, v in flat.items()}, model, "params")
    folder = os.fspath(path)
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(os.path.join(folder, INDEX_FILE)):
        raise ValueError(
            f"{folder!r} holds a sharded checkpoint ({INDEX_FILE}), which transformers would "
            f"read instead of the {SINGLE_FILE} save_hf writes: save into another folder or "
            "remove the old checkpoint"
        )
    param_dtype = dtype_of(model.param_dtype)
    tensors = {}
    for link in tensor_links(model):
        arrays = [np.asarray(flat[p]).astype(param_dtype, copy=False) for p in link.params]
        for (name, _), array in zip(link.tensors, link.to_hf(*arrays), strict=True):
            tensors[name] = np.ascontiguousarray(array)
    write_atomic(
        os.path.join(folder, SINGLE_FILE),
        safetensors.numpy.save(tensors, metadata={"format": "pt"}),
    )
    if tokenizer is not None:
        write_atomic(os.path.join(folder, TOKENIZER_FILE), tokenizer.backend.to_str())
        eos = tokenizer.end_token
        # The class transformers' AutoTokenizer reads tokenizer.json with as it is (from
        # the model's type alone it guesses a slow tokenizer's class and its vocabulary).
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if eos is not None:
            config["eos_token"] = tokenizer.backend.id_to_token(eos)
        write_atomic(os.path.join(folder, "tokenizer_config.json"), json.dumps(config) + "\n")
    write_atomic(
        os.path.join(folder, "config.json"),
        json.dumps(_hf_config(model, family), indent=2) + "\n",
    )


def _export_family(model) -> str:
    """The transformers family that computes what `model` computes, or ValueError."""
    moe = model.moe
    if model.topology != "layerwise":
        raise ValueError(
            f"model.topology={model.topology!r} cannot be exported: transformers' families "
            "give every layer its own keys and values; keep the model as a kvlab workdir"
        )
    if model.sliding_sinks:
        raise ValueError(
            f"model.sliding_sinks={model.sliding_sinks} cannot be exported: transformers' "
            "sliding windows keep no first positions beside them; set model.sliding_sinks=0"
        )
    if model.attention == "mla":
        if model.sliding_window:
            raise ValueError(
                f"model.sliding_window={model.sliding_window} with model.attention='mla' cannot "
                "be exported: transformers' DeepSeek attention has no sliding window; set "
                "model.sliding_window=0"
            )
        mla = model.mla
        converted = {
            "latent_norm": (mla.latent_norm, True),
            "rope_heads": (mla.rope_heads, 1),
            "rope_pairs": (tuple(mla.rope_pairs), ()),
        }
        for name, (value, deepseek) in converted.items():
            if value != deepseek:
                raise ValueError(
                    f"model.mla.{name}={value!r} cannot be exported: transformers' DeepSeek "
                    f"attention has model.mla.{name}={deepseek!r} (one normed latent, one "
                    "shared RoPE key); a model converted to latent attention "
                    "(kvlab.checkpoints.to_mla) is kept as a kvlab workdir (scripts/convert.py "
                    "--out, then train.init_from or --workdir)"
                )
        if model.mla.norm_eps != DEEPSEEK_LATENT_NORM_EPS:
            raise ValueError(
                f"model.mla.norm_eps={model.mla.norm_eps!r} cannot be exported: transformers' "
                f"DeepSeek fixes its latent norms' eps at {DEEPSEEK_LATENT_NORM_EPS}; set "
                f"model.mla.norm_eps={DEEPSEEK_LATENT_NORM_EPS}"
            )
        if moe.num_experts and moe.every != 1:
            raise ValueError(
                f"model.moe.every={moe.every!r} cannot be exported: transformers' DeepSeek makes "
                "every layer from first_k_dense_replace on an MoE layer; set model.moe.every=1"
            )
        if moe.num_experts and moe.routing == "sigmoid":
            return "deepseek_v3"
        if moe.num_experts and moe.normalize_weights:
            raise ValueError(
                "model.moe.normalize_weights=True cannot be exported with routing='softmax': "
                "transformers' DeepSeek-V2 ignores norm_topk_prob; set it False"
            )
        return "deepseek_v2"
    if moe.num_experts:
        raise ValueError(
            f"model.moe.num_experts={moe.num_experts} with model.attention='gqa' cannot be "
            "exported: kvlab writes experts as DeepSeek does, with latent attention only; "
            "set model.attention='mla' or model.moe.num_experts=0"
        )
    if model.qkv_bias and model.qk_norm:
        raise ValueError(
            "model.qkv_bias=True with model.qk_norm=True cannot be exported: no transformers "
            "family kvlab writes has both (qwen2 has the biases, qwen3 the norms); drop one"
        )
    if model.qk_norm or model.qkv_bias:
        return "qwen3" if model.qk_norm else "qwen2"
    if model.layer_types:
        raise ValueError(
            f"model.layer_types={tuple(model.layer_types)!r} cannot be exported as llama or "
            "mistral, whose layers are alike: qwen2 and qwen3 write a window per layer, so "
            "kvlab writes a hybrid model with model.qkv_bias=True or model.qk_norm=True"
        )
    # Mistral is Llama with a window over every layer (Llama has none).
    return "mistral" if model.sliding_window else "llama"


def _hf_rope(model) -> tuple[dict, int]:
    """(rope_parameters, max_position_embeddings) for transformers."""
    scaling = model.rope_scaling
    kind = scaling.type
    parameters = {"rope_type": {v: k for k, v in ROPE_TYPES.items()}[kind]}
    parameters["rope_theta"] = model.rope_theta
    context = EXPORT_CONTEXT
    if kind != "none":
        parameters["factor"] = scaling.factor
    if kind in ("llama3", "yarn"):
        parameters["original_max_position_embeddings"] = scaling.original_max_len
        context = max(
            round(scaling.original_max_len * scaling.factor), scaling.original_max_len + 1
        )
    if kind == "llama3":
        parameters.update(
            low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor
        )
    if kind == "yarn":
        parameters.update(
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
            mscale=scaling.mscale,
            mscale_all_dim=scaling.mscale_all_dim,
        )
    return parameters, context


def _hf_config(model, family: str) -> dict:
    """config.json for `model` as `family`."""
    rope, context = _hf_rope(model)
    config = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed_dim,
        "intermediate_size": model.mlp_dim,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings,
        "max_position_embeddings": context,
        "rope_parameters": rope,  # transformers 5
        "rope_theta": model.rope_theta,  # transformers 4
        "rope_scaling": None if model.rope_scaling.type == "none" else rope,
        "dtype": model.param_dtype,
    }
    if family in GROUPED_FAMILIES:
        config["head_dim"] = model.head_dim
        config["attention_bias"] = False  # qwen2's q/k/v biases are fixed by its family
        config["mlp_bias"] = False
        window = model.sliding_window or None
        if family == "mistral":
            config["sliding_window"] = window
        if family in ("qwen2", "qwen3"):
            config.update(use_sliding_window=window is not None, sliding_window=window)
            if window:  # the layers that slide: every one, or model.layer_types'
                kinds = model.layer_types or ("sliding",) * model.num_layers
                config.update(
                    max_window_layers=0, layer_types=[f"{kind}_attention" for kind in kinds]
                )
        return config
    mla, moe = model.mla, model.moe
    config.update(
        kv_lora_rank=mla.kv_rank,
        q_lora_rank=mla.q_rank or None,
        qk_rope_head_dim=mla.rope_dim,
        qk_nope_head_dim=mla.nope_dim,
        v_head_dim=mla.v_head_dim,
        attention_bias=False,
        mlp_bias=False,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.experts_per_token,
        moe_intermediate_size=moe.expert_dim,
        n_shared_experts=moe.num_shared_experts,
        # a model without experts keeps the dense MLP in every layer
        first_k_dense_replace=moe.first_dense_layers if moe.num_experts else model.num_layers,
        routed_scaling_factor=moe.routed_scale,
        norm_topk_prob=moe.normalize_weights,
        n_group=moe.num_groups,
        topk_group=moe.groups_per_token,
    )
    if family == "deepseek_v2":
        config["topk_method"] = "greedy" if moe.num_groups == 1 else "group_limited_greedy"
    else:
        config.update(topk_method="noaux_tc", rope_interleave=True)
    return config
