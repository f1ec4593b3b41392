"""config.json <-> kvlab's model section: what each family's fields become.

    hf = HFConfig(folder)                       # config.json, problems named by field
    model = model_section(hf, "float32")        # kvlab's model section, field by field
    cfg = config_from_hf(cfg, folder)           # what the scripts' --hf means (no tensor read)

Families (config.json's model_type) and what they become:

    llama, mistral   grouped-query attention; RoPE scaling linear, llama3 or yarn
    qwen2            + q/k/v biases (model.qkv_bias)
    qwen3            + per-head q/k RMSNorm (model.qk_norm)
    deepseek_v2/v3   latent attention (model.attention='mla', model.mla.*, arXiv:2405.04434)
                     and DeepSeekMoE (model.moe.*, kvlab/moe.py; V2 softmax routing,
                     V3 sigmoid routing with its score-correction bias)

Mistral's sliding_window W becomes model.sliding_window (null: 0, full causal
attention); both let the query at position p see keys p - W + 1 .. p. A
Qwen2/Qwen3 window on some layers only (max_window_layers, or layer_types
mixing 'sliding_attention' and 'full_attention') becomes model.layer_types: a
hybrid model whose sliding layers cache a ring of the window.

Every config.json field that changes what the model computes is mapped to a
kvlab field or checked to hold the value kvlab computes (hidden_act 'silu', no
o_proj bias, one window for all layers, ...). Errors name the file, the field,
its value and what is supported. RoPE is read from rope_parameters
(transformers 5) or rope_theta and rope_scaling (transformers 4). The latent
norms use eps 1e-6 whatever rms_norm_eps says (model.mla.norm_eps). The way
back (model -> config.json) is write.py's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import ml_collections

from kvlab.config import BYTE_VOCAB_SIZE, DTYPES, base_config, validate_model_config
from kvlab.data import validate_config
from kvlab.data.tokenizer import TOKENIZER_FILE
from kvlab.files import read_json
from kvlab.rope import yarn_mscale

GROUPED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LATENT_FAMILIES = ("deepseek_v2", "deepseek_v3")
FAMILIES = GROUPED_FAMILIES + LATENT_FAMILIES
# config.json's rope_type -> model.rope_scaling.type
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) are built without an
# eps argument, so they keep RMSNorm's default.
DEEPSEEK_LATENT_NORM_EPS = 1e-6


class HFConfig:
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


def _dtype_name(dtype: Any, hf: HFConfig) -> str:
    """The config dtype name load_hf uses: `dtype` if given, else the checkpoint's own."""
    stored = hf.get("dtype", hf.get("torch_dtype"))
    return dtype_name(
        dtype, stored if stored in DTYPES else "float32", "the checkpoint's own dtype"
    )


def _rope_fields(hf: HFConfig) -> tuple[float, dict]:
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
    scaling = {"type": ROPE_TYPES[kind]}
    if kind != "default":
        scaling.update(_scaling_fields(hf, key, kind, parameters))
    return float(theta), scaling


def _scaling_fields(hf: HFConfig, key: str, kind: str, parameters: Mapping) -> dict:
    """model.rope_scaling's fields beyond its type for the RoPE scaling `kind`
    ('linear', 'llama3' or 'yarn') of config.json's `key`."""

    def field(name: str, default: Any = None) -> Any:
        value = parameters.get(name, default)
        if value is None:
            raise ValueError(f"{hf.file}: {key} of rope_type {kind!r} has no {name}: set it")
        return value

    context = parameters.get("original_max_position_embeddings") or hf.get(
        "max_position_embeddings"
    )
    if kind == "linear":
        return {"factor": float(field("factor"))}
    if kind == "llama3":
        return dict(
            factor=float(field("factor")),
            original_max_len=int(field("original_max_position_embeddings", context)),
            low_freq_factor=float(field("low_freq_factor")),
            high_freq_factor=float(field("high_freq_factor")),
        )
    return _yarn_fields(
        hf, key, parameters, int(field("original_max_position_embeddings", context))
    )


