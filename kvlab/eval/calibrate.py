"""Artefacts a method computes offline from calibration text, stored with a run.

    tokens = calibration_tokens(tokenizer.encode)     # int32[8, 512]: stdlib's training files
    filters = q_filters(model_cfg, params, tokens)   # float32[cache layers, K, H]
    save_filters("runs/x/qfilters.npz", filters)     # cache.evict.options.filters
    patterns = duo_patterns(model_cfg, params, tokens)  # float32[cache layers, K]
    save_patterns("runs/x/duo.npz", patterns)        # cache.evict.options.patterns
    heads = kvzip_heads(model_cfg, params, tokens, tokenizer.encode)  # kvzip_head's
    save_patterns("runs/x/kvzip_heads.npz", heads)   # patterns
    gates = fast_kvzip_gates(model_cfg, params, tokens, tokenizer.encode)  # fast_kvzip's
    save_gates("runs/x/fast_kvzip_gates.npz", gates)  # gates
    # or, for any scorers of SCORER_ARTEFACTS: their missing files, then their options
    calibrate_scorers(["qfilter"], "runs/x", model_cfg, params, tokenizer.encode)
    with_artefacts(cfg.cache.evict.options, ["qfilter"], "runs/x")  # options.filters
    books = codebooks(cfg.model, cfg.cache, params, tokens)  # the 'codebook' format's levels
    save_codebooks("runs/x/codebooks.npz", books)    # cache.codebooks
    ranges = scales(cfg.model, cfg.cache, params, tokens, per="head")  # axis 'calibrated'
    save_scales("runs/x/scales.npz", ranges)         # cache.scales
    found = bases(cfg.model, cfg.cache, params, tokens)  # cache.<prefix>_rank's bases
    save_bases("runs/x/bases.npz", found)            # cache.bases (fit before scales
                                                     # and codebooks: they fit its coordinates)

Q-Filters (arXiv:2503.02812, kvlab/cache/evict/qfilter.py): the model reads
`tokens` (int32[B, T], calibration text in its tokens, e.g. the standard
library's training files: kvlab.data.text) once; per layer, each query head's
queries after RoPE (at positions 0 .. T - 1; after the query norm where the
model has one) are stacked over the rows and positions, at most `samples` of
them drawn evenly, and their first right singular vector v, signed by the
majority sign of the queries' coordinates along it (so most queries project on
it positively), gives the filter -v; a KV head's filter is the mean of its
query heads'. DuoAttention's patterns (arXiv:2410.10819,
kvlab/cache/evict/duo_attention.py) are kvpress's on-the-fly estimate
(`duo_patterns`); KVzip's head-level variant scores the heads by the context's
reconstruction (`kvzip_heads`), and Fast KVzip's gates (arXiv:2601.17668,
kvlab/cache/evict/fast_kvzip.py) are fitted to the contexts' KVzip scores
(`fast_kvzip_gates`, `save_gates`). A cross-layer cache layer takes its
producing layer's queries.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from kvlab.cache import topology
from kvlab.cache.evict.fast_kvzip import GATE_ARRAYS, gate_scores
from kvlab.cache.evict.kvzip import KVzip
from kvlab.cache.evict.scorers import CALIBRATION
from kvlab.cache.factory import init_cache
from kvlab.cache.formats import normal_float
from kvlab.cache.quant.storage import (
    by_groups,
    calibrated_ranges,
    layer_basis,
    rope_numbers,
    split_outliers,
    storages,
    turn,
)
from kvlab.config import base_config, cached_tensors
from kvlab.data.text import decode_bytes, load_corpus
from kvlab.files import write_atomic
from kvlab.model import Transformer
from kvlab.rope import apply_rope


def calibration_tokens(
    encode: Callable[[str], Sequence[int]], rows: int = 8, length: int = 512, split: str = "train"
):
    """int32[rows, length]: the standard library's training files (kvlab.data.text's
    'train' split, never a benchmark's haystack) in a model's tokens, file after
    file, cut into rows; split='test': its held-out files, to evaluate on."""
    text = load_corpus("stdlib", "")[split]
    tokens: list[int] = []
    for start, end in zip(text.offsets[:-1], text.offsets[1:], strict=True):
        tokens += encode(decode_bytes(text.tokens[start:end]))
        if len(tokens) >= rows * length:
            return np.asarray(tokens[: rows * length], np.int32).reshape(rows, length)
    raise ValueError(f"the standard library's {split!r} files hold under {rows * length} tokens")


def q_filters(model_cfg: Mapping, params, tokens: np.ndarray, samples: int = 4096) -> np.ndarray:
    """float32[cache layers, K, H]: each layer's Q-Filters (module docstring)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    groups = model_cfg["num_heads"] // model_cfg["num_kv_heads"]
    filters = []
    for query, _, _ in _projections(model_cfg, params, tokens, "Q-Filters"):
        query = apply_rope(query, positions, model_cfg["rope_theta"], model_cfg["rope_scaling"])
        stacked = np.asarray(query, np.float64).reshape(-1, *query.shape[2:])  # [B x T, N, H]
        stacked = stacked[np.linspace(0, len(stacked) - 1, min(samples, len(stacked))).astype(int)]
        per_head = []
        for head in range(stacked.shape[1]):
            u, _, vh = np.linalg.svd(stacked[:, head], full_matrices=False)
            sign = 1.0 if (u[:, 0] > 0).mean() > 0.5 else -1.0
            per_head.append(-sign * vh[0])
        filters.append(np.reshape(per_head, (-1, groups, stacked.shape[-1])).mean(1))
    return np.asarray(filters, np.float32)


