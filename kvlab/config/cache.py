"""Checks of the `cache` section: storage kind, bit-widths, formats, scale groups,
transforms and eviction, alone and against the model section it caches for."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping

import ml_collections

from kvlab.config.fields import (
    check_choice,
    check_int,
    check_known_fields,
    check_number,
    fail,
    frozen,
)
from kvlab.config.schema import (
    BIT_WIDTHS,
    CACHE_KINDS,
    CACHED_PREFIXES,
    COMPOSED_OPTIONS,
    DTYPES,
    EVICT_WHEN,
    GROUP_AXES,
    QUANTIZING,
    SLIDING_LAYERS,
    UNSCORED_METHODS,
    UNSET,
    cached_prefixes,
    cached_tensors,
    frozen_schema,
    is_hybrid,
    layer_windows,
)
from kvlab.registry import FORMATS, SCORERS, TOPOLOGIES, TRANSFORMS, WRAPPERS


def validate_cache_config(cache: Mapping, model: Mapping | None = None) -> None:
    """Raises ValueError naming the first bad field of a `cache` section.

    With the model section too, also checks what depends on it: which tensors
    the model caches and whether their widths fit the groups and the packing.
    """
    check_known_fields("cache", cache, frozen_schema().cache)
    check_choice("cache", cache, "kind", CACHE_KINDS)
    check_choice("cache", cache, "dtype", tuple(DTYPES))
    check_choice("cache", cache, "scale_dtype", tuple(DTYPES))
    check_choice("cache", cache, "sliding_layers", SLIDING_LAYERS)
    check_int("cache", cache, "group_size")
    check_int("cache", cache, "residual", minimum=0)
    check_int("cache", cache, "page_size")
    check_int("cache", cache, "num_pages", minimum=0)
    if not isinstance(cache["prefix_caching"], bool):
        fail("cache.prefix_caching", cache["prefix_caching"], "is not a bool", "set True or False")
    if not isinstance(cache["symmetric"], bool):
        fail("cache.symmetric", cache["symmetric"], "is not a bool", "set True or False")
    check_int("cache", cache, "k_sketch", minimum=0)
    if cache["k_sketch"] % 8:
        fail("cache.k_sketch", cache["k_sketch"], "is not a whole number of bytes",
             "set a multiple of 8 (e.g. model.head_dim), or 0")  # fmt: skip
    if not isinstance(cache["k_before_rope"], bool):
        fail("cache.k_before_rope", cache["k_before_rope"], "is not a bool", "set True or False")
    for field in ("codebooks", "scales", "bases"):
        if not isinstance(cache[field], str):
            fail(f"cache.{field}", cache[field], "is not a path", "set an .npz path, or ''")
    for prefix in CACHED_PREFIXES:
        check_int("cache", cache, f"{prefix}_outliers", minimum=0)
        check_int("cache", cache, f"{prefix}_rank", minimum=0)
        check_int("cache", cache, f"{prefix}_full_first", minimum=0)
        check_choice("cache", cache, f"{prefix}_transform", TRANSFORMS.names())
        check_choice("cache", cache, f"{prefix}_bits", BIT_WIDTHS)
        check_choice("cache", cache, f"{prefix}_format", FORMATS.names())
        check_choice("cache", cache, f"{prefix}_axis", GROUP_AXES)
        bits, name = cache[f"{prefix}_bits"], cache[f"{prefix}_format"]
        widths = FORMATS.get(name).widths  # the bit-widths the format stores a number in
        if bits < 16 and bits not in widths:
            others = [repr(f) for f in FORMATS.names() if bits in FORMATS.get(f).widths]
            fail(
                f"cache.{prefix}_format",
                name,
                f"needs {' or '.join(map(str, widths))} bits but cache.{prefix}_bits={bits}",
                f"set cache.{prefix}_bits to {' or '.join(map(str, widths))}, or "
                f"cache.{prefix}_format to one that stores {bits} bits ({', '.join(others)})",
            )
        if (
            bits < 16
            and cache[f"{prefix}_axis"] == "calibrated"
            and FORMATS.get(name).has_zero(types.SimpleNamespace(symmetric=cache["symmetric"]))
        ):
            fail(
                f"cache.{prefix}_axis",
                "calibrated",
                f"stores no zero point, but cache.{prefix}_format={name!r} with "
                "cache.symmetric=False has one per group",
                "set cache.symmetric=True (codes around 0 over the calibrated scale)",
            )
        if (
            bits < 16
            and cache[f"{prefix}_axis"] == "channel"
            and cache["kind"] == "paged"
            and cache["page_size"] % cache["group_size"]
        ):
            fail(
                "cache.page_size",
                cache["page_size"],
                f"is not a multiple of cache.group_size={cache['group_size']}, but "
                f"cache.{prefix}_axis='channel' keeps one scale per group of tokens in a page",
                "set cache.page_size to a multiple of cache.group_size",
            )
        if (
            bits < 16
            and cache[f"{prefix}_axis"] == "channel"
            and cache["residual"] % cache["group_size"]
        ):
            fail(
                "cache.residual",
                cache["residual"],
                f"is not a multiple of cache.group_size={cache['group_size']}, but "
                f"cache.{prefix}_axis='channel' flushes tokens to quantized storage in groups",
                "set cache.residual to a multiple of cache.group_size",
            )
    _validate_evict(cache)
    if model is not None:
        _validate_cache_for_model(cache, model)


def _validate_evict(cache: Mapping) -> None:
    evict = cache["evict"]
    section = "cache.evict"
    check_known_fields(section, evict, frozen_schema().cache.evict)
    parts = _method_parts(evict)
    check_int(section, evict, "budget", minimum=0)
    check_number(section, evict, "ratio")
    if evict["ratio"] > 1:
        fail(f"{section}.ratio", evict["ratio"], "is above 1", "set a share in (0, 1]")
    for name in ("sinks", "obs_window", "kernel"):
        check_int(section, evict, name)
    for name in ("recent", "seed"):
        check_int(section, evict, name, minimum=0)
    check_int(section, evict, "interval", minimum=0)
    if evict["interval"] > 1 and evict["method"] in UNSCORED_METHODS:
        fail(
            f"{section}.interval",
            evict["interval"],
            f"applies to scored methods, not cache.evict.method={evict['method']!r}",
            "set cache.evict.interval=1 or a scorer as cache.evict.method",
        )
    check_choice(section, evict, "when", EVICT_WHEN)
    check_int(section, evict, "headroom", minimum=0)
    if evict["when"] != "every_step" and evict["method"] in UNSCORED_METHODS:
        fail(
            f"{section}.when",
            evict["when"],
            f"applies to scored methods, not cache.evict.method={evict['method']!r} (a window "
            "keeps its band at every step)",
            "set cache.evict.when='every_step' or a scorer as cache.evict.method",
        )
    if evict["headroom"] and evict["when"] == "every_step":
        fail(
            f"{section}.headroom",
            evict["headroom"],
            "is room after a compression beside the budget (for a question and its answer, "
            "or a prompt stored whole), which cache.evict.when='every_step' never leaves",
            "set cache.evict.headroom=0 or cache.evict.when='after_prefill' or 'decoding'",
        )
    if evict["when"] == "decoding" and not evict["budget"]:
        fail(
            f"{section}.budget",
            evict["budget"],
            "is 0, but cache.evict.when='decoding' compresses a row back to a number of "
            "tokens (kvpress's DecodingPress target_size), not a share of its length",
            "set cache.evict.budget to the tokens each KV head keeps after a compression",
        )
    if evict["kernel"] % 2 == 0:
        fail(f"{section}.kernel", evict["kernel"], "is even", "set an odd width (1 = no pooling)")
    check_number(section, evict, "pyramid_beta")
    if evict["pyramid_beta"] < 1:
        fail(f"{section}.pyramid_beta", evict["pyramid_beta"], "is below 1", "set a number >= 1")
    check_number(section, evict, "adakv_floor", zero_allowed=True)
    if evict["adakv_floor"] > 1:
        fail(f"{section}.adakv_floor", evict["adakv_floor"], "is above 1", "set a share in [0, 1]")
    method = evict["method"]
    _validate_options(evict, parts)
    unsafe = [getattr(part, "prefix_unsafe", None) for part in parts]
    why = next((reason for reason in unsafe if reason), None)
    if why and cache["prefix_caching"]:
        fail(
            "cache.prefix_caching",
            True,
            f"cannot combine with cache.evict.method={method!r}: {why}",
            "set cache.prefix_caching=False or another cache.evict.method",
        )


def evict_methods() -> tuple[str, ...]:
    """Every cache.evict.method: the unscored layouts, then the registered scorers
    (each may also stand under wrappers: 'chunkkv:snapkv')."""
    return (*UNSCORED_METHODS, *SCORERS.names())


class _Composition:
    """The options of a composed method 'a+b' (kvlab/cache/evict/scorers.py, Composed)."""

    name, defaults, attention_kinds = "a+b", COMPOSED_OPTIONS, None

    def check(self, options: Mapping, field: str) -> None:
        if not 0 < options["share"] <= 1:
            raise ValueError(
                f"{field}.share={options['share']} is not a share in (0, 1]: set the share "
                "of the first scorer's tokens the second keeps"
            )


def _method_parts(evict: Mapping) -> list:
    """cache.evict.method's wrappers (outermost first) and its scorer, as registered
    (none for an unscored layout); a composed 'a+b': each stage's, then the
    composition's own options; ValueError naming the field for an unknown part."""
    method = evict["method"]
    if isinstance(method, str) and "+" in method:
        stages = method.split("+")
        if len(stages) != 2 or not all(stages):
            fail(
                "cache.evict.method",
                method,
                "composes other than two scorers",
                "name two, the first's survivors ranked by the second: e.g. 'snapkv+knorm'",
            )
        return [*(p for s in stages for p in _stage_parts(s, method)), _Composition()]
    if not isinstance(method, str) or ":" not in method:
        check_choice("cache.evict", evict, "method", evict_methods())
        return [] if method in UNSCORED_METHODS else [SCORERS.get(method)]
    return _stage_parts(method, method)


