"""Checks of the `model` section: sizes, dtypes, the attention kind and backend, the
cache topology, RoPE scaling, mixture of experts and latent attention."""

from __future__ import annotations

from collections.abc import Mapping

import ml_collections

from kvlab import backends
from kvlab.config.fields import check_choice, check_int, check_known_fields, check_number, fail
from kvlab.config.schema import (
    ATTENTION_KINDS,
    DTYPES,
    LAYER_TYPES,
    MOE_ROUTINGS,
    ROPE_SCALINGS,
    frozen_schema,
)
from kvlab.registry import TOPOLOGIES


def validate_model_config(model: Mapping) -> None:
    """Raises ValueError naming the first bad field of a `model` section."""
    check_known_fields("model", model, frozen_schema().model)
    for name in (
        "vocab_size",
        "num_layers",
        "embed_dim",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
    ):
        check_int("model", model, name)
    check_int("model", model, "sliding_window", minimum=0)
    check_int("model", model, "sliding_sinks", minimum=0)
    if model["sliding_sinks"] and not model["sliding_window"]:
        fail(
            "model.sliding_sinks",
            model["sliding_sinks"],
            "keeps positions beside a window, but model.sliding_window=0 gives no window",
            "set model.sliding_window, or model.sliding_sinks=0",
        )
    for name in ("rope_theta", "norm_eps"):
        check_number("model", model, name)
    check_choice("model", model, "dtype", tuple(DTYPES))
    check_choice("model", model, "param_dtype", tuple(DTYPES))
    check_choice("model", model, "attention", ATTENTION_KINDS)
    check_choice("model", model, "attention_impl", backends.names())
    _validate_topology(model)
    _validate_layer_types(model)
    for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
        if not isinstance(model[name], bool):
            fail(f"model.{name}", model[name], "is not a bool", "set True or False")
    scaling_schema = frozen_schema().model.rope_scaling
    check_known_fields("model.rope_scaling", model["rope_scaling"], scaling_schema)
    _validate_rope_scaling(model["rope_scaling"])
    check_known_fields("model.mla", model["mla"], frozen_schema().model.mla)
    check_known_fields("model.moe", model["moe"], frozen_schema().model.moe)
    _validate_moe(model)
    if model["attention"] == "mla":
        _validate_mla(model)
    else:
        _validate_grouped(model)


def _validate_topology(model: Mapping) -> None:
    spec = model["topology"]
    if not isinstance(spec, str):
        fail("model.topology", spec, "is not a string", "set e.g. 'layerwise' or 'cla:2'")
    name, _, arg = spec.partition(":")
    if name not in TOPOLOGIES.names():
        listed = ", ".join(repr(n) for n in TOPOLOGIES.names())
        fail("model.topology", spec, "names no cache topology", f"use one of {listed}")
    TOPOLOGIES.get(name).check(arg, model["num_layers"], "model.topology")
    if name != "layerwise" and model["attention"] == "mla" and model["mla"]["rope_pairs"]:
        fail(
            "model.topology",
            spec,
            "cannot combine with model.mla.rope_pairs (each layer's RoPE keys turn its own "
            "frequency pairs, so a layer cannot read another's)",
            "set model.topology='layerwise' for a model converted from grouped-query attention",
        )


def _validate_layer_types(model: Mapping) -> None:
    """model.layer_types: () or one of LAYER_TYPES per layer, with a window for the
    sliding ones, the same kind over each run of layers that share a cache layer."""
    types, window, layers = model["layer_types"], model["sliding_window"], model["num_layers"]
    if not types:
        return
    if not isinstance(types, (tuple, list)) or any(t not in LAYER_TYPES for t in types):
        fail(
            "model.layer_types",
            types,
            f"is not a tuple of {' / '.join(map(repr, LAYER_TYPES))}",
            "give one per layer, e.g. ('sliding',) * 5 + ('full',), or () for layers alike",
        )
    if len(types) != layers:
        fail(
            "model.layer_types",
            types,
            f"names {len(types)} layers but model.num_layers={layers}",
            f"give {layers} entries, or () for layers alike",
        )
    if "sliding" in types and not window:
        fail(
            "model.layer_types",
            types,
            "has sliding layers but model.sliding_window=0 gives them no window",
            "set model.sliding_window to the sliding layers' window",
        )
    if "sliding" not in types and window:
        fail(
            "model.sliding_window",
            window,
            "is read by no layer: model.layer_types has no 'sliding' layer",
            "set model.sliding_window=0, or mark the sliding layers in model.layer_types",
        )
    name, _, arg = model["topology"].partition(":")
    owner = TOPOLOGIES.get(name).layers(arg, layers)
    for i in range(1, layers):
        if owner[i] == owner[i - 1] and types[i] != types[i - 1]:
            fail(
                "model.layer_types",
                types,
                f"gives layers {i - 1} and {i}, which share a cache layer under "
                f"model.topology={model['topology']!r}, different kinds ({types[i - 1]!r}, "
                f"{types[i]!r}): one cache layer holds one window",
                "give the layers of each shared run the same kind, or another topology",
            )


