"""Cache bytes: the analytic count and the measured one, which must agree.

    cache_bytes(model_cfg, cache_cfg, batch_size, seq_len) -> int   (analytic)
    tree_bytes(tree) -> int                                         (measured)
    cache_bytes(..., per_device=True, mesh=mesh) == tree_bytes(init_cache(..., mesh=mesh),
                                                               per_device=True)

The analytic count follows the formula every KV-cache paper uses (docs/references.md):
2 (K and V) x layers x kv_heads x head_dim x seq_len x batch x bytes per element;
latent attention stores (kv_rank + rope_dim) numbers per token and layer instead
(DeepSeek-V2, arXiv:2405.04434). A quantized cache counts, per tensor, its
packed payload (bits / 8 bytes a number), one scale (and zero point) per group
(none for scales calibrated offline: they are the program's constants, like a
codebook's levels), the full-precision ring of recent tokens and the first
positions of a row kept in full precision beside the codes, laid out as kvlab/cache/quant/
describes. A paged cache counts its page pools (num_pages x page_size token
rows, shared by the rows) and each row's ring instead. An evicting cache
counts its budget slots (kvlab/cache/evict/), and per slot an int32 position
(and h2o's float32 score, criticalkv's float32 weight) unless it is a ring;
keys pruned of channels (ThinK) count their kept channels and an int32 id per
kept channel, row and KV head;
a cache whose quantized tokens settle in groups (a residual, per-channel
scales) counts slots of g tokens, its ring and (h2o) a float32 score per ring
slot. A hybrid model (model.layer_types) counts each kind of layer as its
section stores it (kvlab.config.layer_sections: a sliding layer's ring of the
window, in cache.dtype unless cache.sliding_layers='as_full'). Plus the
bookkeeping the cache carries: one int32 length and one int32
of error flags per row
(ROW_BYTES) and, paged, the block tables.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from kvlab import sharding
from kvlab.cache import evict, paged, topology
from kvlab.cache.quant import quantized_layout, storages
from kvlab.config import (
    cached_prefixes,
    cached_tensors,
    dtype_of,
    is_hybrid,
    layer_sections,
    validate_cache_config,
    validate_model_config,
)

ROW_BYTES = 4 + 4  # per row: an int32 length and int32 error flags
TABLE_ENTRY_BYTES = 4  # paged: one int32 page id per row and page
SLOT_BYTES = 4  # evicting caches (scored methods): the int32 position of each slot's token
SCORE_BYTES = 4  # a scorer that keeps: the float32 each slot carries (h2o's attention)
WEIGHT_BYTES = 4  # a scorer that weighs: the float32 weight each slot carries (criticalkv)
CHANNEL_BYTES = 4  # pruned keys (ThinK): the int32 id of each kept channel per row and KV head
COUNT_BYTES = 4  # cache.evict.when='decoding': the int32 decode steps per row since it compressed
# A decoding layer's query buffer (evict.QueryBuffer): per row and buffered token, the int32
# position, and per query head its vector as it meets the keys and before RoPE (cache.dtype).
BUFFERED_BYTES = 4


def cache_bytes(
    model_cfg: Mapping,
    cache_cfg: Mapping,
    batch_size: int,
    seq_len: int,
    *,
    per_device: bool = False,
    mesh: Mesh | Mapping[str, int] | None = None,
    rules: tuple | None = None,
) -> int:
    """Bytes a cache of `batch_size` rows and capacity `seq_len` occupies.

    With per_device=True, the bytes one device of `mesh` (a Mesh, or its axis
    sizes {'data': ., 'fsdp': ., 'tensor': .}) holds of the cache
    `init_cache(..., mesh=mesh, rules=rules)` lays out: rows split over
    `cache_batch`, each tensor's heads over `cache_heads`, pool pages over
    `cache_pages`, each only where the split divides (kvlab.sharding.fit).
    """
    validate_model_config(model_cfg)
    validate_cache_config(cache_cfg, model_cfg)
    if per_device and mesh is None:
        raise ValueError(
            "cache_bytes(per_device=True) needs the mesh: pass mesh=a jax Mesh or its "
            "axis sizes, e.g. {'data': 2, 'fsdp': 1, 'tensor': 4}"
        )
    split = lambda logical, size: 1  # noqa: E731
    if per_device:
        rules = sharding.axis_rules() if rules is None else rules
        split = lambda logical, size: sharding.pieces(logical, size, mesh, rules)  # noqa: E731
    rows_held = batch_size // split("cache_batch", batch_size)  # rows on one device
    # Each kind of layer (a hybrid model's sliding and full ones) as its own sections.
    windows = topology.cache_windows(model_cfg)
    joint = topology.joint_layers(model_cfg)  # built by the topology: counted by it
    layers = sum(
        _layers_bytes(
            m,
            c,
            [i for i, x in enumerate(windows) if x == w and i not in joint],
            batch_size,
            seq_len,
            split,
        )
        for w, (m, c) in layer_sections(model_cfg, cache_cfg).items()
    )
    if joint:
        shape, arg = topology.parse(model_cfg["topology"])
        each = shape.layer_bytes(arg, model_cfg, cache_cfg, rows_held, seq_len, split)
        layers += len(joint) * each
    return layers + ROW_BYTES * rows_held


def _layers_bytes(model_cfg, cache_cfg, layers: list, batch_size: int, seq_len: int, split) -> int:
    """The cache layers `layers` of a model whose layers are alike, and its block tables."""
    layout = quantized_layout(model_cfg, cache_cfg, seq_len)
    tensors = [
        (t._replace(heads=t.heads // split("cache_heads", t.heads)), spec)
        for t, spec in zip(cached_tensors(model_cfg), storages(model_cfg, cache_cfg), strict=True)
    ]
    rows_held = batch_size // split("cache_batch", batch_size)  # rows on one device
    ring = 0 if layout is None else layout.ring_len
    rows = seq_len if layout is None else layout.payload_len
    plan = evict.policies(model_cfg, cache_cfg, seq_len)
    # Token rows each tensor stores: a row's S (or P settled) tokens, or a page pool.
    if plan is not None:
        plan = [p for p in plan if p.layer in layers]
        return _evicting_bytes(plan, tensors, cache_cfg, batch_size, rows_held, split)
    if cache_cfg["kind"] == "paged":
        pages = paged.pool_size(cache_cfg, batch_size, seq_len)
        pooled = pages // split("cache_pages", pages) * cache_cfg["page_size"]
        per_layer = sum(_tensor_bytes(spec, t.heads, t.width, pooled, 0) for t, spec in tensors)
        per_layer += rows_held * sum(
            _tensor_bytes(spec, t.heads, t.width, 0, ring, spec.first_rows(rows))
            for t, spec in tensors
        )
        tables = rows_held * paged.pages_per_row(cache_cfg, seq_len) * TABLE_ENTRY_BYTES
    else:
        per_layer = rows_held * sum(
            _tensor_bytes(s, t.heads, t.width, rows, ring, s.first_rows(rows)) for t, s in tensors
        )
        tables = 0
    return len(layers) * per_layer + tables


def _evicting_bytes(plan, tensors, cache_cfg: Mapping, batch_size: int, rows_held: int, split):
    """The layers and block tables of an evicting cache (`plan`: its policies):
    budget slots per storage head, and per slot a position (and a score)."""
    per_layer, tables = 0, 0
    if cache_cfg["kind"] == "paged":  # the slots live in pages
        row_slots = max(p.rows for p in plan)
        pages = paged.pool_size(cache_cfg, batch_size, row_slots)
        pooled = pages // split("cache_pages", pages) * cache_cfg["page_size"]
        tables = rows_held * paged.pages_per_row(cache_cfg, row_slots) * TABLE_ENTRY_BYTES
    for policy in plan:
        stored = [(spec, 1 if policy.pooled else t.heads, t.width) for t, spec in tensors]
        if policy.key_channels:  # pruned keys: their kept channels, and an int32 index of them
            spec, heads, _ = stored[0]
            stored[0] = (spec, heads, policy.key_channels)
            per_layer += rows_held * heads * policy.key_channels * CHANNEL_BYTES
        if cache_cfg["kind"] == "paged":
            per_layer += sum(_tensor_bytes(s, h, w, pooled, 0) for s, h, w in stored)
        else:  # slots (settling: of g payload rows each) per storage head
            per_layer += rows_held * sum(
                _tensor_bytes(s, h, w, policy.rows, 0) for s, h, w in stored
            )
        keeps = policy.keeps  # a float32 per slot
        if policy.settles:  # a ring per row and KV head (+ what the scorer keeps per slot)
            ring = policy.layout.ring_len
            per_layer += rows_held * sum(
                _tensor_bytes(s, t.heads, t.width, 0, ring) for t, s in tensors
            )
            if keeps:
                kv_heads = policy.kv_heads // split("cache_heads", policy.kv_heads)
                per_layer += rows_held * kv_heads * ring * SCORE_BYTES
        if not policy.ring:
            heads = evict.storage_heads(policy)
            heads //= split("cache_heads", heads)
            per_slot = SLOT_BYTES + (SCORE_BYTES if keeps else 0)
            per_slot += WEIGHT_BYTES if policy.weighs else 0
            per_layer += rows_held * heads * policy.slots * per_slot
        if policy.decodes:
            per_layer += rows_held * COUNT_BYTES
        if policy.buffers:
            keys = tensors[0][0]
            vectors = keys.heads * (policy.query_heads // policy.kv_heads) * keys.width
            element = dtype_of(cache_cfg["dtype"]).itemsize
            per_layer += rows_held * policy.buffers * (BUFFERED_BYTES + 2 * vectors * element)
    return per_layer + tables


def _tensor_bytes(spec, heads: int, width: int, rows: int, ring: int, first: int = 0) -> int:
    """One cached tensor: `rows` stored tokens (`Storage.stored_bytes`), `ring` tokens
    in full precision and a row's `first` positions kept in it beside the codes."""
    element = dtype_of(spec.dtype).itemsize
    return heads * ((ring + first) * width * element + spec.stored_bytes(rows, width))