def _stage_parts(stage: str, method: str) -> list:
    """A scorer under its wrappers ('chunkkv:snapkv'), as registered, outermost first."""
    *wrappers, base = stage.split(":")
    if base not in SCORERS.names():
        fail(
            "cache.evict.method",
            method,
            f"{'puts wrappers over' if wrappers else 'composes'} {base!r}, which is no scorer",
            f"put them over one of {', '.join(map(repr, SCORERS.names()))}, e.g. 'chunkkv:snapkv'",
        )
    for name in wrappers:
        if name not in WRAPPERS.names():
            fail(
                "cache.evict.method",
                method,
                f"names {name!r}, which is no eviction wrapper kvlab knows",
                f"put one of {', '.join(map(repr, WRAPPERS.names()))} (or yours, registered in "
                "kvlab.registry.WRAPPERS) before the scorer",
            )
    return [*(WRAPPERS.get(name) for name in wrappers), SCORERS.get(base)]


def _validate_options(evict: Mapping, parts: list) -> None:
    """cache.evict.options: only the method's own options (its parts' `defaults`),
    each of its default's type, then each part's own checks."""
    field = "cache.evict.options"
    given = evict["options"]
    if not hasattr(given, "items"):  # a dict or a ConfigDict
        fail(field, given, "is not a mapping", "set a dict of the method's options, or {}")
    given = dict(given.items())
    defaults: dict = {}
    for part in parts:
        defaults.update(part.defaults)
    for name, value in given.items():
        if name not in defaults:
            known = ", ".join(sorted(defaults)) or "none"
            fail(
                f"{field}.{name}",
                value,
                f"is no option of cache.evict.method={evict['method']!r} (its options: {known})",
                "remove it, or choose the method whose option it is",
            )
        _check_like(f"{field}.{name}", value, defaults[name])
    options = {**defaults, **given}
    for part in parts:
        part.check(options, field)