def _validate_grouped(model: Mapping) -> None:
    heads, kv_heads = model["num_heads"], model["num_kv_heads"]
    if heads % kv_heads:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        fail(
            "model.num_kv_heads",
            kv_heads,
            f"must divide model.num_heads={heads}",
            f"set model.num_kv_heads to one of {divisors} (MHA={heads}, MQA=1)",
        )
    if model["head_dim"] % 2:
        fail(
            "model.head_dim",
            model["head_dim"],
            "is odd, but RoPE rotates pairs of channels",
            "set an even model.head_dim",
        )


def _validate_rope_scaling(scaling: Mapping) -> None:
    section = "model.rope_scaling"
    check_choice(section, scaling, "type", ROPE_SCALINGS)
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        check_number(section, scaling, name)
    for name in ("mscale", "mscale_all_dim"):
        check_number(section, scaling, name, zero_allowed=True)
    check_int(section, scaling, "original_max_len", minimum=0)
    kind = scaling["type"]
    if kind == "none" and scaling["factor"] != 1.0:
        fail(
            f"{section}.factor",
            scaling["factor"],
            f"does nothing with {section}.type='none'",
            f"set {section}.type to 'linear', 'llama3' or 'yarn', or factor=1.0",
        )
    if kind in ("llama3", "yarn") and scaling["original_max_len"] < 1:
        fail(
            f"{section}.original_max_len",
            scaling["original_max_len"],
            f"is unset but {section}.type={kind!r} scales relative to the pre-training context",
            "set it to the context the model was trained on (HF "
            "original_max_position_embeddings), e.g. 8192",
        )
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        fail(
            f"{section}.high_freq_factor",
            scaling["high_freq_factor"],
            f"is not above {section}.low_freq_factor={scaling['low_freq_factor']}, so the "
            "band between kept and interpolated frequencies is empty",
            "set high_freq_factor > low_freq_factor (Llama 3.1: 4.0 and 1.0)",
        )
    if kind == "yarn" and scaling["beta_fast"] <= scaling["beta_slow"]:
        fail(
            f"{section}.beta_fast",
            scaling["beta_fast"],
            f"is not above {section}.beta_slow={scaling['beta_slow']}, so the ramp between "
            "kept and interpolated frequencies runs backwards",
            "set beta_fast > beta_slow (YaRN: 32.0 and 1.0)",
        )


def parse_rope_scaling(spec: str, original_max_len: int) -> ml_collections.ConfigDict:
    """A model.rope_scaling section from "type=yarn,factor=4" (a script's --rope_scaling).

    Fields not given take base_config()'s defaults; 'llama3' and 'yarn' without
    original_max_len take `original_max_len` (the context the model trained on,
    train.seq_len). "none" (or "") is plain RoPE. Validated as the model section is.
    """
    scaling = ml_collections.ConfigDict(frozen_schema().model.rope_scaling.to_dict())
    given = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, equals, text = (part.strip() for part in item.partition("="))
        if not equals and not given and name in ROPE_SCALINGS:
            name, text = "type", name  # "yarn" alone
        elif not equals or name not in scaling:
            fail(
                "model.rope_scaling",
                spec,
                f"holds {item!r}, not field=value of a model.rope_scaling field",
                f"write e.g. type=yarn,factor=4 with fields from {', '.join(scaling)}",
            )
        if name == "type":
            given[name] = text
        else:
            try:
                given[name] = int(text) if name == "original_max_len" else float(text)
            except ValueError:
                fail(f"model.rope_scaling.{name}", text, "is not a number", "give a number")
    scaling.update(given)
    if scaling.type in ("llama3", "yarn") and "original_max_len" not in given:
        scaling.original_max_len = original_max_len
    _validate_rope_scaling(scaling)
    return scaling


