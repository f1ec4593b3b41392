"""Config schema, defaults, validation and loading.

Every kvlab run is described by one `ml_collections.ConfigDict` with seven
sections (docs/architecture.md, "Configs"): `model`, `cache`, `train`, `data`, `eval`, `wandb`,
`mesh`. Config files in `configs/` start from `base_config(variant)` and change what they study.

    cfg = kvlab.load_config("configs/gqa.py:tiny")   # loads and validates
    cfg.model.num_kv_heads = 1
    kvlab.validate_config(cfg)                       # re-checks after edits

`validate_sections` first fills the fields a config omits with `base_config()`'s
defaults (`complete_config`: a grouped-query model needs no `mla` section), then
raises `ValueError` naming the field, its value and the fix for every unknown,
inconsistent or out-of-range field. What only the files a config names can tell
(data.tokenizer's token ids, the length of eval.tasks' samples) is checked by
kvlab.data, which reads them: `kvlab.validate_config` and `kvlab.load_config`
(kvlab/data/__init__.py) run both, before anything is compiled.
"""

from __future__ import annotations

import importlib.util
import math
import operator
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_collections

from kvlab import backends
from kvlab.registry import SCORERS, TOPOLOGIES, TRANSFORMS

# Names a config may use for `model.dtype`, `model.param_dtype`, `cache.dtype`
# and `cache.scale_dtype`.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

ATTENTION_KINDS = ("gqa", "mla")
MOE_ROUTINGS = ("softmax", "sigmoid")  # model.moe.routing: DeepSeek-V2, DeepSeek-V3
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # model.rope_scaling.type
CACHE_KINDS = ("dense", "paged")
# cache.evict.method: the layouts that score nothing, then the scorers
# (kvlab.registry.SCORERS: kvlab/cache/evict/scorers.py and the methods added beside it).
UNSCORED_METHODS = ("none", "window", "sinks")
BIT_WIDTHS = (16, 8, 4, 2)
CODE_FORMATS = ("int", "fp8")
GROUP_AXES = ("token", "channel")
CACHED_PREFIXES = ("k", "v", "latent", "rope")  # cache.<prefix>_bits, _format, _axis
DATA_SOURCES = ("stdlib", "text", "mqar")
WANDB_MODES = ("offline", "online", "disabled")
EVAL_SPLITS = ("validation", "test")
# eval.tasks: long-context recall over text (the first four) and MQAR (kvlab/data/tasks.py).
EVAL_TASKS = ("needle", "multikey", "multivalue", "vartrack", "mqar")
# Token ids of the byte sources (data.source 'stdlib' and 'text'): one per byte value.
BYTE_VOCAB_SIZE = 256
# train.seed feeds a 32-bit PRNG seed (jax.random.key): larger seeds would wrap around.
SEED_LIMIT = 2**32

# Model sizes. `tiny` runs on two CPU cores in seconds; `small` and `base` are
# meant for an accelerator (base is GPT-2-small sized, ~85M non-embedding).
_SIZES = {
    "tiny": dict(num_layers=2, embed_dim=64, num_heads=4, head_dim=16, mlp_dim=176),
    "small": dict(num_layers=8, embed_dim=512, num_heads=8, head_dim=64, mlp_dim=1408),
    "base": dict(num_layers=12, embed_dim=768, num_heads=12, head_dim=64, mlp_dim=2048),
}
VARIANTS = tuple(_SIZES)