def _check_like(field: str, value, default) -> None:
    """`value` of the same kind as `default`: a bool, an int, a finite number, a
    string, or a sequence of finite numbers (a float default also takes an int)."""
    number = lambda x: (  # noqa: E731
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    )
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = number(value)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        ok = isinstance(value, (list, tuple)) and all(number(x) for x in value)
    if not ok:
        fail(
            field,
            value,
            f"is not of its default's kind ({default!r})",
            "set a value like it (a number: finite)",
        )


def layer_sections(model: Mapping, cache: Mapping) -> dict[int, tuple[Mapping, Mapping]]:
    """The (model, cache) sections each kind of layer is cached as, by its window
    (kvlab.config.layer_windows). A model whose layers are alike: {its window:
    (model, cache)}. A hybrid one (model.layer_types): its full layers (0) as a
    model without a window, with `cache`; its sliding ones as a model whose every
    layer slides, with cache.evict off (the window decides what they keep) and,
    under cache.sliding_layers='plain', nothing quantized, and a ring per row even in
    a paged cache (whose pages hold the full layers). Each is a section a cache of
    layers alike is built, counted and checked from."""
    if not is_hybrid(model):
        return {layer_windows(model)[0]: (model, cache)}
    window = model["sliding_window"]
    plain = {}
    if cache["sliding_layers"] == "plain":
        plain = {f"{p}_{field}": unset for p in CACHED_PREFIXES for field, unset in QUANTIZING}
        plain |= dict(
            residual=0, codebooks="", scales="", bases="", k_before_rope=False, k_sketch=0
        )
    alike = dict(sliding_layers="plain")  # each section is a model of layers alike
    # A ring of the window per row: no pages (a paged cache's full layers hold those).
    ring = dict(evict=dict(method="none"), kind="dense", prefix_caching=False, num_pages=0)
    return {
        0: (
            _replaced(model, sliding_window=0, sliding_sinks=0, layer_types=()),
            _replaced(cache, **alike),
        ),
        window: (_replaced(model, layer_types=()), _replaced(cache, **alike, **ring, **plain)),
    }


