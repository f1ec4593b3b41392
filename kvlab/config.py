"""Config schema, defaults, validation and loading.

Every kvlab run is described by one `ml_collections.ConfigDict` with six
sections (DESIGN.md): `model`, `cache`, `train`, `data`, `eval`, `wandb`. Config files in
`configs/` start from `base_config(variant)` and change what they study.

    cfg = kvlab.load_config("configs/gqa.py:tiny")   # loads and validates
    cfg.model.num_kv_heads = 1
    kvlab.validate_config(cfg)                       # re-checks after edits

`validate_config` raises `ValueError` naming the field, its value and the fix
for every inconsistent or out-of-range field, before anything is compiled.
"""

from __future__ import annotations

import importlib.util
import operator
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_collections

# Names a config may use for `model.dtype`, `model.param_dtype`, `cache.dtype`
# and `cache.scale_dtype`.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

ATTENTION_KINDS = ("gqa", "mla")
CACHE_KINDS = ("dense", "paged")
BIT_WIDTHS = (16, 8, 4, 2)
CODE_FORMATS = ("int", "fp8")
GROUP_AXES = ("token", "channel")
# The cached tensors' config prefixes, by attention kind (kvlab/cache/quant.py).
CACHED = {"gqa": ("k", "v"), "mla": ("latent", "rope")}
CACHED_PREFIXES = ("k", "v", "latent", "rope")
DATA_SOURCES = ("stdlib", "text", "mqar")
WANDB_MODES = ("offline", "online", "disabled")
EVAL_SPLITS = ("validation", "test")

# Model sizes. `tiny` runs on two CPU cores in seconds; `small` and `base` are
# meant for an accelerator (base is GPT-2-small sized, ~85M non-embedding).
_SIZES = {
    "tiny": dict(num_layers=2, embed_dim=64, num_heads=4, head_dim=16, mlp_dim=176),
    "small": dict(num_layers=8, embed_dim=512, num_heads=8, head_dim=64, mlp_dim=1408),
    "base": dict(num_layers=12, embed_dim=768, num_heads=12, head_dim=64, mlp_dim=2048),
}
VARIANTS = tuple(_SIZES)