def _validate_moe(model: Mapping) -> None:
    section, moe = "model.moe", model["moe"]
    for name in ("experts_per_token", "expert_dim", "every", "num_groups", "groups_per_token"):
        check_int(section, moe, name)
    for name in ("num_experts", "num_shared_experts", "first_dense_layers"):
        check_int(section, moe, name, minimum=0)
    check_choice(section, moe, "routing", MOE_ROUTINGS)
    check_number(section, moe, "routed_scale")
    if not isinstance(moe["normalize_weights"], bool):
        fail(
            f"{section}.normalize_weights",
            moe["normalize_weights"],
            "is not a bool",
            "set True or False",
        )
    experts = moe["num_experts"]
    if experts == 0:
        return  # dense everywhere: the other fields are unused
    if moe["experts_per_token"] > experts:
        fail(
            f"{section}.experts_per_token",
            moe["experts_per_token"],
            f"exceeds {section}.num_experts={experts}",
            f"set {section}.experts_per_token <= {experts}",
        )
    if moe["first_dense_layers"] > model["num_layers"]:
        fail(
            f"{section}.first_dense_layers",
            moe["first_dense_layers"],
            f"exceeds model.num_layers={model['num_layers']}",
            f"set {section}.first_dense_layers <= {model['num_layers']}",
        )
    groups = moe["num_groups"]
    if experts % groups:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        fail(
            f"{section}.num_groups",
            groups,
            f"does not divide {section}.num_experts={experts} into equal groups",
            f"set {section}.num_groups to one of {divisors}",
        )
    if moe["groups_per_token"] > groups:
        fail(
            f"{section}.groups_per_token",
            moe["groups_per_token"],
            f"exceeds {section}.num_groups={groups}",
            f"set {section}.groups_per_token <= {groups}",
        )
    reachable = moe["groups_per_token"] * (experts // groups)
    if moe["experts_per_token"] > reachable:
        fail(
            f"{section}.experts_per_token",
            moe["experts_per_token"],
            f"exceeds the {reachable} experts in {section}.groups_per_token="
            f"{moe['groups_per_token']} groups of {experts // groups}",
            f"set {section}.experts_per_token <= {reachable} or raise {section}.groups_per_token",
        )
    if moe["routing"] == "sigmoid" and groups > 1 and experts // groups < 2:
        fail(
            f"{section}.num_groups",
            groups,
            f"leaves one expert per group, but {section}.routing='sigmoid' scores a group "
            "by its two best experts",
            f"set {section}.num_groups to at most {experts // 2} or 1",
        )


def _validate_mla(model: Mapping) -> None:
    mla = model["mla"]
    for name in ("kv_rank", "rope_dim", "v_head_dim", "rope_heads"):
        check_int("model.mla", mla, name)
    check_int("model.mla", mla, "q_rank", minimum=0)
    check_int("model.mla", mla, "nope_dim", minimum=0)
    check_number("model.mla", mla, "norm_eps")
    for name in ("absorb", "latent_norm"):
        if not isinstance(mla[name], bool):
            fail(f"model.mla.{name}", mla[name], "is not a bool", "set True or False")
    if model["num_heads"] % mla["rope_heads"]:
        fail(
            "model.mla.rope_heads",
            mla["rope_heads"],
            f"does not divide model.num_heads={model['num_heads']}",
            "set 1 (one RoPE key for all heads) or a divisor of model.num_heads",
        )
    for name in ("qkv_bias", "qk_norm"):
        if model[name]:
            fail(
                f"model.{name}",
                True,
                "applies to grouped-query attention but model.attention='mla' has no "
                "per-head key and value projections",
                f"set model.{name}=False or model.attention='gqa'",
            )
    if mla["rope_dim"] % 2:
        fail(
            "model.mla.rope_dim",
            mla["rope_dim"],
            "is odd, but RoPE rotates pairs of channels",
            "set an even model.mla.rope_dim",
        )
    query_key_width = mla["nope_dim"] + mla["rope_dim"]
    if model["head_dim"] != query_key_width:
        fail(
            "model.head_dim",
            model["head_dim"],
            f"does not match model.mla.nope_dim + model.mla.rope_dim = {query_key_width}",
            f"set model.head_dim={query_key_width} (the per-head query/key width under MLA)",
        )
    _validate_rope_pairs(model)
    if model["num_kv_heads"] != model["num_heads"]:
        fail(
            "model.num_kv_heads",
            model["num_kv_heads"],
            f"must equal model.num_heads={model['num_heads']} when model.attention='mla'",
            f"set model.num_kv_heads={model['num_heads']}: MLA expands K/V for every head "
            "from the latent",
        )


def _validate_rope_pairs(model: Mapping) -> None:
    """mla.rope_pairs: () or, per layer and RoPE key, rope_dim / 2 distinct pairs
    of a head_dim-wide RoPE."""
    mla = model["mla"]
    pairs = mla["rope_pairs"]
    if isinstance(pairs, (list, tuple)) and not pairs:
        return
    layers, heads = model["num_layers"], mla["rope_heads"]
    count, available = mla["rope_dim"] // 2, model["head_dim"] // 2
    fix = (
        f"give {layers} lists (one per layer) of {heads} lists (one per model.mla.rope_heads) "
        f"of {count} distinct integers in 0..{available - 1} (rope_dim / 2 pairs of a "
        "head_dim-wide RoPE), or () for RoPE over rope_dim"
    )

    def sequence(x, length: int) -> bool:
        return isinstance(x, (list, tuple)) and len(x) == length

    shaped = sequence(pairs, layers) and all(
        sequence(layer, heads) and all(sequence(kept, count) for kept in layer) for layer in pairs
    )
    if not shaped:
        fail("model.mla.rope_pairs", pairs, "has the wrong shape", fix)
    for layer in pairs:
        for kept in layer:
            valid = all(type(i) is int and 0 <= i < available for i in kept)
            if not valid or len(set(kept)) != len(kept):
                fail("model.mla.rope_pairs", pairs, f"holds {list(kept)!r}", fix)