MESH_AXES = ("data", "fsdp", "tensor")  # mesh.data, mesh.fsdp, mesh.tensor, in mesh order
# mesh.rules' defaults: each logical axis and the mesh axes it is split over
# (docs/scale-out.md). Parameters: embed, heads, kv_heads, head_dim, mlp,
# vocab, latent, experts, norm; activations: batch; caches: cache_batch,
# cache_heads, cache_pages.
LOGICAL_AXIS_RULES = (
    ("batch", "data,fsdp"),  # training and evaluation batches
    ("embed", "fsdp"),  # D: every weight's model-width side
    ("heads", "tensor"),  # N query heads
    ("kv_heads", "tensor"),  # K key/value heads (replicated where tensor does not divide K)
    ("head_dim", ""),  # H
    ("mlp", "tensor"),  # F, the feed-forward width (dense and expert)
    ("vocab", "tensor"),  # V
    ("latent", ""),  # MLA's kv_rank and q_rank
    ("experts", ""),  # E routed experts (and the router's outputs)
    ("norm", ""),  # RMSNorm scales
    ("cache_batch", "data,fsdp"),  # cache rows (and lengths, errors, block tables)
    ("cache_heads", "tensor"),  # cached heads (MQA and MLA cache one: replicated)
    ("cache_pages", ""),  # paged pools' pages (rows may use any page: replicated)
)


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
            vocab_size=BYTE_VOCAB_SIZE,  # bytes
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
            qkv_bias=False,  # biases on the query, key and value projections (Qwen2); gqa only
            qk_norm=False,  # RMSNorm over each head's query and key before RoPE (Qwen3); gqa only
            sliding_window=0,  # 0 = full causal attention; W = each query sees the last W
            #                    positions, itself included (Mistral, Gemma); its cache is a
            #                    ring of W slots (kvlab/cache/evict/)
            attention_impl="xla",  # the backend (kvlab.backends) whose kernels attend over
            #                        stored blocks and write caches: 'xla' (plain JAX, any
            #                        platform), 'pallas' (kvlab/kernels/pallas: Triton on
            #                        CUDA, the interpreter on CPU), 'native' (kvlab/kernels/
            #                        native: C++ CPU kernels), or one registered
            topology="layerwise",  # which cache layer each layer reads and writes
            #                       (kvlab.registry.TOPOLOGIES): 'layerwise' (its own) or
            #                       'cla:N' (N adjacent layers share one, arXiv:2405.12981)
        )
    )
    # RoPE for contexts longer than the model was trained on, as Hugging Face
    # transformers computes it (kvlab/attention/rope.py). 'none' is plain RoPE;
    # 'linear' divides every frequency by factor; 'llama3' (Llama 3.1) and 'yarn'
    # (DeepSeek-V2, Qwen2.5) interpolate low frequencies, keep high ones and
    # blend between, relative to original_max_len.
    cfg.model.rope_scaling = ml_collections.ConfigDict(
        dict(
            type="none",  # 'none', 'linear', 'llama3' or 'yarn'
            factor=1.0,  # context stretch: frequencies / factor where interpolated
            original_max_len=0,  # llama3, yarn: the pre-training context (HF
            #                      original_max_position_embeddings)
            low_freq_factor=1.0,  # llama3: wavelengths above original_max_len / this interpolate
            high_freq_factor=4.0,  # llama3: wavelengths below original_max_len / this stay
            beta_fast=32.0,  # yarn: turns over original_max_len below which frequencies stay
            beta_slow=1.0,  # yarn: turns below which frequencies are fully interpolated
            mscale=1.0,  # yarn: cos/sin x mscale(factor, mscale) / mscale(factor, mscale_all_dim)
            mscale_all_dim=0.0,  # yarn: 0 = cos/sin x mscale(factor, 1); MLA's softmax scale
            #                      is multiplied by mscale(factor, mscale_all_dim) ** 2
        )
    )
    # Multi-head latent attention (DeepSeek-V2), used when attention='mla'. The
    # cache holds kv_rank + rope_heads x rope_dim numbers per token and layer; head_dim must
    # be nope_dim + rope_dim and num_kv_heads must equal num_heads (every head
    # gets its own K/V from the latent).
    cfg.model.mla = ml_collections.ConfigDict(
        dict(
            kv_rank=4 * size["head_dim"],  # d_c: width of the cached K/V latent
            q_rank=0,  # d_c': 0 = full-rank queries, else a low-rank query path with its norm
            rope_dim=size["head_dim"] // 2,  # d_h^R: width of each RoPE key
            nope_dim=size["head_dim"],  # per-head key width without position
            v_head_dim=size["head_dim"],  # per-head value width
            absorb=True,  # cached steps attend in latent space (False: expand K/V per head)
            norm_eps=1e-6,  # epsilon of the latent norms (DeepSeek-V2 fixes it at 1e-6)
            latent_norm=True,  # RMSNorm on the cached latent (False: converted models, whose
            #                    latent is linear in x; kvlab/checkpoints/convert.py)
            rope_heads=1,  # RoPE keys cached: 1 = one shared by all heads (DeepSeek); K = one
            #                per group of num_heads / K query heads (MHA2MLA conversions)
            rope_pairs=(),  # () = RoPE over rope_dim; else per layer and RoPE key the
            #                 rope_dim / 2 pairs (0..head_dim/2 - 1) of a head_dim-wide RoPE kept
        )
    )
    # Mixture-of-experts feed-forward (DeepSeekMoE, kvlab/moe.py), used when
    # num_experts > 0: layers from first_dense_layers on (every `every`-th) route
    # each token to experts_per_token of num_experts SwiGLU experts of width
    # expert_dim and add num_shared_experts shared ones; the other layers keep
    # the dense MLP of width mlp_dim. Hugging Face names in brackets.
    cfg.model.moe = ml_collections.ConfigDict(
        dict(
            num_experts=0,  # E routed experts (n_routed_experts); 0 = dense MLP in every layer
            experts_per_token=2,  # k experts each token uses (num_experts_per_tok)
            expert_dim=size["mlp_dim"] // 4,  # each expert's SwiGLU width (moe_intermediate_size)
            num_shared_experts=0,  # experts every token uses, run as one SwiGLU of
            #                        num_shared_experts * expert_dim (n_shared_experts)
            first_dense_layers=0,  # layers 0..n-1 keep the dense MLP (first_k_dense_replace)
            every=1,  # from there, every `every`-th layer is MoE (moe_layer_freq)
            routing="softmax",  # 'softmax' (DeepSeek-V2) or 'sigmoid' with a score-correction
            #                     bias used only for choosing (DeepSeek-V3)
            num_groups=1,  # expert groups (n_group); 1 = plain top-k ('greedy')
            groups_per_token=1,  # groups a token may choose from (topk_group)
            routed_scale=1.0,  # routed experts' weights x this (routed_scaling_factor)
            normalize_weights=False,  # chosen weights / their sum (norm_topk_prob)
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
            k_transform="none",  # an orthogonal map applied before a tensor is stored and
            v_transform="none",  # folded into its reads: 'none', 'hadamard' or one registered
            latent_transform="none",  # (kvlab/cache/transforms; kvlab.registry.TRANSFORMS)
            rope_transform="none",
        )
    )
    # Token eviction (kvlab/cache/evict/): each layer stores `budget` tokens per
    # KV head and drops the rest physically. 'none' is the full cache.
    cfg.cache.evict = ml_collections.ConfigDict(
        dict(
            method="none",  # none|window|sinks, or a scorer: h2o|snapkv|pyramidkv|adakv|knorm|
            #                 random|tova|... (kvlab.config.evict_methods())
            budget=0,  # tokens kept per KV head and layer; 0 = ceil(ratio x max_len)
            ratio=1.0,  # with budget 0: the share of the cache's max_len kept, in (0, 1]
            sinks=4,  # 'sinks': the first tokens, always kept (StreamingLLM)
            recent=8,  # score-based methods: the most recent tokens, always kept
            obs_window=8,  # snapkv, pyramidkv, adakv: last queries of a step that score
            kernel=5,  # snapkv, pyramidkv, adakv: max-pool width over neighbouring tokens (odd)
            pyramid_beta=20.0,  # pyramidkv: the last layer keeps 1/beta of the mean budget
            adakv_floor=0.2,  # adakv: each head keeps at least this share of budget
            seed=0,  # random: which tokens
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
            init_from="",  # '' = random weights; else a training workdir or a Hugging Face dir
        )
    )

    cfg.data = ml_collections.ConfigDict(
        dict(
            source="stdlib",  # the Python standard library's own sources, as bytes
            path="",  # file or folder for source='text'
            # '' = bytes (vocab 256); else a folder holding a real model's tokenizer.json
            # (or the file): 'stdlib' and 'text' then yield its token ids (kvlab/data/tokenizer.py)
            tokenizer="",
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

    # Held-out evaluation: windows of eval.seq_len tokens (0: train.seq_len) from
    # data split `split`, run through the cache in prefill chunks of `chunk` tokens;
    # and the long-context tasks (kvlab/data/tasks.py) scored by scripts/eval_tasks.py.
    cfg.eval = ml_collections.ConfigDict(
        dict(
            split="validation",  # 'validation' or 'test'
            batch_size=16 if on_cpu else 32,
            num_batches=4 if on_cpu else 16,
            chunk=32 if on_cpu else 128,  # tokens per prefill step through the cache
            seq_len=0,  # evaluation window T; 0 = train.seq_len (longer: see model.rope_scaling)
            tasks=(),  # any of 'needle', 'multikey', 'multivalue', 'vartrack', 'mqar'
            task_lengths=(),  # context lengths the tasks run at; () = eval.seq_len alone
            depths=(0.0, 0.25, 0.5, 0.75, 1.0),  # needle: 0 = the start, 1 = before the question
        )
    )
    # The tasks' sizes: every value is value_digits digits, scored on its tokens.
    cfg.eval.task_params = ml_collections.ConfigDict(
        dict(
            value_digits=5,  # digits of each pass key or variable value
            num_keys=4,  # multikey: pass keys under distinct words, one asked
            num_values=4,  # multivalue: pass keys under one word, all asked
            num_chains=2,  # vartrack: chains of assignments, the first asked
            num_hops=4,  # vartrack: variables per chain (X1 = value, X2 = X1, ...)
        )
    )

    cfg.wandb = ml_collections.ConfigDict(dict(mode="offline", project="kvlab", group="", tags=()))

    # The devices a run uses (kvlab/sharding.py): a data x fsdp x tensor mesh whose
    # sizes multiply to the device count; -1 takes the devices the others leave.
    # The default puts every device on `data` (pure data parallelism), so one
    # device runs exactly as without a mesh.
    cfg.mesh = ml_collections.ConfigDict(
        dict(
            data=-1,  # batch rows split, weights replicated (data parallelism)
            fsdp=1,  # batch rows and weights split, weights gathered per use (FSDP, ZeRO-3)
            tensor=1,  # heads and MLP width split (Megatron tensor parallelism)
            # several hosts (jax.distributed.initialize, kvlab/sharding.py); the
            # JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID env asks too
            distributed=False,
        )
    )
    # Logical axis -> mesh axes, as flax's nn.logical_axis_rules takes them (MaxText's
    # scheme): the mesh axes (comma-separated, '' = replicated) each logical axis of a
    # parameter, batch or cache array is split over. A dimension the axes do not divide
    # keeps the longest leading run of them that does (kvlab/sharding.py).
    cfg.mesh.rules = ml_collections.ConfigDict(dict(LOGICAL_AXIS_RULES))
    return cfg


# ---------------------------------------------------------------------------
# What each attention kind caches


class CachedTensor(NamedTuple):
    """One tensor a layer caches per token: `heads` x `width` numbers."""

    name: str  # k, v (grouped-query attention); c_kv, k_rope (latent attention)
    prefix: str  # its storage fields: cache.<prefix>_bits, _format, _axis
    heads: int
    width: int
    width_field: str  # the model field that sets the width (for error messages)


def cached_tensors(model: Mapping) -> tuple[CachedTensor, CachedTensor]:
    """What one layer of `model` caches per token: the one definition of each
    attention kind's cache (docs/caches.md, "The cache pytree").

    Grouped-query attention (MHA, GQA, MQA): keys and values, num_kv_heads heads
    of head_dim. Latent attention (DeepSeek-V2, arXiv:2405.04434): the latent
    c_kv (width mla.kv_rank, one head) and the RoPE keys k_rope (mla.rope_heads
    of width mla.rope_dim; one shared by all heads in DeepSeek's design).
    """
    if model["attention"] == "mla":
        mla = model["mla"]
        return (
            CachedTensor("c_kv", "latent", 1, mla["kv_rank"], "model.mla.kv_rank"),
            CachedTensor(
                "k_rope", "rope", mla["rope_heads"], mla["rope_dim"], "model.mla.rope_dim"
            ),
        )
    heads, width = model["num_kv_heads"], model["head_dim"]
    return (
        CachedTensor("k", "k", heads, width, "model.head_dim"),
        CachedTensor("v", "v", heads, width, "model.head_dim"),
    )


def cached_prefixes(model: Mapping) -> tuple[str, str]:
    """The storage-field prefixes of the two tensors `model` caches: (k, v) or (latent, rope)."""
    first, second = cached_tensors(model)
    return first.prefix, second.prefix


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
                f"{section}.{key} is missing: validate the whole config with "
                "kvlab.validate_config (it fills omitted fields from base_config), or start "
                "it from kvlab.config.base_config(variant)"
            )


def _check_int(section: str, cfg: Mapping, name: str, minimum: int = 1) -> None:
    value = cfg[name]
    if not isinstance(value, int):  # a config stores plain ints (numpy ints do not serialise)
        _fail(f"{section}.{name}", value, "is not an integer", f"set an integer >= {minimum}")
    check_count(f"{section}.{name}", value, minimum)


def _check_number(section: str, cfg: Mapping, name: str, zero_allowed: bool = False) -> None:
    """A finite real number > 0 (>= 0 with `zero_allowed`): NaN and infinity are refused,
    as they would turn every weight or every loss into NaN."""
    value = cfg[name]
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
        bound = ">= 0" if zero_allowed else "> 0"
        _fail(f"{section}.{name}", value, f"is not a finite number {bound}", f"set one {bound}")


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
    _check_int("model", model, "sliding_window", minimum=0)
    for name in ("rope_theta", "norm_eps"):
        _check_number("model", model, name)
    _check_choice("model", model, "dtype", tuple(DTYPES))
    _check_choice("model", model, "param_dtype", tuple(DTYPES))
    _check_choice("model", model, "attention", ATTENTION_KINDS)
    _check_choice("model", model, "attention_impl", backends.names())
    _validate_topology(model)
    for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
        if not isinstance(model[name], bool):
            _fail(f"model.{name}", model[name], "is not a bool", "set True or False")
    scaling_schema = base_config().model.rope_scaling
    _check_known_fields("model.rope_scaling", model["rope_scaling"], scaling_schema)
    _validate_rope_scaling(model["rope_scaling"])
    _check_known_fields("model.mla", model["mla"], base_config().model.mla)
    _check_known_fields("model.moe", model["moe"], base_config().model.moe)
    _validate_moe(model)
    if model["attention"] == "mla":
        _validate_mla(model)
    else:
        _validate_grouped(model)


def _validate_topology(model: Mapping) -> None:
    spec = model["topology"]
    if not isinstance(spec, str):
        _fail("model.topology", spec, "is not a string", "set e.g. 'layerwise' or 'cla:2'")
    name, _, arg = spec.partition(":")
    if name not in TOPOLOGIES.names():
        listed = ", ".join(repr(n) for n in TOPOLOGIES.names())
        _fail("model.topology", spec, "names no cache topology", f"use one of {listed}")
    TOPOLOGIES.get(name).check(arg, model["num_layers"], "model.topology")
    if name != "layerwise" and model["attention"] == "mla" and model["mla"]["rope_pairs"]:
        _fail(
            "model.topology",
            spec,
            "cannot combine with model.mla.rope_pairs (each layer's RoPE keys turn its own "
            "frequency pairs, so a layer cannot read another's)",
            "set model.topology='layerwise' for a model converted from grouped-query attention",
        )


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


def _validate_rope_scaling(scaling: Mapping) -> None:
    section = "model.rope_scaling"
    _check_choice(section, scaling, "type", ROPE_SCALINGS)
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        _check_number(section, scaling, name)
    for name in ("mscale", "mscale_all_dim"):
        _check_number(section, scaling, name, zero_allowed=True)
    _check_int(section, scaling, "original_max_len", minimum=0)
    kind = scaling["type"]
    if kind == "none" and scaling["factor"] != 1.0:
        _fail(
            f"{section}.factor",
            scaling["factor"],
            f"does nothing with {section}.type='none'",
            f"set {section}.type to 'linear', 'llama3' or 'yarn', or factor=1.0",
        )
    if kind in ("llama3", "yarn") and scaling["original_max_len"] < 1:
        _fail(
            f"{section}.original_max_len",
            scaling["original_max_len"],
            f"is unset but {section}.type={kind!r} scales relative to the pre-training context",
            "set it to the context the model was trained on (HF "
            "original_max_position_embeddings), e.g. 8192",
        )
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        _fail(
            f"{section}.high_freq_factor",
            scaling["high_freq_factor"],
            f"is not above {section}.low_freq_factor={scaling['low_freq_factor']}, so the "
            "band between kept and interpolated frequencies is empty",
            "set high_freq_factor > low_freq_factor (Llama 3.1: 4.0 and 1.0)",
        )
    if kind == "yarn" and scaling["beta_fast"] <= scaling["beta_slow"]:
        _fail(
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
    scaling = ml_collections.ConfigDict(base_config().model.rope_scaling.to_dict())
    given = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, equals, text = (part.strip() for part in item.partition("="))
        if not equals and not given and name in ROPE_SCALINGS:
            name, text = "type", name  # "yarn" alone
        elif not equals or name not in scaling:
            _fail(
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
                _fail(f"model.rope_scaling.{name}", text, "is not a number", "give a number")
    scaling.update(given)
    if scaling.type in ("llama3", "yarn") and "original_max_len" not in given:
        scaling.original_max_len = original_max_len
    _validate_rope_scaling(scaling)
    return scaling


def _validate_moe(model: Mapping) -> None:
    section, moe = "model.moe", model["moe"]
    for name in ("experts_per_token", "expert_dim", "every", "num_groups", "groups_per_token"):
        _check_int(section, moe, name)
    for name in ("num_experts", "num_shared_experts", "first_dense_layers"):
        _check_int(section, moe, name, minimum=0)
    _check_choice(section, moe, "routing", MOE_ROUTINGS)
    _check_number(section, moe, "routed_scale")
    if not isinstance(moe["normalize_weights"], bool):
        _fail(
            f"{section}.normalize_weights",
            moe["normalize_weights"],
            "is not a bool",
            "set True or False",
        )
    experts = moe["num_experts"]
    if experts == 0:
        return  # dense everywhere: the other fields are unused
    if moe["experts_per_token"] > experts:
        _fail(
            f"{section}.experts_per_token",
            moe["experts_per_token"],
            f"exceeds {section}.num_experts={experts}",
            f"set {section}.experts_per_token <= {experts}",
        )
    if moe["first_dense_layers"] > model["num_layers"]:
        _fail(
            f"{section}.first_dense_layers",
            moe["first_dense_layers"],
            f"exceeds model.num_layers={model['num_layers']}",
            f"set {section}.first_dense_layers <= {model['num_layers']}",
        )
    groups = moe["num_groups"]
    if experts % groups:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        _fail(
            f"{section}.num_groups",
            groups,
            f"does not divide {section}.num_experts={experts} into equal groups",
            f"set {section}.num_groups to one of {divisors}",
        )
    if moe["groups_per_token"] > groups:
        _fail(
            f"{section}.groups_per_token",
            moe["groups_per_token"],
            f"exceeds {section}.num_groups={groups}",
            f"set {section}.groups_per_token <= {groups}",
        )
    reachable = moe["groups_per_token"] * (experts // groups)
    if moe["experts_per_token"] > reachable:
        _fail(
            f"{section}.experts_per_token",
            moe["experts_per_token"],
            f"exceeds the {reachable} experts in {section}.groups_per_token="
            f"{moe['groups_per_token']} groups of {experts // groups}",
            f"set {section}.experts_per_token <= {reachable} or raise {section}.groups_per_token",
        )
    if moe["routing"] == "sigmoid" and groups > 1 and experts // groups < 2:
        _fail(
            f"{section}.num_groups",
            groups,
            f"leaves one expert per group, but {section}.routing='sigmoid' scores a group "
            "by its two best experts",
            f"set {section}.num_groups to at most {experts // 2} or 1",
        )


def _validate_mla(model: Mapping) -> None:
    mla = model["mla"]
    for name in ("kv_rank", "rope_dim", "v_head_dim", "rope_heads"):
        _check_int("model.mla", mla, name)
    _check_int("model.mla", mla, "q_rank", minimum=0)
    _check_int("model.mla", mla, "nope_dim", minimum=0)
    _check_number("model.mla", mla, "norm_eps")
    for name in ("absorb", "latent_norm"):
        if not isinstance(mla[name], bool):
            _fail(f"model.mla.{name}", mla[name], "is not a bool", "set True or False")
    if model["num_heads"] % mla["rope_heads"]:
        _fail(
            "model.mla.rope_heads",
            mla["rope_heads"],
            f"does not divide model.num_heads={model['num_heads']}",
            "set 1 (one RoPE key for all heads) or a divisor of model.num_heads",
        )
    for name in ("qkv_bias", "qk_norm"):
        if model[name]:
            _fail(
                f"model.{name}",
                True,
                "applies to grouped-query attention but model.attention='mla' has no "
                "per-head key and value projections",
                f"set model.{name}=False or model.attention='gqa'",
            )
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
    _validate_rope_pairs(model)
    if model["num_kv_heads"] != model["num_heads"]:
        _fail(
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
        _fail("model.mla.rope_pairs", pairs, "has the wrong shape", fix)
    for layer in pairs:
        for kept in layer:
            valid = all(type(i) is int and 0 <= i < available for i in kept)
            if not valid or len(set(kept)) != len(kept):
                _fail("model.mla.rope_pairs", pairs, f"holds {list(kept)!r}", fix)


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
        _check_choice("cache", cache, f"{prefix}_transform", TRANSFORMS.names())
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
    _validate_evict(cache)
    if model is not None:
        _validate_cache_for_model(cache, model)


def _validate_evict(cache: Mapping) -> None:
    evict = cache["evict"]
    section = "cache.evict"
    _check_known_fields(section, evict, base_config().cache.evict)
    _check_choice(section, evict, "method", evict_methods())
    _check_int(section, evict, "budget", minimum=0)
    _check_number(section, evict, "ratio")
    if evict["ratio"] > 1:
        _fail(f"{section}.ratio", evict["ratio"], "is above 1", "set a share in (0, 1]")
    for name in ("sinks", "obs_window", "kernel"):
        _check_int(section, evict, name)
    for name in ("recent", "seed"):
        _check_int(section, evict, name, minimum=0)
    if evict["kernel"] % 2 == 0:
        _fail(f"{section}.kernel", evict["kernel"], "is even", "set an odd width (1 = no pooling)")
    _check_number(section, evict, "pyramid_beta")
    if evict["pyramid_beta"] < 1:
        _fail(f"{section}.pyramid_beta", evict["pyramid_beta"], "is below 1", "set a number >= 1")
    _check_number(section, evict, "adakv_floor", zero_allowed=True)
    if evict["adakv_floor"] > 1:
        _fail(f"{section}.adakv_floor", evict["adakv_floor"], "is above 1", "set a share in [0, 1]")
    method = evict["method"]
    why = None if method in UNSCORED_METHODS else SCORERS.get(method).prefix_unsafe
    if why and cache["prefix_caching"]:
        _fail(
            "cache.prefix_caching",
            True,
            f"cannot combine with cache.evict.method={method!r}: {why}",
            "set cache.prefix_caching=False or another cache.evict.method",
        )


def evict_methods() -> tuple[str, ...]:
    """Every cache.evict.method: the unscored layouts, then the registered scorers."""
    return (*UNSCORED_METHODS, *SCORERS.names())


def _validate_cache_for_model(cache: Mapping, model: Mapping) -> None:
    window = model["sliding_window"]
    if window and cache["evict"]["method"] != "none":
        _fail(
            "cache.evict.method",
            cache["evict"]["method"],
            f"cannot combine with model.sliding_window={window} (the model's window already "
            "decides what its cache keeps)",
            "set cache.evict.method='none'",
        )
    used = cached_prefixes(model)
    for prefix in CACHED_PREFIXES:
        for field, unset in (("bits", 16), ("transform", "none")):
            if prefix not in used and cache[f"{prefix}_{field}"] != unset:
                _fail(
                    f"cache.{prefix}_{field}",
                    cache[f"{prefix}_{field}"],
                    f"applies to a tensor model.attention={model['attention']!r} does not cache",
                    f"set cache.{used[0]}_{field} / cache.{used[1]}_{field} instead and leave "
                    f"cache.{prefix}_{field}={unset!r}",
                )
    for tensor in cached_tensors(model):
        prefix, width, width_name = tensor.prefix, tensor.width, tensor.width_field
        transform = TRANSFORMS.get(cache[f"{prefix}_transform"])
        transform.check(width, f"cache.{prefix}_transform")
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


def complete_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Fills the fields `cfg` omits with base_config()'s defaults, in place; returns `cfg`.

    A config may leave out what does not apply to it (the model.mla section of a
    grouped-query model, cache fields it keeps at their defaults), and a run saved
    before a field joined the schema loads with that field at its default. Given
    fields are never changed; unknown ones stay, for validate_sections to refuse.
    Defaults are the tiny variant's: a config sized for an accelerator sets its sizes.
    """
    if isinstance(cfg, ml_collections.FrozenConfigDict):
        return cfg  # immutable: validate_sections names what it lacks
    with cfg.unlocked():  # a config from --config flags comes locked
        _fill(cfg, base_config())
    return cfg


def _fill(given, defaults: ml_collections.ConfigDict) -> None:
    for key, default in defaults.items():
        is_section = isinstance(default, ml_collections.ConfigDict)
        if key not in given:
            given[key] = ml_collections.ConfigDict(default.to_dict()) if is_section else default
        elif is_section and isinstance(given[key], (ml_collections.ConfigDict, Mapping)):
            _fill(given[key], default)


def validate_sections(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Completes `cfg` (complete_config) and checks every section, alone and against
    the others; returns it when valid. What the files it names hold (data.tokenizer,
    eval.tasks' samples) kvlab.data.validate_config checks after this."""
    schema = base_config()
    if isinstance(cfg, ml_collections.ConfigDict):
        complete_config(cfg)
    _check_known_fields("config", cfg, schema)
    validate_model_config(cfg.model)
    pairs = cfg.model.mla.rope_pairs
    canonical = tuple(tuple(map(tuple, layer)) for layer in pairs)
    if pairs != canonical:
        # One form for equal configs: a config.json gives lists where Python gave
        # tuples (and a field read as a list keeps converting tuples to lists).
        with cfg.unlocked():
            del cfg.model.mla["rope_pairs"]
            cfg.model.mla.rope_pairs = canonical
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
    if cfg.train.seed >= SEED_LIMIT:
        _fail(
            "train.seed",
            cfg.train.seed,
            f"does not fit a 32-bit PRNG seed (it would act as {cfg.train.seed % SEED_LIMIT})",
            f"set train.seed in 0..{SEED_LIMIT - 1}",
        )
    _check_number("train", cfg.train, "lr")
    _check_number("train", cfg.train, "clip")
    _check_number("train", cfg.train, "weight_decay", zero_allowed=True)
    init_from = cfg.train.init_from
    if not isinstance(init_from, str) or (init_from and not os.path.isdir(init_from)):
        _fail(
            "train.init_from",
            init_from,
            "is not a directory",
            "give a kvlab training workdir or a Hugging Face model directory, or '' for "
            "random weights",
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
    tokenizer = cfg.data.tokenizer
    if not isinstance(tokenizer, str):
        _fail(
            "data.tokenizer",
            tokenizer,
            "is not a string",
            "set '' (bytes) or a folder holding tokenizer.json (or the file)",
        )
    if tokenizer and cfg.data.source == "mqar":
        _fail(
            "data.tokenizer",
            tokenizer,
            "applies to text, but data.source='mqar' makes its own token ids",
            "set data.tokenizer='' or data.source='text' / 'stdlib'",
        )
    if cfg.data.source == "mqar":
        _validate_mqar(cfg)
    elif not tokenizer and cfg.model.vocab_size < BYTE_VOCAB_SIZE:  # tokens: kvlab.data
        _fail(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"is below the {BYTE_VOCAB_SIZE} byte values data.source={cfg.data.source!r} "
            "feeds the model",
            f"set model.vocab_size >= {BYTE_VOCAB_SIZE}",
        )

    validate_eval_config(cfg)

    _check_known_fields("wandb", cfg.wandb, schema.wandb)
    _check_choice("wandb", cfg.wandb, "mode", WANDB_MODES)
    validate_mesh_config(cfg)
    return cfg


def eval_seq_len(cfg: Mapping) -> int:
    """The evaluation window of a validated config: eval.seq_len, or train.seq_len when 0."""
    return cfg["eval"]["seq_len"] or cfg["train"]["seq_len"]


def validate_eval_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad field of the `eval` section: sizes, the
    window, the tasks' names. Turns the tuple fields given as lists (config.json)
    into tuples. Whether the tasks' samples fit their lengths, the model and the
    data section is kvlab.data.tasks.check_tasks' to say."""
    schema = base_config().eval
    ev = cfg.eval
    _check_known_fields("eval", ev, schema)
    _check_known_fields("eval.task_params", ev.task_params, schema.task_params)
    _check_choice("eval", ev, "split", EVAL_SPLITS)
    for name in ("batch_size", "num_batches", "chunk"):
        _check_int("eval", ev, name)
    _check_int("eval", ev, "seq_len", minimum=0)
    for name in schema.task_params:
        _check_int("eval.task_params", ev.task_params, name)
    for name in ("tasks", "task_lengths", "depths"):
        if not isinstance(ev[name], (tuple, list)):
            _fail(f"eval.{name}", ev[name], "is not a tuple", f"give a tuple, e.g. {schema[name]}")
    for task in ev.tasks:
        if not isinstance(task, str) or task not in EVAL_TASKS:
            listed = ", ".join(map(repr, EVAL_TASKS))
            _fail("eval.tasks", tuple(ev.tasks), f"holds {task!r}, not a task", f"use {listed}")
    if len(set(ev.tasks)) != len(ev.tasks):
        _fail("eval.tasks", tuple(ev.tasks), "names a task twice", "name each task once")
    for length in ev.task_lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            _fail(
                "eval.task_lengths",
                tuple(ev.task_lengths),
                f"holds {length!r}",
                "give integer lengths >= 1, e.g. (256, 512, 1024)",
            )
    for depth in ev.depths:
        number = not isinstance(depth, bool) and isinstance(depth, (int, float))
        if not number or not 0 <= depth <= 1:  # NaN fails too
            _fail(
                "eval.depths",
                tuple(ev.depths),
                f"holds {depth!r}, not a number in [0, 1]",
                "give depths from 0 (the start) to 1 (the end), e.g. (0.0, 0.5, 1.0)",
            )
    if not ev.depths and "needle" in ev.tasks:
        _fail("eval.depths", (), "is empty but eval.tasks holds 'needle'", "give depths in [0, 1]")
    # One form for equal configs (config.json gives lists where Python gave tuples).
    for name in ("tasks", "task_lengths", "depths"):
        if not isinstance(ev[name], tuple):
            value = tuple(ev[name])
            with ev.unlocked():
                del ev[name]
                ev[name] = value
    window = eval_seq_len(cfg)
    if cfg.data.source == "mqar" and 4 * cfg.data.mqar.num_pairs > window + 1:
        _fail(
            "eval.seq_len",
            ev.seq_len,
            f"gives windows of {window} tokens, but data.mqar.num_pairs={cfg.data.mqar.num_pairs} "
            f"needs {4 * cfg.data.mqar.num_pairs - 1}",
            f"set eval.seq_len >= {4 * cfg.data.mqar.num_pairs - 1} (or 0: train.seq_len)",
        )


def validate_mesh_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad field of the `mesh` section.

    What does not depend on the devices: sizes >= 1 or -1 (one at most), the
    rules, and that the sizes given split what they split evenly
    (`check_mesh_shape`). kvlab.sharding.mesh_shape checks the rest (the
    product against the device count) when a run builds its mesh.
    """
    schema = base_config().mesh
    mesh = cfg.mesh
    _check_known_fields("mesh", mesh, schema)
    for axis in MESH_AXES:
        size = mesh[axis]
        if size != -1:
            _check_int("mesh", mesh, axis)
    rest = [axis for axis in MESH_AXES if mesh[axis] == -1]
    if len(rest) > 1:
        _fail(
            f"mesh.{rest[1]}",
            -1,
            f"is the second -1 (mesh.{rest[0]}=-1 already takes the devices the others leave)",
            f"give mesh.{rest[1]} a size >= 1",
        )
    if not isinstance(mesh["distributed"], bool):
        _fail("mesh.distributed", mesh["distributed"], "is not a bool", "set True or False")
    _check_known_fields("mesh.rules", mesh["rules"], schema.rules)
    for name in schema.rules:
        mesh_axes(mesh["rules"], name)  # refuses a malformed rule
    check_mesh_shape(cfg, {axis: mesh[axis] for axis in MESH_AXES})


def mesh_axes(rules: Mapping, name: str) -> tuple[str, ...]:
    """The mesh axes rule `mesh.rules.<name>` splits a logical axis over, in order."""
    value = rules[name]
    if not isinstance(value, str):
        _fail(
            f"mesh.rules.{name}",
            value,
            "is not a string",
            f"give mesh axes separated by commas from {', '.join(MESH_AXES)}, or '' (replicated)",
        )
    axes = tuple(axis.strip() for axis in value.split(",") if axis.strip())
    for axis in axes:
        if axis not in MESH_AXES:
            _fail(
                f"mesh.rules.{name}",
                value,
                f"names {axis!r}, which is not a mesh axis",
                f"use mesh axes from {', '.join(MESH_AXES)} separated by commas, or ''",
            )
    if len(set(axes)) != len(axes):
        _fail(f"mesh.rules.{name}", value, "names a mesh axis twice", "name each axis once")
    return axes


def check_mesh_shape(cfg: Mapping, shape: Mapping[str, int]) -> None:
    """Raises ValueError when the mesh sizes `shape` (-1: not known yet, skipped)
    do not split evenly what the rules split over them: the query heads, the
    feed-forward widths and the training batch. (Key/value heads, the
    vocabulary and the model width are replicated where they do not divide:
    kvlab/sharding.py.)"""
    rules = cfg["mesh"]["rules"]
    model = cfg["model"]
    widths = [("heads", "model.num_heads", model["num_heads"])]
    widths.append(("mlp", "model.mlp_dim", model["mlp_dim"]))
    if model["moe"]["num_experts"]:
        widths.append(("mlp", "model.moe.expert_dim", model["moe"]["expert_dim"]))
    widths.append(("batch", "train.batch_size", cfg["train"]["batch_size"]))
    for logical, field, value in widths:
        axes = mesh_axes(rules, logical)
        if not axes or any(shape[axis] == -1 for axis in axes):
            continue
        split = math.prod(shape[axis] for axis in axes)
        if value % split:
            divisors = [d for d in range(1, value + 1) if value % d == 0]
            _fail(
                " * ".join(f"mesh.{axis}" for axis in axes),
                split,
                f"does not divide {field}={value}, which mesh.rules.{logical}="
                f"{rules[logical]!r} splits over "
                + ("it" if len(axes) == 1 else f"them ({', '.join(axes)})"),
                f"make it one of {divisors}, or change {field}",
            )


def _validate_mqar(cfg: ml_collections.ConfigDict) -> None:
    mqar = cfg.data.mqar
    _check_int("data.mqar", mqar, "num_pairs")
    _check_int("data.mqar", mqar, "vocab_size", minimum=4)
    _check_number("data.mqar", mqar, "power")
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


def dtype_of(name: str) -> jnp.dtype:
    """The JAX dtype a config names (see DTYPES)."""
    return jnp.dtype(DTYPES[name])


def frozen(section: Mapping) -> ml_collections.FrozenConfigDict:
    """An immutable, hashable copy of a config section (modules hold these)."""
    if isinstance(section, ml_collections.FrozenConfigDict):
        return section
    return ml_collections.FrozenConfigDict(section)