def base_config(variant: str = "tiny") -> ml_collections.ConfigDict:
    """The full schema with its defaults, sized by `variant` (tiny|small|base).

    The model is multi-head attention (num_kv_heads == num_heads); the configs
    in `configs/` change the head sharing, cache storage and so on from here.
    """
    if variant not in _SIZES:
        raise ValueError(
            f"config variant {variant!r} is unknown: use one of {', '.join(VARIANTS)} "
            f"(e.g. configs/gqa.py:tiny)"
        )
    size = _SIZES[variant]
    on_cpu = variant == "tiny"
    cfg = ml_collections.ConfigDict()

    cfg.model = ml_collections.ConfigDict(
        dict(
            vocab_size=256,  # bytes
            num_layers=size["num_layers"],
            embed_dim=size["embed_dim"],  # D, the residual stream width
            num_heads=size["num_heads"],  # N query heads
            num_kv_heads=size["num_heads"],  # K: num_heads = MHA, a divisor = GQA, 1 = MQA
            head_dim=size["head_dim"],  # H
            mlp_dim=size["mlp_dim"],  # SwiGLU hidden width
            rope_theta=10_000.0,  # RoPE base frequency
            norm_eps=1e-6,  # RMSNorm epsilon
            tie_embeddings=True,  # output projection shares the input embedding
            dtype="float32" if on_cpu else "bfloat16",  # compute dtype
            param_dtype="float32",  # dtype the weights are stored in
            attention="gqa",  # 'gqa' (covers MHA, GQA, MQA) or 'mla' (latent, see mla below)
        )
    )
    # Multi-head latent attention (DeepSeek-V2), used when attention='mla'. The
    # cache holds kv_rank + rope_dim numbers per token and layer; head_dim must
    # be nope_dim + rope_dim and num_kv_heads must equal num_heads (every head
    # gets its own K/V from the latent).
    cfg.model.mla = ml_collections.ConfigDict(
        dict(
            kv_rank=4 * size["head_dim"],  # d_c: width of the cached K/V latent
            q_rank=0,  # d_c': 0 = full-rank queries, else a low-rank query path with its norm
            rope_dim=size["head_dim"] // 2,  # d_h^R: the one RoPE key shared by all heads
            nope_dim=size["head_dim"],  # per-head key width without position
            v_head_dim=size["head_dim"],  # per-head value width
            absorb=True,  # cached steps attend in latent space (False: expand K/V per head)
        )
    )

    # What each cached tensor is stored in (kvlab/cache/quant.py). Grouped-query
    # attention caches keys (k_*) and values (v_*); latent attention caches the
    # latent c_kv (latent_*) and the RoPE key shared by all heads (rope_*).
    # Format and axis matter only below 16 bits.
    cfg.cache = ml_collections.ConfigDict(
        dict(
            kind="dense",  # 'dense': contiguous per-sequence buffers; 'paged': a page pool
            page_size=16,  # paged: tokens per page
            num_pages=0,  # paged: pages in the pool (0 = enough for every row at max_len)
            prefix_caching=False,  # paged: share full pages of identical prompt prefixes
            dtype="float32" if on_cpu else "bfloat16",  # dtype of 16-bit entries and the residual
            k_bits=16,  # 16 (= cache.dtype), 8, 4 or 2 bits per stored number
            v_bits=16,
            latent_bits=16,
            rope_bits=16,
            k_format="int",  # 'int' (rounded levels) or 'fp8' (float8 e4m3; 8 bits only)
            v_format="int",
            latent_format="int",
            rope_format="int",
            k_axis="channel",  # scale groups: 'token' (a token's channels) or 'channel'
            v_axis="token",  # (a channel's tokens; KIVI's choice for keys)
            latent_axis="token",
            rope_axis="channel",
            group_size=16 if on_cpu else 32,  # numbers (token axis) or tokens (channel) per scale
            residual=0,  # most recent tokens kept in cache.dtype (a multiple of group_size
            #              when a tensor groups along tokens)
            symmetric=False,  # int codes without a zero point (fp8 never has one)
            scale_dtype="bfloat16",  # dtype of scales and zero points
        )
    )

    cfg.train = ml_collections.ConfigDict(
        dict(
            steps=2_000 if on_cpu else 20_000,
            batch_size=16 if on_cpu else 64,
            seq_len=128 if on_cpu else 1024,
            lr=3e-3 if on_cpu else 6e-4,  # peak learning rate
            warmup=100 if on_cpu else 1_000,  # linear warm-up steps
            weight_decay=0.1,
            clip=1.0,  # global gradient-norm clip
            log_every=10 if on_cpu else 50,  # steps between logged training metrics
            eval_every=200 if on_cpu else 1_000,  # steps between validation losses
            checkpoint_every=500 if on_cpu else 2_000,
            keep=3,  # checkpoints kept
            seed=0,
        )
    )

    cfg.data = ml_collections.ConfigDict(
        dict(
            source="stdlib",  # the Python standard library's own sources, as bytes
            path="",  # file or folder for source='text'
        )
    )
    # Multi-query associative recall (Zoology), used when data.source='mqar':
    # num_pairs key-value pairs, then every key again as a query at power-law
    # gaps; sequences are train.seq_len tokens over the first mqar.vocab_size ids.
    cfg.data.mqar = ml_collections.ConfigDict(
        dict(
            num_pairs=8 if on_cpu else 32,
            vocab_size=256,  # token ids used (<= model.vocab_size); 0 is the filler
            power=0.01,  # gaps drawn with p(gap) ~ gap ** (power - 1)
        )
    )

    # Held-out evaluation: windows of train.seq_len tokens from data split
    # `split`, run through the cache in prefill chunks of `chunk` tokens.
    cfg.eval = ml_collections.ConfigDict(
        dict(
            split="validation",  # 'validation' or 'test'
            batch_size=16 if on_cpu else 32,
            num_batches=4 if on_cpu else 16,
            chunk=32 if on_cpu else 128,  # tokens per prefill step through the cache
        )
    )

    cfg.wandb = ml_collections.ConfigDict(dict(mode="offline", project="kvlab", group="", tags=()))
    return cfg