def duo_patterns(model_cfg: Mapping, params, tokens: np.ndarray, length: int = 500) -> np.ndarray:
    """float32[cache layers, K]: each KV head's DuoAttention score, kvpress's on-the-fly
    estimate: per calibration row, the mean query and the mean key (before RoPE)
    repeated at positions 0 .. length - 1; the last query's attention over those
    keys; the area under its cumulated curve (mean of the cumulative sum), high
    where the attention reaches far back. Averaged over the KV head's query heads
    and the rows (kvlab/cache/evict/duo_attention.py streams the lowest)."""
    positions = jnp.broadcast_to(jnp.arange(length), (tokens.shape[0], length))
    rope = lambda x: apply_rope(x, positions, model_cfg["rope_theta"], model_cfg["rope_scaling"])  # noqa: E731
    groups = model_cfg["num_heads"] // model_cfg["num_kv_heads"]
    scores = []
    for query, key, _ in _projections(model_cfg, params, tokens, "DuoAttention's patterns"):
        mean = (
            lambda x: jnp.broadcast_to(  # noqa: E731
                x.astype(jnp.float32).mean(1, keepdims=True), (x.shape[0], length, *x.shape[2:])
            )
        )
        q, k = rope(mean(query))[:, -1], jnp.repeat(rope(mean(key)), groups, axis=2)
        logits = jnp.einsum("bnh,bpnh->bnp", q, k) * query.shape[-1] ** -0.5
        area = jnp.cumsum(jax.nn.softmax(logits, axis=-1), axis=-1).mean(-1)  # [B, N]
        scores.append(np.asarray(area.reshape(area.shape[0], -1, groups).mean((0, 2))))
    return np.asarray(scores, np.float32)


def kvzip_heads(
    model_cfg: Mapping,
    params,
    tokens: np.ndarray,
    encode: Callable[[str], Sequence[int]],
    sinks: int = 4,
) -> np.ndarray:
    """float32[cache layers, K]: KVzip's head-level scores (arXiv:2505.23416, the
    head-level eviction of its section 3; kvlab/cache/evict/kvzip_head.py): a
    head's score is the largest of its context tokens' KVzip scores
    (`kvzip_scores`; the first `sinks` apart, which every head keeps),
    averaged over the rows of `tokens`."""
    scores = kvzip_scores(model_cfg, params, tokens, encode, "KVzip's head scores")
    return np.asarray([s[:, :, sinks:].max(-1).mean(0) for s, _ in scores], np.float32)


def kvzip_calibration(
    model_cfg: Mapping, params, tokens: np.ndarray, encode: Callable[[str], Sequence[int]]
) -> np.ndarray:
    """float32[cache layers, R, K, T]: the KVzip scores of the R contexts of `tokens`
    [R, T] (`kvzip_scores`), from which kvzip's option layerwise=False takes each
    layer's share (save_kvzip_scores writes them where options.scores reads them)."""
    scores = kvzip_scores(model_cfg, params, tokens, encode, "KVzip's calibration")
    return np.stack([s for s, _ in scores]).astype(np.float32)


def kvzip_scores(
    model_cfg: Mapping,
    params,
    tokens: np.ndarray,
    encode: Callable[[str], Sequence[int]],
    what: str = "KVzip's scores",
):
    """Per cache layer: each context token's KVzip score float32[B, K, T] and the
    layer's attention input over the context [B, T, D]. Each row of `tokens`
    [B, T] is a context, fed with its probes after it (KVzip's request to repeat
    it and the context again: kvzip.probe_tokens with `encode`); a token's score
    is the largest probability any probe query of its KV head's group gives it."""
    rows, context = tokens.shape
    fed = np.asarray(
        [[*row, *KVzip().probe_tokens(encode, row.tolist())] for row in tokens], np.int32
    )
    positions = jnp.broadcast_to(jnp.arange(fed.shape[1]), fed.shape)
    rope = lambda x: apply_rope(x, positions, model_cfg["rope_theta"], model_cfg["rope_scaling"])  # noqa: E731
    groups = model_cfg["num_heads"] // model_cfg["num_kv_heads"]
    probe = np.arange(fed.shape[1]) >= context  # [T]
    causal = np.tril(np.ones((fed.shape[1], fed.shape[1]), bool))[probe]  # [P, T]

    @jax.jit
    def peak(q, k):  # one row's [P, N, H] probes and [T', K, H] keys -> [K, T]
        logits = jnp.einsum("pnh,tnh->npt", q, jnp.repeat(k, groups, axis=1))
        logits = jnp.where(causal, logits * q.shape[-1] ** -0.5, -jnp.inf)
        mass = jax.nn.softmax(logits, axis=-1)[..., :context].max(1)  # [N, T]
        return mass.reshape(-1, groups, context).max(1)

    for query, key, hidden in _projections(model_cfg, params, fed, what):
        q = rope(query.astype(jnp.float32))[:, probe]  # [B, P, N, H]
        k = rope(key.astype(jnp.float32))  # [B, T', K, H]
        # a row at a time: the probabilities of a row are [N, P, T']
        scores = np.stack([np.asarray(peak(q[b], k[b])) for b in range(rows)])
        yield scores, np.asarray(hidden[:, :context], np.float32)