def stored_bits(cache_cfg: Mapping, prefix: str) -> int:
    """The bits each number of cached tensor `prefix` is stored in: cache.<prefix>_bits
    when quantized, else the width of cache.dtype (32 for float32, 16 for bfloat16)."""
    bits = cache_cfg[f"{prefix}_bits"]
    return bits if bits < 16 else dtype_of(cache_cfg["dtype"]).itemsize * 8


def bits_label(model_cfg: Mapping, cache_cfg: Mapping) -> str:
    """'K8V4' for grouped-query models, 'L8R16' (latent, RoPE key) for MLA, by
    the bits really stored: an unquantized float32 cache is 'K32V32'."""
    return "".join(
        f"{prefix[0].upper()}{stored_bits(cache_cfg, prefix)}"
        for prefix in cached_prefixes(model_cfg)
    )


def cache_label(model_cfg: Mapping, cache_cfg: Mapping) -> str:
    """The cache in words, every choice that sets what it stores: the bits
    (bits_label), the transforms applied before storing, the quantized
    tensors' format, axis and groups, what is kept in cache.dtype (the
    unquantized tensors, the full-precision residual), the layout, and which
    tokens it keeps (eviction, or the model's sliding window). E.g. 'K2V2 (k
    int per channel, v int per token; groups of 32; residual 128 in bfloat16),
    dense, snapkv keeping 25% of the tokens per KV head (recent 8, observation
    window 8, pooling 5)'."""
    prefixes = cached_prefixes(model_cfg)
    quantized = [p for p in prefixes if cache_cfg[f"{p}_bits"] < 16]
    transformed: dict[str, list] = {}  # transform -> the tensors it applies to
    for p in prefixes:
        if cache_cfg[f"{p}_transform"] != "none":
            transformed.setdefault(cache_cfg[f"{p}_transform"], []).append(p)
    details = [f"{name} on {' and '.join(ps)}" for name, ps in transformed.items()]
    if quantized:
        axes = {p: cache_cfg[f"{p}_axis"] for p in quantized}
        details.append(
            ", ".join(
                f"{p} {cache_cfg[f'{p}_format']} "
                + ("with calibrated scales" if axis == "calibrated" else f"per {axis}")
                + _outliers_words(cache_cfg[f"{p}_outliers"])
                + (" before RoPE" if p == "k" and cache_cfg["k_before_rope"] else "")
                + _first_words(cache_cfg[f"{p}_full_first"], cache_cfg["dtype"])
                + (f" in {cache_cfg[f'{p}_rank']} directions" if cache_cfg[f"{p}_rank"] else "")
                + (
                    f" and a {cache_cfg['k_sketch']}-bit residual sketch"
                    if p == "k" and cache_cfg["k_sketch"]
                    else ""
                )
                for p, axis in axes.items()
            )
        )
        if any(axis != "calibrated" for axis in axes.values()):
            details.append(
                f"groups of {cache_cfg['group_size']}, {cache_cfg['scale_dtype']} scales"
            )
        if cache_cfg["symmetric"]:
            details.append("symmetric")
    in_dtype = [p for p in prefixes if p not in quantized]
    if quantized and cache_cfg["residual"]:
        in_dtype.append(f"residual {cache_cfg['residual']}")
    if in_dtype:
        details.append(f"{' and '.join(in_dtype)} in {cache_cfg['dtype']}")
    layout = "dense"
    if cache_cfg["kind"] == "paged":
        layout = f"paged ({cache_cfg['page_size']} tokens a page"
        layout += ", prefix reuse)" if cache_cfg["prefix_caching"] else ")"
    stored = f"{bits_label(model_cfg, cache_cfg)} ({'; '.join(details)})"
    kept = _kept_label(model_cfg, cache_cfg["evict"])
    if is_hybrid(model_cfg):  # the cache section's storage and eviction are the full layers'
        windows = topology.cache_windows(model_cfg)
        full = _kept_label({**model_cfg, "sliding_window": 0}, cache_cfg["evict"])
        plain = cache_cfg["sliding_layers"] == "plain"
        kept = (
            f"{full} in {windows.count(0)} full layers; {_window_words(model_cfg)} in "
            f"{len(windows) - windows.count(0)} sliding layers"
            + (f" (in {cache_cfg['dtype']})" if plain else "")
        )
    return f"{stored}, {layout}, {kept}"