# ---------------------------------------------------------------------------
# Validation


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """`value` as a Python int if it is an integer >= `minimum`, else a ValueError.

    The one check of a count or size given to kvlab (config fields, function
    arguments): Python and numpy integers pass; bools, floats, strings and
    anything below `minimum` are refused with the field's name and the fix.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name}={value!r} is not an integer: pass an integer >= {minimum}")
    number = operator.index(value)
    if number < minimum:
        raise ValueError(f"{name}={value!r} is below {minimum}: pass an integer >= {minimum}")
    return number


def _fail(field: str, value: Any, problem: str, fix: str) -> None:
    raise ValueError(f"{field}={value!r} {problem}: {fix}")


def _check_known_fields(section: str, given: Mapping, schema: Mapping) -> None:
    for key in given:
        if key not in schema:
            raise ValueError(
                f"{section}.{key} is not a kvlab config field: remove it or use one of "
                f"{', '.join(sorted(schema))}"
            )
    for key in schema:
        if key not in given:
            raise ValueError(
                f"{section}.{key} is missing: start the config from "
                f"kvlab.config.base_config(variant) so every field has a value"
            )


def _check_int(section: str, cfg: Mapping, name: str, minimum: int = 1) -> None:
    value = cfg[name]
    if not isinstance(value, int):  # a config stores plain ints (numpy ints do not serialise)
        _fail(f"{section}.{name}", value, "is not an integer", f"set an integer >= {minimum}")
    check_count(f"{section}.{name}", value, minimum)


def _check_positive_number(section: str, cfg: Mapping, name: str) -> None:
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        _fail(f"{section}.{name}", value, "is not a positive number", "set a number > 0")


def _check_choice(section: str, cfg: Mapping, name: str, choices: tuple) -> None:
    value = cfg[name]
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        listed = ", ".join(repr(c) for c in choices)
        _fail(f"{section}.{name}", value, "is not supported", f"use one of {listed}")


def validate_model_config(model: Mapping) -> None:
    """Raises ValueError naming the first bad field of a `model` section."""
    _check_known_fields("model", model, base_config().model)
    for name in (
        "vocab_size",
        "num_layers",
        "embed_dim",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
    ):
        _check_int("model", model, name)
    for name in ("rope_theta", "norm_eps"):
        _check_positive_number("model", model, name)
    _check_choice("model", model, "dtype", tuple(DTYPES))
    _check_choice("model", model, "param_dtype", tuple(DTYPES))
    _check_choice("model", model, "attention", ATTENTION_KINDS)
    if not isinstance(model["tie_embeddings"], bool):
        _fail("model.tie_embeddings", model["tie_embeddings"], "is not a bool", "set True or False")
    _check_known_fields("model.mla", model["mla"], base_config().model.mla)
    if model["attention"] == "mla":
        _validate_mla(model)
    else:
        _validate_grouped(model)


def _validate_grouped(model: Mapping) -> None:
    heads, kv_heads = model["num_heads"], model["num_kv_heads"]
    if heads % kv_heads:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        _fail(
            "model.num_kv_heads",
            kv_heads,
            f"must divide model.num_heads={heads}",
            f"set model.num_kv_heads to one of {divisors} (MHA={heads}, MQA=1)",
        )
    if model["head_dim"] % 2:
        _fail(
            "model.head_dim",
            model["head_dim"],
            "is odd, but RoPE rotates pairs of channels",
            "set an even model.head_dim",
        )


def _validate_mla(model: Mapping) -> None:
    mla = model["mla"]
    for name in ("kv_rank", "rope_dim", "nope_dim", "v_head_dim"):
        _check_int("model.mla", mla, name)
    _check_int("model.mla", mla, "q_rank", minimum=0)
    if not isinstance(mla["absorb"], bool):
        _fail("model.mla.absorb", mla["absorb"], "is not a bool", "set True or False")
    if mla["rope_dim"] % 2:
        _fail(
            "model.mla.rope_dim",
            mla["rope_dim"],
            "is odd, but RoPE rotates pairs of channels",
            "set an even model.mla.rope_dim",
        )
    query_key_width = mla["nope_dim"] + mla["rope_dim"]
    if model["head_dim"] != query_key_width:
        _fail(
            "model.head_dim",
            model["head_dim"],
            f"does not match model.mla.nope_dim + model.mla.rope_dim = {query_key_width}",
            f"set model.head_dim={query_key_width} (the per-head query/key width under MLA)",
        )
    if model["num_kv_heads"] != model["num_heads"]:
        _fail(
            "model.num_kv_heads",
            model["num_kv_heads"],
            f"must equal model.num_heads={model['num_heads']} when model.attention='mla'",
            f"set model.num_kv_heads={model['num_heads']}: MLA expands K/V for every head "
            "from the latent",
        )


def validate_cache_config(cache: Mapping, model: Mapping | None = None) -> None:
    """Raises ValueError naming the first bad field of a `cache` section.

    With the model section too, also checks what depends on it: which tensors
    the model caches and whether their widths fit the groups and the packing.
    """
    _check_known_fields("cache", cache, base_config().cache)
    _check_choice("cache", cache, "kind", CACHE_KINDS)
    _check_choice("cache", cache, "dtype", tuple(DTYPES))
    _check_choice("cache", cache, "scale_dtype", tuple(DTYPES))
    _check_int("cache", cache, "group_size")
    _check_int("cache", cache, "residual", minimum=0)
    _check_int("cache", cache, "page_size")
    _check_int("cache", cache, "num_pages", minimum=0)
    if not isinstance(cache["prefix_caching"], bool):
        _fail("cache.prefix_caching", cache["prefix_caching"], "is not a bool", "set True or False")
    if not isinstance(cache["symmetric"], bool):
        _fail("cache.symmetric", cache["symmetric"], "is not a bool", "set True or False")
    for prefix in CACHED_PREFIXES:
        _check_choice("cache", cache, f"{prefix}_bits", BIT_WIDTHS)
        _check_choice("cache", cache, f"{prefix}_format", CODE_FORMATS)
        _check_choice("cache", cache, f"{prefix}_axis", GROUP_AXES)
        bits = cache[f"{prefix}_bits"]
        if cache[f"{prefix}_format"] == "fp8" and bits != 8:
            _fail(
                f"cache.{prefix}_format",
                "fp8",
                f"needs 8 bits but cache.{prefix}_bits={bits}",
                f"set cache.{prefix}_bits=8 or cache.{prefix}_format='int'",
            )
        if (
            bits < 16
            and cache[f"{prefix}_axis"] == "channel"
            and cache["kind"] == "paged"
            and cache["page_size"] % cache["group_size"]
        ):
            _fail(
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
            _fail(
                "cache.residual",
                cache["residual"],
                f"is not a multiple of cache.group_size={cache['group_size']}, but "
                f"cache.{prefix}_axis='channel' flushes tokens to quantized storage in groups",
                "set cache.residual to a multiple of cache.group_size",
            )
    if model is not None:
        _validate_cache_for_model(cache, model)


def _validate_cache_for_model(cache: Mapping, model: Mapping) -> None:
    used = CACHED[model["attention"]]
    for prefix in CACHED_PREFIXES:
        if prefix not in used and cache[f"{prefix}_bits"] != 16:
            _fail(
                f"cache.{prefix}_bits",
                cache[f"{prefix}_bits"],
                f"applies to a tensor model.attention={model['attention']!r} does not cache",
                f"set cache.{used[0]}_bits / cache.{used[1]}_bits instead and leave "
                f"cache.{prefix}_bits=16",
            )
    if model["attention"] == "mla":
        mla = model["mla"]
        widths = {
            "latent": ("model.mla.kv_rank", mla["kv_rank"]),
            "rope": ("model.mla.rope_dim", mla["rope_dim"]),
        }
    else:
        widths = {p: ("model.head_dim", model["head_dim"]) for p in ("k", "v")}
    for prefix, (width_name, width) in widths.items():
        bits = cache[f"{prefix}_bits"]
        if bits == 16:
            continue
        group = cache["group_size"]
        if cache[f"{prefix}_axis"] == "token" and width % group:
            _fail(
                "cache.group_size",
                group,
                f"does not divide {width_name}={width}, but cache.{prefix}_axis='token' "
                "groups a token's channels",
                f"set cache.group_size to a divisor of {width}",
            )
        if width * bits % 8:
            _fail(
                f"cache.{prefix}_bits",
                bits,
                f"packs {width_name}={width} numbers into {width * bits / 8} bytes per token",
                f"use a width that is a multiple of {8 // bits} or another bit-width",
            )


def validate_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks every section of a full config; returns it unchanged when valid."""
    schema = base_config()
    _check_known_fields("config", cfg, schema)
    validate_model_config(cfg.model)
    validate_cache_config(cfg.cache, cfg.model)

    _check_known_fields("train", cfg.train, schema.train)
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep",
    ):
        _check_int("train", cfg.train, name)
    _check_int("train", cfg.train, "warmup", minimum=0)
    _check_int("train", cfg.train, "seed", minimum=0)
    _check_positive_number("train", cfg.train, "lr")
    _check_positive_number("train", cfg.train, "clip")
    if not isinstance(cfg.train.weight_decay, (int, float)) or cfg.train.weight_decay < 0:
        _fail(
            "train.weight_decay",
            cfg.train.weight_decay,
            "is not a number >= 0",
            "set a number >= 0 (0 turns weight decay off)",
        )

    _check_known_fields("data", cfg.data, schema.data)
    _check_choice("data", cfg.data, "source", DATA_SOURCES)
    if cfg.data.source == "text" and not cfg.data.path:
        _fail(
            "data.path",
            cfg.data.path,
            "is empty but data.source='text' reads a local file",
            "set data.path to a text file or a folder of text files",
        )

    _check_known_fields("data.mqar", cfg.data.mqar, schema.data.mqar)
    if cfg.data.source == "mqar":
        _validate_mqar(cfg)

    _check_known_fields("eval", cfg.eval, schema.eval)
    _check_choice("eval", cfg.eval, "split", EVAL_SPLITS)
    for name in ("batch_size", "num_batches", "chunk"):
        _check_int("eval", cfg.eval, name)

    _check_known_fields("wandb", cfg.wandb, schema.wandb)
    _check_choice("wandb", cfg.wandb, "mode", WANDB_MODES)
    return cfg