def _yarn_fields(hf: HFConfig, key: str, parameters: Mapping, context: int) -> dict:
    """model.rope_scaling's yarn fields; an attention_factor given is checked
    against the one kvlab derives."""
    factor = parameters.get("factor") or hf.count("max_position_embeddings") / context
    if parameters.get("truncate", True) is not True:
        hf.refuse(
            f"{key}.truncate",
            parameters["truncate"],
            "keeps yarn's correction range unrounded",
            "kvlab rounds it as transformers does by default (truncate true)",
        )
    scaling = dict(
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
            f"differs from the {computed!r} kvlab derives from factor, mscale and mscale_all_dim",
            "remove attention_factor or make it the derived value",
        )
    return scaling


def _yarn_attention_factor(scaling: Mapping) -> float:
    """yarn's cos/sin factor, as kvlab.rope computes it."""
    factor, mscale, mscale_all_dim = scaling["factor"], scaling["mscale"], scaling["mscale_all_dim"]
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def model_section(hf: HFConfig, dtype: str) -> ml_collections.ConfigDict:
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
    theta, scaling = _rope_fields(hf)
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


def _grouped_fields(hf: HFConfig, model: ml_collections.ConfigDict) -> None:
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
        model.sliding_window, model.layer_types = _qwen_window(hf, model.num_layers)


def _window(hf: HFConfig, key: str) -> int:
    """model.sliding_window for config.json's `key`: W -> W, absent or null -> 0.

    transformers' window W lets the query at position p see keys at positions
    p - W + 1 .. p (key visible iff p - k < W), as kvlab's model.sliding_window."""
    return hf.count(key) if key in hf else 0


def _qwen_window(hf: HFConfig, num_layers: int) -> tuple[int, tuple[str, ...]]:
    """(model.sliding_window, model.layer_types) for Qwen2/Qwen3, whose windows are
    per layer.

    As transformers 5 reads the config: the window is sliding_window when
    use_sliding_window is true, else there is none; layer i slides when
    layer_types[i] is 'sliding_attention' or, without layer_types, when there is a
    window and i >= max_window_layers. Layers that all slide, or none, need no
    model.layer_types; a mix becomes a hybrid model (kvlab.config.layer_windows)."""
    window = _window(hf, "sliding_window") if hf.get("use_sliding_window", False) else 0
    layer_types = hf.get("layer_types")
    if layer_types is None:
        value = hf.count("max_window_layers", 28, minimum=0)
        sliding = [bool(window) and i >= value for i in range(num_layers)]
    else:
        kinds = ["full_attention", "sliding_attention"]
        if (
            not isinstance(layer_types, list)
            or len(layer_types) != num_layers
            or not set(layer_types) <= {*kinds}
        ):
            hf.refuse(
                "layer_types", layer_types, "is not a layer kind per layer",
                f"give {num_layers} of {kinds}",
            )  # fmt: skip
        sliding = [kind == "sliding_attention" for kind in layer_types]
        if any(sliding) and not window:
            hf.refuse(
                "layer_types",
                layer_types,
                "has sliding-attention layers but config.json gives them no window "
                f"(use_sliding_window={hf.get('use_sliding_window', False)!r}, "
                f"sliding_window={hf.get('sliding_window')!r})",
                "set use_sliding_window true and sliding_window, or only 'full_attention' layers",
            )
    if not any(sliding):
        return 0, ()
    if all(sliding):
        return window, ()
    return window, tuple("sliding" if s else "full" for s in sliding)


def _latent_fields(hf: HFConfig, model: ml_collections.ConfigDict) -> None:
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


def mapped_config(
    folder: str, dtype: Any, cfg: ml_collections.ConfigDict
) -> tuple[HFConfig, ml_collections.ConfigDict]:
    """config.json of `folder` read, and `cfg` (changed in place) with the model
    section it maps to and the data section reading the folder's tokenizer, validated."""
    if not os.path.isdir(folder):
        raise ValueError(f"path={folder!r} is not a folder: pass a save_pretrained directory")
    hf = HFConfig(folder)
    model = model_section(hf, _dtype_name(dtype, hf))
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
    return mapped_config(folder, None, cfg)[1]