def _outliers_words(count: int) -> str:
    return f" and {count} outlier{'s' if count > 1 else ''} a token" if count else ""


def _first_words(count: int, dtype: str) -> str:
    return f" and the first {count} position{'s' if count > 1 else ''} in {dtype}" if count else ""


def _window_words(model_cfg: Mapping) -> str:
    """What a sliding layer keeps, in words: its window and sinks."""
    sinks = model_cfg["sliding_sinks"]
    kept = f"the last {model_cfg['sliding_window']} tokens"
    return kept + (f" and the first {sinks}" if sinks else "")


def _kept_label(model_cfg: Mapping, evict_cfg: Mapping) -> str:
    """Which tokens a cache keeps, in words (cache_label)."""
    method = evict_cfg["method"]
    if method == "none":
        window = model_cfg["sliding_window"]
        return f"{_window_words(model_cfg)} (sliding window)" if window else "every token kept"
    if evict_cfg["budget"]:
        kept = f"{evict_cfg['budget']} tokens per KV head"
    else:
        kept = f"{100 * evict_cfg['ratio']:.4g}% of the tokens per KV head"
    if method == "window":
        return f"window keeping {kept}"
    if method == "sinks":
        return f"sinks keeping {kept} ({evict_cfg['sinks']} sinks)"
    words = {
        "recent": "recent {}",
        "obs_window": "observation window {}",
        "kernel": "pooling {}",
        "pyramid_beta": "pyramid beta {:g}",
        "adakv_floor": "floor {:g}",
        "seed": "seed {}",
    }
    scorer = evict.scorer_of(method)
    details = [words.get(name, name + " {}").format(evict_cfg[name]) for name in scorer.fields]
    details += [  # its own options where they differ from its defaults
        f"{name}={value}"
        for name, value in evict.scorer_options(scorer, evict_cfg)
        if value != scorer.defaults[name]
    ]
    interval = evict_cfg["interval"]
    if not interval:  # the method's own (evict.method_interval)
        batched = not scorer.stepwise and evict_cfg["when"] != "after_prefill"
        interval = f"budget/{evict.BATCH_SHARE} up to {evict.BATCH_STEPS}" if batched else 1
    if interval != 1:
        details.append(f"interval {interval}")
    if evict_cfg["when"] == "after_prefill":
        kept = kept.replace("of the tokens", "of the context") + " after its prefill"
        details.append(f"headroom {evict_cfg['headroom']}")
    if evict_cfg["when"] == "decoding":
        kept += f" every {interval} decode steps"
        if scorer.observes == "all" and not scorer.keeps and model_cfg["attention"] != "mla":
            details.append(f"buffering {evict_cfg['obs_window']} queries")  # evict.QueryBuffer
        details = [d for d in details if not d.startswith("interval ")]
        details.append(f"headroom {evict_cfg['headroom']}")
    return f"{method} keeping {kept} ({', '.join(details)})"


def elements_per_token_and_layer(model_cfg: Mapping) -> int:
    """Numbers cached per token in one layer: 2 x kv_heads x head_dim, or kv_rank + rope_dim."""
    return sum(t.heads * t.width for t in cached_tensors(model_cfg))


def tree_bytes(tree, per_device: bool = False) -> int:
    """Sum of the bytes of every array leaf (concrete or `jax.eval_shape` output).

    per_device=True counts what one device holds: each leaf's shard under its
    sharding (a leaf without one counts whole)."""

    def shape(leaf):
        placed = getattr(leaf, "sharding", None) if per_device else None
        return leaf.shape if placed is None else placed.shard_shape(leaf.shape)

    return sum(
        int(np.prod(shape(leaf))) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree_util.tree_leaves(tree)
    )