def _validate_mqar(cfg: ml_collections.ConfigDict) -> None:
    mqar = cfg.data.mqar
    _check_int("data.mqar", mqar, "num_pairs")
    _check_int("data.mqar", mqar, "vocab_size", minimum=4)
    _check_positive_number("data.mqar", mqar, "power")
    if mqar.vocab_size > cfg.model.vocab_size:
        _fail(
            "data.mqar.vocab_size",
            mqar.vocab_size,
            f"exceeds model.vocab_size={cfg.model.vocab_size}",
            f"set data.mqar.vocab_size <= {cfg.model.vocab_size}",
        )
    keys = mqar.vocab_size // 2 - 1  # ids 1 .. V/2-1 are keys, V/2 .. V-1 values
    if mqar.num_pairs > keys:
        _fail(
            "data.mqar.num_pairs",
            mqar.num_pairs,
            f"exceeds the {keys} distinct keys data.mqar.vocab_size={mqar.vocab_size} holds",
            f"set data.mqar.num_pairs <= {keys} or raise data.mqar.vocab_size",
        )
    needed = 4 * mqar.num_pairs  # the pairs, then every key and its value again
    if needed > cfg.train.seq_len + 1:
        _fail(
            "data.mqar.num_pairs",
            mqar.num_pairs,
            f"needs {needed} tokens but train.seq_len={cfg.train.seq_len} holds "
            f"{cfg.train.seq_len + 1} per sequence",
            f"set data.mqar.num_pairs <= {(cfg.train.seq_len + 1) // 4} or raise train.seq_len",
        )


# ---------------------------------------------------------------------------
# Loading


def import_config_file(path: str):
    """The config file as a module: its `get_config(arg)`, and for sweeps `get_grid(cfg)`."""
    if not os.path.isfile(path):
        raise ValueError(
            f"config file {path!r} does not exist: give a path such as configs/gqa.py:tiny"
        )
    name = "kvlab_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path!r} has no get_config(arg) function: add one")
    return module


def load_config(spec: str) -> ml_collections.ConfigDict:
    """Loads `path/to/file.py[:arg]` through its `get_config(arg)` and validates it."""
    path, _, arg = spec.partition(":")
    module = import_config_file(path)
    cfg = module.get_config(arg) if arg else module.get_config()
    return validate_config(cfg)


def dtype_of(name: str) -> jnp.dtype:
    """The JAX dtype a config names (see DTYPES)."""
    return jnp.dtype(DTYPES[name])


def frozen(section: Mapping) -> ml_collections.FrozenConfigDict:
    """An immutable, hashable copy of a config section (modules hold these)."""
    if isinstance(section, ml_collections.FrozenConfigDict):
        return section
    return ml_collections.FrozenConfigDict(section)
