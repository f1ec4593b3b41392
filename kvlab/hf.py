"""Hugging Face transformers checkpoints in and out of kvlab.

    cfg, params = kvlab.load_hf("path/to/model", dtype=None)   # a local save_pretrained folder
    kvlab.save_hf(cfg, params, "out/model", tokenizer=None)    # transformers loads it back

A checkpoint is a folder as `save_pretrained` writes it: config.json and the
weights in model.safetensors, or in shards named by model.safetensors.index.json.
Nothing is downloaded (fetch a hub model first, e.g. `hf download NAME --local-dir
DIR`). `load_hf` returns a validated kvlab config (the model section mapped from
config.json, every other section at its defaults) and the parameter pytree of
`kvlab.Transformer(cfg.model)`; `save_hf` writes config.json and model.safetensors
(and tokenizer.json when given the tokenizer). Text for an imported model goes
through the folder's tokenizer.json (data.tokenizer); a model whose vocabulary
is not the 256 byte values never reads bytes: without a tokenizer.json it is
refused. Weights holding NaN or infinity are refused naming the tensor
(`allow_nonfinite=True` loads them), and so is a cast to `dtype` that overflows.

Families (config.json's model_type) and what they become:

    llama, mistral   grouped-query attention; RoPE scaling linear, llama3 or yarn
    qwen2            + q/k/v biases (model.qkv_bias)
    qwen3            + per-head q/k RMSNorm (model.qk_norm)
    deepseek_v2/v3   latent attention (model.attention='mla', model.mla.*, arXiv:2405.04434)
                     and DeepSeekMoE (model.moe.*, kvlab/moe.py; V2 softmax routing,
                     V3 sigmoid routing with its score-correction bias)

Mistral's sliding_window W becomes model.sliding_window (null: 0, full causal
attention); both let the query at position p see keys p - W + 1 .. p. kvlab
has one window for all layers, so a Qwen2/Qwen3 window loads only when every
layer slides (use_sliding_window with max_window_layers 0, or layer_types all
'sliding_attention'); a window on some layers is refused.

Nothing is dropped silently. Every config.json field that changes what the
model computes is mapped to a kvlab field or checked to hold the value kvlab
computes (hidden_act 'silu', no o_proj bias, one window for all layers, ...);
every tensor kvlab needs must be there with the shape config.json implies; a tensor
left over is refused. Errors name the field or tensor, its value and what is
supported.

Layouts. transformers stores a linear map as weight [out, in]; kvlab's kernels
are [in..., out...] (axis letters: docs/architecture.md):

    embed_tokens [V, D]                   -> embed/embedding [V, D]
    q_proj [N*H, D], k_proj/v_proj [K*H, D] -> attention/{query,key,value}/kernel [D, N|K, H]
    q/k/v_proj.bias [N*H], [K*H]          -> attention/{query,key,value}/bias [N|K, H]
    q_norm, k_norm [H]                    -> attention/{query,key}_norm/scale [H]
    o_proj [D, N*H]                       -> attention/out/kernel [N, H, D]
    gate_proj, up_proj [F, D], down_proj [D, F] -> mlp/{gate,up,down}/kernel [D, F], [F, D]
    input_layernorm, post_attention_layernorm [D] -> attention_norm, mlp_norm/scale
    norm [D], lm_head [V, D]              -> final_norm/scale, unembed/kernel [D, V]

DeepSeek's latent attention (R = kv_lora_rank, Hr = qk_rope_head_dim):

    q_proj or q_b_proj [N*(nope+Hr), D|q_rank] rows per head [nope; rope]
                                          -> query or query_up/kernel [D|q_rank, N, nope+Hr]
    q_a_proj [q_rank, D], q_a_layernorm   -> query_down/kernel, query_norm/scale
    kv_a_proj_with_mqa [R+Hr, D] rows [latent; rope key]
                                          -> kv_down/kernel [D, R], key_rope/kernel [D, 1, Hr]
    kv_a_layernorm [R]                    -> kv_norm/scale
    kv_b_proj [N*(nope+Hv), R] rows per head [nope key; value]
                                          -> key_up [R, N, nope], value_up [R, N, Hv]
    mlp.gate [E, D] (+ e_score_correction_bias [E])  -> mlp/router/kernel [D, E] (+ router_bias)
    mlp.experts.e.{gate,up,down}_proj     -> mlp/{gate,up,down} [E, D, F], [E, F, D]
    mlp.shared_experts.*                  -> mlp/shared/*

DeepSeek rotates interleaved channel pairs (2j, 2j+1); kvlab rotates halves
(j, j + Hr/2), as Llama does. Each RoPE block (a query head's rope part, the
shared rope key) is reordered [0, 2, 4, ..., 1, 3, 5, ...] on import and back
on export; q . k is unchanged because queries and keys move alike. (DeepSeek-V3
with rope_interleave=false is already in halves and is not reordered.) The
latent norms use eps 1e-6 whatever rms_norm_eps says (model.mla.norm_eps).

Export picks the family from the model: latent attention -> deepseek_v3 with
sigmoid routing, else deepseek_v2; qk_norm -> qwen3; qkv_bias -> qwen2; else
mistral with a sliding window, llama without (a window on latent attention is
refused: DeepSeek has none). Import then export then import gives bit-identical
parameters: the layouts are transposes, reshapes and permutations, nothing is
rounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import safetensors.numpy
from flax import traverse_util
from safetensors import SafetensorError, safe_open

from kvlab.attention.rope import yarn_mscale
from kvlab.config import (
    BYTE_VOCAB_SIZE,
    DTYPES,
    base_config,
    dtype_of,
    validate_model_config,
)
from kvlab.data import validate_config
from kvlab.data.tokenizer import TOKENIZER_FILE, Tokenizer
from kvlab.files import read_json, write_atomic
from kvlab.model import init_params, unfuse_projections
from kvlab.moe import uses_experts

GROUPED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LATENT_FAMILIES = ("deepseek_v2", "deepseek_v3")
FAMILIES = GROUPED_FAMILIES + LATENT_FAMILIES
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
# safetensors dtype codes kvlab reads, and the config dtype each becomes.
STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) are built without an
# eps argument, so they keep RMSNorm's default.
DEEPSEEK_LATENT_NORM_EPS = 1e-6
# max_position_embeddings written when the RoPE scaling gives no context length:
# kvlab has no position limit and transformers' plain RoPE does not read it.
EXPORT_CONTEXT = 4096
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------------------
# config.json


class _HFConfig:
    """config.json's fields; problems are reported naming the file and the field."""

    def __init__(self, folder: str):
        self.file = os.path.join(folder, "config.json")
        if not os.path.isfile(self.file):
            raise ValueError(
                f"{folder!r} has no config.json: load_hf reads a folder as transformers' "
                "save_pretrained writes it (config.json and *.safetensors)"
            )
        self.values = read_json(self.file)
        if not isinstance(self.values, dict):
            raise ValueError(f"{self.file} does not hold a JSON object: it is not a model config")
        self.family = self.values.get("model_type")
        if self.family not in FAMILIES:
            self.refuse(
                "model_type",
                self.family,
                "is not a family kvlab reads",
                f"kvlab reads {', '.join(FAMILIES)}",
            )

    def __contains__(self, key: str) -> bool:
        return self.values.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        """The field's value; `default` when it is absent or null."""
        value = self.values.get(key)
        return default if value is None else value

    def refuse(self, key: str, value: Any, problem: str, fix: str) -> None:
        raise ValueError(f"{self.file}: {key}={value!r} {problem}: {fix}")

    def count(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """An integer field >= minimum; required unless a default is given."""
        value = self.get(key, default)
        if value is None:
            raise ValueError(
                f"{self.file} has no {key}: a {self.family} config sets it; re-save the model "
                "with save_pretrained or add the field"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.refuse(key, value, "is not a count", f"set an integer >= {minimum}")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        """A finite number > 0; required unless a default is given."""
        value = self.get(key, default)
        if value is None:
            raise ValueError(f"{self.file} has no {key}: a {self.family} config sets it")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            self.refuse(key, value, "is not a number > 0", "set a positive number")
        if not math.isfinite(value):
            self.refuse(key, value, "is not finite", "set a finite number")
        return float(value)

    def expect(self, key: str, allowed: Sequence, default: Any, why: str) -> None:
        """Refuses a field whose value kvlab does not compute (`why` says what kvlab does)."""
        value = self.get(key, default)
        if value not in allowed:
            self.refuse(key, value, why, f"kvlab supports {key} in {list(allowed)}")


def dtype_name(dtype: Any, default: str, meaning: str) -> str:
    """The config dtype name for a loader's `dtype` argument: `default` when None
    (`meaning` says what that is), else the name of a dtype kvlab configs take."""
    if dtype is None:
        return default
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not supported: pass one of {', '.join(map(repr, DTYPES))} "
            f"or None ({meaning})"
        )
    return name


def _dtype_name(dtype: Any, hf: _HFConfig) -> str:
    """The config dtype name load_hf uses: `dtype` if given, else the checkpoint's own."""
    stored = hf.get("dtype", hf.get("torch_dtype"))
    return dtype_name(
        dtype, stored if stored in DTYPES else "float32", "the checkpoint's own dtype"
    )


def _rope(hf: _HFConfig) -> tuple[float, dict]:
    """(rope_theta, model.rope_scaling fields) from rope_parameters (transformers 5)
    or rope_theta and rope_scaling (transformers 4), read as transformers reads them."""
    key = "rope_scaling" if "rope_scaling" in hf else "rope_parameters"
    parameters = hf.get(key, {})
    if not isinstance(parameters, Mapping) or any(
        isinstance(v, Mapping) for v in parameters.values()
    ):
        hf.refuse(
            key,
            parameters,
            "is not one set of RoPE parameters (per-layer-type RoPE?)",
            "kvlab uses one RoPE for every layer",
        )
    theta = parameters.get("rope_theta") or hf.number("rope_theta", 10_000.0)
    partial = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        hf.refuse(
            "partial_rotary_factor",
            partial,
            "rotates only part of each head",
            "kvlab rotates whole heads (partial_rotary_factor 1.0)",
        )
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in ROPE_TYPES:
        hf.refuse(
            f"{key}.rope_type",
            kind,
            "is not supported",
            f"kvlab computes RoPE types {', '.join(map(repr, ROPE_TYPES))} (model.rope_scaling)",
        )

    def field(name: str, default: Any = None) -> Any:
        value = parameters.get(name, default)
        if value is None:
            raise ValueError(f"{hf.file}: {key} of rope_type {kind!r} has no {name}: set it")
        return value

    scaling = {"type": ROPE_TYPES[kind]}
    if kind == "default":
        return float(theta), scaling
    context = parameters.get("original_max_position_embeddings") or hf.get(
        "max_position_embeddings"
    )
    if kind == "linear":
        scaling["factor"] = float(field("factor"))
    elif kind == "llama3":
        scaling.update(
            factor=float(field("factor")),
            original_max_len=int(field("original_max_position_embeddings", context)),
            low_freq_factor=float(field("low_freq_factor")),
            high_freq_factor=float(field("high_freq_factor")),
        )
    else:  # yarn
        context = int(field("original_max_position_embeddings", context))
        factor = parameters.get("factor") or hf.count("max_position_embeddings") / context
        if parameters.get("truncate", True) is not True:
            hf.refuse(
                f"{key}.truncate",
                parameters["truncate"],
                "keeps yarn's correction range unrounded",
                "kvlab rounds it as transformers does by default (truncate true)",
            )
        scaling.update(
            factor=float(factor),
            original_max_len=context,
            beta_fast=float(parameters.get("beta_fast") or 32.0),
            beta_slow=float(parameters.get("beta_slow") or 1.0),
            # transformers treats an absent or zero mscale alike; kvlab's 0.0 is that
            mscale=float(parameters.get("mscale") or 0.0),
            mscale_all_dim=float(parameters.get("mscale_all_dim") or 0.0),
        )
        given = parameters.get("attention_factor")
        computed = _yarn_attention_factor(scaling)
        if given is not None and not math.isclose(given, computed, rel_tol=1e-12):
            hf.refuse(
                f"{key}.attention_factor",
                given,
                f"differs from the {computed!r} kvlab derives from factor, mscale and "
                "mscale_all_dim",
                "remove attention_factor or make it the derived value",
            )
    return float(theta), scaling


def _yarn_attention_factor(scaling: Mapping) -> float:
    """yarn's cos/sin factor, as kvlab.attention.rope computes it."""
    factor, mscale, mscale_all_dim = scaling["factor"], scaling["mscale"], scaling["mscale_all_dim"]
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _model_section(hf: _HFConfig, dtype: str) -> ml_collections.ConfigDict:
    """kvlab's model section for config.json, field by field."""
    model = base_config().model
    family = hf.family
    hf.expect("hidden_act", ("silu",), "silu", "is not SwiGLU's activation")
    if "quantization_config" in hf:
        hf.refuse(
            "quantization_config",
            hf.get("quantization_config"),
            "describes quantized weights",
            "kvlab reads float32, bfloat16 and float16 checkpoints: dequantize first",
        )
    theta, scaling = _rope(hf)
    heads = hf.count("num_attention_heads")
    model.update(
        vocab_size=hf.count("vocab_size"),
        num_layers=hf.count("num_hidden_layers"),
        embed_dim=hf.count("hidden_size"),
        num_heads=heads,
        mlp_dim=hf.count("intermediate_size"),
        rope_theta=theta,
        norm_eps=hf.number("rms_norm_eps"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype,
        param_dtype=dtype,
    )
    model.rope_scaling.update(scaling)
    if family in LATENT_FAMILIES:
        _latent_fields(hf, model)
    else:
        _grouped_fields(hf, model)
    return model


def _grouped_fields(hf: _HFConfig, model: ml_collections.ConfigDict) -> None:
    family, heads, embed_dim = hf.family, model.num_heads, model.embed_dim
    if "head_dim" not in hf and embed_dim % heads:
        hf.refuse(
            "hidden_size",
            embed_dim,
            f"is not a multiple of num_attention_heads={heads} and config.json has no head_dim",
            "add head_dim",
        )
    model.update(
        attention="gqa",
        num_kv_heads=hf.count("num_key_value_heads", heads),
        head_dim=hf.count("head_dim", embed_dim // heads),
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
    )
    if family in ("llama", "qwen3"):
        hf.expect(
            "attention_bias",
            (False,),
            False,
            "puts biases on q/k/v and o_proj; kvlab has q/k/v biases only (Qwen2)",
        )
    if family == "llama":
        hf.expect("mlp_bias", (False,), False, "puts biases on the MLP; kvlab's MLP has none")
    if family == "mistral":
        # Mistral slides every layer: None is full causal attention.
        model.sliding_window = _window(hf, "sliding_window")
    if family in ("qwen2", "qwen3"):
        model.sliding_window = _qwen_window(hf, model.num_layers)


def _window(hf: _HFConfig, key: str) -> int:
    """model.sliding_window for config.json's `key`: W -> W, absent or null -> 0.

    transformers' window W lets the query at position p see keys at positions
    p - W + 1 .. p (key visible iff p - k < W), as kvlab's model.sliding_window."""
    return hf.count(key) if key in hf else 0


def _qwen_window(hf: _HFConfig, num_layers: int) -> int:
    """model.sliding_window for Qwen2/Qwen3, whose windows are per layer.

    As transformers 5 reads the config: the window is sliding_window when
    use_sliding_window is true, else there is none; layer i slides when
    layer_types[i] is 'sliding_attention' or, without layer_types, when there is a
    window and i >= max_window_layers. kvlab has one window for every layer, so
    only checkpoints whose layers all slide, or none, load."""
    window = _window(hf, "sliding_window") if hf.get("use_sliding_window", False) else 0
    layer_types = hf.get("layer_types")
    if layer_types is None:
        key, value = "max_window_layers", hf.count("max_window_layers", 28, minimum=0)
        sliding = [bool(window) and i >= value for i in range(num_layers)]
    else:
        key, value = "layer_types", layer_types
        kinds = ["full_attention", "sliding_attention"]
        if not isinstance(value, list) or len(value) != num_layers or not set(value) <= {*kinds}:
            hf.refuse(key, value, "is not a layer kind per layer", f"give {num_layers} of {kinds}")
        sliding = [kind == "sliding_attention" for kind in value]
        if any(sliding) and not window:
            hf.refuse(
                key,
                value,
                "has sliding-attention layers but config.json gives them no window "
                f"(use_sliding_window={hf.get('use_sliding_window', False)!r}, "
                f"sliding_window={hf.get('sliding_window')!r})",
                "set use_sliding_window true and sliding_window, or only 'full_attention' layers",
            )
    if any(sliding) and not all(sliding):
        hf.refuse(
            key,
            value,
            f"slides {sum(sliding)} of the {num_layers} layers (sliding_window={window}) and "
            "lets the others attend to every position",
            "kvlab has one model.sliding_window for every layer: only checkpoints whose layers "
            "all slide, or none, load",
        )
    return window if all(sliding) else 0


def _latent_fields(hf: _HFConfig, model: ml_collections.ConfigDict) -> None:
    # num_key_value_heads is not read: every head's key and value come from the latent
    # (DeepseekV3Config's default of 128 stays in configs of smaller models).
    family, heads = hf.family, model.num_heads
    hf.expect(
        "attention_bias",
        (False,),
        False,
        "puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj; kvlab's MLA has none",
    )
    hf.expect("mlp_bias", (False,), False, "puts biases on the MLP; kvlab's MLP has none")
    nope, rope = hf.count("qk_nope_head_dim"), hf.count("qk_rope_head_dim")
    model.update(attention="mla", num_kv_heads=heads, head_dim=nope + rope)
    model.mla.update(
        kv_rank=hf.count("kv_lora_rank"),
        q_rank=hf.count("q_lora_rank", 0, minimum=0),
        rope_dim=rope,
        nope_dim=nope,
        v_head_dim=hf.count("v_head_dim"),
        norm_eps=DEEPSEEK_LATENT_NORM_EPS,
    )
    num_experts = hf.count("n_routed_experts", 0, minimum=0)
    if not num_experts:
        return  # every layer keeps the dense MLP
    sigmoid = family == "deepseek_v3"
    routing = "sigmoid" if sigmoid else "softmax"
    hf.expect("scoring_func", (routing,), routing, f"is not {family}'s router scoring")
    if sigmoid:
        hf.expect("topk_method", ("noaux_tc",), "noaux_tc", "is not DeepSeek-V3's routing")
        groups, groups_per_token = hf.count("n_group", 1), hf.count("topk_group", 1)
    else:
        hf.expect(
            "topk_method",
            ("greedy", "group_limited_greedy"),
            "greedy",
            "is not a DeepSeek-V2 routing",
        )
        grouped = hf.get("topk_method", "greedy") == "group_limited_greedy"
        groups = hf.count("n_group") if grouped else 1
        groups_per_token = hf.count("topk_group") if grouped else 1
    model.moe.update(
        num_experts=num_experts,
        experts_per_token=hf.count("num_experts_per_tok"),
        expert_dim=hf.count("moe_intermediate_size"),
        num_shared_experts=hf.count("n_shared_experts", 0, minimum=0),
        first_dense_layers=hf.count("first_k_dense_replace", 0, minimum=0),
        every=hf.count("moe_layer_freq", 1),
        routing=routing,
        num_groups=groups,
        groups_per_token=groups_per_token,
        routed_scale=hf.number("routed_scaling_factor", 1.0),
        normalize_weights=bool(hf.get("norm_topk_prob", False)),
    )


# ---------------------------------------------------------------------------
# Tensor layouts


@dataclasses.dataclass(frozen=True)
class TensorLink:
    """Checkpoint tensors <-> kvlab parameters, and how values move between them."""

    tensors: tuple[tuple[str, tuple[int, ...]], ...]  # checkpoint names and shapes
    params: tuple[tuple[str, ...], ...]  # kvlab parameter paths
    to_kvlab: Callable[..., tuple[np.ndarray, ...]]  # checkpoint arrays -> parameter arrays
    to_hf: Callable[..., tuple[np.ndarray, ...]]  # parameter arrays -> checkpoint arrays


def _same(name: str, path: tuple, shape: tuple) -> TensorLink:
    """A tensor kvlab keeps as it is (norm scales, the embedding, a router bias)."""
    return TensorLink(((name, shape),), (path,), lambda w: (w,), lambda p: (p,))


def _flat(name: str, path: tuple, shape: tuple) -> TensorLink:
    """A bias [N*H] kept per head [N, H]."""
    return TensorLink(
        ((name, (math.prod(shape),)),),
        (path,),
        lambda w: (w.reshape(shape),),
        lambda p: (p.reshape(-1),),
    )


def _halves_order(width: int, rope: int) -> np.ndarray:
    """kvlab channel j takes checkpoint channel order[j]: the last `rope` channels
    go from interleaved pairs to halves ([0, 2, 4, ..., 1, 3, 5, ...]), the rest stay."""
    start = width - rope
    return np.concatenate(
        [np.arange(start), start + np.arange(0, rope, 2), start + np.arange(1, rope, 2)]
    )


def _linear(
    name: str, path: tuple, kernel_shape: tuple, inputs: int = 1, rope: int = 0
) -> TensorLink:
    """nn.Linear weight [out, in] <-> kernel [in..., out...] (`inputs` leading axes
    are the input); `rope` > 0 reorders the last rope channels of every output group."""
    fan_in, fan_out = math.prod(kernel_shape[:inputs]), math.prod(kernel_shape[inputs:])
    order = _halves_order(kernel_shape[-1], rope)
    inverse = np.argsort(order)

    def to_kvlab(w):
        return (w.T.reshape(kernel_shape)[..., order],)

    def to_hf(kernel):
        return (kernel[..., inverse].reshape(fan_in, fan_out).T,)

    return TensorLink(((name, (fan_out, fan_in)),), (path,), to_kvlab, to_hf)


def _latent_and_rope_key(name: str, path: tuple, model, rope: int) -> TensorLink:
    """kv_a_proj_with_mqa [R + Hr, D], rows [latent; rope key] <-> kv_down/kernel
    [D, R] and key_rope/kernel [D, 1, Hr]."""
    rank, rope_dim = model.mla.kv_rank, model.mla.rope_dim
    order = _halves_order(rope_dim, rope)
    inverse = np.argsort(order)

    def to_kvlab(w):
        return w[:rank].T, w[rank:].T[:, None, order]

    def to_hf(kv_down, key_rope):
        return (np.concatenate([kv_down.T, key_rope[:, 0, inverse].T]),)

    return TensorLink(
        ((name, (rank + rope_dim, model.embed_dim)),),
        ((*path, "kv_down", "kernel"), (*path, "key_rope", "kernel")),
        to_kvlab,
        to_hf,
    )


def _key_value_up(name: str, path: tuple, model) -> TensorLink:
    """kv_b_proj [N * (nope + Hv), R], rows per head [nope key; value] <->
    key_up [R, N, nope] and value_up [R, N, Hv]."""
    heads, mla = model.num_heads, model.mla
    rank, nope, value = mla.kv_rank, mla.nope_dim, mla.v_head_dim

    def to_kvlab(w):
        w = w.reshape(heads, nope + value, rank).transpose(2, 0, 1)  # [R, N, nope + Hv]
        return w[..., :nope], w[..., nope:]

    def to_hf(key_up, value_up):
        w = np.concatenate([key_up, value_up], axis=-1)  # [R, N, nope + Hv]
        return (w.transpose(1, 2, 0).reshape(heads * (nope + value), rank),)

    return TensorLink(
        ((name, (heads * (nope + value), rank)),),
        ((*path, "key_up"), (*path, "value_up")),
        to_kvlab,
        to_hf,
    )


def _experts(names: Sequence[str], path: tuple, shape: tuple) -> TensorLink:
    """One weight [out, in] per expert <-> the experts' kernels stacked [E, in, out]."""
    fan_in, fan_out = shape
    return TensorLink(
        tuple((name, (fan_out, fan_in)) for name in names),
        (path,),
        lambda *ws: (np.stack([w.T for w in ws]),),
        lambda stacked: tuple(kernel.T for kernel in stacked),
    )


def _mlp(prefix: str, path: tuple, embed_dim: int, hidden_dim: int) -> list[TensorLink]:
    return [
        _linear(prefix + "gate_proj.weight", (*path, "gate", "kernel"), (embed_dim, hidden_dim)),
        _linear(prefix + "up_proj.weight", (*path, "up", "kernel"), (embed_dim, hidden_dim)),
        _linear(prefix + "down_proj.weight", (*path, "down", "kernel"), (hidden_dim, embed_dim)),
    ]


def _grouped_attention(prefix: str, path: tuple, model) -> list[TensorLink]:
    embed, heads, kv_heads, width = (
        model.embed_dim,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
    )
    shapes = {"q": (heads, width), "k": (kv_heads, width), "v": (kv_heads, width)}
    names = {"q": "query", "k": "key", "v": "value"}
    links = [
        _linear(f"{prefix}{x}_proj.weight", (*path, names[x], "kernel"), (embed, *shapes[x]))
        for x in "qkv"
    ]
    links.append(
        _linear(prefix + "o_proj.weight", (*path, "out", "kernel"), (heads, width, embed), 2)
    )
    if model.qkv_bias:
        links += [
            _flat(f"{prefix}{x}_proj.bias", (*path, names[x], "bias"), shapes[x]) for x in "qkv"
        ]
    if model.qk_norm:
        links += [
            _same(f"{prefix}{x}_norm.weight", (*path, f"{names[x]}_norm", "scale"), (width,))
            for x in "qk"
        ]
    return links


def _latent_attention(prefix: str, path: tuple, model, interleaved: bool) -> list[TensorLink]:
    mla, heads, embed = model.mla, model.num_heads, model.embed_dim
    rope = mla.rope_dim if interleaved else 0
    width = mla.nope_dim + mla.rope_dim
    if mla.q_rank:
        links = [
            _linear(
                prefix + "q_a_proj.weight", (*path, "query_down", "kernel"), (embed, mla.q_rank)
            ),
            _same(prefix + "q_a_layernorm.weight", (*path, "query_norm", "scale"), (mla.q_rank,)),
            _linear(
                prefix + "q_b_proj.weight",
                (*path, "query_up", "kernel"),
                (mla.q_rank, heads, width),
                rope=rope,
            ),
        ]
    else:
        links = [
            _linear(
                prefix + "q_proj.weight",
                (*path, "query", "kernel"),
                (embed, heads, width),
                rope=rope,
            )
        ]
    return links + [
        _latent_and_rope_key(prefix + "kv_a_proj_with_mqa.weight", path, model, rope),
        _same(prefix + "kv_a_layernorm.weight", (*path, "kv_norm", "scale"), (mla.kv_rank,)),
        _key_value_up(prefix + "kv_b_proj.weight", path, model),
        _linear(
            prefix + "o_proj.weight", (*path, "out", "kernel"), (heads, mla.v_head_dim, embed), 2
        ),
    ]


def _feed_forward(prefix: str, path: tuple, model, index: int) -> list[TensorLink]:
    embed = model.embed_dim
    if not uses_experts(model, index):
        return _mlp(prefix, path, embed, model.mlp_dim)
    moe = model.moe
    num_experts, width = moe.num_experts, moe.expert_dim
    links = [_linear(prefix + "gate.weight", (*path, "router", "kernel"), (embed, num_experts))]
    if moe.routing == "sigmoid":
        links.append(
            _same(prefix + "gate.e_score_correction_bias", (*path, "router_bias"), (num_experts,))
        )
    for hf_name, name, shape in (
        ("gate_proj", "gate", (embed, width)),
        ("up_proj", "up", (embed, width)),
        ("down_proj", "down", (width, embed)),
    ):
        names = [f"{prefix}experts.{e}.{hf_name}.weight" for e in range(num_experts)]
        links.append(_experts(names, (*path, name), shape))
    if moe.num_shared_experts:
        shared = moe.num_shared_experts * width
        links += _mlp(prefix + "shared_experts.", (*path, "shared"), embed, shared)
    return links


def tensor_links(model, interleaved: bool = True) -> list[TensorLink]:
    """Every checkpoint tensor of `model` and the kvlab parameters it holds (load_hf,
    save_hf and kvlab.gguf map tensors through these)."""
    vocab, embed = model.vocab_size, model.embed_dim
    links = [_same("model.embed_tokens.weight", ("embed", "embedding"), (vocab, embed))]
    for i in range(model.num_layers):
        prefix, block = f"model.layers.{i}.", f"block_{i}"
        links += [
            _same(prefix + "input_layernorm.weight", (block, "attention_norm", "scale"), (embed,)),
            _same(
                prefix + "post_attention_layernorm.weight", (block, "mlp_norm", "scale"), (embed,)
            ),
        ]
        attention = (prefix + "self_attn.", (block, "attention"), model)
        if model.attention == "mla":
            links += _latent_attention(*attention, interleaved)
        else:
            links += _grouped_attention(*attention)
        links += _feed_forward(prefix + "mlp.", (block, "mlp"), model, i)
    links.append(_same("model.norm.weight", ("final_norm", "scale"), (embed,)))
    if not model.tie_embeddings:
        links.append(_linear("lm_head.weight", ("unembed", "kernel"), (embed, vocab)))
    return links


@functools.lru_cache(maxsize=16)
def _expected_shapes(model) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Every parameter path of Transformer(model) and its shape (nothing allocated)."""
    shapes = jax.eval_shape(functools.partial(init_params, model), jax.random.key(0))
    return {path: tuple(x.shape) for path, x in traverse_util.flatten_dict(shapes).items()}


# ---------------------------------------------------------------------------
# Reading


class _Checkpoint(contextlib.ExitStack):
    """The tensors of a folder's safetensors file(s), read lazily by name."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        index = os.path.join(folder, INDEX_FILE)
        single = os.path.join(folder, SINGLE_FILE)
        if os.path.isfile(index):
            stored = read_json(index)
            weight_map = stored.get("weight_map") if isinstance(stored, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map: the sharded checkpoint is damaged")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = [SINGLE_FILE]
        else:
            others = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth"))]
            hint = f" (it has {others[:3]}: re-save with safe_serialization=True)" if others else ""
            raise ValueError(
                f"{folder!r} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}: kvlab reads "
                "safetensors checkpoints"
            )
        self.files: dict[str, Any] = {}  # tensor name -> open file
        for name in files:
            file = os.path.join(folder, name)
            if not os.path.isfile(file):
                raise ValueError(f"{INDEX_FILE} names {name}, which {folder!r} does not hold")
            try:
                handle = self.enter_context(safe_open(file, framework="numpy"))
            except SafetensorError as error:
                raise ValueError(
                    f"{file} is not a safetensors file the safetensors library reads ({error}): "
                    "it is damaged or was cut short; write or download it again"
                ) from None
            for tensor in handle.keys():
                if tensor in self.files:
                    raise ValueError(f"tensor {tensor!r} is stored twice in {folder!r}")
                self.files[tensor] = handle

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.files[name].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        stored = self.files[name].get_slice(name).get_dtype()
        if stored not in STORED_DTYPES:
            raise ValueError(
                f"tensor {name!r} in {self.folder!r} is stored as {stored}: kvlab reads "
                f"{', '.join(STORED_DTYPES)} tensors; dequantize the checkpoint first"
            )
        return self.files[name].get_tensor(name)


def _read_params(checkpoint: _Checkpoint, hf: _HFConfig, model, allow_nonfinite: bool):
    folder, family = checkpoint.folder, hf.family
    interleaved = family == "deepseek_v2" or bool(hf.get("rope_interleave", True))
    links = tensor_links(model, interleaved)
    values: dict[tuple[str, ...], np.ndarray] = {}
    used = set()
    for link in links:
        arrays = []
        for name, shape in link.tensors:
            where = " and ".join("/".join(path) for path in link.params)
            if name not in checkpoint:
                raise ValueError(
                    f"{folder!r} has no tensor {name!r}, which a {family} model as its "
                    f"config.json describes needs (kvlab's {where}): the weights and "
                    "config.json do not belong together, or the files are incomplete"
                )
            if checkpoint.shape(name) != shape:
                raise ValueError(
                    f"tensor {name!r} in {folder!r} has shape {checkpoint.shape(name)} but "
                    f"config.json makes it {shape} (kvlab's {where}): the weights and "
                    "config.json do not belong together"
                )
            array = checkpoint.read(name)
            if not allow_nonfinite:
                refuse_nonfinite(array, f"tensor {name!r} in {folder!r}")
            arrays.append(array)
            used.add(name)
        values.update(zip(link.params, link.to_kvlab(*arrays), strict=True))
    if model.tie_embeddings and "lm_head.weight" in checkpoint:
        # Some tied checkpoints store the shared matrix twice; only an equal copy is accepted.
        if not np.array_equal(checkpoint.read("lm_head.weight"), values[("embed", "embedding")]):
            raise ValueError(
                f"tensor 'lm_head.weight' in {folder!r} differs from model.embed_tokens.weight "
                "but config.json has tie_word_embeddings=true: set it to false to use both"
            )
        used.add("lm_head.weight")
    left = sorted(set(checkpoint.files) - used)
    if left:
        shown = ", ".join(map(repr, left[:5])) + (f" and {len(left) - 5} more" if left[5:] else "")
        raise ValueError(
            f"{folder!r} holds tensors a {family} model as its config.json describes has no "
            f"place for: {shown}; kvlab refuses rather than drop weights: check config.json "
            "(num_hidden_layers, tie_word_embeddings, attention_bias, ...) or remove them"
        )
    return imported_params(values, model, allow_nonfinite)


def refuse_nonfinite(array: np.ndarray, what: str, fix: str = "") -> None:
    """ValueError naming `what` when `array` holds NaN or infinite values."""
    finite = np.isfinite(array)
    if finite.all():
        return
    bad = finite.size - int(finite.sum())
    first = np.unravel_index(int(np.argmin(finite)), array.shape)
    raise ValueError(
        f"{what} holds {bad} non-finite value(s) of {finite.size} ({array[first]} at index "
        f"{tuple(map(int, first))} first): "
        + (fix or "the weights are damaged; load them with allow_nonfinite=True to study them")
    )


def imported_params(values: Mapping[tuple, np.ndarray], model, allow_nonfinite: bool) -> dict:
    """The params tree of Transformer(model) from imported arrays by parameter path:
    shapes checked (_check_params), cast to model.param_dtype; a finite value that
    the cast overflows is refused naming the parameter, unless allow_nonfinite."""
    _check_params({path: v.shape for path, v in values.items()}, model, "the import")
    param_dtype = dtype_of(model.param_dtype)
    params = {}
    for path, value in values.items():
        with np.errstate(over="ignore"):  # an overflow is refused below, naming the parameter
            params[path] = jnp.asarray(value, param_dtype)
        cast = np.dtype(value.dtype) != param_dtype
        if cast and not allow_nonfinite and not bool(jnp.isfinite(params[path]).all()):
            refuse_nonfinite(
                np.asarray(params[path]),
                f"parameter {'/'.join(path)} in {model.param_dtype}",
                f"values beyond {model.param_dtype}'s range overflowed: load it in a wider "
                "dtype (dtype='float32' or 'bfloat16')",
            )
    return traverse_util.unflatten_dict(params)


def _check_params(shapes: Mapping[tuple, tuple], model, what: str) -> None:
    """Refuses parameters that are not exactly Transformer(model)'s, naming the first
    path that is missing, extra or of another shape."""
    expected = _expected_shapes(ml_collections.FrozenConfigDict(model))
    for path, shape in expected.items():
        name = "/".join(path)
        if path not in shapes:
            raise ValueError(
                f"{what} has no parameter {name} of shape {shape}, which the model needs"
            )
        if tuple(shapes[path]) != shape:
            raise ValueError(
                f"parameter {name} of {what} has shape {tuple(shapes[path])} but the model's "
                f"config gives {shape}"
            )
    extra = sorted("/".join(path) for path in set(shapes) - set(expected))
    if extra:
        raise ValueError(
            f"{what} has parameters the model does not use: {', '.join(extra[:5])}: pass the "
            "params of kvlab.Transformer(cfg.model) for this config"
        )


def load_hf(
    path: str | os.PathLike, dtype: Any = None, *, allow_nonfinite: bool = False
) -> tuple[ml_collections.ConfigDict, dict]:
    """(config, params) of the transformers checkpoint in the local folder `path`.

    The config is base_config()'s with the model section mapped from
    config.json and data.tokenizer the folder when it holds a tokenizer.json,
    then validated; model.dtype and model.param_dtype are `dtype`
    ('float32', 'bfloat16', 'float16' or a JAX/numpy dtype), by default the
    checkpoint's dtype (float32 when it names none). The params are jax arrays
    in that dtype, laid out as kvlab.init_params(cfg.model, key) lays them out.

    Refused, naming the folder or tensor: a model whose vocabulary is not the
    256 byte values in a folder without tokenizer.json (kvlab would read text
    as bytes), and NaN or infinite weights (in the file, or from the cast to
    `dtype`) unless allow_nonfinite.
    """
    folder = os.fspath(path)
    hf, cfg = _mapped_config(folder, dtype, base_config())
    with _Checkpoint(folder) as checkpoint:
        params = _read_params(checkpoint, hf, cfg.model, allow_nonfinite)
    return cfg, params


def _mapped_config(
    folder: str, dtype: Any, cfg: ml_collections.ConfigDict
) -> tuple[_HFConfig, ml_collections.ConfigDict]:
    """config.json of `folder` read, and `cfg` (changed in place) with the model
    section it maps to and the data section reading the folder's tokenizer, validated."""
    if not os.path.isdir(folder):
        raise ValueError(f"path={folder!r} is not a folder: pass a save_pretrained directory")
    hf = _HFConfig(folder)
    model = _model_section(hf, _dtype_name(dtype, hf))
    try:
        validate_model_config(model)
    except ValueError as error:
        raise ValueError(f"{hf.file} maps to a kvlab config that is not valid: {error}") from None
    cfg.model = model
    _read_with_tokenizer(cfg, folder)
    return hf, validate_config(cfg)


def _read_with_tokenizer(cfg: ml_collections.ConfigDict, folder: str) -> None:
    """Text for the checkpoint in `folder` goes through its tokenizer.json: data.tokenizer
    becomes the folder unless `cfg` names one or reads MQAR's ids. Without one, a
    model whose vocabulary is not the byte values is refused: it never reads bytes."""
    if cfg.data.tokenizer or cfg.data.source == "mqar":
        return
    if os.path.isfile(os.path.join(folder, TOKENIZER_FILE)):
        cfg.data.tokenizer = folder
    elif cfg.model.vocab_size != BYTE_VOCAB_SIZE:
        raise ValueError(
            f"{folder!r} holds no {TOKENIZER_FILE}, and its model's vocabulary of "
            f"{cfg.model.vocab_size} token ids is not the {BYTE_VOCAB_SIZE} byte values kvlab "
            f"reads text as without one: put the model's {TOKENIZER_FILE} in the folder "
            "(kvlab.save_hf(cfg, params, folder, tokenizer=tokenizer) writes it), or name it "
            "with data.tokenizer"
        )


def config_from_hf(
    cfg: ml_collections.ConfigDict, path: str | os.PathLike
) -> ml_collections.ConfigDict:
    """A copy of `cfg` that runs the checkpoint in `path` (what the scripts' --hf means).

    The model section becomes the one config.json maps to (load_hf's, nothing
    else of `cfg.model` kept), train.init_from becomes `path` (training starts
    from its weights; kvlab.train.initial_params(cfg) reads them), and when the
    folder holds a tokenizer.json and `cfg` names no data.tokenizer, text goes
    through it (data.tokenizer = path; not for data.source='mqar'); a folder
    without one whose model's vocabulary is not the 256 byte values is refused
    (load_hf). Every other section is `cfg`'s. The result is validated; no
    tensor is read.
    """
    folder = os.fspath(path)
    cfg = cfg.copy_and_resolve_references()
    cfg.train.init_from = folder
    return _mapped_config(folder, None, cfg)[1]


# ---------------------------------------------------------------------------
# Writing


def _export_family(model) -> str:
    """The transformers family that computes what `model` computes, or ValueError."""
    moe = model.moe
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
                    "(kvlab.convert.to_mla) is kept as a kvlab workdir (scripts/convert.py "
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
            if window:  # every layer slides
                config.update(
                    max_window_layers=0, layer_types=["sliding_attention"] * model.num_layers
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


def save_hf(
    cfg: ml_collections.ConfigDict,
    params: Mapping,
    path: str | os.PathLike,
    tokenizer: Tokenizer | None = None,
) -> None:
    """Writes `params` of the model `cfg.model` as a transformers checkpoint in the
    folder `path` (created if needed): config.json and model.safetensors, and with
    `tokenizer` (a kvlab.data.tokenizer.Tokenizer: load_gguf's, or load_tokenizer's)
    its tokenizer.json and, when it has an end token, tokenizer_config.json naming
    it as eos_token; each replaced atomically. AutoModelForCausalLM.from_pretrained(path)
    computes the same logits; tensors are written in model.param_dtype. `params` may be
    fused (kvlab.model.fuse_projections). A model whose vocabulary is not the 256 byte
    values needs its tokenizer in the folder for kvlab to read text (load_hf)."""
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
    _check_params({p: np.shape(v) for p, v in flat.items()}, model, "params")
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
        config = {} if eos is None else {"eos_token": tokenizer.backend.id_to_token(eos)}
        write_atomic(os.path.join(folder, "tokenizer_config.json"), json.dumps(config) + "\n")
    write_atomic(
        os.path.join(folder, "config.json"),
        json.dumps(_hf_config(model, family), indent=2) + "\n",
    )