GATE_STEPS = 1000  # the reference runs 5000 over a larger corpus than 8 x 512 tokens
GATE_BATCH = 1000  # the reference's batch of tokens


def fast_kvzip_gates(
    model_cfg: Mapping,
    params,
    tokens: np.ndarray,
    encode: Callable[[str], Sequence[int]],
    steps: int = GATE_STEPS,
    width: int = 16,
    sink_keys: int = 16,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Fast KVzip's gates (arXiv:2601.17668; kvlab/cache/evict/fast_kvzip.py), one per
    cache layer, fitted to the KVzip scores of `tokens`' contexts (`kvzip_scores`)
    from each token's attention input, as the reference fits them: the gates of
    `init_gates`, binary cross-entropy per token (averaged, summed over the KV
    heads and the layers), batches of GATE_BATCH tokens drawn afresh each pass
    over them, SGD with momentum 0.9 at learning rate 0.2 under its schedule
    (`gate_schedule`) for `steps` steps. (The reference holds out every 100th
    token to report on; here `gate_loss` over other contexts' `gate_data` does.)"""
    hidden, targets = gate_data(model_cfg, params, tokens, encode)
    gates = init_gates(
        len(hidden),
        hidden.shape[-1],
        model_cfg["num_kv_heads"],
        model_cfg["num_heads"] // model_cfg["num_kv_heads"],
        width,
        sink_keys,
        seed,
    )
    optimizer = optax.sgd(gate_schedule(steps), momentum=0.9)

    @jax.jit
    def step(gates, state, x, y):
        grads = jax.grad(gate_loss)(gates, x, y)
        updates, state = optimizer.update(grads, state, gates)
        return optax.apply_updates(gates, updates), state

    state = optimizer.init(gates)
    rng = np.random.default_rng(seed)
    count = hidden.shape[1]
    batch = min(GATE_BATCH, count)
    order = rng.permutation(count)
    for i in range(steps):
        split = i % (count // batch)
        if split == 0 and i:
            order = rng.permutation(count)
        chosen = order[split * batch : (split + 1) * batch]
        gates, state = step(gates, state, hidden[:, chosen], targets[:, :, chosen])
    fitted = {name: np.asarray(array, np.float32) for name, array in gates.items()}
    return {**fitted, "calibration": _gate_calibration(fitted, hidden, len(tokens))}


def fast_kvzip_calibration(
    model_cfg: Mapping, params, gates: Mapping, tokens: np.ndarray
) -> np.ndarray:
    """float32[cache layers, R, K, T]: `gates`' scores (fast_kvzip.gate_scores) of the
    R contexts of `tokens` [R, T], from each token's attention input: what a gates
    file holds as 'calibration' (fast_kvzip_gates writes its own contexts'), from
    which option layerwise=False takes each layer's share."""
    hidden = np.stack(
        [
            np.asarray(x, np.float32).reshape(-1, x.shape[-1])
            for *_, x in _projections(model_cfg, params, tokens, "Fast KVzip's calibration")
        ]
    )
    return _gate_calibration(gates, hidden, len(tokens))


def _gate_calibration(gates: Mapping, hidden: np.ndarray, rows: int) -> np.ndarray:
    """[L, R, K, T]: the gates' scores of `hidden` [L, R x T, D] (R contexts)."""
    arrays = {name: jnp.asarray(gates[name]) for name in GATE_ARRAYS}
    scores = np.asarray(jax.jit(jax.vmap(gate_scores))(arrays, jnp.asarray(hidden)))
    layers, heads, _ = scores.shape
    return scores.reshape(layers, heads, rows, -1).transpose(0, 2, 1, 3).astype(np.float32)


def gate_data(model_cfg: Mapping, params, tokens: np.ndarray, encode) -> tuple:
    """(float32[L, N, D] each cache layer's attention input, float32[L, K, N] its KVzip
    scores) over the N = B x T tokens of `tokens`' contexts (`kvzip_scores`)."""
    pairs = list(kvzip_scores(model_cfg, params, tokens, encode, "Fast KVzip's gates"))
    hidden = np.stack([x.reshape(-1, x.shape[-1]) for _, x in pairs])
    targets = np.stack([s.transpose(1, 0, 2).reshape(s.shape[1], -1) for s, _ in pairs])
    return hidden, targets


def init_gates(
    layers: int, width: int, kv_heads: int, groups: int, d: int = 16, sinks: int = 16, seed=0
) -> dict:
    """Untrained gates (fast_kvzip.GATE_ARRAYS), initialized as the reference's
    torch modules are: projections uniform in +-1/sqrt(width), norms 1, the sink
    keys and the bias 0."""
    keys = jax.random.split(jax.random.key(seed), 3)
    bound = 1.0 / np.sqrt(width)
    uniform = lambda key, shape: jax.random.uniform(key, shape, jnp.float32, -bound, bound)  # noqa: E731
    return {
        "q_kernel": uniform(keys[0], (layers, width, kv_heads, groups, d)),
        "q_bias": uniform(keys[1], (layers, kv_heads, groups, d)),
        "k_kernel": uniform(keys[2], (layers, width, kv_heads, d)),
        "q_norm": jnp.ones((layers, d)),
        "k_norm": jnp.ones((layers, d)),
        "sink_keys": jnp.zeros((layers, kv_heads, sinks, d)),
        "bias": jnp.zeros((layers, kv_heads, groups)),
    }


def gate_loss(gates: Mapping, hidden, targets):
    """The gates' binary cross-entropy against KVzip's scores: `hidden` [L, N, D],
    `targets` [L, K, N]; per layer and head the mean over the tokens, summed (the
    reference's; its logs floored at -100 as torch's)."""
    predicted = jax.vmap(gate_scores)(gates, hidden)  # [L, K, N]
    log = lambda x: jnp.maximum(jnp.log(x), -100.0)  # noqa: E731
    bce = -(targets * log(predicted) + (1 - targets) * log(1 - predicted))
    return bce.mean(-1).sum()


def gate_schedule(steps: int) -> Callable:
    """The reference's learning rate over `steps`: 0.2 x (0.01 x step) in the first
    1% of the steps, 0.2 to half of them, then 0.1, then 0.05 from three quarters."""

    def rate(count):
        scale = jnp.where(
            count < 0.01 * steps,
            0.01 * count,
            jnp.where(count < 0.5 * steps, 1.0, jnp.where(count < 0.75 * steps, 0.5, 0.25)),
        )
        return 0.2 * scale

    return rate


# The modules whose outputs _projections reads (capturing every module's outputs
# of 8 rows of 1,040 tokens held 12 GB for SmolLM2-135M).
_CAPTURED = frozenset(("query", "key", "query_norm", "key_norm", "attention_norm"))


def _projections(model_cfg: Mapping, params, tokens: np.ndarray, what: str):
    """Per cache layer, its producing layer's queries and keys before RoPE (after the
    query and key norms where the model has them), [B, T, N, H] and [B, T, K, H],
    and its attention's input [B, T, D] (after the layer's norm)."""
    if model_cfg["attention"] != "gqa":
        raise ValueError(
            f"model.attention={model_cfg['attention']!r}: {what} are per KV head, "
            "which only grouped-query attention caches"
        )
    tokens = jnp.asarray(tokens, jnp.int32)
    _, state = Transformer(model_cfg).apply(
        {"params": params},
        tokens,
        capture_intermediates=lambda module, method: module.name in _CAPTURED,
        mutable=["intermediates"],
    )
    seen = -1
    for layer, cache_layer in enumerate(topology.cache_layers(model_cfg)):
        if cache_layer <= seen:  # a consumer of a cross-layer run
            continue
        seen = cache_layer
        attention = state["intermediates"][f"block_{layer}"]["attention"]
        if "query" not in attention:
            raise ValueError(
                f"{what} read the query projection: pass params before kvlab.fuse_projections"
            )
        query = attention.get("query_norm", attention["query"])["__call__"][0]
        key = attention.get("key_norm", attention["key"])["__call__"][0]
        yield query, key, state["intermediates"][f"block_{layer}"]["attention_norm"]["__call__"][0]


def _stored(model_cfg: Mapping, cache_cfg: Mapping, params, tokens: np.ndarray, what: str):
    """The tensors of `cache_cfg` quantized below 16 bits with `what(spec)` true, as
    (prefix, tensor, its index in the layer, its storage), and the model's cache of
    `tokens` holding their numbers as stored (after the transforms, in float32,
    every tensor whole: nothing quantized or evicted)."""
    tensors = cached_tensors(model_cfg)
    chosen = [
        (tensor.prefix, tensor, index, spec)
        for index, (tensor, spec) in enumerate(
            zip(tensors, storages(model_cfg, cache_cfg), strict=True)
        )
        if spec.quantized and what(spec)
    ]
    whole = ml_collections.ConfigDict(dict(cache_cfg)).copy_and_resolve_references()
    whole.update(kind="dense", dtype="float32", residual=0, codebooks="", scales="", bases="")
    whole.update(k_before_rope=False, k_sketch=0)
    whole.update(prefix_caching=False, sliding_layers="plain")
    whole.update({f"{tensor.prefix}_bits": 16 for tensor in tensors})
    whole.update({f"{tensor.prefix}_outliers": 0 for tensor in tensors})
    whole.update({f"{tensor.prefix}_rank": 0 for tensor in tensors})
    whole.update({f"{tensor.prefix}_full_first": 0 for tensor in tensors})
    whole.evict = base_config().cache.evict
    tokens = jnp.asarray(tokens, jnp.int32)
    cache = init_cache(model_cfg, whole, tokens.shape[0], tokens.shape[1])
    _, cache = Transformer(model_cfg).apply({"params": params}, tokens, cache=cache)
    return chosen, cache


def _numbers(layer, index: int, spec, basis: tuple = ()) -> np.ndarray:
    """float32 [B, K, T, W]: a cache layer's tensor `index` of `_stored` as `spec`
    codes it (keys before RoPE turned back from their positions, the rows; with
    the layer's `basis` [K][W][rank], its coordinates in it: W = rank), past the
    first positions of each row it reads exactly (cache.<prefix>_full_first: the
    attention sink, whose numbers its codes never stand for; on the channel axis,
    past the groups of tokens holding them, so the groups stay as coded)."""
    stored = jnp.asarray(layer.tensors[index], jnp.float32)
    if spec.rope:
        b, _, t, _ = stored.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        stored = turn(stored, spec.rope, positions, back=True)
    if basis:
        stored = jnp.einsum("BKTw,Kwr->BKTr", stored, jnp.asarray(basis, jnp.float32))
    skip = spec.full_first
    if spec.axis == "channel":
        skip = -(-skip // spec.group_size) * spec.group_size
    return np.asarray(stored[:, :, skip:])


def _basis(cache_cfg: Mapping, tensor, spec, layer: int, layers: int) -> tuple:
    """Layer `layer`'s basis of a tensor coded in one (cache.bases), else ()."""
    return layer_basis(cache_cfg["bases"], tensor, spec.rank, layer, layers) if spec.rank else ()


def codebooks(
    model_cfg: Mapping,
    cache_cfg: Mapping,
    params,
    tokens: np.ndarray,
    samples: int = 1 << 16,
    channel_groups: int = 1,
) -> dict[str, np.ndarray]:
    """Per cached tensor stored in the 'codebook' format (cache.<prefix>_format,
    below 16 bits): float32[cache layers, 2^bits] levels (with channel_groups G
    > 1: [cache layers, G, 2^bits], levels for each run of W / G adjacent coded
    channels, at most `samples` numbers each), fitted by Lloyd-Max to
    the layer's numbers as the cache stores them (after its transform), each
    divided by the largest magnitude of its group (cache.<prefix>_axis,
    group_size) or by its calibrated range (axis 'calibrated', read from
    cache.scales, beyond it clipped to +-1; each number weighed by its range
    squared, so the error is least in the numbers' own units, as KVQuant's
    sensitivity-weighted fit weighs them; the numbers a tensor keeps apart as
    outliers, cache.<prefix>_outliers, left out), over the model's read of `tokens`
    (at most `samples` numbers per layer, drawn evenly).
    kvlab/cache/formats/codebook.py reads them."""
    _check_channel_groups(model_cfg, cache_cfg, channel_groups)
    fitted, cache = _stored(
        model_cfg, cache_cfg, params, tokens, lambda spec: spec.format == "codebook"
    )
    if not fitted:
        raise ValueError(
            "no cached tensor is stored in the 'codebook' format: set cache.<prefix>_format="
            "'codebook' and cache.<prefix>_bits below 16 for the tensors to calibrate"
        )
    out = {}
    for prefix, tensor, index, spec in fitted:
        rows = []
        for number, layer in enumerate(cache.layers):
            basis = _basis(cache_cfg, tensor, spec, number, len(cache.layers))
            stored = _numbers(layer, index, spec, basis)  # [B, K, T, W]
            if spec.axis == "channel":  # whole groups of tokens
                stored = stored[:, :, : stored.shape[2] // spec.group_size * spec.group_size]
            if spec.axis == "calibrated":
                ranges = calibrated_ranges(
                    cache_cfg["scales"], tensor, number, len(cache.layers), stored.shape[-1]
                )
                layer_spec = dataclasses.replace(spec, ranges=ranges)
            else:
                layer_spec = spec
            coded = np.ones(stored.shape, bool)
            if spec.outliers:  # the numbers kept apart are not coded
                rest, channels, _ = split_outliers(jnp.asarray(stored), layer_spec)
                stored = np.asarray(rest)
                apart = np.asarray(channels)[..., None] == np.arange(stored.shape[-1])
                coded = ~apart.any(-2)
            weights = None
            if spec.axis == "calibrated":  # error in the numbers' units: x range^2
                ranges = np.asarray(layer_spec.ranges)[:, None, :]
                scaled = np.clip(stored / ranges, -1, 1)
                weights = np.broadcast_to(ranges**2, stored.shape)
            else:
                grouped, axis = by_groups(stored, spec)
                top = np.abs(grouped).max(axis=axis, keepdims=True)
                scaled = (grouped / np.where(top > 0, top, 1.0)).reshape(stored.shape)
            width = stored.shape[-1]
            run = width // channel_groups
            fitted_rows = []
            for first in range(0, width, run):  # each run of adjacent channels alone
                mine = coded[..., first : first + run]
                values = scaled[..., first : first + run][mine]
                pick = np.linspace(0, values.size - 1, min(samples, values.size)).astype(np.int64)
                weighed = None if weights is None else weights[..., first : first + run][mine][pick]
                fitted_rows.append(lloyd_max(values[pick], spec.bits, weights=weighed))
            rows.append(fitted_rows[0] if channel_groups == 1 else np.stack(fitted_rows))
        out[prefix] = np.stack(rows)
    return out


def _check_channel_groups(model_cfg: Mapping, cache_cfg: Mapping, groups) -> None:
    """Refuses, before the model runs, `channel_groups` that is no positive integer
    or does not split a codebook tensor's coded channels evenly."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"channel_groups={groups!r} is no positive integer: give 1 or more")
    for tensor, spec in zip(cached_tensors(model_cfg), storages(model_cfg, cache_cfg), strict=True):
        width = spec.coded_width(tensor.width)
        if spec.quantized and spec.format == "codebook" and width % groups:
            raise ValueError(
                f"channel_groups={groups} does not split {tensor.prefix!r}'s {width} coded "
                "channels evenly: give a number of groups that divides them"
            )


PER = ("channel", "head", "tensor")  # what one calibrated range covers (`scales`' per)


def scales(
    model_cfg: Mapping,
    cache_cfg: Mapping,
    params,
    tokens: np.ndarray,
    per: str = "channel",
    quantile: float = 1.0,
) -> dict[str, np.ndarray]:
    """Per cached tensor with cache.<prefix>_axis='calibrated' (below 16 bits):
    float32[cache layers, KV heads, channels], the ranges its static scales map
    to the format's top level (kvlab.cache.quant.Storage.static_scale): the
    `quantile` of the magnitudes (1.0: the largest) the layer's numbers take as
    the cache stores them (after its transform) over the model's read of
    `tokens`, per channel of each KV head (KVQuant's per-channel scales), per
    head (vLLM's per-head fp8 scales) or per tensor, repeated over what one
    range covers. A range of 0 (a channel always 0) takes the layer's smallest
    positive range. kvlab.cache.quant.calibrated_ranges reads them."""
    if per not in PER:
        raise ValueError(f"per={per!r} is not one of {PER}: choose what one range covers")
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile={quantile!r} is not in (0, 1]: 1.0 takes the largest")
    chosen, cache = _stored(
        model_cfg, cache_cfg, params, tokens, lambda spec: spec.axis == "calibrated"
    )
    if not chosen:
        raise ValueError(
            "no cached tensor has calibrated scales: set cache.<prefix>_axis='calibrated' "
            "and cache.<prefix>_bits below 16 for the tensors to calibrate"
        )
    reduce = {"channel": (0, 2), "head": (0, 2, 3), "tensor": (0, 1, 2, 3)}[per]
    out = {}
    for prefix, tensor, index, spec in chosen:
        rows = []
        for number, layer in enumerate(cache.layers):
            basis = _basis(cache_cfg, tensor, spec, number, len(cache.layers))
            magnitude = np.abs(_numbers(layer, index, spec, basis))  # [B, K, T, W]
            ranges = np.quantile(magnitude, quantile, axis=reduce, keepdims=True)
            ranges = np.broadcast_to(ranges, (1, *magnitude.shape[1:2], 1, magnitude.shape[3]))
            ranges = ranges[0, :, 0, :]  # [K, W]
            positive = ranges[ranges > 0]
            rows.append(np.where(ranges > 0, ranges, positive.min() if positive.size else 1.0))
        out[prefix] = np.stack(rows).astype(np.float32)
    return out


def bases(model_cfg: Mapping, cache_cfg: Mapping, params, tokens: np.ndarray) -> dict:
    """Per cached tensor with cache.<prefix>_rank = r (below 16 bits): float32[cache
    layers, KV heads, W, r], each head's r directions that keep the most of its
    numbers as the cache codes them (after its transform; keys before RoPE
    unrotated) over the model's read of `tokens`: the leading eigenvectors of their
    second moment E[x x^T] (principal directions, not centred: the cache maps
    back by the basis alone), so x B B^T is the rank-r map of least mean squared
    error. That is Palu's low-rank cache (arXiv:2407.21118) for a KV head with its
    projection fitted on activations (SVD-LLM's whitening): Palu stores x W_k B,
    the same numbers, by folding B into the key projection. Signs are fixed
    (each column's largest entry positive). kvlab.cache.quant.layer_basis reads them."""
    if topology.parse(model_cfg["topology"])[0].codes_in_bases:
        return _run_bases(model_cfg, cache_cfg, params, tokens)
    chosen, cache = _stored(model_cfg, cache_cfg, params, tokens, lambda spec: spec.rank > 0)
    if not chosen:
        raise ValueError(
            "no cached tensor is coded in a basis: set cache.<prefix>_rank and "
            "cache.<prefix>_bits below 16 for the tensors to fit"
        )
    out = {}
    for prefix, _, index, spec in chosen:
        rows = [_principal(_numbers(layer, index, spec), spec.rank) for layer in cache.layers]
        out[prefix] = np.asarray(rows, np.float32)
    return out


def _principal(numbers: np.ndarray, rank: int) -> np.ndarray:
    """float64[K, W, rank]: per head of `numbers` [B, K, T, W], the leading `rank`
    eigenvectors of their second moment, each column's largest entry positive."""
    numbers = np.asarray(numbers, np.float64)
    heads = []
    for head in range(numbers.shape[1]):
        x = numbers[:, head].reshape(-1, numbers.shape[-1])
        _, vectors = np.linalg.eigh(x.T @ x / len(x))  # ascending eigenvalues
        basis = vectors[:, ::-1][:, :rank]
        peak = np.take_along_axis(basis, np.abs(basis).argmax(0)[None], 0)
        heads.append(basis * np.where(peak < 0, -1.0, 1.0))
    return np.stack(heads)


def _run_bases(model_cfg: Mapping, cache_cfg: Mapping, params, tokens: np.ndarray) -> dict:
    """`bases` of a topology that codes runs of layers together (model.topology
    'xkv:G', kvlab/cache/topology/xkv.py): per run, float32[runs, K, G W, rank],
    the principal directions of the run's keys (before RoPE) and values side
    by side, read from the layerwise model's float32 cache of `tokens` (whatever
    bits the runs' codes are stored in)."""
    shape, arg = topology.parse(model_cfg["topology"])
    layerwise = ml_collections.ConfigDict(dict(model_cfg)).copy_and_resolve_references()
    layerwise.topology = "layerwise"
    plain = ml_collections.ConfigDict(dict(cache_cfg)).copy_and_resolve_references()
    plain.update(dtype="float32", bases="", k_rank=0, v_rank=0, k_bits=16, v_bits=16)
    tokens = jnp.asarray(tokens, jnp.int32)
    cache = init_cache(layerwise, plain, tokens.shape[0], tokens.shape[1])
    _, cache = Transformer(layerwise).apply({"params": params}, tokens, cache=cache)
    owner = topology.cache_layers(model_cfg)
    rope = rope_numbers(model_cfg, model_cfg["head_dim"])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    out = {}
    for index, prefix in enumerate(("k", "v")):
        rows = []
        for run in shape.joint_layers(arg, model_cfg["num_layers"]):
            members = [cache.layers[i].tensors[index] for i, c in enumerate(owner) if c == run]
            if prefix == "k":
                members = [turn(jnp.asarray(x), rope, positions, back=True) for x in members]
            side = np.concatenate([np.asarray(x, np.float64) for x in members], axis=-1)
            rows.append(_principal(side, cache_cfg[f"{prefix}_rank"]))
        out[prefix] = np.asarray(rows, np.float32)
    return out


def lloyd_max(
    values: np.ndarray, bits: int, iterations: int = 100, weights: np.ndarray | None = None
) -> np.ndarray:
    """float32[2^bits]: the levels of least squared error for `values` in [-1, 1]
    (Lloyd's algorithm from the normal-float grid: each number to its nearest
    level, each level to the mean of its numbers, until they stay), ascending;
    with `weights`, of least weighted squared error (weighted means)."""
    levels = normal_float.grid(bits).astype(np.float64)
    values = np.asarray(values, np.float64)
    weights = np.ones_like(values) if weights is None else np.asarray(weights, np.float64)
    for _ in range(iterations):
        bins = np.searchsorted((levels[1:] + levels[:-1]) / 2, values)
        counts = np.bincount(bins, weights=weights, minlength=levels.size)
        sums = np.bincount(bins, weights=values * weights, minlength=levels.size)
        moved = np.where(counts > 0, sums / np.maximum(counts, 1), levels)
        if np.array_equal(moved, levels):
            break
        levels = moved
    return np.sort(levels).astype(np.float32)


def save_codebooks(path: str | os.PathLike, books: Mapping[str, np.ndarray]) -> None:
    """Writes `codebooks`' levels where cache.codebooks reads them (an .npz with one
    array [cache layers, 2^bits], or [cache layers, channel groups, 2^bits], per
    tensor prefix), atomically."""
    _save_arrays(path, books, "codebook", ("[layers, 2^bits]", "[layers, groups, 2^bits]"))


def save_scales(path: str | os.PathLike, ranges: Mapping[str, np.ndarray]) -> None:
    """Writes `scales`' ranges where cache.scales reads them (an .npz with one array
    [cache layers, KV heads, channels] per tensor prefix), atomically."""
    _save_arrays(path, ranges, "ranges", "[layers, KV heads, channels]", positive=True)


def save_bases(path: str | os.PathLike, found: Mapping[str, np.ndarray]) -> None:
    """Writes `bases`' bases where cache.bases reads them (an .npz with one array
    [cache layers or runs, KV heads, W, rank] per tensor prefix), atomically."""
    _save_arrays(path, found, "bases", "[layers, KV heads, W, rank]")


def save_filters(path: str | os.PathLike, filters: np.ndarray) -> None:
    """Writes `filters` [layers, K, H] where cache.evict.options.filters reads them
    (an .npz with the array 'filters'), atomically."""
    _save_arrays(path, {"filters": filters}, "Q-Filters", "[layers, K, H]")


def save_patterns(path: str | os.PathLike, patterns: np.ndarray) -> None:
    """Writes DuoAttention's `patterns` [layers, K] where cache.evict.options.patterns
    reads them (an .npz with the array 'patterns'), atomically."""
    _save_arrays(path, {"patterns": patterns}, "DuoAttention's patterns", "[layers, K]")


def save_kvzip_scores(path: str | os.PathLike, scores: np.ndarray) -> None:
    """Writes the calibration contexts' KVzip `scores` [L, R, K, T] (kvzip_calibration)
    where kvzip's cache.evict.options.scores reads them, atomically."""
    _save_arrays(path, {"calibration": scores}, "KVzip's calibration scores", CALIBRATION)


def save_gates(path: str | os.PathLike, gates: Mapping[str, np.ndarray]) -> None:
    """Writes Fast KVzip's `gates` (fast_kvzip.GATE_ARRAYS, and 'calibration' where
    given: fast_kvzip_calibration) where cache.evict.options.gates reads them,
    atomically."""
    missing = sorted(set(GATE_ARRAYS) - set(gates))
    if missing:
        raise ValueError(f"Fast KVzip's gates miss {missing}: pass fast_kvzip_gates' arrays")
    unknown = sorted(set(gates) - set(GATE_ARRAYS) - {"calibration"})
    if unknown:
        raise ValueError(f"Fast KVzip's gates hold no arrays {unknown}: pass fast_kvzip_gates'")
    _save_arrays(path, gates, "Fast KVzip's gates", (*GATE_ARRAYS.values(), CALIBRATION))


def _save_arrays(
    path: str | os.PathLike,
    arrays: Mapping,
    what: str,
    shape: str | tuple[str, ...],
    positive: bool = False,
) -> None:
    """The float32 `arrays` as one .npz at `path`, atomically; ValueError unless each
    is finite (and positive) with as many axes as `shape` (or one of its shapes) names."""
    shapes = (shape,) if isinstance(shape, str) else shape
    arrays = {name: np.asarray(array, np.float32) for name, array in arrays.items()}
    for name, array in arrays.items():
        axes = {s.count(",") + 1 for s in shapes}
        wrong = array.ndim not in axes or not np.isfinite(array).all()
        if wrong or (positive and (array <= 0).any()):
            sign = "positive " if positive else ""
            named = " or ".join(shapes)
            raise ValueError(f"{what} {name!r} of shape {array.shape} are not {sign}finite {named}")
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(path, buffer.getvalue())


@dataclasses.dataclass(frozen=True)
class ScorerArtefact:
    """What a calibrated eviction scorer (Scorer.calibrated) reads: its file's name in
    a run's folder, the cache.evict.options field that names the file, and how it
    is computed from (model config, params, calibration tokens, the tokenizer's
    encode) and written."""

    file: str
    option: str
    compute: Callable
    save: Callable


# The calibrated scorers' artefacts by scorer name; a scorer of one's own that reads
# an artefact adds its entry, and scripts/benchmark.py and bench_decode.py compute it.
SCORER_ARTEFACTS = {
    "qfilter": ScorerArtefact(
        "qfilters.npz", "filters", lambda m, p, tokens, _: q_filters(m, p, tokens), save_filters
    ),
    "duo_attention": ScorerArtefact(
        "duo_patterns.npz",
        "patterns",
        lambda m, p, tokens, _: duo_patterns(m, p, tokens),
        save_patterns,
    ),
    "kvzip_head": ScorerArtefact("kvzip_heads.npz", "patterns", kvzip_heads, save_patterns),
    "fast_kvzip": ScorerArtefact("fast_kvzip_gates.npz", "gates", fast_kvzip_gates, save_gates),
    # read by option layerwise=False alone (the kvpress preset's)
    "kvzip": ScorerArtefact("kvzip_scores.npz", "scores", kvzip_calibration, save_kvzip_scores),
}


def calibrate_scorers(
    names: Sequence[str],
    folder: str | os.PathLike,
    model_cfg: Mapping,
    params,
    encode: Callable[[str], Sequence[int]],
    tokens: np.ndarray | None = None,
) -> None:
    """Writes into `folder` the artefact (SCORER_ARTEFACTS) of each scorer of `names`
    that reads one and finds no file there yet, computed over `tokens` (default:
    calibration_tokens(encode), the standard library's training files)."""
    for name in dict.fromkeys(n for n in names if n in SCORER_ARTEFACTS):
        artefact = SCORER_ARTEFACTS[name]
        path = os.path.join(folder, artefact.file)
        if os.path.exists(path):
            continue
        os.makedirs(folder, exist_ok=True)
        if tokens is None:
            tokens = calibration_tokens(encode)
        artefact.save(path, artefact.compute(model_cfg, params, tokens, encode))


def with_artefacts(options: MutableMapping, names: Sequence[str], folder) -> None:
    """Points `options` (cache.evict.options) at `folder`'s artefact of each scorer of
    `names` that reads one (calibrate_scorers writes them)."""
    for name in names:
        if name in SCORER_ARTEFACTS:
            artefact = SCORER_ARTEFACTS[name]
            options[artefact.option] = os.path.join(os.fspath(folder), artefact.file)
