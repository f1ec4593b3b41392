"""A Llama-style decoder-only transformer that threads an explicit KV cache.

Embedding -> num_layers x (RMSNorm, attention, residual, RMSNorm, SwiGLU MLP,
residual) -> RMSNorm -> logits (tied to the embedding or a separate matrix).
Llama (arXiv:2302.13971); SwiGLU (arXiv:2002.05202). With model.moe.num_experts
> 0, layers from model.moe.first_dense_layers on replace the MLP by DeepSeek's
mixture of experts (kvlab/moe.py).

    model = Transformer(cfg.model)
    logits, cache = model.apply({"params": p}, tokens, cache=cache, num_tokens=None)
    logits, None  = model.apply({"params": p}, tokens)        # plain causal forward

tokens int32[B, T]; logits float32[B, T, V]. With a cache, row b's tokens are
appended after its `cache.lengths[b]` tokens and take the positions that
follow; `num_tokens int32[B]` (default T) says how many of row b's T tokens are
real, the rest being right padding that is neither written nor counted.
Without a cache num_tokens changes nothing: causal attention never looks at the
padding that follows a row's real tokens (its own logits are meaningless).
The model refuses, before anything runs, a cache built for another model
(layer count, cached tensors and their shapes, dtypes). Called outside jit it
also checks its inputs' values (token ids, num_tokens, capacity) and raises
ValueError. Inside jit values cannot raise: a row given a token id outside the
vocabulary, num_tokens outside 0..T or a negative length is flagged in
`cache.errors`, nothing is written for it and its logits are NaN; a row given
more tokens than fit is flagged and keeps a length above the capacity. Host
loops call `cache.check()` (docs/architecture.md, "Invalid values inside compiled code").
Without a cache, rows with an invalid id get NaN logits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from ml_collections import FrozenConfigDict

from kvlab import backends, sharding
from kvlab.attention.gqa import GroupedQueryAttention
from kvlab.attention.mla import MultiHeadLatentAttention
from kvlab.cache import topology
from kvlab.cache.dense import BAD_COUNT, BAD_TOKEN, OVERFLOW, Cache
from kvlab.cache.evict import EvictingLayer, PagedEvictingLayer, model_ring
from kvlab.cache.placement import Placement, place_without_cache, stored_end
from kvlab.cache.quant import QuantizedTensor
from kvlab.config import cached_tensors, frozen, layer_windows, validate_model_config
from kvlab.layers import Embedding, RMSNorm, logical_axes, projection
from kvlab.moe import MLP, MoE, uses_experts

EVICTING = (EvictingLayer, PagedEvictingLayer)  # layers whose budgets may differ by layer


class Block(nn.Module):
    """Pre-norm residual block: attention then the feed-forward (the MLP, or
    the mixture of experts where `uses_experts(config, index)`). `produces` and
    `commits` place it in its run of a cross-layer topology (the attention
    modules' fields, kvlab/cache/topology)."""

    config: FrozenConfigDict
    index: int = 0  # the layer's place in the stack
    produces: bool = True
    commits: bool = True

    @nn.compact
    def __call__(self, x, placement: Placement, layer):
        role = dict(produces=self.produces, commits=self.commits, name="attention")
        if self.config.attention == "mla":
            attention = MultiHeadLatentAttention(self.config, self.index, **role)
        else:
            attention = GroupedQueryAttention(self.config, **role)
        h, layer = attention(RMSNorm(self.config, name="attention_norm")(x), placement, layer)
        x = x + h
        feed_forward = MoE if uses_experts(self.config, self.index) else MLP
        x = x + feed_forward(self.config, name="mlp")(RMSNorm(self.config, name="mlp_norm")(x))
        return x, layer


def _is_concrete(*arrays) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def check_inputs(config, tokens, cache: Cache | None, num_tokens, probes=None) -> None:
    """Raises ValueError for inputs the model cannot run on.

    Shape checks always run; value checks (token ids, lengths, capacity) run
    when the values are concrete, i.e. outside jit. `probes`: a probing cache's
    `compress` (int32: each row's context length, its tokens past it not held,
    Placement.context).
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens has shape {tokens.shape}: pass int32[batch, length]")
    batch, length = tokens.shape
    if length == 0 or batch == 0:
        raise ValueError(f"tokens has shape {tokens.shape}: pass at least one token per row")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens has dtype {tokens.dtype}: pass integer token ids")
    if num_tokens is not None and num_tokens.shape != (batch,):
        raise ValueError(
            f"num_tokens has shape {num_tokens.shape}: pass one count per row, shape ({batch},)"
        )
    if cache is not None:
        check_cache(config, cache)
        if cache.batch_size != batch:
            raise ValueError(
                f"tokens has batch size {batch} but the cache holds {cache.batch_size} rows: "
                f"init the cache with batch_size={batch}"
            )
    if not _is_concrete(tokens):
        return
    ids = sharding.fetch(tokens)  # every row, whichever host holds it
    bad = (ids < 0) | (ids >= config.vocab_size)
    if bad.any():
        row, col = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"tokens[{row}, {col}]={int(ids[row, col])} is outside the vocabulary "
            f"0..{config.vocab_size - 1} (model.vocab_size={config.vocab_size})"
        )
    counts = np.full((batch,), length) if num_tokens is None else None
    if num_tokens is not None and _is_concrete(num_tokens):
        counts = sharding.fetch(num_tokens)
        if ((counts < 0) | (counts > length)).any():
            raise ValueError(
                f"num_tokens={counts.tolist()} must lie in 0..{length} (the tokens' length)"
            )
    if cache is not None and counts is not None and _is_concrete(cache.lengths):
        after = np.asarray(cache.lengths) + counts
        given = None if probes is None else jnp.asarray(probes)
        if given is not None and jnp.issubdtype(given.dtype, jnp.integer) and _is_concrete(given):
            context = np.broadcast_to(sharding.fetch(given), after.shape)
            after = np.asarray(stored_end(np.asarray(cache.lengths), counts, context))
        if (after > cache.capacity).any():
            row = int(np.argmax(after > cache.capacity))
            raise ValueError(
                f"row {row} would hold {int(after[row])} tokens but the cache holds "
                f"{cache.capacity} (max_len): init the cache with max_len >= {int(after.max())}"
            )


def check_cache(config, cache: Cache) -> None:
    """Raises ValueError unless `cache` was built for this model: one layer per
    cache layer of its topology (kvlab/cache/topology), each caching what the
    model's attention caches (names, heads, widths), a sliding layer's a ring of
    its window, the layers of each kind (a hybrid model's sliding and full ones)
    alike (structure, shapes, dtypes). Shapes are static, so this also runs under jit."""
    fix = "build the cache with kvlab.init_cache(cfg.model, cfg.cache, ...) for this model"
    expected = cached_tensors(config)
    if tuple(cache.tensors) != expected:
        show = lambda ts: ", ".join(f"{t.name} {t.heads}x{t.width}" for t in ts)  # noqa: E731
        raise ValueError(
            f"the cache holds ({show(cache.tensors)}) per token and layer but this model "
            f"(model.attention={config.attention!r}) caches ({show(expected)}): {fix}"
        )
    expected_layers = topology.num_cache_layers(config)
    if len(cache.layers) != expected_layers:
        shared = "" if expected_layers == config.num_layers else (
            f" under model.topology={config.topology!r}, which caches {expected_layers}"
        )  # fmt: skip
        raise ValueError(
            f"the cache has {len(cache.layers)} layers but model.num_layers="
            f"{config.num_layers}{shared}: {fix}"
        )
    joint = topology.joint_layers(config)
    for i, layer in enumerate(cache.layers):
        if (i in joint) != bool(getattr(layer, "joint", False)):
            raise ValueError(
                f"cache layer {i} is {'not ' if i in joint else ''}one the model's topology "
                f"(model.topology={config.topology!r}) builds to store a run of layers: {fix}"
            )
    windows = topology.cache_windows(config)
    for i, (layer, window) in enumerate(zip(cache.layers, windows, strict=True)):
        policy = getattr(layer, "policy", None)
        ring = None if policy is None else (policy.method, policy.sinks, policy.span)
        if window and ring != model_ring(config, policy.max_len if policy else 0):
            raise ValueError(
                f"cache layer {i} is not a ring of the model's window: the model's layer "
                f"slides over model.sliding_window={window} positions (and keeps "
                f"model.sliding_sinks={config.sliding_sinks}): {fix}"
            )
    # Evicting layers may keep different budgets (pyramidkv): their slot axis may differ.
    slotted = lambda x, first: x.shape[:2] + x.shape[3:] if isinstance(first, EVICTING) else x.shape  # noqa: E731

    def structure(layer):  # an evicting layer's policy names its layer: compare the arrays
        layer = jax.tree.map(_untabled, layer, is_leaf=lambda x: isinstance(x, QuantizedTensor))
        if hasattr(layer, "alike"):  # a topology's own layer, without what differs by run
            layer = layer.alike()
        if isinstance(layer, EVICTING):
            arrays = layer.pools if isinstance(layer, PagedEvictingLayer) else layer.tensors
            state = (layer.positions, layer.scores, layer.weights)
            return type(layer), jax.tree.structure((arrays, *state))
        return jax.tree.structure(layer)

    for i, layer in enumerate(cache.layers):
        if layer.tensor_shapes() != tuple((t.heads, t.width) for t in expected):
            raise ValueError(
                f"cache layer {i} stores (heads, width) {layer.tensor_shapes()} but the "
                f"cached tensors are {[(t.heads, t.width) for t in expected]}: {fix}"
            )
        # Layers of one kind (a hybrid model's sliding and full layers, a topology's
        # joint ones and the others differ) are alike.
        j = next(
            k for k in range(i + 1) if windows[k] == windows[i] and (k in joint) == (i in joint)
        )
        first = cache.layers[j]
        same = structure(layer) == structure(first) and [
            (slotted(x, first), x.dtype) for x in jax.tree.leaves(first)
        ] == [(slotted(x, first), x.dtype) for x in jax.tree.leaves(layer)]
        if not same:
            raise ValueError(
                f"cache layer {i} differs from layer {j} in structure, shape or dtype: {fix}"
            )


def _untabled(x):
    """A quantized tensor without its layer's levels, ranges and basis (Storage.table:
    a codebook fitted per layer; Storage.ranges: calibrated scales; Storage.basis),
    which are all that may differ between layers."""
    if isinstance(x, QuantizedTensor):
        return x.replace(spec=dataclasses.replace(x.spec, table=(), ranges=(), basis=()))
    return x


def flag_invalid(config, tokens, cache: Cache, num_tokens, context=None):
    """What a compiled step does with invalid values: (tokens, num_tokens, errors, invalid).

    Rows with a real token outside the vocabulary, num_tokens outside 0..T or
    a negative length are `invalid`: they take num_tokens 0 (nothing is
    written) and token 0 in place of every id (no garbage reaches the
    arithmetic); their bits are added to the cache's error flags, as is
    OVERFLOW for rows given more tokens than the capacity holds (a probing
    row's `context`: its tokens past it are not held, Placement.context).
    """
    length = tokens.shape[1]
    real = jnp.arange(length)[None, :] < num_tokens[:, None]
    bad_id = (tokens < 0) | (tokens >= config.vocab_size)
    bad_token = jnp.any(bad_id & real, axis=1)
    bad_count = (num_tokens < 0) | (num_tokens > length) | (cache.lengths < 0)
    invalid = bad_token | bad_count
    num_tokens = jnp.where(invalid, 0, num_tokens)
    overflow = stored_end(cache.lengths, num_tokens, context) > cache.capacity
    errors = (
        cache.errors
        | jnp.where(bad_token, BAD_TOKEN, 0)
        | jnp.where(bad_count, BAD_COUNT, 0)
        | jnp.where(overflow, OVERFLOW, 0)
    )
    return jnp.where(bad_id, 0, tokens), num_tokens, errors.astype(jnp.int32), invalid


class Transformer(nn.Module):
    """The decoder; `config` is the model section of a kvlab config."""

    config: Mapping

    def __post_init__(self):
        validate_model_config(self.config)
        # A hashable, immutable copy, so the module can be a static jit argument.
        object.__setattr__(self, "config", frozen(self.config))
        super().__post_init__()

    @nn.compact
    def __call__(
        self, tokens, cache: Cache | None = None, num_tokens=None, logits_at=None, compress=None
    ):
        """Logits float32[B, T, V] (and the cache). `logits_at` int32[B]: only the
        logits after each row's token at that index, [B, 1, V] (generation needs
        the last prompt token's alone; the output projection of every position
        would cost more than the rest of a long prompt's prefill). `compress`
        (bool or bool[B]): these rows' context ends with this step, so a cache with
        cache.evict.when='after_prefill' compresses them after it (others ignore it);
        int32[B]: each row's whole context length (0: no compression), its target
        taken of that many tokens, so a context prefilled in blocks is compressed
        after each block to what the whole keeps (kvpress's BlockPress, KeyDiff's
        block-wise prefill: no row ever holds more than its target and a block).
        Over a cache that probes (KVzip), a row's tokens past its context are its
        probes: they attend and score the context, and are not stored; the row's
        length ends at the context (Placement.context).
        The forward runs under the backend model.attention_impl names
        (kvlab.backends.running)."""
        with backends.running(backends.get(self.config.attention_impl)):
            return self._forward(tokens, cache, num_tokens, logits_at, compress)

    @nn.nowrap  # part of the compact __call__: its submodules are the model's
    def _forward(self, tokens, cache, num_tokens, logits_at, compress=None):
        cfg = self.config
        probing = cache is not None and cache.probes and compress is not None
        check_inputs(cfg, tokens, cache, num_tokens, compress if probing else None)
        batch, length = tokens.shape
        compress, context = _compression(compress, batch)
        probes = context if probing else None
        if cache is None:
            # Each window's band (a hybrid model's sliding and full layers differ).
            placement = {
                w: place_without_cache(batch, length, w, cfg.sliding_sinks if w else 0)
                for w in set(layer_windows(cfg))
            }
            layers = (None,) * topology.num_cache_layers(cfg)
            invalid = jnp.any((tokens < 0) | (tokens >= cfg.vocab_size), axis=1)
            tokens = jnp.where(invalid[:, None], 0, tokens)
        else:
            if num_tokens is None:
                num_tokens = jnp.full((batch,), length, jnp.int32)
            num_tokens = num_tokens.astype(jnp.int32)
            if probing and context is None:
                raise ValueError(
                    "compress=True over a cache that scores a context by the probes fed "
                    "after it (cache.evict.method='kvzip'): feed each context, then its "
                    "probes (Scorer.probe_tokens), with compress=int32 context lengths, as "
                    "kvlab.eval.benchmark does"
                )
            tokens, num_tokens, errors, invalid = flag_invalid(
                cfg, tokens, cache, num_tokens, probes
            )
            placement = cache.place(length, num_tokens)
            if compress is not None:
                placement = placement._replace(compress=compress, context=context)
            layers = cache.layers

        embed = Embedding(cfg, name="embed")
        x = embed(tokens)  # [B, T, D]
        # Each run of model layers that share a cache layer (kvlab/cache/topology):
        # the first reads it, each attends, the last writes it (a joint run's layers
        # each read it as theirs, and the last writes every layer's tokens).
        owner, windows = topology.cache_layers(cfg), layer_windows(cfg)
        new_layers, state = [], None
        for i, c in enumerate(owner):
            first = i == 0 or owner[i - 1] != c
            produces = topology.produces(cfg, i)
            commits = i == len(owner) - 1 or owner[i + 1] != c
            block = Block(cfg, i, produces, commits, name=f"block_{i}")
            # With a cache, a sliding layer's ring bands its reads itself (kvlab/cache/evict/).
            placed = placement[windows[i]] if cache is None else placement
            # Without a cache, a joint run's layers each attend over their own tokens.
            given = layers[c] if first or (produces and cache is None) else state
            x, state = block(x, placed, given)
            if commits:
                new_layers.append(state)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)
        x = RMSNorm(cfg, name="final_norm")(x)
        if cfg.tie_embeddings:
            logits = embed(x, head=True)
        else:
            logits = projection(cfg, cfg.vocab_size, "unembed", axes=("embed", "vocab"))(x)
        logits = logits.astype(jnp.float32)  # [B, T, V]
        logits = jnp.where(invalid[:, None, None], jnp.nan, logits)
        if cache is None:
            return logits, None
        lengths = stored_end(cache.lengths, num_tokens, probes)
        return logits, cache.replace(layers=tuple(new_layers), lengths=lengths, errors=errors)


def _compression(compress, batch: int):
    """Transformer's `compress` as (bool[B] rows that compress, int32[B] their whole
    context's length or None), or (None, None)."""
    if compress is None:
        return None, None
    compress = jnp.asarray(compress)
    if jnp.issubdtype(compress.dtype, jnp.integer):
        context = jnp.broadcast_to(compress.astype(jnp.int32), (batch,))
        return context > 0, context
    return jnp.broadcast_to(compress.astype(bool), (batch,)), None


def init_params(model_cfg: Mapping, key: jax.Array):
    """Randomly initialised parameters for `Transformer(model_cfg)`."""
    model = Transformer(model_cfg)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.jit(model.init)(key, tokens)["params"]


def param_axes(model_cfg: Mapping) -> dict:
    """The logical axis names of every parameter of `Transformer(model_cfg)`: a tree
    shaped like its params of PartitionSpec (one name or None per dimension).

    Read from the names the layers give their initialisers (kvlab.layers.logical,
    flax's nn.with_logical_partitioning) by tracing init inside
    kvlab.layers.logical_axes(); a parameter without them is replicated.
    Nothing is allocated."""
    return _param_axes(frozen(model_cfg))


@functools.cache
def _param_axes(model_cfg: FrozenConfigDict) -> dict:
    model = Transformer(model_cfg)
    tokens = jnp.zeros((1, 1), jnp.int32)
    with logical_axes():
        # A fresh function, so no trace cached for model.init stands in for this one.
        boxed = jax.eval_shape(lambda key: model.init(key, tokens), jax.random.key(0))["params"]

    def axes(path, leaf):
        if isinstance(leaf, nn.Partitioned):
            return leaf.get_partition_spec()
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(
        axes, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )


def fuse_projections(params: Mapping) -> dict:
    """`params` with each attention's query, key and value kernels in one `qkv`
    kernel [D, K, G + 2, H] (for each key/value head its G query heads, its
    key, its value) and each SwiGLU's gate and up kernels in one `gate_up`
    kernel [D, 2, F] (biases alike); everything else is kept.

    The same model computes the same function from either tree with one
    product where there were three (two): fewer, larger weight reads, which
    is what a memory-bound decode step is made of. Convert once at load and
    drop the unfused tree; place_params lays a fused tree out like the
    unfused one (the K/V-head and mlp axes stay sharded). `unfuse_projections`
    gives back the tree init_params, load_hf, the checkpoints and the
    conversions use; save_hf, kvlab.checkpoints.convert and train.start_workdir
    take either. A tree of PartitionSpecs (param_axes) is fused alike; a fused
    tree comes back as it is."""

    def heads(q, k, v):
        if isinstance(k, PartitionSpec):  # [.., K, H] -> [.., K, None, H]
            return PartitionSpec(*k[:-1], None, k[-1])
        if q.shape[-2] % k.shape[-2] or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"query {q.shape}, key {k.shape} and value {v.shape} do not fuse: the query "
                "heads must be a multiple of the key/value heads, of the same width; pass "
                "the tree init_params or load_hf made"
            )
        grouped = q.reshape(*k.shape[:-1], -1, k.shape[-1])  # [.., N, H] -> [.., K, G, H]
        return jnp.concatenate([grouped, k[..., None, :], v[..., None, :]], axis=-2)

    def pair(gate, up):
        if isinstance(gate, PartitionSpec):
            return PartitionSpec(*gate[:-1], None, gate[-1])
        return jnp.stack([gate, up], axis=-2)

    def fuse(node):
        if not isinstance(node, Mapping):
            return node
        node = {name: fuse(child) for name, child in node.items()}
        if {"query", "key", "value"} <= node.keys():
            q, k, v = (
                _kernels(node.pop(name), "fuse_projections") for name in ("query", "key", "value")
            )
            node["qkv"] = {name: heads(q[name], k[name], v[name]) for name in q}
        if {"gate", "up"} <= node.keys() and isinstance(node["gate"], Mapping):  # not MoE's experts
            gate, up = (_kernels(node.pop(name), "fuse_projections") for name in ("gate", "up"))
            node["gate_up"] = {name: pair(gate[name], up[name]) for name in gate}
        return node

    return fuse(params)


def unfuse_projections(params: Mapping) -> dict:
    """The inverse of `fuse_projections`: separate query/key/value and gate/up
    kernels (the tree init_params makes); an unfused tree comes back as it is.
    A plug-in's decode layout is refused (`_kernels`)."""

    def unfuse(node):
        if not isinstance(node, Mapping):
            return node
        node = {name: unfuse(child) for name, child in node.items()}
        if "qkv" in node:
            qkv = _kernels(node.pop("qkv"), "unfuse_projections")  # [..., K, G + 2, H]
            groups = qkv["kernel"].shape[-2] - 2
            node["query"], node["key"], node["value"] = {}, {}, {}
            for name, array in qkv.items():
                q = array[..., :groups, :]
                node["query"][name] = q.reshape(*q.shape[:-3], -1, q.shape[-1])
                node["key"][name] = array[..., groups, :]
                node["value"][name] = array[..., groups + 1, :]
        if "gate_up" in node:
            gate_up = _kernels(node.pop("gate_up"), "unfuse_projections")  # [..., 2, F]
            node["gate"] = {name: array[..., 0, :] for name, array in gate_up.items()}
            node["up"] = {name: array[..., 1, :] for name, array in gate_up.items()}
        return node

    return unfuse(params)


def _kernels(projection: Mapping, use: str) -> Mapping:
    """A projection's parameters when they are a kernel (and a bias), as
    init_params lays them out; ValueError naming `use` otherwise (a plug-in's
    decode layout, e.g. kvlab.kernels.native.panel_projections, is one way)."""
    if (
        not isinstance(projection, Mapping)
        or "kernel" not in projection
        or (set(projection) - {"kernel", "bias"})
    ):
        found = sorted(projection) if isinstance(projection, Mapping) else projection
        raise ValueError(
            f"{use} takes the parameter tree of kvlab.init_params, whose projections hold a "
            f"kernel (and a bias), not {found}: a plug-in's decode layout (e.g. "
            "kvlab.kernels.native.panel_projections) is one way; pass the tree it was made from"
        )
    return projection
