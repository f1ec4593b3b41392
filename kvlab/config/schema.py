"""The config schema: its constants, `base_config` (every field with its default and
what it means), what each attention kind caches, and the dtypes a config names."""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from typing import NamedTuple

import jax.numpy as jnp
import ml_collections

# Names a config may use for `model.dtype`, `model.param_dtype`, `cache.dtype`
# and `cache.scale_dtype`.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

ATTENTION_KINDS = ("gqa", "mla")
MOE_ROUTINGS = ("softmax", "sigmoid")  # model.moe.routing: DeepSeek-V2, DeepSeek-V3
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # model.rope_scaling.type
CACHE_KINDS = ("dense", "paged")
# cache.evict.method: the layouts that score nothing, then the scorers
# (kvlab.registry.SCORERS: kvlab/cache/evict/scorers.py and the methods added beside it),
# each perhaps under wrappers (kvlab.registry.WRAPPERS: 'chunkkv:snapkv').
UNSCORED_METHODS = ("none", "window", "sinks")
# A composed cache.evict.method 'a+b' (kvpress's ComposedPress, scorers one after the
# other): its own options beside its scorers' (kvlab/cache/evict/scorers.py, Composed).
COMPOSED_OPTIONS = types.MappingProxyType({"share": 0.5})
EVICT_WHEN = ("every_step", "after_prefill", "decoding")  # cache.evict.when
BIT_WIDTHS = (16, 8, 4, 3, 2)  # a format stores some of them (Format.widths; 3: nf, codebook)
GROUP_AXES = ("token", "channel", "calibrated")
CACHED_PREFIXES = ("k", "v", "latent", "rope")  # cache.<prefix>_bits, _format, _axis
# A cached tensor's storage fields that quantize it, and their values when it is not;
# with the transform, those of a tensor stored as it is.
QUANTIZING = (("bits", 16), ("outliers", 0), ("rank", 0), ("full_first", 0))
UNSET = (*QUANTIZING, ("transform", "none"))
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
            sliding_sinks=0,  # with sliding_window: the first N positions stay visible to
            #                   every query of a sliding layer beside its window
            #                   (StreamingLLM's attention sinks as the layer's mask); its
            #                   ring keeps N + W slots
            layer_types=(),  # () = every layer alike (sliding when sliding_window > 0);
            #                  else one of 'full' | 'sliding' per layer: hybrid attention
            #                  (Gemma 2/3, GPT-OSS, Qwen2/3 layer_types), the sliding ones
            #                  over model.sliding_window; see layer_windows
            attention_impl="xla",  # the backend (kvlab.backends) whose kernels attend over
            #                        stored blocks and write caches: 'xla' (plain JAX, any
            #                        platform), 'pallas' (kvlab/kernels/pallas: Triton on
            #                        CUDA, Mosaic on TPU, the interpreter on CPU),
            #                        'native' (kvlab/kernels/native: C++ CPU kernels),
            #                        or one registered
            topology="layerwise",  # which cache layer each layer reads and writes
            #                       (kvlab.registry.TOPOLOGIES): 'layerwise' (its own) or
            #                       'cla:N' (N adjacent layers share one, arXiv:2405.12981)
        )
    )
    # RoPE for contexts longer than the model was trained on, as Hugging Face
    # transformers computes it (kvlab/rope.py). 'none' is plain RoPE;
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

    # What each cached tensor is stored in (kvlab/cache/quant/). Grouped-query
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
            k_bits=16,  # 16 (= cache.dtype), 8, 4, 3 (nf, codebook) or 2 bits per number
            v_bits=16,
            latent_bits=16,
            rope_bits=16,
            k_format="int",  # a storage format (kvlab/cache/formats): 'int', 'fp8' (8 bits),
            #                  'nf', 'codebook' (fitted per layer: cache.codebooks)
            v_format="int",
            latent_format="int",
            rope_format="int",
            k_axis="channel",  # scale groups: 'token' (a token's channels), 'channel' (a
            v_axis="token",  # channel's tokens; KIVI's keys) or 'calibrated' (no groups:
            #                  a static scale per KV head and channel, cache.scales)
            latent_axis="token",
            rope_axis="channel",
            group_size=16 if on_cpu else 32,  # numbers (token axis) or tokens (channel) per scale
            residual=0,  # most recent tokens kept in cache.dtype (a multiple of group_size
            #              when a tensor groups along tokens)
            symmetric=False,  # int codes without a zero point (fp8 and nf never have one)
            scale_dtype="bfloat16",  # dtype of scales and zero points
            codebooks="",  # format 'codebook': the .npz of its levels per layer (or
            #                per channel group; kvlab.eval.calibrate.save_codebooks)
            scales="",  # axis 'calibrated': the .npz of each layer's ranges per KV head
            #             and channel (kvlab.eval.calibrate.save_scales)
            k_transform="none",  # an orthogonal map applied before a tensor is stored and
            v_transform="none",  # folded into its reads: 'none', 'hadamard', 'orthogonal', ...
            latent_transform="none",  # (kvlab/cache/transforms; kvlab.registry.TRANSFORMS)
            rope_transform="none",
            k_outliers=0,  # numbers per token and KV head a quantized tensor keeps in
            v_outliers=0,  # cache.dtype with their channel beside its codes, the largest
            latent_outliers=0,  # against their range (KVQuant's dense-and-sparse split)
            rope_outliers=0,
            k_rank=0,  # a quantized tensor coded in a basis of this many directions per KV
            v_rank=0,  # head (cache.bases: fitted offline) instead of its channels, and
            latent_rank=0,  # read back through it (Palu's low-rank cache); 0 = its width
            rope_rank=0,
            bases="",  # cache.<prefix>_rank: the .npz of each layer's bases per KV head
            #            (kvlab.eval.calibrate.save_bases)
            k_full_first=0,  # the first positions of every row a quantized tensor also
            v_full_first=0,  # keeps in cache.dtype beside its codes, read exactly (KVQuant's
            latent_full_first=0,  # attention sink, IntactKV); 0 = none
            rope_full_first=0,
            # grouped-query keys coded before RoPE and turned at their positions when read
            # (KVQuant's pre-RoPE keys: a channel's scale then follows one channel); the
            # keys must be quantized, in a cache that keeps every token
            k_before_rope=False,
            # grouped-query keys: bits of a sign sketch of what their codes leave out, per
            # token and KV head (with its norm), so scores are unbiased (TurboQuant's 1-bit
            # residual, QJL); a multiple of 8, 0 = none
            k_sketch=0,
            # model.layer_types mixing 'sliding' and 'full' layers: what a sliding layer's
            # ring of model.sliding_window slots stores. 'plain': cache.dtype, whatever the
            # bits above (they and cache.evict apply to the full layers); 'as_full': the
            # storage above (bits, formats, groups, residual) as the full layers store it
            sliding_layers="plain",
        )
    )
    # Token eviction (kvlab/cache/evict/): each layer stores `budget` tokens per
    # KV head and drops the rest physically. 'none' is the full cache.
    cfg.cache.evict = ml_collections.ConfigDict(
        dict(
            method="none",  # none|window|sinks, or a scorer: h2o|snapkv|pyramidkv|adakv|knorm|
            #                 random|tova|... (kvlab.config.evict_methods()), or wrappers over
            #                 a scorer ('chunkkv:snapkv'; kvlab.registry.WRAPPERS)
            budget=0,  # tokens kept per KV head and layer; 0 = ceil(ratio x max_len)
            ratio=1.0,  # with budget 0: the share of the cache's max_len kept, in (0, 1]
            sinks=4,  # 'sinks': the first tokens, always kept (StreamingLLM)
            recent=8,  # score-based methods: the most recent tokens, always kept
            obs_window=8,  # snapkv, pyramidkv, adakv: last queries of a step that score
            kernel=5,  # snapkv, pyramidkv, adakv: max-pool width over neighbouring tokens (odd)
            pyramid_beta=20.0,  # pyramidkv: the last layer keeps 1/beta of the mean budget
            adakv_floor=0.2,  # adakv: each head keeps at least this share of budget
            # scored methods: a head that overflows evicts interval - 1 tokens more than
            # the step needs, so the next interval - 1 steps append unscored; 1 = every
            # step keeps the best budget. when='decoding': the decode steps between
            # compressions (kvpress's DecodingPress compression_interval). 0 = the
            # method's own: 1 where its definition evicts every step (h2o, tova,
            # duo_attention), else budget/16 tokens, at most 64 (policy.method_interval)
            interval=0,
            # when scored methods evict: 'every_step' (every step's write keeps the budget),
            # 'after_prefill' (kvpress's protocol: the step given compress=True, e.g.
            # the prompt's prefill, keeps the best budget of the context, floor(ratio x its
            # length) with budget 0; the next `headroom` tokens then append unscored) or
            # 'decoding' (kvpress's DecodingPress: the prefill is stored whole, and every
            # `interval` decode steps a row compresses back to the budget, its target_size)
            when="every_step",
            # after_prefill: tokens a row adds after it (question, answer); decoding: tokens
            # a prompt may exceed the budget by and still be stored whole
            headroom=0,
            seed=0,  # random: which tokens
            # the method's own options (each scorer's and wrapper's `defaults`, e.g.
            # {'pooling': 'mean'} for snapkv, {'lag_size': 64} for lagkv); omitted ones
            # keep their defaults
            options=ml_collections.ConfigDict(),
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
    prefix: str  # its storage fields: cache.<prefix>_bits, _format, _axis, ...
    heads: int
    width: int
    width_field: str  # the model field that sets the width (for error messages)


@functools.cache
def frozen_schema() -> ml_collections.FrozenConfigDict:
    """base_config()'s fields, built once and immutable: what validation checks a
    config's fields against (building base_config takes about 3 ms, and one
    validation asked for it ten times)."""
    return ml_collections.FrozenConfigDict(base_config())


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


LAYER_TYPES = ("full", "sliding")  # model.layer_types entries
SLIDING_LAYERS = ("plain", "as_full")  # cache.sliding_layers


def layer_windows(model: Mapping) -> tuple[int, ...]:
    """Each model layer's attention window: model.sliding_window where the layer
    slides (every layer without model.layer_types), 0 (full causal attention) elsewhere."""
    types = model.get("layer_types") or ("sliding",) * model["num_layers"]
    return tuple(model["sliding_window"] if kind == "sliding" else 0 for kind in types)


def is_hybrid(model: Mapping) -> bool:
    """Whether the model's layers mix windowed and full attention (model.layer_types)."""
    return len(set(layer_windows(model))) > 1


def cached_prefixes(model: Mapping) -> tuple[str, str]:
    """The storage-field prefixes of the two tensors `model` caches: (k, v) or (latent, rope)."""
    first, second = cached_tensors(model)
    return first.prefix, second.prefix


def dtype_of(name: str) -> jnp.dtype:
    """The JAX dtype a config names (see DTYPES)."""
    return jnp.dtype(DTYPES[name])