def _validate_before_rope(cache: Mapping, model: Mapping) -> None:
    """cache.k_before_rope: quantized grouped-query keys, read at the positions their
    rows stand for (a cache that keeps every token, in rows or pages), unrotated."""
    if not cache["k_before_rope"]:
        return
    refusals = [
        (model["attention"] != "gqa", f"model.attention={model['attention']!r}", "caches no k"),
        (cache["k_bits"] == 16, "cache.k_bits=16", "stores keys as they are"),
        (
            cache["evict"]["method"] != "none",
            f"cache.evict.method={cache['evict']['method']!r}",
            "keeps tokens in slots that are not their positions",
        ),
        (
            model["sliding_window"] > 0,
            f"model.sliding_window={model['sliding_window']}",
            "keeps its window in a ring whose slots are not positions",
        ),
        (
            cache["k_transform"] != "none",
            f"cache.k_transform={cache['k_transform']!r}",
            "rotates keys after RoPE, into the queries",
        ),
    ]
    for refused, field, why in refusals:
        if refused:
            fail(
                "cache.k_before_rope",
                True,
                f"cannot combine with {field}, which {why}",
                "set cache.k_before_rope=False, or quantize keys (k_bits below 16) of a "
                "grouped-query model in a cache without eviction, window or key transform",
            )


def _validate_full_first(cache: Mapping, model: Mapping) -> None:
    """cache.<prefix>_full_first: a quantized tensor's first positions kept beside its
    codes per row, in a cache that keeps every token at its position and whose rows
    are filled by their own tokens (no shared prefix pages)."""
    for prefix in cached_prefixes(model):
        first = cache[f"{prefix}_full_first"]
        if not first:
            continue
        refusals = [
            (
                cache[f"{prefix}_bits"] == 16,
                f"cache.{prefix}_bits=16",
                "stores every token in cache.dtype already",
            ),
            (
                cache["evict"]["method"] != "none",
                f"cache.evict.method={cache['evict']['method']!r}",
                "keeps tokens in slots that are not their positions (the first may be evicted)",
            ),
            (
                model["sliding_window"] > 0,
                f"model.sliding_window={model['sliding_window']}",
                "keeps its window in a ring whose slots are not positions",
            ),
            (
                cache["prefix_caching"],
                "cache.prefix_caching=True",
                "starts a row from shared pages, and the first tokens are kept per row",
            ),
        ]
        for refused, field, why in refusals:
            if refused:
                fail(
                    f"cache.{prefix}_full_first",
                    first,
                    f"cannot combine with {field}, which {why}",
                    f"set cache.{prefix}_full_first=0, or keep it for a quantized tensor "
                    "(bits below 16) in a cache without eviction, window or prefix caching",
                )


def _replaced(section: Mapping, **fields) -> ml_collections.FrozenConfigDict:
    """A frozen copy of `section` with `fields` set (a dict value updates that subsection)."""
    copy = ml_collections.ConfigDict(frozen(section).as_configdict().to_dict())
    for name, value in fields.items():
        if isinstance(value, dict):
            copy[name].update(value)
        else:
            copy[name] = value
    return frozen(copy)


def _validate_cache_for_model(cache: Mapping, model: Mapping) -> None:
    if is_hybrid(model):
        if cache["prefix_caching"]:
            fail(
                "cache.prefix_caching",
                True,
                f"cannot serve model.layer_types={tuple(model['layer_types'])!r}: a sliding "
                "layer keeps its window in a ring per row, which no shared page holds",
                "set cache.prefix_caching=False for a model that mixes sliding and full layers",
            )
        for layer_model, layer_cache in layer_sections(model, cache).values():
            _validate_cache_for_model(layer_cache, layer_model)
        return
    if cache["sliding_layers"] != "plain":
        fail(
            "cache.sliding_layers",
            cache["sliding_layers"],
            "applies to a model whose layers mix sliding and full attention, and this "
            "model's layers are alike (model.layer_types)",
            "leave cache.sliding_layers='plain'",
        )
    fitted = [
        p
        for p in cached_prefixes(model)
        if cache[f"{p}_bits"] < 16 and cache[f"{p}_format"] == "codebook"
    ]
    if cache["codebooks"] and not fitted:
        fail(
            "cache.codebooks",
            cache["codebooks"],
            "is read by no tensor: none of this model's quantized tensors has "
            "cache.<prefix>_format='codebook'",
            "set the format of the tensors it holds levels for, or cache.codebooks=''",
        )
    calibrated = [
        p
        for p in cached_prefixes(model)
        if cache[f"{p}_bits"] < 16 and cache[f"{p}_axis"] == "calibrated"
    ]
    if cache["scales"] and not calibrated:
        fail(
            "cache.scales",
            cache["scales"],
            "is read by no tensor: none of this model's quantized tensors has "
            "cache.<prefix>_axis='calibrated'",
            "set the axis of the tensors it holds ranges for, or cache.scales=''",
        )
    name, _, arg = model["topology"].partition(":")
    topology = TOPOLOGIES.get(name)
    in_bases = [  # coded in a basis per KV head (a topology's runs' ranks are its own)
        p
        for p in cached_prefixes(model)
        if cache[f"{p}_bits"] < 16 and cache[f"{p}_rank"] and not topology.codes_in_bases
    ]
    for part in _method_parts(cache["evict"]):
        pools_heads = model["attention"] == "gqa" and model["num_kv_heads"] > 1
        per_head = [
            (f"cache.{p}_axis='calibrated'", "a static scale per KV head") for p in calibrated
        ] + [(f"cache.{p}_rank={cache[p + '_rank']}", "a basis per KV head") for p in in_bases]
        if per_head and getattr(part, "pooled", False) and pools_heads:
            field, what = per_head[0]
            fail(
                "cache.evict.method",
                cache["evict"]["method"],
                "keeps one pool of every KV head's tokens per layer, which cannot be read "
                f"with {field} ({what})",
                "choose a method that keeps a budget per head (snapkv, h2o, ...), or "
                "store the tensor without it",
            )
        kinds = getattr(part, "attention_kinds", None)
        if kinds is not None and model["attention"] not in kinds:
            fail(
                "cache.evict.method",
                cache["evict"]["method"],
                f"cannot score a model.attention={model['attention']!r} cache ({part.name} "
                f"scores {' or '.join(map(repr, kinds))} attention)",
                "choose another cache.evict.method",
            )
    _validate_before_rope(cache, model)
    _validate_full_first(cache, model)
    topology.check_cache(arg, model, cache)
    if cache["k_sketch"] and (model["attention"] != "gqa" or cache["k_bits"] == 16):
        fail(
            "cache.k_sketch",
            cache["k_sketch"],
            f"sketches what quantized keys leave out, but model.attention="
            f"{model['attention']!r} with cache.k_bits={cache['k_bits']} has none",
            "set cache.k_sketch=0, or quantize a grouped-query model's keys",
        )
    ranked = [p for p in cached_prefixes(model) if cache[f"{p}_rank"]]
    if cache["bases"] and not ranked:
        fail(
            "cache.bases",
            cache["bases"],
            "is read by no tensor: none of this model's tensors has cache.<prefix>_rank set",
            "set the rank of the tensors it holds bases for, or cache.bases=''",
        )
    if cache["k_sketch"] and "k" in ranked:
        fail(
            "cache.k_sketch",
            cache["k_sketch"],
            f"cannot combine with cache.k_rank={cache['k_rank']} (the sketch estimates "
            "products with the keys' channels, and those keys are coded in a basis)",
            "set one of them to 0",
        )
    if cache["k_sketch"] and cache["k_before_rope"]:
        fail(
            "cache.k_sketch",
            cache["k_sketch"],
            "cannot combine with cache.k_before_rope=True (the sketch estimates products "
            "with keys as stored, and those keys are turned by RoPE when read)",
            "set one of them off",
        )
    window = model["sliding_window"]
    if window and cache["evict"]["method"] != "none":
        fail(
            "cache.evict.method",
            cache["evict"]["method"],
            f"cannot combine with model.sliding_window={window} (the model's window already "
            "decides what its cache keeps)",
            "set cache.evict.method='none'",
        )
    used = cached_prefixes(model)
    for prefix in CACHED_PREFIXES:
        for field, unset in UNSET:
            if prefix not in used and cache[f"{prefix}_{field}"] != unset:
                fail(
                    f"cache.{prefix}_{field}",
                    cache[f"{prefix}_{field}"],
                    f"applies to a tensor model.attention={model['attention']!r} does not cache",
                    f"set cache.{used[0]}_{field} / cache.{used[1]}_{field} instead and leave "
                    f"cache.{prefix}_{field}={unset!r}",
                )
    runs_coded = topology.codes_in_bases  # its check_cache checks the ranks
    for tensor in cached_tensors(model):
        prefix, width, width_name = tensor.prefix, tensor.width, tensor.width_field
        transform = TRANSFORMS.get(cache[f"{prefix}_transform"])
        transform.check(width, f"cache.{prefix}_transform")
        bits, outliers = cache[f"{prefix}_bits"], cache[f"{prefix}_outliers"]
        rank = 0 if runs_coded else cache[f"{prefix}_rank"]
        if rank and (bits == 16 or rank > width):
            fail(
                f"cache.{prefix}_rank",
                rank,
                f"codes a quantized tensor in fewer directions, but cache.{prefix}_bits=16"
                if bits == 16
                else f"exceeds {width_name}={width}, the directions a head's vector has",
                f"set cache.{prefix}_bits below 16 (8-bit codes lose least), or a rank in "
                f"1..{width}, or 0",
            )
        if rank:  # what follows counts the coded numbers: the rank's coordinates
            width, width_name = rank, f"cache.{prefix}_rank"
        if outliers and (bits == 16 or outliers >= min(width, 256)):
            fail(
                f"cache.{prefix}_outliers",
                outliers,
                f"keeps numbers beside the codes of a quantized tensor, but cache.{prefix}_bits="
                f"{bits}"
                if bits == 16
                else f"leaves no number of {width_name}={width} to codes (or its channel ids "
                "need more than a byte)",
                f"set cache.{prefix}_outliers=0, or below {min(width, 256)} with "
                f"cache.{prefix}_bits below 16",
            )
        if bits == 16:
            continue
        group = cache["group_size"]
        if cache[f"{prefix}_axis"] == "token" and width % group:
            fail(
                "cache.group_size",
                group,
                f"does not divide {width_name}={width}, but cache.{prefix}_axis='token' "
                "groups a token's channels",
                f"set cache.group_size to a divisor of {width}",
            )
        if width * bits % 8:
            fail(
                f"cache.{prefix}_bits",
                bits,
                f"packs {width_name}={width} numbers into {width * bits / 8} bytes per token",
                f"use a width that is a multiple of {8 // math.gcd(8, bits)} or another bit-width",
            )
